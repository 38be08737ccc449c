"""`sing`: submit and manage jobs on singularityd. stdout carries only results."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import typer

from singularity.cli import cluster, machine, output
from singularity.cli.client import LOST_CONNECTION, connect, resolve_socket, rpc_error, unreachable_message
from singularity.cli.errors import (
    EXIT_CONFLICT,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    exit_code_for_status,
    exit_interrupted,
    fail,
    stopped_by_ctrl_c,
    warn,
)
from singularity.cli.params import (
    COUNT_MAX,
    COUNT_MIN,
    HeaderOption,
    JobIdArgument,
    JobIdsArgument,
    OutputOption,
    SocketOption,
    chosen_format,
    chosen_header,
    not_empty,
)
from singularity.cli.progress import Progress
from singularity.cli.source import LogFollower
from singularityd import __version__
from singularityd.api.v1 import singularity_pb2 as pb
from singularityd.tiers import DEFAULT_TIER, TIERS

app = typer.Typer(
    name="sing",
    help="Submit and manage jobs on singularityd, the lab's preemptive GPU scheduler.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

FOLLOW_GIVE_UP_SECONDS = 60.0
"""How long `logs -f` waits for a daemon that went away: a restart takes seconds, a stop is for good."""


def _version(value: bool) -> None:
    """Print the version for --version and stop."""
    if value:
        print(f"sing {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_version, help="Print the version and exit."
    ),
) -> None:
    """Submit and manage jobs on singularityd, the lab's preemptive GPU scheduler."""


def _job_status(job: pb.Job) -> int:
    """The job's status as a shell reports it; 1 when it ended without one."""
    if job.HasField("signal"):
        return 128 + job.signal
    if job.HasField("exit_code"):
        return job.exit_code
    return EXIT_FAILURE


def _parse_env(pairs: list[str]) -> dict[str, str]:
    """KEY=VALUE pairs of --env as a dict."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--env takes KEY=VALUE, not {pair!r}", EXIT_USAGE)
        env[key] = value
    return env


def _wait_for(stub: Any, job_id: int) -> pb.Job:
    """Block until the job ends, riding out daemon restarts (the job survives them) once the
    daemon has been reached (a socket no daemon listens on is refused at once, as other verbs are)."""
    reached = False
    with Progress(f"waiting for job {job_id}") as progress:
        while True:
            try:
                job: pb.Job = stub.Wait(pb.JobRef(id=job_id))
                return job
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                reached = reached or any(sign in (error.details() or "") for sign in LOST_CONNECTION)
                if not reached:
                    raise
                progress.update(f"waiting for job {job_id} (the daemon is restarting)")
                time.sleep(1.0)


@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    command: list[str] = typer.Argument(None, help="The program and its arguments, after --."),
    gpus: int = typer.Option(
        None,
        "--gpus",
        "-g",
        help="Devices the job needs, all at once (default 1; elastic: --max-gpus).",
        min=COUNT_MIN,
        max=COUNT_MAX,
    ),
    name: str | None = typer.Option(
        None, "--name", "-n", help="Job name (default: the program's name).", callback=not_empty
    ),
    priority: int = typer.Option(
        0, "--priority", "-p", help="Higher runs first, within its tier.", min=COUNT_MIN, max=COUNT_MAX
    ),
    tier: str = typer.Option(
        DEFAULT_TIER,
        "--tier",
        "-t",
        help=f"Service tier: {' > '.join(reversed(TIERS))}; a higher one runs first, may preempt lower ones.",
        callback=not_empty,
    ),
    ranks: int = typer.Option(
        1, "--ranks", help="Processes to start (torchrun-style ranks).", min=COUNT_MIN, max=COUNT_MAX
    ),
    env: list[str] = typer.Option([], "--env", "-e", help="Extra KEY=VALUE for the job."),
    cwd: str | None = typer.Option(
        None, "--cwd", help="Working directory (default: the current one).", callback=not_empty
    ),
    wait: bool = typer.Option(False, "--wait", "-W", help="Wait for the job; exit with its status."),
    checkpoint_every: float = typer.Option(
        None, "--checkpoint-every", help="Seconds between periodic checkpoints (0: none; default: daemon's)."
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        help="Failures after which the job resumes from its last checkpoint (0-100).",
        min=COUNT_MIN,
        max=COUNT_MAX,
    ),
    min_gpus: int | None = typer.Option(
        None,
        "--min-gpus",
        help="Elastic: fewest devices the job runs on (default 1 with --max-gpus).",
        min=COUNT_MIN,
        max=COUNT_MAX,
    ),
    max_gpus: int | None = typer.Option(
        None,
        "--max-gpus",
        help="Elastic: most devices the job grows to (default --ranks with --min-gpus).",
        min=COUNT_MIN,
        max=COUNT_MAX,
    ),
    output_format: str = typer.Option(None, "--output", "-o", help="id (default) or json: the job queued."),
    anywhere: bool = typer.Option(
        None,
        "--anywhere/--here",
        help="Let a job that cannot start here start on a peer with room (default: the daemon's setting).",
    ),
    socket: str = SocketOption,
) -> None:
    """Queue a program; prints its job id. The job runs as you, with your environment."""
    if output_format not in (None, "id", "json"):
        raise CliError(f"-o must be id or json, not {output_format!r}", EXIT_USAGE)
    if checkpoint_every is not None and not (math.isfinite(checkpoint_every) and checkpoint_every >= 0):
        raise CliError(f"--checkpoint-every must be 0 or more seconds, not {checkpoint_every:g}", EXIT_USAGE)
    if not command:
        raise CliError(
            "empty command: give the program to run after --, e.g. sing submit -- python train.py", EXIT_USAGE
        )
    job_env = dict(os.environ)
    job_env.update(_parse_env(env))
    try:
        directory = os.path.abspath(cwd) if cwd else os.getcwd()
    except FileNotFoundError:
        raise CliError("the current directory no longer exists; give --cwd", EXIT_USAGE) from None
    if os.path.isdir(directory) and not os.access(directory, os.X_OK):
        raise CliError(f"cannot enter working directory {directory}: permission denied", EXIT_USAGE)
    for flag, given in (("--min-gpus", min_gpus), ("--max-gpus", max_gpus)):
        if given is not None and given < 1:
            raise CliError(f"{flag} must be at least 1, not {given}", EXIT_USAGE)
    request = pb.SubmitRequest(
        command=command,
        name=name or "",
        priority=priority,
        ranks=ranks,
        cwd=directory,
        env=job_env,
        max_restarts=max_restarts,
        min_gpus=min_gpus or 0,
        max_gpus=max_gpus or 0,
        tier=tier,
    )
    if gpus is not None:
        request.gpus = gpus
    if checkpoint_every is not None:
        request.checkpoint_interval = checkpoint_every
    if anywhere is not None:
        request.anywhere = anywhere
    with connect(socket) as stub:
        job = stub.Submit(request).job
        print(output.to_json(output.job_dict(job)) if output_format == "json" else job.id, flush=True)
        if wait:
            raise SystemExit(_job_status(_wait_for(stub, job.id)))


@app.command()
def ps(
    all_jobs: bool = typer.Option(False, "--all", "-a", help="Include ended jobs."),
    output_format: str = OutputOption,
    header: bool = HeaderOption,
    watch: bool = typer.Option(False, "--watch", "-w", help="After the list, print each change."),
    user: str | None = typer.Option(None, "--user", "-u", help="Only this user's jobs.", callback=not_empty),
    cluster_wide: bool = typer.Option(False, "--cluster", "-c", help="The jobs of every node of the lab."),
    socket: str = SocketOption,
) -> None:
    """List jobs (queued and running; -a for all; --cluster for every node's)."""
    fmt = chosen_format(output_format, ("wide", "json"))
    with_header = chosen_header(header)
    request = pb.ListJobsRequest(all=all_jobs, user=user or "")
    if cluster_wide:
        if watch:
            raise CliError("--watch lists this node's jobs only; leave out --cluster", EXIT_USAGE)
        with connect(socket) as stub:
            listing = stub.ListClusterJobs(request)
        for node in listing.unreachable:
            warn(f"{node} did not answer; its jobs are not listed")
        if fmt == "json":
            print(output.to_json([output.job_dict(j) for j in listing.jobs]))
        else:
            text = output.jobs_table(listing.jobs, fmt == "wide", with_header, nodes=True)
            if text:
                print(text)
        return
    with connect(socket) as stub:
        if not watch:
            jobs = stub.ListJobs(request).jobs
            if fmt == "json":
                print(output.to_json([output.job_dict(j) for j in jobs]))
            else:
                text = output.jobs_table(jobs, fmt == "wide", with_header)
                if text:
                    print(text)
            return
        updates = stub.WatchJobs(request)
        with stopped_by_ctrl_c(updates.cancel) as interrupted:
            try:
                for update in updates:
                    if fmt == "json":
                        for job in update.jobs:
                            print(output.to_json(output.job_dict(job)).replace("\n", " "), flush=True)
                        continue
                    text = output.jobs_table(update.jobs, fmt == "wide", with_header and not update.is_change)
                    if text:
                        print(text, flush=True)
            except grpc.RpcError:
                if not interrupted:
                    raise
        if interrupted:
            exit_interrupted()


@app.command()
def show(
    job_id: int = JobIdArgument,
    output_format: str = OutputOption,
    header: bool = HeaderOption,
    socket: str = SocketOption,
) -> None:
    """Show a job: its spec, devices, usage, checkpoints, pending reason and event timeline."""
    fmt = chosen_format(output_format, ("wide", "json"))
    with connect(socket) as stub:
        detail = stub.GetJob(pb.JobRef(id=job_id))
    if fmt == "json":
        print(output.to_json(output.job_detail_dict(detail)))
    else:
        print(output.job_detail_text(detail, wide=fmt == "wide", header=chosen_header(header)))


@app.command()
def logs(
    job_id: int = JobIdArgument,
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing until the job ends (through preemptions and restarts)."
    ),
    tail: int | None = typer.Option(
        None,
        "--tail",
        help="Start with the last N lines (0: none, only new output with -f).",
        min=COUNT_MIN,
        max=COUNT_MAX,
    ),
    rank: int = typer.Option(0, "--rank", help="Which rank's output.", min=COUNT_MIN, max=COUNT_MAX),
    socket: str = SocketOption,
) -> None:
    """Print a job's output (stdout and stderr of one rank), as the job wrote it."""
    if tail is not None and tail < 0:
        raise CliError(f"--tail must not be negative, not {tail}", EXIT_USAGE)
    path = resolve_socket(socket)
    if not path.exists():
        raise CliError(unreachable_message(path), EXIT_UNAVAILABLE)
    out = sys.stdout.buffer
    follower = LogFollower(
        path, job_id, rank, follow=follow, tail=tail, give_up_seconds=FOLLOW_GIVE_UP_SECONDS
    )
    with stopped_by_ctrl_c(follower.cancel) as interrupted:
        for data in follower:
            out.write(data)
            out.flush()
    if interrupted:
        exit_interrupted()
    if follow:
        with connect(socket) as stub:
            job = stub.GetJob(pb.JobRef(id=job_id)).job
        if job.state == output.MOVED:  # the output goes on there
            raise CliError(f"job {job_id} {job.reason}: its output goes on there", EXIT_CONFLICT)


@app.command()
def cancel(
    job_ids: list[int] = JobIdsArgument,
    socket: str = SocketOption,
) -> None:
    """Cancel jobs: queued ones at once, running ones with SIGTERM then SIGKILL."""
    status = EXIT_OK
    with connect(socket) as stub:
        response = stub.Cancel(pb.CancelRequest(ids=job_ids))
    for result in response.results:
        if not result.ok:
            warn(result.error)
            if status == EXIT_OK:
                status = exit_code_for_status(result.code)
    raise SystemExit(status)


@app.command()
def preempt(job_id: int = JobIdArgument, socket: str = SocketOption) -> None:
    """Checkpoint a running job and stop it; it resumes when the scheduler gives it devices."""
    with connect(socket) as stub, Progress(f"preempting job {job_id} (checkpointing)"):
        job = stub.Preempt(pb.JobRef(id=job_id))
    print(output.stopped_text(job, "preempted") + "; it resumes when the scheduler gives it devices")


@app.command()
def suspend(job_id: int = JobIdArgument, socket: str = SocketOption) -> None:
    """Checkpoint a running job and stop it (or hold a queued one) until `sing resume`."""
    with connect(socket) as stub, Progress(f"suspending job {job_id} (checkpointing)"):
        job = stub.Suspend(pb.JobRef(id=job_id))
    print(output.stopped_text(job, "suspended") + f"; `sing resume {job_id}` queues it again")


@app.command()
def resize(
    job_id: int = JobIdArgument,
    gpus: int = typer.Option(
        ..., "--gpus", "-g", help="Devices to run on (1 up to the job's ranks).", min=COUNT_MIN, max=COUNT_MAX
    ),
    socket: str = SocketOption,
) -> None:
    """Move a running job to another number of devices: checkpoint, stop, restore (its ranks see
    no change)."""
    with connect(socket) as stub:
        with Progress(f"resizing job {job_id} to {gpus} device{'s' if gpus != 1 else ''} (checkpointing)"):
            stub.Resize(pb.ResizeRequest(id=job_id, gpus=gpus))
        job = _wait_running(stub, job_id)
        if job.state != "RUNNING":
            raise CliError(_not_running_again(job))
        count = len(job.devices)
        listed = ",".join(str(d) for d in job.devices)
        print(f"job {job_id} runs on {count} device{'s' if count != 1 else ''} ({listed})")


@app.command()
def resume(
    job_id: int = JobIdArgument,
    wait: bool = typer.Option(
        False, "--wait", "-W", help="Return once the job runs again (restored from its checkpoint)."
    ),
    socket: str = SocketOption,
) -> None:
    """Put a suspended job back in the queue."""
    with connect(socket) as stub:
        stub.Resume(pb.JobRef(id=job_id))
        if wait:
            job = _wait_running(stub, job_id)
            if job.state != "RUNNING":
                raise CliError(_not_running_again(job))


def _not_running_again(job: pb.Job) -> str:
    """Why a job waited for did not run again: held again after a failed restore, or ended."""
    if job.state == "SUSPENDED":
        return f"job {job.id} did not run again: {job.reason}"
    return f"job {job.id} ended ({job.state}: {job.reason}) before it ran again"


def _wait_running(stub: Any, job_id: int) -> pb.Job:
    """Block until the job's processes run (launched or restored) or it has ended."""
    with Progress(f"job {job_id} queued") as progress:
        for update in stub.WatchJobs(pb.ListJobsRequest(all=True)):
            for job in update.jobs:
                if job.id != job_id:
                    continue
                if (job.state == "RUNNING" and not job.starting) or job.ended_at or job.state == "SUSPENDED":
                    running: pb.Job = job  # SUSPENDED: held again, its restore failed
                    return running
                if job.starting:
                    progress.update(
                        f"restoring job {job_id}" if job.checkpoints else f"starting job {job_id}"
                    )
                else:
                    progress.update(f"job {job_id} {job.state.lower()}: {job.pending_reason or job.reason}")
    raise CliError("the daemon closed the stream", EXIT_UNAVAILABLE)


@app.command()
def checkpoint(
    job_id: int = JobIdArgument,
    output_format: str = typer.Option(None, "--output", "-o", help="json: the checkpoint as JSON."),
    socket: str = SocketOption,
) -> None:
    """Checkpoint a running job and let it keep running; prints the checkpoint taken."""
    if output_format not in (None, "json"):
        raise CliError(f"-o must be json, not {output_format!r}", EXIT_USAGE)
    with connect(socket) as stub, Progress(f"checkpointing job {job_id}"):
        response = stub.Checkpoint(pb.JobRef(id=job_id))
    if output_format == "json":
        print(output.to_json({"job": response.job.id, **output.checkpoint_dict(response.checkpoint)}))
    else:
        print(output.checkpoint_text(response))


@app.command()
def wait(
    job_id: int = JobIdArgument,
    output_format: str = typer.Option(None, "--output", "-o", help="json: print the ended job."),
    socket: str = SocketOption,
) -> None:
    """Wait for a job to end; exit with its status (its exit code, or 128 + signal)."""
    if output_format not in (None, "json"):
        raise CliError(f"-o must be json, not {output_format!r}", EXIT_USAGE)
    with connect(socket) as stub:
        job = _wait_for(stub, job_id)
    if job.state == output.MOVED:
        raise CliError(f"job {job_id} {job.reason}: wait for it there", EXIT_CONFLICT)
    if output_format == "json":
        print(output.to_json(output.job_dict(job)))
    raise SystemExit(_job_status(job))


machine.register(app)
cluster.register(app)


_CLICK_EXCEPTIONS: Any = sys.modules[typer.BadParameter.__module__]
"""The exceptions module of the click that typer runs: its own copy since typer 0.26, click's before."""


def _usage_line(error: Any) -> str:
    """Click's usage error as one line naming where the command's help is, like every other error
    of `sing` (click's own four lines put the error last, after the usage and a hint)."""
    command = error.ctx.command_path if error.ctx is not None else "sing"
    message: str = error.format_message().removesuffix(".")
    if message[:2].istitle():
        message = message[0].lower() + message[1:]
    return f"{message}; see `{command} -h`"


def main() -> None:
    """Entry point of `sing`: run the app; errors become one line on stderr and an exit code."""
    try:
        status = app(prog_name="sing", standalone_mode=False)
    except getattr(_CLICK_EXCEPTIONS, "NoArgsIsHelpError", ()) as error:
        error.show()
        raise SystemExit(error.exit_code) from None
    except _CLICK_EXCEPTIONS.ClickException as error:
        usage = isinstance(error, _CLICK_EXCEPTIONS.UsageError)
        fail(_usage_line(error) if usage else error.format_message(), error.exit_code)
    except typer.Abort:
        fail("aborted", EXIT_FAILURE)
    except CliError as error:
        fail(error.message, error.code)
    except grpc.RpcError as error:
        failure = rpc_error(error, Path(resolve_socket(None)))
        fail(failure.message, failure.code)
    except BrokenPipeError:
        os._exit(EXIT_OK)
    raise SystemExit(status if isinstance(status, int) else EXIT_OK)


if __name__ == "__main__":
    main()
