"""The collectives' rounds as a pure table (`cluster.scheduler.machine.rounds`), without a loop:
random contributions, repeats, cancellations, answers, deadlines and failures of the job keep what
is held accounted and bounded, and a completed round gathers every rank's bytes in rank order."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cluster.protocol.errors import (
    CapacityError,
    ClusterError,
    CollectiveError,
    CollectiveMismatchError,
    JobFailedError,
)
from cluster.scheduler.machine.admission import ALLGATHER, BARRIER, BROADCAST
from cluster.scheduler.machine.rounds import (
    MAX_REASON_CHARS,
    ROUNDS_PER_RANK,
    Completed,
    Failed,
    Key,
    Round,
    Rounds,
    Waiting,
)

SIZE = 3


def test_a_round_completes_with_every_rank_in_rank_order() -> None:
    rounds = Rounds(max_bytes=1000, timeout_s=10.0)
    first = rounds.join((1, 1), rank=1, size=2, op=ALLGATHER, root=0, value=b"b", now=0.0)
    assert isinstance(first, Waiting)
    last = rounds.join((1, 1), rank=0, size=2, op=ALLGATHER, root=0, value=b"a", now=1.0)
    assert isinstance(last, Completed)
    assert last.gathered == [b"a", b"b"]
    rounds.answered(last.round, 0)
    rounds.answered(last.round, 1)
    assert (rounds.open, rounds.held_bytes) == ({}, 0)


def test_the_deadline_fails_the_round_for_late_ranks_too() -> None:
    rounds = Rounds(max_bytes=1000, timeout_s=10.0)
    joined = rounds.join((1, 1), rank=0, size=3, op=BARRIER, root=0, value=b"", now=5.0)
    assert rounds.due(joined.round) == 15.0
    error = rounds.expire(joined.round)
    assert isinstance(error, CollectiveError)
    assert "rank(s) 1, 2, which never called it" in str(error)
    with pytest.raises(CollectiveError, match="CLUSTER_COLLECTIVE_TIMEOUT_S"):
        rounds.join((1, 1), rank=1, size=3, op=BARRIER, root=0, value=b"", now=16.0)


def test_a_complete_round_whose_answers_are_not_taken_yet_does_not_expire() -> None:
    """Found by the machine below: a round complete before its deadline keeps its answer for
    calls that have not taken it yet, past the deadline too."""
    rounds = Rounds(max_bytes=8, timeout_s=10.0)
    for rank in range(SIZE):
        last = rounds.join((1, 1), rank=rank, size=SIZE, op=ALLGATHER, root=0, value=b"", now=0.0)
    assert isinstance(last, Completed)
    assert rounds.expire(last.round) is None
    assert last.round.outcome == [b"", b"", b""]


WHY = "its broadcast_object payload of 73400320 bytes (70.0 MiB) is over the limit"


def test_a_withdrawal_fails_the_round_at_once_for_the_ranks_in_it_and_those_to_come() -> None:
    """Rank 1 waits in rank 0's broadcast; rank 0 withdraws (its payload was refused in its own
    process): the round fails for rank 1 with an error naming rank 0 and the reason, rank 2
    coming later gets it too, nothing is held, and the next round completes for everybody."""
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    waiting = rounds.join((1, 1), rank=1, size=3, op=BROADCAST, root=0, value=b"", now=0.0)
    assert isinstance(waiting, Waiting)
    failed = rounds.withdraw((1, 1), rank=0, size=3, op=BROADCAST, root=0, reason=WHY, now=1.0)
    assert failed.round is waiting.round
    assert failed.round.outcome is failed.error
    assert isinstance(failed.error, CollectiveError)
    assert not isinstance(failed.error, CapacityError)
    assert str(failed.error) == (
        "broadcast(root=0) #1 of generation 1 failed for every rank: rank 0 withdrew from it, "
        f"as {WHY}; the next collective goes on"
    )
    assert (rounds.open, rounds.held_bytes) == ({}, 0)
    rounds.answered(waiting.round, 1)
    with pytest.raises(CollectiveError) as late:
        rounds.join((1, 1), rank=2, size=3, op=BROADCAST, root=0, value=b"", now=2.0)
    assert str(late.value) == str(failed.error)
    again = rounds.withdraw  # the withdrawal made again (a lost connection): the same error
    with pytest.raises(CollectiveError, match="rank 0 withdrew from it"):
        again((1, 1), rank=0, size=3, op=BROADCAST, root=0, reason=WHY, now=3.0)
    for rank in range(3):
        last = rounds.join((1, 2), rank=rank, size=3, op=BROADCAST, root=0, value=b"x", now=4.0)
    assert isinstance(last, Completed)
    assert last.round.answer_for(last.gathered) == [b"x"]


def test_a_withdrawal_is_refused_alone_when_it_cannot_be_this_rounds() -> None:
    """A withdrawal from another collective than the round's, or after the rank contributed to
    it, is that call's refusal: the round goes on."""
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    rounds.join((1, 1), rank=0, size=2, op=ALLGATHER, root=0, value=b"a", now=0.0)
    with pytest.raises(CollectiveMismatchError, match="another rank called allgather"):
        rounds.withdraw((1, 1), rank=1, size=2, op=BROADCAST, root=0, reason=WHY, now=0.0)
    with pytest.raises(CollectiveError, match="after it contributed to it"):
        rounds.withdraw((1, 1), rank=0, size=2, op=ALLGATHER, root=0, reason=WHY, now=0.0)
    done = rounds.join((1, 1), rank=1, size=2, op=ALLGATHER, root=0, value=b"b", now=0.0)
    assert isinstance(done, Completed)
    assert done.gathered == [b"a", b"b"]


def test_a_withdrawals_reason_is_shown_escaped_and_cut() -> None:
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    reason = "\x1b[31m" + "y" * 10_000
    failed = rounds.withdraw((1, 1), rank=0, size=2, op=BARRIER, root=0, reason=reason, now=0.0)
    shown = str(failed.error)
    assert "\x1b" not in shown
    assert "\\x1b[31m" in shown
    assert len(shown) < MAX_REASON_CHARS + 200
    assert "(10005 chars)" in shown


class RoundsMachine(RuleBasedStateMachine):
    @initialize(max_bytes=st.sampled_from([8, 64, 10_000]))
    def setup(self, max_bytes: int) -> None:
        self.rounds = Rounds(max_bytes=max_bytes, timeout_s=10.0)
        self.now = 0.0
        self.waiting: list[tuple[Round, int]] = []  # calls that wait for an outcome
        self.sent: dict[tuple[Round, int], bytes] = {}  # what each rank put in each round
        self.withdrawn: dict[Key, str] = {}  # rounds failed by a withdrawal: their error
        self.failed: set[Key] = set()  # rounds failed by a cap, a deadline or a withdrawal

    @rule(
        seq=st.integers(1, 4),
        rank=st.integers(0, SIZE - 1),
        value=st.binary(max_size=6),
        generation=st.integers(1, 2),
    )
    def join(self, seq: int, rank: int, value: bytes, generation: int) -> None:
        key = (generation, seq)
        try:
            joined = self.rounds.join(
                key, rank=rank, size=SIZE, op=ALLGATHER, root=0, value=value, now=self.now
            )
        except (CapacityError, CollectiveError) as exc:
            event(f"refused: {type(exc).__name__}")
            refused = str(exc)
        else:
            refused = ""
        if refused:
            # A rank that comes to a withdrawn round later gets the withdrawal's error.
            assert refused == self.withdrawn.get(key, refused)
            return
        if isinstance(joined, Failed):
            event("failed by a cap")
            self.failed.add(key)
            return
        self.sent.setdefault((joined.round, rank), value)
        self.waiting.append((joined.round, rank))
        if isinstance(joined, Completed):
            event("completed")
            expected = [self.sent[(joined.round, r)] for r in range(SIZE)]
            assert joined.gathered == expected

    @rule(index=st.integers(0, 20), cancelled=st.booleans())
    def a_call_ends(self, index: int, cancelled: bool) -> None:
        if not self.waiting:
            return
        rnd, rank = self.waiting.pop(index % len(self.waiting))
        if rnd.open and cancelled:
            self.rounds.abandoned(rnd, rank)
            if rank not in rnd.values:
                self.sent.pop((rnd, rank), None)  # taken back: the call made again may differ
        elif not rnd.open:
            self.rounds.answered(rnd, rank)
        else:
            self.waiting.append((rnd, rank))  # still waiting: nothing to answer yet

    @rule(
        seq=st.integers(1, 4),
        rank=st.integers(0, SIZE - 1),
        generation=st.integers(1, 2),
    )
    def a_rank_withdraws(self, seq: int, rank: int, generation: int) -> None:
        """`rank`'s contribution was refused in its own process: the round fails at once for
        every rank waiting in it, with an error naming `rank` and the reason."""
        key = (generation, seq)
        before = self.rounds.open.get(key)
        others = before is not None and any(r != rank for r in before.values)
        try:
            failed = self.rounds.withdraw(
                key, rank=rank, size=SIZE, op=ALLGATHER, root=0, reason=WHY, now=self.now
            )
        except CollectiveError as exc:
            refused = str(exc)
        else:
            refused = ""
        if refused:
            event("withdrawal refused")
            # That call alone: it contributed to the round already, or the round failed before
            # (its error again, the withdrawal's for a round withdrawn from).
            assert (before is not None and rank in before.values) or key in self.failed
            assert refused == self.withdrawn.get(key, refused)
            return
        event("withdrawn" + (", others waiting" if others else ""))
        assert before is None or failed.round is before
        assert f"rank {rank} withdrew from it, as {WHY}" in str(failed.error)
        assert failed.round.outcome is failed.error  # every caller waiting in it gets it
        assert key not in self.rounds.open
        self.withdrawn[key] = str(failed.error)
        self.failed.add(key)

    @rule()
    def time_passes(self) -> None:
        self.now += 11.0
        for rnd in list(self.rounds.open.values()):
            if self.rounds.due(rnd) <= self.now:
                was_open = rnd.open
                expired = self.rounds.expire(rnd)
                if expired is not None:
                    self.failed.add(rnd.key)
                # A complete round is kept until its answers are taken: its time is not up.
                assert isinstance(expired, CollectiveError) if was_open else expired is None

    @rule()
    def the_job_fails(self) -> None:
        for rnd in self.rounds.fail_all(JobFailedError("a node died")):
            assert isinstance(rnd.outcome, ClusterError)
        self.withdrawn.clear()  # a failure of the job forgets the rounds failed before
        self.failed.clear()

    @invariant()
    def what_is_held_is_accounted_and_bounded(self) -> None:
        rounds = self.rounds
        if not hasattr(self, "rounds"):
            return
        assert rounds.held_bytes == sum(r.held for r in rounds.open.values())
        assert rounds.held_bytes <= rounds.max_bytes
        for rnd in rounds.open.values():
            assert rnd.held == sum(len(v) for v in rnd.values.values())
        for generation in (1, 2):
            for rank in range(SIZE):
                mine = [
                    r for (g, _), r in rounds.open.items() if g == generation and rank in r.values
                ]
                assert len([r for r in mine if r.open]) <= ROUNDS_PER_RANK


TestRounds = RoundsMachine.TestCase
TestRounds.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def answered_allgather() -> Rounds:
    """Rounds in which ranks 0 and 1 of 2 gathered b"a" and b"b" (#1 of generation 1) and both
    were answered."""
    rounds = Rounds(max_bytes=1000, timeout_s=10.0)
    rounds.join((1, 1), rank=0, size=2, op=ALLGATHER, root=0, value=b"a", now=0.0)
    done = rounds.join((1, 1), rank=1, size=2, op=ALLGATHER, root=0, value=b"b", now=0.0)
    assert isinstance(done, Completed)
    for rank in (0, 1):
        rounds.answered(done.round, rank)
    return rounds


def test_a_call_made_again_after_its_round_was_forgotten_gets_the_same_answer() -> None:
    """Rank 1's answer was sent as its connection broke: it calls again once every rank was
    answered and the round forgotten. It gets the answer at once instead of opening a round
    that would wait for ranks that have moved on."""
    rounds = answered_allgather()
    assert rounds.open == {}
    rounds.join((1, 2), rank=0, size=2, op=ALLGATHER, root=0, value=b"c", now=1.0)  # moved on
    again = rounds.join((1, 1), rank=1, size=2, op=ALLGATHER, root=0, value=b"b", now=2.0)
    assert isinstance(again, Completed)
    assert again.gathered == [b"a", b"b"]
    rounds.answered(again.round, 1)
    assert list(rounds.open) == [(1, 2)]  # nothing new opened, nothing more held
    assert rounds.held_bytes == 1
    rounds.fail_all(JobFailedError("the job ended"))
    gone = rounds.join((1, 1), rank=1, size=2, op=ALLGATHER, root=0, value=b"b", now=4.0)
    assert isinstance(gone, Waiting)  # no answer kept past the job's failure of its rounds


def test_once_a_rank_finished_only_a_call_made_again_of_the_answered_round_goes_on() -> None:
    """Rank 0 finished after both were answered #1: the rounds fail with its answer kept, and
    rank 1's #1 made again is answered; no other call is one (the engine refuses those)."""
    rounds = answered_allgather()
    rounds.fail_all(CollectiveError("rank 0 has finished"), keep_answer=True)
    again = rounds.made_again((1, 1), rank=1, op=ALLGATHER, root=0, value=b"b")
    assert again is not None
    assert again.gathered == [b"a", b"b"]
    rounds.answered(again.round, 1)
    for key, value in (((1, 2), b"b"), ((1, 1), b"x")):  # a new round; #1 with other bytes
        assert rounds.made_again(key, rank=1, op=ALLGATHER, root=0, value=value) is None
    assert rounds.made_again((1, 1), rank=1, op=BARRIER, root=0, value=b"b") is None
    assert (rounds.open, rounds.held_bytes) == ({}, 0)


# A restarted scheduler (its rounds of the restored generation 4 start empty): the scheduler
# before it answered collective #1 to some ranks only.


def test_a_round_the_scheduler_before_answered_is_cut_when_a_rank_says_so_after_the_call() -> None:
    """Rank 1 never got #1 and calls it again here; ranks 0 and 2 got it and hold (no call
    comes from them): their registrations say so, and the round is cut at once."""
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    again = rounds.join((4, 1), rank=1, size=SIZE, op=ALLGATHER, root=0, value=b"b", now=0.0)
    assert isinstance(again, Waiting)
    assert rounds.answered_before(4, rank=0, answered=1) == 1
    assert rounds.answered_before(4, rank=2, answered=1) == 1  # open until the engine fails it


def test_a_round_the_scheduler_before_answered_is_cut_when_called_after_a_rank_said_so() -> None:
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    assert rounds.answered_before(4, rank=0, answered=1) is None  # nothing open to cut yet
    assert rounds.cut_off(4, 1, rank=1)  # rank 0 has moved on from #1: it will never call it
    assert not rounds.cut_off(4, 2, rank=1)  # a round nobody was answered: the next one
    assert not rounds.cut_off(4, 1, rank=0)  # only another rank's word cuts a round
    assert not rounds.cut_off(5, 1, rank=1)  # another generation's numbers


def test_a_round_completed_here_is_never_cut_by_what_ranks_say_of_it() -> None:
    """A stream that broke and came back (the same scheduler): rank 0 says it has #1, which
    completed here; rank 1, whose answer was lost on the way, calls #1 again and gets it."""
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    for rank in range(SIZE):
        done = rounds.join((4, 1), rank=rank, size=SIZE, op=BARRIER, root=0, value=b"", now=0.0)
    assert isinstance(done, Completed)
    for rank in range(SIZE):
        rounds.answered(done.round, rank)
    assert rounds.answered_before(4, rank=0, answered=1) is None
    assert not rounds.cut_off(4, 1, rank=1)
    assert isinstance(
        rounds.join((4, 1), rank=1, size=SIZE, op=BARRIER, root=0, value=b"", now=1.0), Completed
    )


def test_a_round_a_rank_called_here_is_not_cut_by_that_ranks_own_word() -> None:
    """Rank 0 calls #2 here and says it was answered #2 (two calls of its own in flight at the
    restart): its word is about rounds it has not called here."""
    rounds = Rounds(max_bytes=1000, timeout_s=600.0)
    rounds.join((4, 2), rank=0, size=SIZE, op=ALLGATHER, root=0, value=b"a", now=0.0)
    assert rounds.answered_before(4, rank=0, answered=2) is None
    assert rounds.answered_before(4, rank=1, answered=2) == 2
