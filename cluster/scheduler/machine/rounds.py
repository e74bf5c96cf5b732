"""Rounds of the control-plane collectives (barrier, allgather, broadcast), as a pure table.

Every rank of a generation calls the same collectives in the same order, each numbered by a
per-process sequence number. A round collects one contribution per rank; when the last one
arrives every caller gets its answer, and the round is forgotten once every rank has been
answered. A node failure or the end of the job fails every open round at once, so no caller
waits on a peer that will never come.

What the rounds hold is bounded. A rank contributes once per round: the same bytes again are
the same call made again (after a lost connection) and get the same answer; other bytes are
refused. That holds after the round is over too: the answer of the round completed last is
kept (one answer, until the next completes or the job's rounds fail, but not when they fail
because a rank finished), since a call answered while its connection broke is made again once
every rank has been answered and the round forgotten; made as a new round it would wait for
ranks that have moved on, until its deadline. Once a rank has finished no new round can
complete: only such a call made again goes on (`made_again`), the engine refuses any other.

Each rank has its share, so that one runaway member cannot stop the others. Ranks that call the
same collectives in the same order are never more than one round apart (a rank that has
contributed to round k waits for its answer before it can call k+1): a rank's contributions
may wait in at most `ROUNDS_PER_RANK` (2) unfinished rounds, and hold at most its share of the
bytes (CLUSTER_COLLECTIVE_MAX_BYTES / ranks, and never less than two full answers); past either,
that call alone is refused with a `CapacityError` and the others' rounds go on. The bytes held
by all open rounds are capped too (CLUSTER_COLLECTIVE_MAX_BYTES); a contribution past that cap
fails its round for every rank in it, with a `CapacityError` naming the cap, and a rank that
comes to that round later gets the same error instead of waiting.

A rank whose contribution was refused in its own process (past what a collective carries)
still takes the round's number and withdraws from it (`withdraw`): the round fails at once for
every rank in it, and for those that come to it later, with a `CollectiveError` that names the
rank and its reason, so nobody waits for its deadline and every rank's next collective is the
next round.

A restarted scheduler has none of its predecessor's rounds. When the predecessor died while
answering a round, some ranks have their answer and went on, and the others make their call
again; that round can never complete here. The table sees it either way round: when a call comes
for a round another rank has already said it was answered (a node says how far its collectives
got when it registers again, `answered_before`), or when a rank's next round is called while
an older one is still open (`cut_off`). The engine then starts a new generation, in which
everyone rolls back.

A round waits at most CLUSTER_COLLECTIVE_TIMEOUT_S (10 minutes) from its first contribution for
its last; then it fails for every rank, those waiting and those that come later, with a
`CollectiveError` that names the ranks that never came.

This module decides; it holds no future and no timer. `cluster.scheduler.exchange` keeps, per
round, the future its callers wait on and the timer of its deadline, and carries out what
`join`, `withdraw`, `expire` and `fail_all` answer: a `Completed` round's answer to every
caller, a `Failed` round's error to every caller.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from cluster.protocol.config import DEFAULT_COLLECTIVE_MAX_BYTES, DEFAULT_COLLECTIVE_TIMEOUT_S
from cluster.protocol.display import safe
from cluster.protocol.errors import (
    CapacityError,
    ClusterError,
    CollectiveError,
    CollectiveMismatchError,
)
from cluster.protocol.value import frozen
from cluster.scheduler.machine.admission import ALLGATHER, BROADCAST

ROUNDS_PER_RANK = 2
# A round's answer is one message: what an allgather gathers must fit in one (gRPC's limit on
# the scheduler's messages, less room for framing).
MAX_ANSWER_BYTES = 64 * 1024 * 1024 - 64 * 1024
# Rounds failed by a cap, remembered so that a late rank gets the error instead of waiting.
FAILED_KEPT = 64
# How much of a rank's reason to withdraw from a round its peers' error quotes.
MAX_REASON_CHARS = 512

Key = tuple[int, int]  # (generation, seq)


@dataclass(eq=False)
class Round:
    """One collective in progress (compared by identity: a key may be reused once it is
    forgotten)."""

    key: Key
    op: str
    root: int
    size: int
    started: float
    values: dict[int, bytes] = field(default_factory=dict)
    held: int = 0  # bytes of the values
    answered: set[int] = field(default_factory=set)
    waiting: collections.Counter[int] = field(default_factory=collections.Counter)
    outcome: list[bytes] | ClusterError | None = None  # set once, when it completes or fails

    @property
    def open(self) -> bool:
        return self.outcome is None

    def missing(self) -> list[int]:
        return [rank for rank in range(self.size) if rank not in self.values]

    def answer_for(self, gathered: list[bytes]) -> list[bytes]:
        """What a caller of this round gets back."""
        if self.op == ALLGATHER:
            return gathered
        if self.op == BROADCAST:
            return [gathered[self.root]]
        return []


@frozen
class Withdrawn:
    """What a rank sends instead of its contribution when that was refused in its own process
    (past what a collective carries): `reason`, in words (`Rounds.withdraw`)."""

    reason: str


@frozen
class Waiting:
    """The contribution is in (or is the same call again): wait for the round's outcome."""

    round: Round


@frozen
class Completed:
    """This contribution was the last: every caller of the round gets `gathered`."""

    round: Round
    gathered: list[bytes]


@frozen
class Failed:
    """This contribution failed the round for every rank in it (a cap, a withdrawal)."""

    round: Round
    error: ClusterError


Joined = Waiting | Completed | Failed


class Rounds:
    """The open rounds of the job's collectives, and what they hold."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_COLLECTIVE_MAX_BYTES,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.open: dict[Key, Round] = {}
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.held_bytes = 0
        self._failed: collections.OrderedDict[Key, ClusterError] = collections.OrderedDict()
        self._completed: Round | None = None  # the round completed last, for calls made again
        # The highest round completed here, and how far each rank says it was answered by the
        # scheduler before this one (`answered_before`): each of one generation, the latest.
        self._completed_through: Key = (0, 0)
        self._answered_before: tuple[int, dict[int, int]] = (0, {})

    def join(
        self, key: Key, *, rank: int, size: int, op: str, root: int, value: bytes, now: float
    ) -> Joined:
        """`rank`'s contribution `value` to the round `key`. A refusal of this call alone (the
        round is another collective, other bytes than this rank sent before, past this rank's
        share, a round failed before) is raised, and changes nothing."""
        again = self.made_again(key, rank=rank, op=op, root=root, value=value)
        if again is not None:
            return again
        rnd = self._round(key, rank=rank, size=size, op=op, root=root, now=now)
        known = rnd.values.get(rank)
        if known is None:
            joined = self._add(rnd, rank, value)
        elif known != value:
            raise CollectiveError(
                f"rank {rank} sent collective #{key[1]} of generation {key[0]} twice, with "
                "different values: a rank contributes once to each collective"
            )
        else:
            joined = Waiting(rnd)
        if not isinstance(joined, Failed):
            rnd.waiting[rank] += 1  # until `answered` or `abandoned`
        return joined

    def withdraw(
        self, key: Key, *, rank: int, size: int, op: str, root: int, reason: str, now: float
    ) -> Failed:
        """`rank` withdrew from the round `key`: its contribution was refused in its own
        process, for `reason` (in words, from the wire: shown escaped and cut). The round fails
        for every rank in it, and for those that come to it later. A refusal of this call alone
        (the round is another collective, or `rank` contributed to it already) is raised and
        changes nothing; a withdrawal made again gets the round's error again."""
        rnd = self._round(key, rank=rank, size=size, op=op, root=root, now=now)
        generation, seq = key
        if rank in rnd.values:
            raise CollectiveError(
                f"rank {rank} withdrew from collective #{seq} of generation {generation} after "
                "it contributed to it: a rank contributes once to each collective"
            )
        error = CollectiveError(
            f"{describe(op, root)} #{seq} of generation {generation} failed for every rank: "
            f"rank {rank} withdrew from it, as {safe(reason, MAX_REASON_CHARS)}; the next "
            "collective goes on"
        )
        self._fail_round(rnd, error)
        return Failed(rnd, error)

    def made_again(
        self, key: Key, *, rank: int, op: str, root: int, value: bytes
    ) -> Completed | None:
        """The answer of `rank`'s call when it is the same call made again of the round
        completed last, over since; None when it is not. Once a rank has finished, no new round
        can complete: only such a call goes on (the engine refuses any other)."""
        done = self._completed
        if (
            done is None
            or (done.key, done.op, done.root, done.values.get(rank)) != (key, op, root, value)
            or key in self.open
        ):
            return None
        done.waiting[rank] += 1
        return Completed(done, [done.values[r] for r in range(done.size)])

    def answered(self, rnd: Round, rank: int) -> None:
        """`rank`'s call got the round's outcome; the round is forgotten once every rank has
        its answer, or at once when it failed."""
        rnd.waiting[rank] -= 1
        if isinstance(rnd.outcome, ClusterError):
            self._forget(rnd)
            return
        rnd.answered.add(rank)
        if len(rnd.answered) >= rnd.size:
            self._forget(rnd)

    def abandoned(self, rnd: Round, rank: int) -> None:
        """`rank`'s call was cancelled (its caller gone, or its deadline past). Not an answer: a
        call made again gets it. Before the round is complete, the contribution is taken back
        when no other call of that rank waits for it, so that what nobody waits for is not
        held (the call made again brings it back)."""
        rnd.waiting[rank] -= 1
        if not rnd.open or rnd.waiting[rank] > 0:
            return
        value = rnd.values.pop(rank, None)
        if value is not None:
            rnd.held -= len(value)
            if self.open.get(rnd.key) is rnd:
                self.held_bytes -= len(value)
        if not rnd.values:
            self._forget(rnd)

    def due(self, rnd: Round) -> float:
        """When `rnd` has waited long enough for its last rank (`expire` then)."""
        return rnd.started + self.timeout_s

    def expire(self, rnd: Round) -> CollectiveError | None:
        """`rnd`'s time is up (`due`): the error that fails it for every rank; None when it is
        over already."""
        if not rnd.open or self.open.get(rnd.key) is not rnd:
            return None
        generation, seq = rnd.key
        missing = rnd.missing()
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        error = CollectiveError(
            f"{describe(rnd.op, rnd.root)} #{seq} of generation {generation} waited "
            f"{self.timeout_s:g} s for rank(s) {shown}, which never called it "
            "(CLUSTER_COLLECTIVE_TIMEOUT_S): every rank must call the same collectives in "
            "the same order; look at what those ranks were doing"
        )
        self._fail_round(rnd, error)
        return error

    def fail_all(self, error: ClusterError, *, keep_answer: bool = False) -> list[Round]:
        """Every open round fails with `error` (a node died or left, or the job ended): the
        rounds whose callers must hear it. `keep_answer`: the round completed last stays
        answerable (a rank finished: the others' calls of that round, made again, were
        answered before it left)."""
        failed = list(self.open.values())
        for rnd in failed:
            rnd.outcome = error
        self.open.clear()
        self._failed.clear()
        if not keep_answer:
            self._completed = None
        self.held_bytes = 0
        return failed

    def cut_off(self, generation: int, seq: int, rank: int) -> bool:
        """True when `rank`'s call of round `seq` of `generation` can never complete because
        the scheduler was restarted in between: an unfinished round of `generation` has another
        number (ranks that call the same collectives in the same order never do that, unless
        some of them got an answer the others can no longer get), or another rank said it was
        answered this round by the scheduler before this one (`answered_before`)."""
        if any(
            key[0] == generation and key[1] != seq and rnd.open for key, rnd in self.open.items()
        ):
            return True
        if seq <= self._through(generation):
            return False  # completed here: a call made again gets its answer
        reported_generation, reports = self._answered_before
        return reported_generation == generation and any(
            answered >= seq for other, answered in reports.items() if other != rank
        )

    def answered_before(self, generation: int, rank: int, answered: int) -> int | None:
        """`rank`, registering again with this scheduler, says it was answered `generation`'s
        collectives up to #`answered`. The number of the open round that cuts in two, if any: a
        round up to that number, not completed here, that `rank` has not called here, waits for
        a rank that has moved on. Reports of one generation are kept, one number per rank."""
        completed = self._through(generation)
        if answered <= completed:
            return None  # nothing this scheduler does not know
        reported_generation, reports = self._answered_before
        if reported_generation != generation:
            reports = {}
            self._answered_before = (generation, reports)
        reports[rank] = max(answered, reports.get(rank, 0))
        cut = [
            key[1]
            for key, rnd in self.open.items()
            if key[0] == generation
            and completed < key[1] <= answered
            and rnd.open
            and rank not in rnd.values
        ]
        return min(cut, default=None)

    def _through(self, generation: int) -> int:
        """The highest round of `generation` completed here (0: none)."""
        done_generation, seq = self._completed_through
        return seq if done_generation == generation else 0

    def _round(self, key: Key, *, rank: int, size: int, op: str, root: int, now: float) -> Round:
        """The open round of `key`, made when this is its first contribution; a
        CollectiveMismatchError when the round is another collective than `op` from `root`."""
        failed = self._failed.get(key)
        if failed is not None:
            raise type(failed)(str(failed))
        rnd = self.open.get(key)
        if rnd is None:
            rnd = self.open[key] = Round(key, op, root, size, started=now)
        elif (rnd.op, rnd.root) != (op, root):
            raise CollectiveMismatchError(
                f"rank {rank} called {describe(op, root)} as collective #{key[1]}, but another "
                f"rank called {describe(rnd.op, rnd.root)}: every rank must call the same "
                "collectives in the same order"
            )
        return rnd

    def _check_share(self, rnd: Round, rank: int, adding: int) -> None:
        """Refuse `rank`'s call (only it) when its contributions would wait in more than
        `ROUNDS_PER_RANK` unfinished rounds, or hold more than its share of the bytes."""
        generation, seq = rnd.key
        mine = [
            (k, len(r.values[rank]))
            for k, r in self.open.items()
            if k[0] == generation and rank in r.values and r.open
        ]
        if len(mine) >= ROUNDS_PER_RANK:
            numbers = ", ".join(f"#{k[1]}" for k, _ in mine)
            raise CapacityError(
                f"rank {rank} called collective #{seq} of generation {generation} while its "
                f"contributions wait in {len(mine)} unfinished ones ({numbers}), the most the "
                f"scheduler keeps per rank ({ROUNDS_PER_RANK}): ranks that call the same "
                "collectives in the same order are never more than one apart"
            )
        size = rnd.size
        share = min(self.max_bytes, max(self.max_bytes // max(size, 1), 2 * MAX_ANSWER_BYTES))
        held = sum(n for _, n in mine)
        if held + adding > share:
            raise CapacityError(
                f"rank {rank}'s {adding} bytes for collective #{seq} of generation {generation} "
                f"would make its open contributions {held + adding} bytes, past its share "
                f"({share} bytes of CLUSTER_COLLECTIVE_MAX_BYTES={self.max_bytes}): send less "
                "per call"
            )

    def _add(self, rnd: Round, rank: int, value: bytes) -> Joined:
        """Take `rank`'s contribution, or fail the round when it would pass a cap."""
        try:
            self._check_share(rnd, rank, len(value))
        except CapacityError:
            if not rnd.values:
                self._forget(rnd)  # made for this call: nothing of it is kept
            raise
        problem = self._over_cap(rnd, rank, len(value))
        if problem is not None:
            self._fail_round(rnd, problem)
            return Failed(rnd, problem)
        rnd.values[rank] = value
        rnd.held += len(value)
        self.held_bytes += len(value)
        if len(rnd.values) < rnd.size:
            return Waiting(rnd)
        gathered = [rnd.values[r] for r in range(rnd.size)]
        rnd.outcome = gathered
        self._completed = rnd
        self._completed_through = max(self._completed_through, rnd.key)
        return Completed(rnd, gathered)

    def _over_cap(self, rnd: Round, rank: int, adding: int) -> ClusterError | None:
        generation, seq = rnd.key
        if self.held_bytes + adding > self.max_bytes:
            return CapacityError(
                f"collective #{seq} of generation {generation}: rank {rank}'s {adding} bytes "
                f"would make the scheduler hold {self.held_bytes + adding} bytes of open "
                f"collectives, past its cap (CLUSTER_COLLECTIVE_MAX_BYTES={self.max_bytes}); "
                "collectives are for coordination: send less per call (tensors go through a "
                "data-plane library), or start the scheduler with a larger "
                "CLUSTER_COLLECTIVE_MAX_BYTES"
            )
        if rnd.op == ALLGATHER and rnd.held + adding > MAX_ANSWER_BYTES:
            return CollectiveError(
                f"allgather #{seq} of generation {generation} gathers more than "
                f"{MAX_ANSWER_BYTES} bytes, which its answer cannot carry (a message holds at "
                "most 64 MiB): gather less per call"
            )
        return None

    def _fail_round(self, rnd: Round, error: ClusterError) -> None:
        self._forget(rnd)
        rnd.outcome = error
        self._failed[rnd.key] = error
        if len(self._failed) > FAILED_KEPT:
            self._failed.popitem(last=False)

    def _forget(self, rnd: Round) -> None:
        # fail_all may have replaced this round under the same key: forget only our own.
        if self.open.get(rnd.key) is rnd:
            del self.open[rnd.key]
            self.held_bytes -= rnd.held


def describe(op: str, root: int) -> str:
    return f"broadcast(root={root})" if op == BROADCAST else op
