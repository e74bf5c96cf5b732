"""The scheduler's node calls: Register, Watch, Heartbeat, checkpoint reports, the key-value
calls, Finish and the collectives, served on the engine (`cluster.scheduler.engine.Engine`, which
`SchedulerCore` extends: the state machine, the write-ahead saver, the streams).

Every call of a node is admitted by the state machine first (`SchedulerState.admit*`: its
membership, its credential, and for a collective the phase, the generation and the peers); a
refused call raises the ClusterError of its refusal (`Denied.error()`), which the servicer turns
into a status code, and changes nothing. What an admitted call changes goes to the state
machine, and the engine applies what it decides (`_apply`: saved, then told); a call whose
answer rests on a change is answered once that change is saved (`durable`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

from cluster.protocol.config import canonical_node_id
from cluster.protocol.errors import (
    CollectiveError,
    EvictedError,
    NotLeaderError,
    PeerFailedError,
    UnknownNodeError,
)
from cluster.protocol.events import MemoryResume
from cluster.protocol.settings import JobSettings
from cluster.scheduler.engine import Engine
from cluster.scheduler.exchange import Withdrawn
from cluster.scheduler.kv import KvStore
from cluster.scheduler.machine import ready as ready_
from cluster.scheduler.machine import state
from cluster.scheduler.machine.rollback import held_steps
from cluster.scheduler.streams import Superseded
from cluster.transport.membership import Caller

T = TypeVar("T")

log = logging.getLogger("cluster.scheduler")


def admitted(verdict: T | state.Denied) -> T:
    """What an admission allows, or the error of its refusal."""
    if isinstance(verdict, state.Denied):
        raise verdict.error()
    return verdict


# The name of JobSettings before it was the job's one settings object (kept for its callers).
CoreSettings = JobSettings


class SchedulerCore(Engine):
    """The node calls of the scheduler, each admitted, stepped into the state machine, and
    answered once what it decided is saved."""

    # -- node calls ----------------------------------------------------------------------------

    async def register(
        self, reg: state.Registration, peer: str = ""
    ) -> state.Accepted | state.Refused:
        """`peer`: the caller's address as gRPC names it (its refusals are told at a bounded
        rate per address, `cluster.scheduler.refusals`)."""
        prior = self.journal.incarnation_of(reg.node_id)
        # A node waiting out its guard asks every second: its first refusal is logged and
        # journaled, the others are not.
        waiting = canonical_node_id(reg.node_id) in self.state.guard_waiting
        outcome, effects = self.state.register(reg)
        self.registrations.set()
        if isinstance(outcome, state.Accepted) and outcome.rejoined:
            key = canonical_node_id(reg.node_id)
            for effect in effects:  # the process it replaced failed first (cause `replaced`)
                if isinstance(effect, state.NodeFailedEvent) and effect.node_id == key:
                    self.journal.effect_ahead(effect)
        self._tell_registration(reg, prior, outcome, waiting=waiting, peer=peer)
        self._apply(effects)
        if isinstance(outcome, state.Accepted):
            self._answered_before(reg)
            await self._durable_keeping_alive(reg.node_id, reg.incarnation)
        elif not outcome.reason.transient:
            await self.durable()  # a final no rests on what is saved (the job's end, ...)
        # A transient refusal (the guard) says nothing the disk must know: at once, so that
        # the node's next attempt comes when the guard ends, saves failing or not.
        return outcome

    def _tell_registration(
        self,
        reg: state.Registration,
        prior: int | None,
        outcome: state.Accepted | state.Refused,
        *,
        waiting: bool,
        peer: str,
    ) -> None:
        """Journal and log a registration's outcome. Refusals other than the guard's can come
        from anyone, as fast as they like: told at most once an interval per address. The
        journal (which readers see) has what the node was told; the log, the whole line
        (`Refused.logged`)."""
        if isinstance(outcome, state.Accepted):
            self.journal.registration(reg, prior, outcome, was_waiting=waiting)
            if outcome.rejoined:
                log.info(
                    "node %r rejoined: generation %d (restart %d of that node)",
                    reg.node_id,
                    outcome.generation,
                    self.state.members[canonical_node_id(reg.node_id)].restarts,
                )
            return
        if outcome.reason is state.Refusal.NODE_ALIVE:
            self.journal.registration(reg, prior, outcome, was_waiting=waiting)
            level = logging.DEBUG if waiting else logging.INFO
            log.log(level, "refused node %r: %s", reg.node_id, outcome.message)
            return
        count = self.refusals.refused(peer, "Register", outcome.reason.value)
        if count:
            self.journal.registration(reg, prior, outcome, count=count)
            log.info("refused node %r: %s", reg.node_id, outcome.logged or outcome.message)

    async def _durable_keeping_alive(self, node_id: str, incarnation: int) -> None:
        """`durable()`, with the node counted alive meanwhile: its call waiting for the answer
        is its sign of life (its heartbeats begin once it has the answer)."""
        if self.persister is None or self.persister.saved >= self.state.revision:
            return  # the common case: no task, no timer
        waiter = asyncio.ensure_future(self.durable())
        try:
            while not waiter.done():
                await asyncio.wait((waiter,), timeout=self.settings.heartbeat_interval_s)
                with contextlib.suppress(UnknownNodeError):
                    self.state.heartbeat(node_id, incarnation)
            waiter.result()
        finally:
            waiter.cancel()

    async def watch(
        self,
        node_id: str,
        incarnation: int,
        caller: Caller | None = None,
        *,
        by_digest: bool = False,
    ) -> AsyncIterator[bytes]:
        """The event stream of one node (events, some serialized already), with the
        scheduler's heartbeats in the gaps (sent by `monitor`). `caller`: who opens it with a
        hello (None: the registration on the stream was just accepted). `by_digest`: whole
        tables as their digests (`cluster.scheduler.tables`)."""
        form = self._wire.by_digest if by_digest else _as_sent
        if caller is not None:
            admitted(self.state.admission.admit(node_id, incarnation, caller.presented))
        awaited = bool(self.state.awaiting)
        self.state.connect(node_id, incarnation)
        if awaited and not self.state.awaiting:
            log.info(
                "every node is back after the scheduler's restart (%.2f s after start)",
                self._clock() - self.state.started,
            )
            self.journal.nodes_back(self._clock() - self.state.started)
        key = (self.state.member(node_id, incarnation).node_id, incarnation)
        mailbox = self._streams.open(key)
        self.streams_closed.clear()
        current = True
        try:
            # What was told so far (so on disk), and, through `mailbox`, what is told from now on:
            # the catch-up never names a generation that a crash could forget.
            for event in self.state.catch_up_for(node_id, self._catch_up):
                told = self._wire.serialized(event)
                yield form(told)
                if told is self._wire.final:
                    return  # the job's end: nothing follows
            while True:
                item = await mailbox.get()
                if isinstance(item, state.Evict):
                    raise EvictedError(f"node {node_id!r} was removed from the job: {item.reason}")
                if isinstance(item, NotLeaderError):
                    raise item
                if isinstance(item, Superseded):
                    return  # the node's newer stream speaks for it (closing: not current)
                yield form(self._handed(node_id, item))
                if item is self._wire.final:
                    return
        finally:
            current = self._streams.close(key, mailbox)
            if not self._streams:
                self.streams_closed.set()
            if current:
                # Only the node's current stream speaks for it: an older one (a registration
                # attempt the node gave up on and made again) ending late is not a failure.
                self._apply(self.state.disconnect(node_id, incarnation))

    def _handed(self, node_id: str, item: bytes) -> bytes:
        """`item`, handed to `node_id`'s stream: the job's end told it, when it is that."""
        if item is self._wire.final:
            self.state.told_end(node_id)
        return item

    def heartbeat(self, node_id: str, incarnation: int, caller: Caller | None) -> None:
        """A beat of the node; `caller` None: a later beat of a Heartbeat call whose first beat
        was admitted for this node and incarnation (UnknownNodeError if it is no member now).
        A beat too soon after the node's last is dropped (`MemberLimits.beat`)."""
        if caller is not None:
            admitted(self.state.admission.admit(node_id, incarnation, caller.presented))
        if self.bounds.beat(node_id, incarnation):
            self.state.heartbeat(node_id, incarnation)

    @contextlib.contextmanager
    def heartbeat_call(self) -> Iterator[None]:
        """Around one node's Heartbeat call, so that the server stops only once the nodes have
        ended theirs: a call still open when it stops is cancelled by the server while its
        node's cancel is on the way, and gRPC prints that double cancel as a traceback."""
        self._beating += 1
        self.beats_closed.clear()
        try:
            yield
        finally:
            self._beating -= 1
            if not self._beating:
                self.beats_closed.set()

    async def report_checkpoints(
        self,
        node_id: str,
        incarnation: int,
        steps: list[int],
        caller: Caller,
        resumed: MemoryResume | None = None,
        numbered: tuple[int, int] = (0, 0),
    ) -> int:
        """Record the steps the node holds (and rank 0's resume from memory, `resumed`); a step
        every worker holds (see `held_by_all`). `numbered`: the generation the worker resumed
        in and the report's number (`SchedulerState.report_checkpoints`)."""
        member = admitted(
            self.state.admission.admit_report(node_id, incarnation, caller.presented, len(steps))
        )
        if resumed is not None:
            self.journal.memory_resume(node_id, resumed)
        # A report that changes the holdings waits for its member's turn (`ReportTurns`).
        changes = held_steps(steps) != member.checkpoints
        report = (node_id, incarnation, steps, numbered)
        await self.reports.turn(member.node_id, report, changes=changes)
        held = self.state.held_by_all()  # of what this save holds, not of later reports
        await self.durable()
        return held

    def peer_table(self, caller: Caller, digest: bytes) -> bytes:
        """The compressed whole table of `digest`, for a member (`cluster.scheduler.tables`)."""
        admitted(self.state.admission.admit(caller.node_id, caller.incarnation, caller.presented))
        return self._wire.tables.table(digest)

    def kv_for(self, caller: Caller) -> KvStore:
        return self.kv_calls.store_for(caller)

    async def kv_set(self, caller: Caller, key: str, value: bytes) -> None:
        await self.kv_calls.set(caller, key, value)

    async def kv_add(self, caller: Caller, key: str, amount: int, add_id: int = 0) -> int:
        return await self.kv_calls.add(caller, key, amount, add_id)

    async def kv_wait(self, caller: Caller, keys: list[str], timeout_s: float) -> list[bytes]:
        return await self.kv_calls.wait(caller, keys, timeout_s)

    async def finish(
        self, node_id: str, incarnation: int, caller: Caller, failure: str = ""
    ) -> None:
        """The node is done; with `failure`, its process dies of that error (the first line,
        escaped): failed now with it as the reason, before its connection breaks."""
        verdict = self.state.admission.admit_finish(node_id, incarnation, caller.presented)
        if isinstance(verdict, state.Denied) and verdict.kind is state.Denial.JOB_OVER:
            await self.durable()  # the refusal tells that the job failed: once that is saved
        member = admitted(verdict)
        if failure:
            why = f"its process died of an error: {failure}"
            self._apply(self.state.disconnect(node_id, incarnation, why))
        else:
            effects: list[ready_.Decision] = [*self.state.finish(node_id, incarnation)]
            if member.state is state.NodeState.FINISHED and self.state.phase is state.Phase.READY:
                # The others' rounds fail once its finish is saved, as an event is told (a round
                # answered before it left is answered again).
                reason = (
                    f"{member.describe()} has finished (called cluster.finalize()) while others "
                    "were still in a collective; every rank must take part in every collective"
                )
                effects.append(ready_.FailRounds(reason, CollectiveError, keep_answer=True))
            self._apply(effects)
        await self.durable()
        if not failure:  # its answer goes now: lost, if its stream closed since the count
            self.state.finish_answered(node_id)

    async def exchange(
        self,
        node_id: str,
        caller: Caller,
        *,
        generation: int,
        seq: int,
        op: str,
        root: int,
        value: bytes | Withdrawn,
    ) -> list[bytes]:
        """`node_id`'s contribution `value` (or its `Withdrawn` reason) to collective #`seq`
        of `generation`; its answer."""
        st = self.state
        if st.phase in (state.Phase.FINISHED, state.Phase.FAILED):
            await self.durable()  # the job's end is told once it is saved, not before
        verdict = st.admission.admit_exchange(
            node_id, caller.presented, generation=generation, op=op, root=root
        )
        if isinstance(verdict, state.Denied):
            await self.durable()  # a refusal tells what is decided (a peer failed): once saved
        ticket = admitted(verdict)
        if st.restored_generation == generation and self.exchanges.cut_off(
            generation, seq, ticket.rank
        ):
            # Some ranks got this generation's collective #k from the scheduler that died and
            # went on; the others never got #k, and its answer died with it.
            reason = self._cut_in_two(generation, seq)
            await self.durable()  # the new generation is told once saved
            raise PeerFailedError(f"{op} cannot complete: {reason}")
        return await self.exchanges.contribute(
            generation=generation,
            seq=seq,
            ticket=ticket,
            op=op,
            root=root,
            value=value,
        )

    def _cut_in_two(self, generation: int, seq: int) -> str:
        """Collective #`seq` of `generation` was answered to some ranks only, by the scheduler
        before this one: nobody can go on. A new generation, in which everyone rolls back."""
        reason = (
            f"collective #{seq} of generation {generation} was cut in two by the scheduler's "
            "restart"
        )
        log.warning("%s; re-forming the job so that every worker rolls back", reason)
        self._apply(self.state.reform(reason))
        return reason

    def _answered_before(self, reg: state.Registration) -> None:
        """A node registering again says how far its collectives got (`Rounds.answered_before`):
        re-form as soon as a round open here cannot complete, not at that node's next call."""
        report = self.state.collectives_report(reg)
        if report is not None:
            cut = self.exchanges.answered_before(*report)
            if cut is not None:
                self._cut_in_two(report[0], cut)


def _as_sent(item: bytes) -> bytes:
    return item
