"""What the scheduler's log says of the job's events as they are told: registration progress
(at most one line per `PROGRESS_LOG_EVERY_S`, and the last), a formed topology, a failed node,
the job's end."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cluster.scheduler.machine import state

log = logging.getLogger("cluster.scheduler")

PROGRESS_LOG_EVERY_S = 5.0


class EffectLog:
    def __init__(self, job: state.SchedulerState, clock: Callable[[], float]) -> None:
        self._job = job
        self._clock = clock
        self._last_progress_log = 0.0

    def told(self, event: state.Event) -> None:
        """Log `event`, which the nodes are told now."""
        if isinstance(event, state.ProgressEvent):
            now = self._clock()
            full = event.registered == event.expected
            if full or now - self._last_progress_log >= PROGRESS_LOG_EVERY_S:
                self._last_progress_log = now
                log.info("registered %d of %d nodes", event.registered, event.expected)
        elif isinstance(event, state.TopologyReadyEvent):
            log.info(
                "topology ready: %d nodes, generation %d, %.2f s after start",
                len(event.peers),
                event.generation,
                self._clock() - self._job.started,
            )
        elif isinstance(event, state.NodeFailedEvent):
            log.error("node %r (rank %s) failed: %s", event.node_id, event.rank, event.reason)
        elif event.ok:
            log.info("job finished: %s", event.reason)
        else:
            log.error("job failed: %s", event.reason)
