"""What the scheduler's log says of the job's events as they are told: registration progress
(at most one line per `PROGRESS_LOG_EVERY_S`, and the last), a formed topology, a failed node
(and why no spare takes its rank, where that is not plain), the job's end."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cluster.scheduler.machine import spares, state

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
            self._kept_for_its_node(event)
        elif event.ok:
            log.info("job finished: %s", event.reason)
        else:
            log.error("job failed: %s", event.reason)

    def _kept_for_its_node(self, event: state.NodeFailedEvent) -> None:
        """Say why no spare takes the rank of the worker that failed, when that is because
        every other worker has finished (`spares.others_finished`): where the job has a spare
        (live, or taken for dead a moment ago: a starved spare comes back), or where the node
        that held the rank before cannot take it back (`spares.gives_back`), which may come back
        as a spare later."""
        job, member = self._job, self._job.find(event.node_id)
        if member is None or member.rank is None:
            return
        if not spares.others_finished(job.members.values(), member):
            return
        back = spares.gives_back(member)
        has_spare = any(not m.replaced_by for m in job.spares.values())
        if not (has_spare or (member.took_over and not back)):
            return
        before = after = ""
        if back:
            before = f" (or node {member.took_over!r}, which held it before)"
        elif member.took_over:
            held = member.took_over_step
            after = (
                f"; node {member.took_over!r}, which held it before, does not take it back: the "
                f"rank reached step {spares.newest_step(member)} after it, and "
                + (f"the newest step it reported was {held}" if held >= 0 else "it reported none")
            )
        log.warning(
            "no spare takes rank %s: every other worker has finished, so a spare could fetch "
            "the rank's final state from nobody; the rank waits for node %r to come back%s, "
            "whose files hold that state, for up to MS_TOPO_TIMEOUT (%g s)%s",
            member.rank,
            member.node_id,
            before,
            job.settings.topo_timeout_s,
            after,
        )
