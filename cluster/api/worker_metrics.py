"""A worker's Prometheus metrics, off by default: CLUSTER_WORKER_METRICS_PORT + its local rank.

`TrainingLoop` and the collectives call the hooks below. With the variable unset, `start()`
checks it once a job and every hook returns at once (one global read); with it set, the first
`TrainingLoop` (or collective) after `cluster.init()` serves /metrics on the worker's advertised
address, port base + local rank, so the workers of one host do not collide, until the worker
finalizes (`stop`: the port is closed, and a next `cluster.init()` serves it again). It is plain
HTTP and open to whoever reaches it; its server (`cluster.transport.bounded_http`, the
scheduler's too) holds a bounded number of threads and descriptors for a bounded time, however
many connections are opened to it, so an outsider cannot take the training process's
descriptors. A port that cannot be had is said once; training goes on without metrics.

    cluster_worker_steps_total                  steps completed
    cluster_worker_step_seconds                 seconds per step (histogram)
    cluster_worker_rollbacks_total              rollbacks to a generation's rollback step
    cluster_worker_steps_redone_total           steps computed again after rollbacks
    cluster_worker_checkpoint_pause_seconds     seconds the loop spent in a save (histogram)
    cluster_worker_checkpoint_persist_seconds   seconds from a save to its report, on disk
    cluster_worker_collective_seconds{op}       seconds in a collective, by op (histogram)
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from cluster.api import runtime

if TYPE_CHECKING:
    from cluster.transport.bounded_http import BoundedHttp

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OPS = ("barrier", "allgather", "broadcast", "allreduce")
# The longest a scrape's answer takes to make (the registry's values, read in this process).
MAKING_S = 5.0


class WorkerMetrics:
    def __init__(self, rank: int, node_id: str) -> None:
        # prometheus_client only when metrics are on: importing it costs a worker 0.1-0.2 s.
        from prometheus_client import (  # noqa: PLC0415
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
        )

        r = self.registry = CollectorRegistry()
        info = Gauge(
            "cluster_worker_info",
            "This worker (labels); always 1.",
            ["rank", "node_id"],
            registry=r,
        )
        info.labels(str(rank), node_id).set(1)
        self.steps = Counter("cluster_worker_steps", "Training steps completed.", registry=r)

        def seconds(name: str, documentation: str, *labels: str) -> Histogram:
            return Histogram(name, documentation, labels, buckets=SECONDS_BUCKETS, registry=r)

        self.step_seconds = seconds("cluster_worker_step_seconds", "Seconds per training step.")
        self.rollbacks = Counter(
            "cluster_worker_rollbacks", "Rollbacks to a generation's rollback step.", registry=r
        )
        self.steps_redone = Counter(
            "cluster_worker_steps_redone", "Steps computed again after rollbacks.", registry=r
        )
        self.pause = seconds(
            "cluster_worker_checkpoint_pause_seconds",
            "Seconds the training loop spent in a checkpoint save.",
        )
        self.persist = seconds(
            "cluster_worker_checkpoint_persist_seconds",
            "Seconds from a checkpoint save to its report to the scheduler (complete on disk).",
        )
        self.collective = seconds(
            "cluster_worker_collective_seconds",
            "Seconds in a control-plane collective, by op.",
            "op",
        )
        for op in OPS:
            self.collective.labels(op)
        self.saving: dict[int, float] = {}  # step -> when its save began, until reported


_metrics: WorkerMetrics | None = None
_checked = False
# The server of `_metrics`' port, from `start` until the worker finalizes (`stop`).
_server: BoundedHttp | None = None


def start() -> WorkerMetrics | None:
    """The process's metrics, started on the first call after `cluster.init()` when
    CLUSTER_WORKER_METRICS_PORT is set (None: off, or not in a job yet). Its port is served
    until the worker finalizes (`stop`, an `on_finalize` closer)."""
    global _metrics, _checked, _server
    if _checked or not runtime.is_initialized():
        return _metrics
    _checked = True
    runtime.on_finalize(stop)  # each job checks once: the next init()'s too
    session = runtime.session()
    base = session.config.observe.worker_metrics_port
    if base is None:
        return None
    topology = runtime.topology()
    port = base + topology.local_rank
    metrics = WorkerMetrics(topology.rank, session.identity.node_id)
    from prometheus_client import make_wsgi_app  # noqa: PLC0415 - see WorkerMetrics

    from cluster.transport.bounded_http import BoundedHttp  # noqa: PLC0415 - http.server too

    app = make_wsgi_app(metrics.registry)
    host = session.identity.host
    server = BoundedHttp(app, host, port, making_s=MAKING_S, name="cluster-worker-metrics")
    try:
        server.start()
    except (OSError, OverflowError) as exc:
        sys.stderr.write(
            f"cluster[rank {topology.rank}]: no worker metrics: CLUSTER_WORKER_METRICS_PORT="
            f"{base} + local rank {topology.local_rank} = port {port} cannot be had "
            f"({getattr(exc, 'strerror', None) or exc}); training goes on\n"
        )
        return None
    _metrics, _server = metrics, server
    return metrics


def stop() -> None:
    """Close the metrics port and end its serving thread (within a sweep, and 5 s for the
    thread: `BoundedHttp.stop`); the hooks record nothing more, and the first call after a
    next `cluster.init()` starts metrics again."""
    global _metrics, _checked, _server
    server, _server = _server, None
    _metrics, _checked = None, False
    if server is not None:
        server.stop()


# -- hooks: each returns at once when metrics are off -----------------------------------------


def step_done(started: float) -> None:
    """A training step that began at `started` (perf_counter) has completed."""
    m = _metrics
    if m is not None:
        m.steps.inc()
        m.step_seconds.observe(time.perf_counter() - started)


def rolled_back(steps_lost: int) -> None:
    m = _metrics
    if m is not None:
        m.rollbacks.inc()
        m.steps_redone.inc(steps_lost)


def checkpoint(step: int) -> contextlib.AbstractContextManager[None]:
    """Around a checkpoint save of `step`: the loop's pause; its persist ends at the report."""
    m = _metrics
    if m is None:
        return contextlib.nullcontext()
    m.saving[step] = time.perf_counter()
    return _timed(m.pause.observe)


def reported(steps: list[int]) -> None:
    """The worker reported the checkpoint steps it holds: those saved here are on disk. (Called
    by a background writer's thread while the loop saves on: `saving` is read as a copy.)"""
    m = _metrics
    if m is None or not m.saving:
        return
    now = time.perf_counter()
    newest = max(steps, default=0)
    for step in [s for s in list(m.saving) if s <= newest]:
        started = m.saving.pop(step, None)
        if started is not None and step in steps:
            m.persist.observe(now - started)


def collective(op: str) -> contextlib.AbstractContextManager[None]:
    """Around a collective call of `op` (a job without a TrainingLoop starts metrics here)."""
    m = start()
    return contextlib.nullcontext() if m is None else _timed(m.collective.labels(op).observe)


@contextlib.contextmanager
def _timed(observe: Callable[[float], None]) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        observe(time.perf_counter() - started)
