"""The scheduler's Prometheus metrics (prometheus_client), served on /metrics when asked for.

Off by default, and then nothing of this module runs: no registry, no interceptor, no work per
call or per heartbeat. On (`mscluster scheduler --metrics-port`, CLUSTER_METRICS_PORT):

- counters of what happened, fed by the event journal (registrations, node failures by cause,
  rejoins, rollbacks, guard refusals) and by the persister (saves, their seconds and bytes,
  failures);
- what is read at scrape time on the scheduler's loop by a custom collector
  (`SchedulerCollector`): whether this scheduler leads the job, the refusals counted so far
  (every one, from the `RefusalLimiter`s: the journal tells them at a bounded rate, the metrics
  count them all), and, only while it leads, the job's gauges (`cluster.scheduler.job_gauges`:
  nodes by role and state, phase, generation, rollback step, heartbeat ages, key-value usage,
  saves pending). A scheduler that does not lead (a standby, one that stepped down) has no job
  of its own to show: the leader shows it, and sums over schedulers count it once. A scrape
  costs one pass over the nodes; a heartbeat costs nothing more than without metrics;
- RPCs by service, method and status code, with latency (`cluster.scheduler.rpc_metrics`).

The HTTP server (`MetricsServer`: `cluster.transport.bounded_http`) runs on threads of its own,
a bounded number, whoever reaches the port: a scrape reads the job on the scheduler's loop
(`read_on_loop`), so it never sees a change half applied.

Label values are bounded: roles, states, phases, causes and refusal reasons are enums, services,
methods and codes are gRPC's; series per node (`cluster_member_*`, labelled by rank and node id)
exist only in jobs of at most NODE_LABEL_LIMIT nodes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from cluster.protocol.errors import ConfigError, NotLeaderError
from cluster.protocol.events import Failed, Formed, GuardRefusal, LeaderChange
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.gate import Gate
from cluster.scheduler.job_gauges import JobGauges, gauge, job_metrics
from cluster.scheduler.machine import state
from cluster.scheduler.machine.events import Cause, JobEvent, Kind
from cluster.scheduler.rpc_metrics import RpcMetrics
from cluster.transport.bounded_http import BoundedHttp

log = logging.getLogger("cluster.scheduler")

T = TypeVar("T")

SAVE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# How long a scrape waits for the scheduler's loop to read the job: Prometheus's default scrape
# timeout (it has given up by then).
READ_TIMEOUT_S = 10.0


def read_on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], T]) -> T | None:
    """`read()` run on `loop` (from another thread); None when the loop does not answer."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(read())
        except Exception as exc:  # handed to the waiting thread
            future.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # the loop is closed: the scheduler is stopping
        return None
    try:
        return future.result(READ_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        log.warning(
            "a metrics scrape waited %g s for the scheduler's loop and got no answer: it has "
            "only the process and RPC metrics",
            READ_TIMEOUT_S,
        )
        return None


@dataclass(frozen=True)
class Reading:
    """What one scrape reads on the scheduler's loop, in one step."""

    leading: bool
    job: JobGauges | None  # None while this scheduler does not lead the job
    registration_refusals: dict[str, int]  # by reason
    edge_refusals: dict[tuple[str, str], int]  # by (method, reason)
    # Members' calls refused, beats dropped, reports that waited, by (method, reason).
    member_bounds: dict[tuple[str, str], int] = field(default_factory=dict)


class SchedulerCollector(Collector):
    """Leadership, refusals and (while leading) the job's gauges, from `read()` at each scrape
    (None: the scheduler's loop did not answer)."""

    def __init__(self, read: Callable[[], Reading | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        r = self._read()
        if r is None:
            return
        yield gauge(
            "cluster_leader",
            "1 while this scheduler leads the job (a scheduler without standbys always does), 0 "
            "while it stands by.",
            1.0 if r.leading else 0.0,
        )
        refusals = CounterMetricFamily(
            "cluster_registration_refusals",
            "Registrations the job refused, by reason (node_alive: once per wait of the guard).",
            labels=["reason"],
        )
        for reason, count in sorted(r.registration_refusals.items()):
            refusals.add_metric([reason], count)
        yield refusals
        yield _by_method_and_reason(
            "cluster_edge_refusals",
            "Calls refused before they reached the job (malformed, oversized, unauthenticated, "
            "crowded, stalled), by method and reason.",
            r.edge_refusals,
        )
        yield _by_method_and_reason(
            "cluster_member_bounds",
            "Members past their share: calls refused (member_calls, member_bytes), beats "
            "dropped (beats_dropped), Heartbeat streams refused (stream_opens), checkpoint "
            "reports that waited for their turn (reports_coalesced), by method and reason; "
            "the log names the member.",
            r.member_bounds,
        )
        if r.job is not None:
            yield from job_metrics(r.job)


def _by_method_and_reason(
    name: str, documentation: str, counts: dict[tuple[str, str], int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["method", "reason"])
    for (method, reason), count in sorted(counts.items()):
        family.add_metric([method, reason], count)
    return family


class SchedulerMetrics:
    """Every metric of one scheduler, in a registry of its own."""

    def __init__(self) -> None:
        # No `_created` series beside every counter: they double what a scrape carries, and
        # Prometheus does not need them (process-wide; this process is the scheduler).
        disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in the library
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        self.registrations = Counter(
            "cluster_registrations",
            "Processes accepted into the job (first joins and rejoins).",
            registry=r,
        )
        self.guard_refusals = Counter(
            "cluster_guard_refusals",
            "Restarted nodes refused by the re-registration guard (the node id was alive within "
            "MS_NODE_TIMEOUT): once per wait, not per retry.",
            registry=r,
        )
        self.failures = Counter(
            "cluster_node_failures", "Nodes failed, by cause.", ["cause"], registry=r
        )
        self.rejoins = Counter("cluster_rejoins", "Failed nodes that rejoined the job.", registry=r)
        self.rollbacks = Counter(
            "cluster_rollbacks",
            "New generations after the first: each rolls every worker back.",
            registry=r,
        )
        self.promotions = Counter("cluster_promotions", "Ranks taken by spares.", registry=r)
        self.memory_resumes = Counter(
            "cluster_memory_resumes",
            "New generations resumed from the step the survivors hold in memory, not from disk.",
            registry=r,
        )
        self.saves, self.save_failures, self.save_seconds = _save_metrics(r)
        self.leader_changes = Counter(
            "cluster_leader_changes",
            "Times this scheduler took the job's leadership or gave it up.",
            registry=r,
        )
        self.save_bytes = Gauge(
            "cluster_state_save_bytes", "Size of the recovery state file last saved.", registry=r
        )
        for cause in Cause:
            self.failures.labels(cause.value)
        self.rpc = RpcMetrics(r)
        self._core: SchedulerCore | None = None  # observed: its journal feeds `count`
        self._refused_before: collections.Counter[str] = collections.Counter()  # older cores'
        self._bounds_before: collections.Counter[tuple[str, str]] = collections.Counter()
        self._guarded = 0  # guard refusals (once per wait), counted from the journal
        self._formation_s: float | None = None  # of the observed core, `JobGauges.formation_s`

    def adopt(self, core: SchedulerCore) -> None:
        """Observe `core` from now on: its events (`count`), its refusals, its formation."""
        if self._core is not None and self._core is not core:
            for (_, reason), count in self._core.refusals.counts.items():
                self._refused_before[reason] += count
            self._bounds_before.update(self._core.bounds.counts)
        self._core = core
        # A job that formed before this scheduler took it: its formation time is not known here.
        self._formation_s = 0.0 if core.state.phase is state.Phase.WAITING else None
        core.journal.listeners.append(self.count)

    def attach(self, gate: Gate, loop: asyncio.AbstractEventLoop) -> None:
        """Read, at each scrape, whether this scheduler leads (the gate, as every call does)
        and the gauges of the core that answers."""
        self.registry.register(
            SchedulerCollector(lambda: read_on_loop(loop, lambda: self.read(gate)))
        )

    def read(self, gate: Gate) -> Reading:
        """What a scrape shows, read on the scheduler's loop."""
        try:
            leading: SchedulerCore | None = gate.current()
        except NotLeaderError:
            leading = None
        refused = collections.Counter({reason.value: 0 for reason in state.Refusal})
        refused.update(self._refused_before)
        if self._core is not None:
            for (_, reason), count in self._core.refusals.counts.items():
                refused[reason] += count
        refused[state.Refusal.NODE_ALIVE.value] += self._guarded
        job = None
        if leading is not None:
            formation_s = self._formation_s if leading is self._core else None
            job = JobGauges.of(leading, formation_s)
        bounds = collections.Counter(self._bounds_before)
        if self._core is not None:
            bounds.update(self._core.bounds.counts)
        edge = dict(gate.refusals.counts)
        return Reading(leading is not None, job, dict(refused), edge, dict(bounds))

    def count(self, event: JobEvent) -> None:
        kind, view = event.kind, event.typed()
        if kind in (Kind.REGISTERED.value, Kind.REJOINED.value):
            self.registrations.inc()
            if kind == Kind.REJOINED.value:
                self.rejoins.inc()
        elif kind in (Kind.GENERATION.value, Kind.PROMOTED.value):
            self.rollbacks.inc()
            if kind == Kind.PROMOTED.value:
                self.promotions.inc()
        elif kind == Kind.MEMORY_RESUME.value:
            self.memory_resumes.inc()
        match view:
            case GuardRefusal():
                self.guard_refusals.inc()
                self._guarded += 1
            case Failed(cause=cause):
                self.failures.labels(cause.value).inc()
            case LeaderChange():
                self.leader_changes.inc()
            case Formed(seconds=seconds):
                self._formation_s = seconds

    def saved(self, seconds: float, ok: bool, path: Path | None) -> None:
        """A save of the recovery state to `path` (None: not a file) ended."""
        if not ok:
            self.save_failures.inc()
            return
        self.saves.inc()
        self.save_seconds.observe(seconds)
        if path is not None:
            with contextlib.suppress(OSError):
                self.save_bytes.set(path.stat().st_size)


def _save_metrics(r: CollectorRegistry) -> tuple[Counter, Counter, Histogram]:
    """With recovery: saves of the job's state that landed, that failed, and how long each took."""
    saves = Counter("cluster_state_saves", "Saves of the recovery state that landed.", registry=r)
    failures = Counter(
        "cluster_state_save_failures", "Saves of the recovery state that failed.", registry=r
    )
    seconds = Histogram(
        "cluster_state_save_seconds",
        "Seconds a save of the recovery state took.",
        buckets=SAVE_SECONDS_BUCKETS,
        registry=r,
    )
    return saves, failures, seconds


class MetricsServer:
    """/metrics for `registry` at host:port (`BoundedHttp`: bounded in threads, connections and
    the time a connection may take); a scrape's answer is made within READ_TIMEOUT_S."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.requested_port = port
        self._http: BoundedHttp | None = None

    @property
    def port(self) -> int:
        return 0 if self._http is None else self._http.port

    def start(self) -> int:
        http = BoundedHttp(
            make_wsgi_app(self.registry),
            self.host,
            self.requested_port,
            making_s=READ_TIMEOUT_S,
            name="cluster-metrics",
        )
        try:
            port = http.start()
        except OSError as exc:
            raise ConfigError(
                f"CLUSTER_METRICS_PORT={self.requested_port}: the scheduler cannot serve metrics "
                f"on {self.host}:{self.requested_port} ({exc.strerror or exc}); choose a free port "
                "(0: any), and CLUSTER_METRICS_HOST an address of this host"
            ) from None
        self._http = http
        return port

    async def stop(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await asyncio.to_thread(http.stop)
