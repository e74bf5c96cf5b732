"""What the scheduler shows of itself: its event log and, when asked for, Prometheus metrics.

`SchedulerServer` makes one `Observability` from the `ObserveConfig` (CLUSTER_EVENT_LOG,
CLUSTER_METRICS_PORT and CLUSTER_METRICS_HOST: /metrics listens on the scheduler's host unless
told another), installs its interceptors in the gRPC server, starts it once its core is
final (a restarted scheduler's is loaded from disk) and stops it last. The journal of events
exists whatever the config (`WatchEvents` reads it); the file and the metrics only when asked.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from cluster.protocol.config import ObserveConfig
from cluster.scheduler.core import SchedulerCore
from cluster.scheduler.gate import Gate
from cluster.scheduler.machine import events
from cluster.scheduler.persist import STATE

if TYPE_CHECKING:
    from cluster.scheduler.event_file import EventLogLock
    from cluster.scheduler.metrics import MetricsServer, SchedulerMetrics
    from cluster.scheduler.rpc_metrics import RpcMetrics

log = logging.getLogger("cluster.scheduler")


class Observability:
    def __init__(self, config: ObserveConfig, host: str, gate: Gate, state: str = "") -> None:
        """`gate`: the server's, which says whether this scheduler leads the job (the metrics
        show the job only while it does) and counts the calls refused at the edge; `state`:
        where its state store keeps the job ('' without one), which the event log's lock names."""
        self.config = config
        self.log_lock: EventLogLock | None = None
        if config.event_log is not None:
            from cluster.scheduler.event_file import EventLogLock  # noqa: PLC0415 - files

            self.log_lock = EventLogLock(config.event_log, state)
        self.host = host
        self.gate = gate
        self.metrics: SchedulerMetrics | None = None
        if config.metrics_port is not None:
            # prometheus_client only when metrics are on: importing it costs a restarted
            # scheduler 70 ms or more, which it would spend before taking its nodes back.
            from cluster.scheduler.metrics import SchedulerMetrics  # noqa: PLC0415

            self.metrics = SchedulerMetrics()
        self._http: MetricsServer | None = None
        self._core: SchedulerCore | None = None

    @property
    def metrics_port(self) -> int | None:
        """Where /metrics is served (None: metrics are off, or not started yet)."""
        return None if self._http is None else self._http.port

    def interceptors(self) -> list[RpcMetrics]:
        return [] if self.metrics is None else [self.metrics.rpc]

    def claim_event_log(self, *, standby: bool = False) -> None:
        """At start: the event log's lock (`EventLogLock.claim`), a ConfigError when another
        job's scheduler writes the file. A standby holds nothing until it leads."""
        if self.log_lock is not None:
            self.log_lock.claim(standby=standby)

    async def start(self, core: SchedulerCore, *, announce: bool = True) -> None:
        """Observe `core` (and serve /metrics when asked): once, at start. A standby starts
        with a core of no job (`announce` False: no "started" event, no event log), and adopts
        the job's core when it leads."""
        self.adopt(core, announce=announce, log=announce)
        if self.metrics is not None and self.config.metrics_port is not None:
            from cluster.scheduler.metrics import MetricsServer  # noqa: PLC0415

            self.metrics.attach(self.gate, asyncio.get_running_loop())
            host = self.host if self.config.metrics_host is None else self.config.metrics_host
            self._http = MetricsServer(self.metrics.registry, host, self.config.metrics_port)
            port = self._http.start()
            where = f"[{host}]" if ":" in host else host
            log.info("metrics at http://%s:%d/metrics", where, port)

    @property
    def started(self) -> bool:
        return self._core is not None

    def adopt(self, core: SchedulerCore, *, announce: bool = True, log: bool = True) -> None:
        """Observe `core` from now on (a standby that takes the job over answers with a core of
        its own): its events go to the log (with `log`) and the metrics, its saves are
        counted."""
        if self._core is not None and self._core is not core:
            self._core.journal.close()
        self._core = core
        if self.config.event_log is not None and log:
            core.journal.open(self.config.event_log, self.config.rotation, self.log_lock)
        if core.persister is not None:
            core.persister.observer = self._saved
        if self.metrics is not None:
            self.metrics.adopt(core)
        if announce:
            core.journal.emit(events.of_start(core.state))

    def _saved(self, seconds: float, error: str | None, part: str) -> None:
        """A save of `part` (the state, or a key-value batch) ended with `error` (None: it
        landed): the metrics count it, and the event log says when saving as a whole starts
        failing and when it works again (both parts landing)."""
        core = self._core
        assert core is not None
        persister = core.persister
        failing = error if persister is None else persister.error
        core.journal.save(failing is None, failing or "")
        if self.metrics is not None and persister is not None:
            # The directory store's state file (its size is a metric); a batch leaves it as it is.
            path = getattr(persister.store, "path", None) if part == STATE else None
            self.metrics.saved(seconds, error is None, path)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._core is not None:
            self._core.journal.close()
        if self.log_lock is not None:
            self.log_lock.release()
