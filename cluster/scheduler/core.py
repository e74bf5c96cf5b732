"""The scheduler's engine: the state machine plus everything that waits.

`SchedulerCore` owns the `SchedulerState`, the open Watch streams, the key-value store and the
collective rounds, all on one asyncio loop (so none of it needs a lock). Every input goes to the
state machine; the effects it returns are applied here: events fan out to every stream, an
eviction ends one stream, a shutdown fails open collectives and marks the job done.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cluster import state
from cluster.config import canonical_node_id
from cluster.errors import ClusterError, CollectiveError, JobFailedError
from cluster.scheduler import convert
from cluster.scheduler.exchange import ExchangeTable
from cluster.scheduler.kv import KvStore
from cluster.scheduler.streams import Streams
from cluster.v1 import scheduler_pb2 as pb

log = logging.getLogger("cluster.scheduler")

# How often the monitor lets time pass for the state machine (heartbeat silence, topology
# timeout). Detection of a dead process does not depend on it: a broken stream is seen at once.
TICK_S = 0.1
# Registration progress is coalesced: at most one broadcast per interval (not one per
# registration, which would be N^2 messages for N nodes), and one log line per PROGRESS_LOG_EVERY_S.
PROGRESS_BROADCAST_EVERY_S = 2.0
PROGRESS_LOG_EVERY_S = 5.0


class EvictedError(ClusterError):
    """This stream's node was removed from the job (replaced, or silent while forming)."""


# The scheduler's heartbeat, serialized once.
_HEARTBEAT = pb.Event(heartbeat=pb.SchedulerHeartbeat()).SerializeToString()


@dataclass(frozen=True)
class CoreSettings:
    worker_num: int
    server_num: int
    node_timeout_s: float
    topo_timeout_s: float
    heartbeat_interval_s: float
    heartbeat_enabled: bool = True
    recovery: bool = False


class SchedulerCore:
    def __init__(self, settings: CoreSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self.state = state.SchedulerState(
            cluster_id=uuid.uuid4().hex[:12],
            worker_num=settings.worker_num,
            server_num=settings.server_num,
            node_timeout_s=settings.node_timeout_s,
            topo_timeout_s=settings.topo_timeout_s,
            heartbeat_enabled=settings.heartbeat_enabled,
            recovery=settings.recovery,
            clock=clock,
        )
        self.kv = KvStore()
        self.exchanges = ExchangeTable()
        self._streams = Streams(clock)
        self.done = asyncio.Event()
        self.streams_closed = asyncio.Event()
        self.streams_closed.set()
        self._last_progress_log = 0.0
        self._pending_progress: state.ProgressEvent | None = None
        # The published topology, serialized once: it goes to every node, and is large.
        self._topology_bytes: tuple[state.TopologyReadyEvent, bytes] | None = None
        self._last_progress_broadcast = 0.0
        # The Shutdown event as sent: a stream ends after writing it.
        self._final: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.state.phase is state.Phase.FINISHED

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- lifecycle -----------------------------------------------------------------------------

    async def monitor(self) -> None:
        """Let time pass for the state machine until the job is over."""
        while not self.done.is_set():
            self._apply(self.state.tick())
            self._flush_progress()
            self._streams.idle(self.settings.heartbeat_interval_s, _HEARTBEAT)
            try:
                await asyncio.wait_for(self.done.wait(), TICK_S)
            except asyncio.TimeoutError:  # not builtin TimeoutError before 3.11
                continue

    def abort(self, reason: str) -> None:
        self._apply(self.state.abort(reason))

    # -- node calls ----------------------------------------------------------------------------

    def register(self, reg: state.Registration) -> state.Accepted | state.Refused:
        outcome, effects = self.state.register(reg)
        if isinstance(outcome, state.Refused):
            log.info("refused node %r: %s", reg.node_id, outcome.message)
        self._apply(effects)
        return outcome

    async def watch(self, node_id: str, incarnation: int) -> AsyncIterator[pb.Event | bytes]:
        """The event stream of one node (events, some serialized already), with the
        scheduler's heartbeats in the gaps (sent by `monitor`)."""
        welcome = self.state.connect(node_id, incarnation)
        key = (self.state.member(node_id, incarnation).node_id, incarnation)
        box = self._streams.open(key)
        self.streams_closed.clear()
        current = True
        try:
            for event in welcome:
                yield self._serialized(event)
            while True:
                item = await box.get()
                if item is None:  # the node closed its side
                    return
                if isinstance(item, state.Evict):
                    raise EvictedError(f"node {node_id!r} was removed from the job: {item.reason}")
                yield item
                if item is self._final:
                    return
        finally:
            current = self._streams.close(key, box)
            if not self._streams:
                self.streams_closed.set()
            if current:
                # Only the node's current stream speaks for it: an older one (a registration
                # attempt the node gave up on and made again) ending late is not a failure.
                self._apply(self.state.disconnect(node_id, incarnation))

    def heartbeat(self, node_id: str, incarnation: int) -> None:
        self.state.heartbeat(node_id, incarnation)

    def stream_closed(self, node_id: str, incarnation: int) -> None:
        """The node half-closed its stream: end ours too."""
        self._streams.put((canonical_node_id(node_id), incarnation), None)

    def finish(self, node_id: str, incarnation: int) -> None:
        member = self.state.member(node_id, incarnation)
        self._apply(self.state.finish(node_id, incarnation))
        if member.state is state.NodeState.FINISHED and self.state.phase is state.Phase.READY:
            self.exchanges.fail_all(
                f"{member.describe()} has finished (called cluster.finalize()) while others were "
                "still in a collective; every rank must take part in every collective",
                kind=CollectiveError,
            )

    async def exchange(
        self, node_id: str, *, generation: int, seq: int, op: str, root: int, value: bytes
    ) -> list[bytes]:
        st = self.state
        if st.phase is not state.Phase.READY:
            raise JobFailedError(f"job is {st.phase.value}: {st.detail or 'not formed yet'}")
        member = st.members.get(canonical_node_id(node_id))
        if member is None or member.rank is None or member.role is not state.NodeRole.WORKER:
            raise CollectiveError(f"node {node_id!r} is not a ranked worker of this job")
        if generation != st.generation:
            raise CollectiveError(
                f"collective of generation {generation}, but the job is at generation "
                f"{st.generation}"
            )
        gone = [m for m in st.members.values() if m.state is state.NodeState.FINISHED]
        if gone:
            raise CollectiveError(
                f"{op} cannot complete: {gone[0].describe()} has already finished "
                "(called cluster.finalize()); every rank must take part in every collective"
            )
        if op == "broadcast" and not 0 <= root < st.worker_num:
            raise CollectiveError(f"broadcast root {root} is not a rank (0-{st.worker_num - 1})")
        return await self.exchanges.contribute(
            generation=generation,
            seq=seq,
            rank=member.rank,
            size=st.worker_num,
            op=op,
            root=root,
            value=value,
        )

    def status(self) -> pb.StatusResponse:
        return convert.status_to_pb(self.state, self._clock())

    # -- effects -------------------------------------------------------------------------------

    def _apply(self, effects: list[state.Effect]) -> None:
        for effect in effects:
            if isinstance(effect, state.Evict):
                self._streams.put((effect.node_id, effect.incarnation), effect)
                continue
            self._log(effect)
            if isinstance(effect, state.ProgressEvent):
                self._pending_progress = effect
                continue
            if isinstance(effect, state.TopologyReadyEvent):
                self._pending_progress = None
            self._broadcast(effect)
            if isinstance(effect, state.NodeFailedEvent):
                self.exchanges.fail_all(
                    f"rank {effect.rank} (node {effect.node_id!r}) died: {effect.reason}"
                )
            if isinstance(effect, state.ShutdownEvent):
                self.exchanges.fail_all(effect.reason)
                self.done.set()

    def _serialized(self, event: state.Event) -> bytes:
        """The event on the wire; the topology converted and serialized once per generation."""
        if isinstance(event, state.TopologyReadyEvent):
            cached = self._topology_bytes
            if cached is None or cached[0] is not event:
                cached = (event, convert.event_to_pb(event).SerializeToString())
                self._topology_bytes = cached
            return cached[1]
        data = convert.event_to_pb(event).SerializeToString()
        if isinstance(event, state.ShutdownEvent):
            self._final = data
        return data

    def _broadcast(self, event: state.Event) -> None:
        self._streams.broadcast(self._serialized(event))

    def _flush_progress(self) -> None:
        now = self._clock()
        if self._pending_progress is None:
            return
        if now - self._last_progress_broadcast < PROGRESS_BROADCAST_EVERY_S:
            return
        if self.state.phase is state.Phase.WAITING:
            self._broadcast(self._pending_progress)
        self._pending_progress = None
        self._last_progress_broadcast = now

    def _log(self, event: state.Event) -> None:
        st = self.state
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
                self._clock() - st.started,
            )
        elif isinstance(event, state.NodeFailedEvent):
            log.error("node %r (rank %d) failed: %s", event.node_id, event.rank, event.reason)
        elif event.ok:
            log.info("job finished: %s", event.reason)
        else:
            log.error("job failed: %s", event.reason)
