"""`sing`: submit and manage jobs on singularityd. stdout carries only results."""

from __future__ import annotations

import math
import os
import pwd
import stat
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import typer

from singularity.cli import output
from singularity.cli.client import connect, resolve_socket, rpc_error, unreachable_message
from singularity.cli.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    exit_code_for_status,
    fail,
    warn,
)
from singularityd.api.v1 import singularity_pb2 as pb

app = typer.Typer(
    name="sing",
    help="Submit and manage jobs on singularityd, the lab's preemptive GPU scheduler.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

SocketOption = typer.Option(None, "--socket", envvar="SING_SOCKET", help="Daemon socket.")


def _output_format(value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        raise CliError(f"-o must be one of {', '.join(allowed)}, not {value!r}", EXIT_USAGE)
    return value


def _job_status(job: pb.Job) -> int:
    """The job's status as a shell reports it; 1 when it ended without one."""
    if job.HasField("signal"):
        return 128 + job.signal
    if job.HasField("exit_code"):
        return job.exit_code
    return EXIT_FAILURE


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--env takes KEY=VALUE, not {pair!r}", EXIT_USAGE)
        env[key] = value
    return env


def _wait_for(stub: Any, job_id: int) -> pb.Job:
    """Block until the job ends, riding out daemon restarts (the job survives them)."""
    while True:
        try:
            job: pb.Job = stub.Wait(pb.JobRef(id=job_id))
            return job
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            time.sleep(1.0)


@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    command: list[str] = typer.Argument(None, help="The program and its arguments, after --."),
    gpus: int = typer.Option(1, "--gpus", "-g", help="Devices the job needs (all at once)."),
    name: str = typer.Option("", "--name", "-n", help="Job name (default: the program's name)."),
    priority: int = typer.Option(0, "--priority", "-p", help="Higher runs first."),
    ranks: int = typer.Option(1, "--ranks", help="Processes to start (torchrun-style ranks)."),
    env: list[str] = typer.Option([], "--env", "-e", help="Extra KEY=VALUE for the job."),
    cwd: str = typer.Option(None, "--cwd", help="Working directory (default: the current one)."),
    wait: bool = typer.Option(False, "--wait", "-W", help="Wait for the job; exit with its status."),
    checkpoint_every: float = typer.Option(
        None, "--checkpoint-every", help="Seconds between periodic checkpoints (0: none; default: daemon's)."
    ),
    socket: str = SocketOption,
) -> None:
    """Queue a program; prints its job id. The job runs as you, with your environment."""
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
    request = pb.SubmitRequest(
        command=command, name=name, gpus=gpus, priority=priority, ranks=ranks, cwd=directory, env=job_env
    )
    if checkpoint_every is not None:
        request.checkpoint_interval = checkpoint_every
    with connect(socket) as stub:
        job = stub.Submit(request).job
        print(job.id, flush=True)
        if wait:
            raise SystemExit(_job_status(_wait_for(stub, job.id)))


@app.command()
def ps(
    all_jobs: bool = typer.Option(False, "--all", "-a", help="Include ended jobs."),
    output_format: str = typer.Option(None, "--output", "-o", help="wide or json."),
    no_header: bool = typer.Option(False, "--no-header", help="Omit the header line."),
    watch: bool = typer.Option(False, "--watch", "-w", help="After the list, print each change."),
    user: str = typer.Option("", "--user", "-u", help="Only this user's jobs."),
    socket: str = SocketOption,
) -> None:
    """List jobs (queued and running; -a for all)."""
    fmt = _output_format(output_format, ("wide", "json"))
    request = pb.ListJobsRequest(all=all_jobs, user=user)
    with connect(socket) as stub:
        if not watch:
            jobs = stub.ListJobs(request).jobs
            if fmt == "json":
                print(output.to_json([output.job_dict(j) for j in jobs]))
            else:
                text = output.jobs_table(jobs, fmt == "wide", not no_header)
                if text:
                    print(text)
            return
        try:
            for update in stub.WatchJobs(request):
                if fmt == "json":
                    for job in update.jobs:
                        print(output.to_json(output.job_dict(job)).replace("\n", " "), flush=True)
                    continue
                header = not no_header and not update.is_change
                text = output.jobs_table(update.jobs, fmt == "wide", header)
                if text:
                    print(text, flush=True)
        except KeyboardInterrupt:
            return


@app.command()
def show(
    job_id: int = typer.Argument(..., metavar="ID"),
    output_format: str = typer.Option(None, "--output", "-o", help="json."),
    socket: str = SocketOption,
) -> None:
    """Show a job: its spec, devices, usage, pending reason and event timeline."""
    fmt = _output_format(output_format, ("json",))
    with connect(socket) as stub:
        detail = stub.GetJob(pb.JobRef(id=job_id))
    if fmt == "json":
        print(output.to_json(output.job_detail_dict(detail)))
    else:
        print(output.job_detail_text(detail))


@app.command()
def logs(
    job_id: int = typer.Argument(..., metavar="ID"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    tail: int = typer.Option(0, "--tail", help="Start with the last N lines."),
    rank: int = typer.Option(0, "--rank", help="Which rank's output."),
    socket: str = SocketOption,
) -> None:
    """Print a job's output (stdout and stderr of one rank)."""
    if tail < 0:
        raise CliError(f"--tail must not be negative, not {tail}", EXIT_USAGE)
    out = sys.stdout.buffer
    with connect(socket) as stub:
        try:
            for chunk in stub.StreamLogs(pb.LogsRequest(id=job_id, follow=follow, tail=tail, rank=rank)):
                out.write(chunk.data)
                out.flush()
        except KeyboardInterrupt:
            return


@app.command()
def cancel(
    job_ids: list[int] = typer.Argument(..., metavar="ID..."),
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
def preempt(job_id: int = typer.Argument(..., metavar="ID"), socket: str = SocketOption) -> None:
    """Checkpoint a running job and stop it; it resumes when the scheduler gives it devices."""
    with connect(socket) as stub:
        stub.Preempt(pb.JobRef(id=job_id))


@app.command()
def suspend(job_id: int = typer.Argument(..., metavar="ID"), socket: str = SocketOption) -> None:
    """Checkpoint a running job and stop it (or hold a queued one) until `sing resume`."""
    with connect(socket) as stub:
        stub.Suspend(pb.JobRef(id=job_id))


@app.command()
def resume(job_id: int = typer.Argument(..., metavar="ID"), socket: str = SocketOption) -> None:
    """Put a suspended job back in the queue."""
    with connect(socket) as stub:
        stub.Resume(pb.JobRef(id=job_id))


@app.command()
def checkpoint(job_id: int = typer.Argument(..., metavar="ID"), socket: str = SocketOption) -> None:
    """Checkpoint a running job and let it keep running; prints the checkpoint taken."""
    with connect(socket) as stub:
        response = stub.Checkpoint(pb.JobRef(id=job_id))
    print(output.checkpoint_text(response))


@app.command()
def wait(
    job_id: int = typer.Argument(..., metavar="ID"),
    socket: str = SocketOption,
) -> None:
    """Wait for a job to end; exit with its status (its exit code, or 128 + signal)."""
    with connect(socket) as stub:
        job = _wait_for(stub, job_id)
    raise SystemExit(_job_status(job))


@app.command()
def devices(
    output_format: str = typer.Option(None, "--output", "-o", help="json."),
    socket: str = SocketOption,
) -> None:
    """List the devices the daemon owns and the jobs on them."""
    fmt = _output_format(output_format, ("json",))
    with connect(socket) as stub:
        found = stub.ListDevices(pb.ListDevicesRequest()).devices
    if fmt == "json":
        print(output.to_json([output.device_dict(d) for d in found]))
    else:
        print(output.devices_table(found))


def _check(ok: bool, label: str, detail: str) -> bool:
    print(f"[{'ok' if ok else 'FAIL'}] {label}: {detail}")
    return ok


@app.command()
def doctor(socket: str = SocketOption) -> None:
    """Check the set-up: daemon reachable, socket permissions, CRIU, NVML."""
    path = resolve_socket(socket)
    healthy = True
    try:
        info = path.stat()
        mode = info.st_mode
        try:
            owner = pwd.getpwuid(info.st_uid).pw_name
        except KeyError:
            owner = str(info.st_uid)
        usable = stat.S_ISSOCK(mode) and os.access(path, os.R_OK | os.W_OK)
        healthy &= _check(
            usable,
            "socket",
            f"{path} ({stat.filemode(mode)}, owner {owner})" + ("" if usable else ": not usable by you"),
        )
    except FileNotFoundError:
        _check(False, "socket", unreachable_message(path))
        raise SystemExit(EXIT_UNAVAILABLE) from None
    except OSError as error:
        _check(False, "socket", f"{path}: {error.strerror}")
        raise SystemExit(EXIT_UNAVAILABLE) from None
    try:
        with connect(socket) as stub:
            info = stub.GetDaemonInfo(pb.DaemonInfoRequest())
    except CliError as error:
        _check(False, "daemon", error.message)
        raise SystemExit(error.code) from None
    _check(True, "daemon", f"singularityd {info.version} ({info.mode} mode), state in {info.state_dir}")
    _check(
        True,
        "identity",
        f"you are {info.caller_user} (uid {info.caller_uid})"
        + (", an admin" if info.caller_is_admin else ""),
    )
    _check(True, "devices", f"{info.device_count} {info.device_kind} device(s)")
    nvml_ok = info.device_kind == "nvml" or not info.nvml_status.startswith("unavailable")
    print(f"[{'ok' if nvml_ok else 'info'}] nvml: {info.nvml_status}")
    criu_ok = not info.criu_unavailable_reason
    healthy &= _check(
        criu_ok,
        "criu",
        f"CRIU {info.criu_version} at {info.criu_path}"
        if criu_ok
        else f"checkpoints unavailable: {info.criu_unavailable_reason}",
    )
    healthy &= _check(
        info.pid_namespaces or info.mode == "user",
        "isolation",
        "jobs run in their own PID namespace" if info.pid_namespaces else "no PID namespaces (user mode)",
    )
    raise SystemExit(EXIT_OK if healthy else EXIT_FAILURE)


def main() -> None:
    """Entry point of `sing`: run the app; errors become one line on stderr and an exit code."""
    try:
        app()
    except CliError as error:
        fail(error.message, error.code)
    except grpc.RpcError as error:
        failure = rpc_error(error, Path(resolve_socket(None)))
        fail(failure.message, failure.code)
    except BrokenPipeError:
        os._exit(EXIT_OK)


if __name__ == "__main__":
    main()
