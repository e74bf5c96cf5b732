"""Ready/Advance (`cluster.scheduler.machine.ready`): the write-ahead rule as a property of the pure
machine. The scheduler's state machine takes random registrations, disconnects, finishes,
aborts and passing time; the saver lands, fails or lags; another scheduler takes the job. No
effect whose revision is unsaved ever reaches a node, nor the failure of the others' rounds that
a rank's finish brings (the engine steps it in, `SchedulerCore.finish`); none is lost or
reordered, and a planted early release is caught."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from cluster.protocol.errors import CollectiveError, JobFailedError, PeerFailedError
from cluster.protocol.records import (
    Evict,
    NodeFailedEvent,
    ProgressEvent,
    ShutdownEvent,
    TopologyReadyEvent,
)
from cluster.scheduler.machine.ready import (
    Decision,
    FailRounds,
    Outbox,
    Ready,
    Tell,
    rounds_failed,
)
from cluster.scheduler.machine.state import NodeState, Phase, SchedulerState
from tests.conftest import FakeClock
from tests.sim.control_plane import EarlyRelease
from tests.unit.test_state import make_state, reg

WORKERS = ["0", "1", "2"]


class WriteAheadMachine(RuleBasedStateMachine):
    outbox_kind: type[Outbox] = Outbox

    @initialize(worker_num=st.integers(min_value=1, max_value=3))
    def setup(self, worker_num: int) -> None:
        self.clock = FakeClock()
        self.state: SchedulerState = make_state(
            self.clock, worker_num=worker_num, node_timeout_s=10.0, recovery=True
        )
        # The first save, before any node hears of the job (`SchedulerCore.save_first`).
        self.stored = self.state.revision
        self.outbox = self.outbox_kind(write_ahead=True, saved=-1, recovery=True)
        self._carry_out(self.outbox.advance(self.stored))
        self.told: list[Tell] = []
        self.decided: list[tuple[int, Decision]] = []  # every effect, at its revision
        self.incarnations = dict.fromkeys(WORKERS, 0)
        self.fenced_at: int | None = None  # how many were told when the job was taken

    def _step(self, effects: Sequence[Decision]) -> None:
        self.decided.extend((self.state.revision, e) for e in effects)
        self._carry_out(self.outbox.step(self.state.revision, effects))

    def _carry_out(self, ready: Ready) -> None:
        if ready.save is not None:
            assert ready.save > self.stored, "a save asked for what is stored"
            event("a save asked for")
        for tell in ready.tell:
            # The property the recovery design rests on.
            assert tell.revision <= self.stored, (tell, self.stored)
            self.told.append(tell)
            event(f"told {type(what_told(tell)).__name__}")

    @rule(index=st.integers(min_value=0, max_value=2))
    def register(self, index: int) -> None:
        node_id = WORKERS[index % self.state.settings.worker_num]
        self.incarnations[node_id] += 1
        registration = reg(self.state, node_id, incarnation=self.incarnations[node_id])
        _outcome, effects = self.state.register(registration)
        self._step(effects)

    def _member(self, index: int) -> str | None:
        node_id = WORKERS[index]
        member = self.state.members.get(node_id)
        if member is None or member.incarnation != self.incarnations[node_id]:
            return None
        return node_id

    @rule(index=st.integers(min_value=0, max_value=2))
    def disconnect(self, index: int) -> None:
        node_id = self._member(index)
        if node_id is not None:
            self._step(self.state.disconnect(node_id, self.incarnations[node_id]))

    @rule(index=st.integers(min_value=0, max_value=2))
    def finish(self, index: int) -> None:
        node_id = self._member(index)
        if node_id is None:
            return
        effects: list[Decision] = [*self.state.finish(node_id, self.incarnations[node_id])]
        member = self.state.members.get(node_id)
        if member and member.state is NodeState.FINISHED and self.state.phase is Phase.READY:
            # As the engine: the others' rounds fail, once the finish is saved.
            effects.append(FailRounds(f"{node_id} finished", CollectiveError, keep_answer=True))
            event("a rank finished while others were in the job")
        self._step(effects)

    @rule(seconds=st.sampled_from([0.5, 11.0, 40.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self._step(self.state.tick())

    @rule(roll=st.integers(min_value=0, max_value=9))
    def abort(self, roll: int) -> None:
        if roll == 0:  # rarely: it ends the job
            self._step(self.state.abort("the operator stopped it"))

    @rule()
    def save_lands(self) -> None:
        """The saver stores the newest state (not only what was asked) and says so."""
        if self.outbox.requested > self.stored:
            self.stored = self.state.revision
            self._carry_out(self.outbox.advance(self.stored))
            event("a save landed")

    @rule()
    def an_old_save_answers_late(self) -> None:
        """A save of an older revision answers after a newer one landed: it releases nothing
        that the newer one did not."""
        self._carry_out(self.outbox.advance(self.stored - 1))

    @rule()
    def save_fails(self) -> None:
        event("a save failed")  # the saver tries again later; nothing is released

    @rule(roll=st.integers(min_value=0, max_value=9))
    def another_scheduler_takes_the_job(self, roll: int) -> None:
        if roll != 0:  # rarely: nothing is told afterwards
            return
        if self.fenced_at is None:
            self.fenced_at = len(self.told)
        self.outbox.fence()

    @invariant()
    def told_in_the_order_decided_and_nothing_lost(self) -> None:
        told = [(t.revision, what_told(t)) for t in self.told]
        assert told == self.decided[: len(told)]
        if self.fenced_at is not None:
            assert len(self.told) == self.fenced_at, "told after another scheduler took the job"
        elif self.stored >= self.outbox.requested:
            assert not self.outbox.held, "a saved decision still waits"
            assert told == self.decided


def what_told(tell: Tell) -> Decision:
    """What a tell tells: its effect, or only its failure of the rounds."""
    if tell.effect is not None:
        return tell.effect
    assert tell.fail is not None
    return tell.fail


TestWriteAhead = WriteAheadMachine.TestCase
TestWriteAhead.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class EarlyMachine(WriteAheadMachine):
    outbox_kind = EarlyRelease


def test_a_release_planted_early_is_caught() -> None:
    with pytest.raises(AssertionError, match="revision"):
        run_state_machine_as_test(
            EarlyMachine,
            settings=settings(
                max_examples=200, stateful_step_count=20, deadline=None, database=None
            ),
        )


def test_without_recovery_everything_is_told_at_once() -> None:
    outbox = Outbox(write_ahead=False, saved=-1, recovery=False)
    failed = NodeFailedEvent(rank=1, node_id="1", reason="its stream broke", generation=1)
    ready = outbox.step(7, [failed])
    assert ready.save is None
    assert [t.effect for t in ready.tell] == [failed]
    assert ready.tell[0].fail is not None
    assert ready.tell[0].fail.error is JobFailedError


def test_what_each_effect_does_to_the_rounds_in_progress() -> None:
    failed = NodeFailedEvent(rank=1, node_id="1", reason="its stream broke", generation=1)
    peer = rounds_failed(failed, recovery=True)
    assert peer is not None
    assert peer.error is PeerFailedError
    assert peer.reason == "rank 1 (node '1') died: its stream broke"
    job = rounds_failed(failed, recovery=False)
    assert job is not None
    assert job.error is JobFailedError
    ended = rounds_failed(ShutdownEvent(ok=True, reason="all 2 nodes finished"), recovery=True)
    assert ended is not None
    assert ended.error is JobFailedError
    assert rounds_failed(ProgressEvent(registered=1, expected=2), recovery=True) is None
    assert rounds_failed(Evict(node_id="1", incarnation=1, reason="replaced"), True) is None
    first = TopologyReadyEvent(generation=1, peers=())
    assert rounds_failed(first, recovery=True) is None
    rejoined = rounds_failed(TopologyReadyEvent(generation=2, peers=()), recovery=True)
    assert rejoined is not None
    assert rejoined.error is PeerFailedError


def test_the_rounds_a_finish_fails_wait_for_its_save() -> None:
    outbox = Outbox(write_ahead=True, saved=3, recovery=True)
    fail = FailRounds("rank 0 has finished", CollectiveError, keep_answer=True)
    ready = outbox.step(4, [fail])
    assert (ready.save, ready.tell) == (4, ())
    assert outbox.advance(4).tell == (Tell(None, 4, fail),)
