"""A submission as the API received it, and its validation into the spec that is stored."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from singularityd.core.states import JobState
from singularityd.errors import InvalidRequest, StateConflict, Unsatisfiable
from singularityd.identity import Caller
from singularityd.scheduling.replicas import device_range, resize_refusal
from singularityd.store import JobRecord, JobSpec
from singularityd.tiers import DEFAULT_TIER, TIERS
from singularityd.units import counted

MAX_PRIORITY = 1_000_000
MAX_RANKS = 4096
"""Most processes one job may start (a process group's limit on the proxies, proxy/server/collectives.py)."""
MAX_RESTARTS = 100
"""Most restarts after failures one job may ask for (`--max-restarts`)."""
MAX_NAME_CHARS = 200
"""Longest job name: every listing carries it, to every user."""
MAX_COMMAND_BYTES = 1 << 20
"""Most bytes of command line and environment one job keeps (Linux takes at most 2 MiB in all)."""


@dataclass(frozen=True)
class SubmitArgs:
    """A submission as the API received it, before validation."""

    command: tuple[str, ...]
    name: str
    gpus: int
    priority: int
    ranks: int
    cwd: str
    env: dict[str, str]
    checkpoint_interval: float | None = None
    max_restarts: int = 0
    min_gpus: int = 0
    max_gpus: int = 0
    tier: str = ""
    """'' for the default tier."""


def default_gpus(ranks: int, min_gpus: int, max_gpus: int) -> int:
    """The devices a job asks for when `--gpus` is not given: an elastic job its maximum (the
    ranks when only --min-gpus is given), any other one."""
    return max_gpus or (ranks if min_gpus else 1)


def elastic_range(args: SubmitArgs) -> tuple[int, int]:
    """The job's elastic range of devices, (0, 0) when it is not elastic; a missing end defaults
    to 1 (min) or the job's ranks (max); InvalidRequest when the range cannot hold."""
    if not args.min_gpus and not args.max_gpus:
        return (0, 0)
    low, high = args.min_gpus or 1, args.max_gpus or args.ranks
    if low < 1:
        raise InvalidRequest(f"--min-gpus must be at least 1, not {low}")
    if low > high:
        raise InvalidRequest(f"--min-gpus {low} is more than --max-gpus {high}")
    if high > args.ranks:
        raise InvalidRequest(
            f"--max-gpus {high} is more than --ranks {args.ranks}: "
            "an elastic job uses at most one device per rank"
        )
    if not low <= args.gpus <= high:
        raise InvalidRequest(
            f"--gpus {args.gpus} is outside the elastic range {low}-{high} (--min-gpus/--max-gpus)"
        )
    return (low, high)


def validated_spec(caller: Caller, args: SubmitArgs, total_devices: int) -> JobSpec:
    """The job spec to store, or InvalidRequest / Unsatisfiable saying what is wrong."""
    if not args.command or not args.command[0]:
        raise InvalidRequest("empty command: give the program to run after --")
    if args.gpus < 1:
        raise InvalidRequest(f"--gpus must be at least 1, not {args.gpus}")
    if args.ranks < 1:
        raise InvalidRequest(f"--ranks must be at least 1, not {args.ranks}")
    if args.ranks > MAX_RANKS:
        raise InvalidRequest(f"--ranks must be at most {MAX_RANKS}, not {args.ranks}")
    if not 0 <= args.max_restarts <= MAX_RESTARTS:
        raise InvalidRequest(f"--max-restarts must be between 0 and {MAX_RESTARTS}, not {args.max_restarts}")
    low, high = elastic_range(args)
    if args.ranks > 1 and args.gpus > args.ranks:
        raise InvalidRequest(
            f"--gpus {args.gpus} is more than --ranks {args.ranks}: each rank runs on one device, "
            "so a job of several ranks can use at most one device per rank"
        )
    if abs(args.priority) > MAX_PRIORITY:
        raise InvalidRequest(f"--priority must be between -{MAX_PRIORITY} and {MAX_PRIORITY}")
    tier = args.tier or DEFAULT_TIER
    if tier not in TIERS:
        raise InvalidRequest(f"--tier must be one of {', '.join(TIERS)}, not {tier!r}")
    if args.gpus > total_devices:
        raise Unsatisfiable(f"requested {counted(args.gpus, 'device')} but this machine has {total_devices}")
    if not os.path.isabs(args.cwd):
        raise InvalidRequest(f"working directory must be absolute: {args.cwd!r}")
    if not os.path.isdir(args.cwd):
        problem = "is not a directory" if os.path.exists(args.cwd) else "does not exist"
        raise InvalidRequest(f"working directory {args.cwd} {problem}")
    interval = args.checkpoint_interval
    if interval is not None and not (math.isfinite(interval) and interval >= 0):
        raise InvalidRequest(f"--checkpoint-every must be 0 or more seconds, not {interval:g}")
    bad = [key for key in args.env if not key or "=" in key or "\0" in key]
    if bad:
        raise InvalidRequest(f"invalid environment variable name {bad[0]!r}")
    name = args.name or os.path.basename(args.command[0])
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"a job's name must be at most {MAX_NAME_CHARS} characters, not {len(name)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidRequest(f"a job's name must not hold control characters (newlines, escapes): {name!r}")
    size = sum(len(word.encode()) for word in args.command) + sum(
        len(key.encode()) + len(value.encode()) for key, value in args.env.items()
    )
    if size > MAX_COMMAND_BYTES:
        raise InvalidRequest(
            f"the command and environment take {size} bytes; at most {MAX_COMMAND_BYTES} are kept per job"
        )
    return JobSpec(
        name=name,
        uid=caller.uid,
        gid=caller.gid,
        user=caller.user,
        priority=args.priority,
        gpus=args.gpus,
        ranks=args.ranks,
        command=args.command,
        env=args.env,
        cwd=args.cwd,
        checkpoint_interval=interval,
        max_restarts=args.max_restarts,
        min_gpus=low,
        max_gpus=high,
        tier=tier,
    )


def check_resize(job: JobRecord, gpus: int, total_devices: int) -> None:
    """Whether the job may be resized to `gpus` devices: InvalidRequest, StateConflict or
    Unsatisfiable say why not."""
    ranks = job.spec.ranks
    if ranks < 2:
        raise InvalidRequest(f"job {job.id} has one rank: only a job of several ranks can be resized")
    if not 1 <= gpus <= ranks:
        raise InvalidRequest(f"--gpus must be between 1 and the job's {ranks} ranks, not {gpus}")
    refused = resize_refusal(job.id, ranks, gpus, job.splice_refusal)
    if refused:
        raise InvalidRequest(f"cannot splice: {refused}")
    low, high = device_range(ranks, job.spec.min_gpus, job.spec.max_gpus, job.splice_refusal)
    if job.spec.elastic and not low <= gpus <= high:
        raise InvalidRequest(f"--gpus {gpus} is outside job {job.id}'s elastic range {low}-{high}")
    if gpus > total_devices:
        raise Unsatisfiable(f"requested {counted(gpus, 'device')} but this machine has {total_devices}")
    if job.state is not JobState.RUNNING:
        raise StateConflict(f"job {job.id} is {job.state.value}; only a RUNNING job can be resized")


def grow_refusal(job: JobRecord, gpus: int, free: int) -> str:
    """Why a running job cannot grow to `gpus` devices now: it holds fewer and not enough are free
    (stopping it would only bring it back on the devices it has)."""
    text = (
        f"job {job.id} cannot grow to {counted(gpus, 'device')} now: it runs on {len(job.devices)} and "
        f"{free} more {'is' if free == 1 else 'are'} free"
    )
    if not job.spec.elastic:
        return text
    _low, high = device_range(job.spec.ranks, job.spec.min_gpus, job.spec.max_gpus, job.splice_refusal)
    return f"{text}; being elastic, it grows into idle devices by itself (up to {high})"
