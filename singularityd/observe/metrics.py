"""Prometheus metrics of the daemon, served over HTTP with prometheus-client.

What happens to jobs (submissions, transitions, checkpoints with their pause, duration and size,
preemptions, restores), scheduling rounds, config reloads and spooled files arrive as observations
on the daemon's change feed (singularityd.observe.feed): `Metrics.observe` is its only entry, so
the rest of the daemon never calls into the metrics. Devices are sampled when Prometheus scrapes:
memory and utilisation from NVML for GPUs, and for every proxied device what its proxy server
reports (memory held by jobs, operations and busy time, sessions; a virtual device's utilisation).

The endpoint runs on prometheus-client's own HTTP thread: the event-fed metrics are thread-safe,
the job table is guarded by a lock, and device sampling only reads files and proxy sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from singularityd import __version__
from singularityd.core.actions import RestoreProcesses, TakeCheckpoint
from singularityd.core.states import JobState
from singularityd.core.stimuli import Checkpointed, CheckpointFailed, Restored, RestoreFailed
from singularityd.devices.inventory import Inventory, refresh
from singularityd.devices.proxies import JobProxies
from singularityd.observe.feed import (
    ConfigReloaded,
    JobDecided,
    JobSubmitted,
    Observation,
    RoundPlanned,
    SpoolFileHandled,
)
from singularityd.store import Store

log = logging.getLogger(__name__)

MIB = 1024**2
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SIZE_BUCKETS = tuple(float(MIB * 4**k) for k in range(10))  # 1 MiB to 256 GiB
ROUND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class DeviceSample:
    """One device as sampled for a scrape; `proxy` is what its proxy server reported, if it runs."""

    index: int
    kind: str
    memory_total: int
    memory_used: int
    utilization_ratio: float | None
    proxy: dict[str, Any] | None


class DeviceSampler:
    """Reads the devices' live facts: NVML for GPUs, the proxy servers for what jobs hold on them."""

    def __init__(self, inventory: Inventory, proxies: JobProxies | None) -> None:
        self.inventory = inventory
        self.proxies = proxies

    def sample(self) -> list[DeviceSample]:
        """Every device now (blocking: runs on the metrics thread, never the event loop)."""
        samples = []
        for device in refresh(self.inventory).devices:
            status = self.proxies.status(device.index) if self.proxies is not None else None
            used = device.memory_used
            total = device.memory_total
            ratio = device.utilization_percent / 100 if device.utilization_percent is not None else None
            if device.kind != "nvml":
                used = int(status["allocated"]) if status else 0
                total = int(status["capacity"]) if status else total
                if self.proxies is not None:
                    ratio = float(status.get("utilization_percent", 0)) / 100 if status else 0.0
            samples.append(DeviceSample(device.index, device.kind, total, used, ratio, status))
        return samples


class _DeviceCollector(Collector):
    """Device and proxy metrics, sampled at each scrape."""

    def __init__(self, sampler: DeviceSampler) -> None:
        self.sampler = sampler

    def collect(self) -> Iterator[Metric]:
        """The device families, one sample per device."""
        labels = ["device", "kind"]
        total = GaugeMetricFamily(
            "singularity_device_memory_total_bytes", "Memory capacity of the device.", labels=labels
        )
        used = GaugeMetricFamily(
            "singularity_device_memory_used_bytes",
            "Device memory in use (GPUs: NVML; virtual devices: what jobs hold in the proxy).",
            labels=labels,
        )
        utilization = GaugeMetricFamily(
            "singularity_device_utilization_ratio",
            "Share of the last second the device ran work, 0 to 1: NVML's for a GPU, the proxy server's "
            "for a virtual device.",
            labels=labels,
        )
        up = GaugeMetricFamily(
            "singularity_proxy_up", "1 when the device's proxy server runs and answers.", labels=labels
        )
        operations = CounterMetricFamily(
            "singularity_proxy_operations", "Operations the proxy server ran.", labels=labels
        )
        batches = CounterMetricFamily(
            "singularity_proxy_batches", "Batches of operations the proxy server ran.", labels=labels
        )
        busy = CounterMetricFamily(
            "singularity_proxy_busy_seconds",
            "Time the proxy server spent running operations (its rate is a virtual device's utilisation).",
            labels=labels,
        )
        sessions = GaugeMetricFamily(
            "singularity_proxy_sessions", "Job processes (ranks) with a session on the device.", labels=labels
        )
        for sample in self.sampler.sample():
            values = [str(sample.index), sample.kind]
            total.add_metric(values, sample.memory_total)
            used.add_metric(values, sample.memory_used)
            if sample.utilization_ratio is not None:
                utilization.add_metric(values, sample.utilization_ratio)
            status = sample.proxy
            up.add_metric(values, 1.0 if status else 0.0)
            if status:
                operations.add_metric(values, float(status.get("operations", 0)))
                batches.add_metric(values, float(status.get("batches", 0)))
                busy.add_metric(values, float(status.get("busy_seconds", 0.0)))
                sessions.add_metric(values, float(len(status.get("jobs", {}))))
        yield from (total, used, utilization, up, operations, batches, busy, sessions)


class _JobTable(Collector):
    """How many jobs are in each state, and the state of every live job (kept from the feed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[JobState, int] = dict.fromkeys(JobState, 0)
        self._live: dict[int, tuple[str, JobState]] = {}

    def load(self, store: Store) -> None:
        """Start from what the store holds."""
        counts = store.count_by_state()
        live = {job.id: (job.spec.user, job.state) for job in store.list_jobs()}
        with self._lock:
            self._counts = {state: counts.get(state, 0) for state in JobState}
            self._live = live

    def submitted(self, job_id: int, user: str) -> None:
        """A new PENDING job."""
        with self._lock:
            self._counts[JobState.PENDING] += 1
            self._live[job_id] = (user, JobState.PENDING)

    def moved(self, job_id: int, user: str, before: JobState, after: JobState) -> None:
        """A job changed state."""
        with self._lock:
            self._counts[before] = max(0, self._counts[before] - 1)
            self._counts[after] += 1
            if after.is_terminal:
                self._live.pop(job_id, None)
            else:
                self._live[job_id] = (user, after)

    def collect(self) -> Iterator[Metric]:
        """The job families."""
        with self._lock:
            counts = dict(self._counts)
            live = sorted(self._live.items())
        jobs = GaugeMetricFamily("singularity_jobs", "Jobs in each state.", labels=["state"])
        for state, count in counts.items():
            jobs.add_metric([state.value], count)
        each = GaugeMetricFamily(
            "singularity_job_state", "1 for each job not yet ended, labelled with its state.",
            labels=["job", "user", "state"],
        )  # fmt: skip
        for job_id, (user, state) in live:
            each.add_metric([str(job_id), user, state.value], 1)
        yield from (jobs, each)


def checkpoint_trigger(take: TakeCheckpoint | None) -> str:
    """Who asked for a checkpoint: scheduler, periodic, suspend, preempt (a user) or request."""
    if take is None:
        return "request"
    if take.for_scheduler:
        return "scheduler"
    if take.periodic:
        return "periodic"
    if take.hold:
        return "suspend"
    return "preempt" if take.stop else "request"


class Metrics:
    """The daemon's metrics: a registry fed by the change feed, and its HTTP endpoint."""

    def __init__(self, sampler: DeviceSampler, mode: str = "system") -> None:
        self.registry = CollectorRegistry()
        self.jobs = _JobTable()
        self.registry.register(self.jobs)
        self.registry.register(_DeviceCollector(sampler))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._checkpoint_began: dict[int, float] = {}
        self._restore_began: dict[int, float] = {}
        self._define(mode)

    def _define(self, mode: str) -> None:
        """Create the metrics the feed updates; known label values start at 0, so that the first
        increment shows in rate() and increase()."""
        registry = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = (), *values: tuple[str, ...]) -> Counter:
            made = Counter(name, doc, labels, registry=registry)
            for known in values:
                made.labels(*known)
            return made

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        info = Gauge("singularity_daemon_info", "The daemon's version and mode.", ["version", "mode"],
                     registry=registry)  # fmt: skip
        info.labels(__version__, mode).set(1)
        started = Gauge("singularity_daemon_start_time_seconds", "When the daemon started.",
                        registry=registry)  # fmt: skip
        started.set(time.time())
        outcomes = (("ok",), ("failed",))
        triggers = ("scheduler", "preempt", "suspend", "periodic", "request")
        self.submitted = counter("singularity_jobs_submitted_total", "Jobs submitted.")
        self.transitions = counter(
            "singularity_job_transitions_total", "Job state changes.", ("from_state", "to_state")
        )
        self.preemptions = counter(
            "singularity_preemptions_total",
            "Jobs checkpointed and stopped to go back to the queue, by who asked (scheduler or user).",
            ("trigger",), ("scheduler",), ("user",),
        )  # fmt: skip
        self.suspensions = counter(
            "singularity_suspensions_total", "Jobs checkpointed and held until resumed."
        )
        self.checkpoints = counter(
            "singularity_checkpoints_total",
            "Checkpoints by who asked (scheduler, preempt, suspend, periodic, request) and outcome.",
            ("trigger", "outcome"), *((t, o) for t in triggers for (o,) in outcomes),
        )  # fmt: skip
        self.pause = histogram(
            "singularity_checkpoint_pause_seconds", "How long a checkpoint stopped the job's processes.",
            PAUSE_BUCKETS,
        )  # fmt: skip
        self.duration = histogram(
            "singularity_checkpoint_duration_seconds",
            "From the decision to checkpoint to the checkpoint complete (pre-copy included).",
            DURATION_BUCKETS,
        )
        self.size = histogram(
            "singularity_checkpoint_size_bytes", "Size of each complete checkpoint's images.", SIZE_BUCKETS
        )
        self.restores = counter(
            "singularity_restores_total",
            "Jobs resumed from a checkpoint, by outcome.",
            ("outcome",),
            *outcomes,
        )
        self.restore_duration = histogram(
            "singularity_restore_duration_seconds",
            "From the devices granted to the restored processes running.",
            DURATION_BUCKETS,
        )
        self.rounds = histogram(
            "singularity_scheduler_round_seconds",
            "Time of one scheduling round with jobs queued (the plan and the decisions it leads to).",
            ROUND_BUCKETS,
        )
        self.reloads = counter(
            "singularity_config_reloads_total", "Config file reloads, by outcome.", ("outcome",),
            ("applied",), ("failed",),
        )  # fmt: skip
        self.spooled = counter(
            "singularity_spool_files_total", "Job files from the spool directory, by outcome.", ("outcome",),
            ("submitted",), ("refused",),
        )  # fmt: skip

    def load(self, store: Store) -> None:
        """Take the jobs' states from the store (before the feed reports any change)."""
        self.jobs.load(store)

    # Fed by the change feed

    def observe(self, observation: Observation) -> None:
        """Update the metrics from one observation of the change feed."""
        match observation:
            case JobSubmitted(job_id=job_id, user=user):
                self.submitted.inc()
                self.jobs.submitted(job_id, user)
            case JobDecided():
                self._decided(observation)
            case RoundPlanned(seconds=seconds):
                self.rounds.observe(seconds)
            case ConfigReloaded(error=error):
                self.reloads.labels("failed" if error else "applied").inc()
            case SpoolFileHandled(job_id=job_id):
                self.spooled.labels("refused" if job_id is None else "submitted").inc()

    def _decided(self, seen: JobDecided) -> None:
        """A decision of the state machine: transitions, and the checkpoints and restores it ends."""
        transition = seen.decision.transition
        if transition is not None and transition.from_state is not None:
            self.transitions.labels(transition.from_state.value, transition.to_state.value).inc()
            self.jobs.moved(seen.job_id, seen.user, transition.from_state, transition.to_state)
        now = time.monotonic()
        for action in seen.decision.actions:
            if isinstance(action, TakeCheckpoint):
                self._checkpoint_began[seen.job_id] = now
            elif isinstance(action, RestoreProcesses):
                self._restore_began[seen.job_id] = now
        stimulus = seen.stimulus
        if isinstance(stimulus, Checkpointed | CheckpointFailed):
            take = seen.activity.checkpoint
            began = self._checkpoint_began.pop(seen.job_id, None)
            succeeded = isinstance(stimulus, Checkpointed)
            self.checkpoints.labels(checkpoint_trigger(take), "ok" if succeeded else "failed").inc()
            if isinstance(stimulus, Checkpointed):
                self.pause.observe(stimulus.pause_s)
                self.size.observe(stimulus.image_bytes)
                if began is not None:
                    self.duration.observe(now - began)
            stopped = transition.to_state if transition is not None else None
            if stopped is JobState.PREEMPTED:
                self.preemptions.labels("scheduler" if take and take.for_scheduler else "user").inc()
            elif stopped is JobState.SUSPENDED:
                self.suspensions.inc()
        elif isinstance(stimulus, Restored | RestoreFailed):
            began = self._restore_began.pop(seen.job_id, None)
            ok = isinstance(stimulus, Restored) and not stimulus.problem
            self.restores.labels("ok" if ok else "failed").inc()
            if ok and began is not None:
                self.restore_duration.observe(now - began)

    # The HTTP endpoint

    @property
    def address(self) -> tuple[str, int] | None:
        """Where the endpoint listens (host, port), or None when it is off."""
        if self._server is None:
            return None
        return str(self._server.server_address[0]), int(self._server.server_port)

    def serve(self, address: str, port: int) -> tuple[str, int]:
        """Serve /metrics on address:port (port 0: any free one); OSError when it cannot bind."""
        self.stop_serving()
        server, thread = start_http_server(port, address, registry=self.registry)
        self._server, self._thread = server, thread
        return str(server.server_address[0]), int(server.server_port)

    def stop_serving(self) -> None:
        """Close the endpoint (the metrics keep counting)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(5.0)
