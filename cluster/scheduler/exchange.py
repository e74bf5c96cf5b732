"""Rounds of the control-plane collectives (barrier, allgather, broadcast).

Every rank of a generation calls the same collectives in the same order, each numbered by a
per-process sequence number. A round collects one contribution per rank; when the last one
arrives every caller gets its answer, and the round is forgotten once every rank has been
answered. A node failure or the end of the job fails every open round at once, so no caller
waits on a peer that will never come.

What the rounds hold is bounded. A rank contributes once per round: the same bytes again are
the same call made again (after a lost connection) and get the same answer; other bytes are
refused.

Each rank has its share, so that one runaway member cannot stop the others. Ranks that call the
same collectives in the same order are never more than one round apart (a rank that has
contributed to round k waits for its answer before it can call k+1): a rank's contributions
may wait in at most `ROUNDS_PER_RANK` (2) unfinished rounds, and hold at most its share of the
bytes (CLUSTER_COLLECTIVE_MAX_BYTES / ranks, and never less than two full answers); past either,
that call alone is refused with a `CapacityError` and the others' rounds go on. The bytes held
by all open rounds are capped too (CLUSTER_COLLECTIVE_MAX_BYTES); a contribution past that cap
fails its round for every rank in it, with a `CapacityError` naming the cap, and a rank that
comes to that round later gets the same error instead of waiting.

A round waits at most CLUSTER_COLLECTIVE_TIMEOUT_S (10 minutes) from its first contribution for
its last; then it fails for every rank, those waiting and those that come later, with a
`CollectiveError` that names the ranks that never came.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from cluster.protocol.admission import ALLGATHER, BARRIER, BROADCAST
from cluster.protocol.config import DEFAULT_COLLECTIVE_MAX_BYTES, DEFAULT_COLLECTIVE_TIMEOUT_S
from cluster.protocol.errors import CapacityError, ClusterError, CollectiveError, JobFailedError

__all__ = ["ALLGATHER", "BARRIER", "BROADCAST", "ROUNDS_PER_RANK", "ExchangeTable"]

ROUNDS_PER_RANK = 2
# A round's answer is one message: what an allgather gathers must fit in one (gRPC's limit on
# the scheduler's messages, less room for framing).
MAX_ANSWER_BYTES = 64 * 1024 * 1024 - 64 * 1024
# Rounds failed by a cap, remembered so that a late rank gets the error instead of waiting.
_FAILED_KEPT = 64

Key = tuple[int, int]  # (generation, seq)


@dataclass
class _Round:
    op: str
    root: int
    size: int
    values: dict[int, bytes] = field(default_factory=dict)
    held: int = 0  # bytes of the values
    answered: set[int] = field(default_factory=set)
    waiting: collections.Counter[int] = field(default_factory=collections.Counter)
    done: asyncio.Future[list[bytes]] | None = None
    timer: asyncio.TimerHandle | None = None  # its CLUSTER_COLLECTIVE_TIMEOUT_S

    def missing(self) -> list[int]:
        return [rank for rank in range(self.size) if rank not in self.values]


class ExchangeTable:
    def __init__(
        self,
        max_bytes: int = DEFAULT_COLLECTIVE_MAX_BYTES,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self._rounds: dict[Key, _Round] = {}
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.held_bytes = 0
        self._failed: collections.OrderedDict[Key, ClusterError] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rounds)

    async def contribute(
        self, *, generation: int, seq: int, rank: int, size: int, op: str, root: int, value: bytes
    ) -> list[bytes]:
        key = (generation, seq)
        rnd = self._round(key, rank=rank, size=size, op=op, root=root)
        assert rnd.done is not None
        known = rnd.values.get(rank)
        if known is None:
            self._add(key, rnd, rank, value)
        elif known != value:
            raise CollectiveError(
                f"rank {rank} sent collective #{seq} of generation {generation} twice, with "
                "different values: a rank contributes once to each collective"
            )
        rnd.waiting[rank] += 1
        try:
            gathered = await asyncio.shield(rnd.done)
        except asyncio.CancelledError:
            self._abandoned(key, rnd, rank)
            raise
        except ClusterError:
            self._forget(key, rnd)
            raise
        finally:
            rnd.waiting[rank] -= 1
        rnd.answered.add(rank)
        if len(rnd.answered) >= rnd.size:
            self._forget(key, rnd)
        if op == ALLGATHER:
            return gathered
        if op == BROADCAST:
            return [gathered[root]]
        return []

    def _expire(self, key: Key, rnd: _Round) -> None:
        """The round has waited `timeout_s` for its last rank: it fails for every rank."""
        if rnd.done is None or rnd.done.done() or self._rounds.get(key) is not rnd:
            return
        generation, seq = key
        missing = rnd.missing()
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        self._fail_round(
            key,
            rnd,
            CollectiveError(
                f"{_describe(rnd.op, rnd.root)} #{seq} of generation {generation} waited "
                f"{self.timeout_s:g} s for rank(s) {shown}, which never called it "
                "(CLUSTER_COLLECTIVE_TIMEOUT_S): every rank must call the same collectives in "
                "the same order; look at what those ranks were doing"
            ),
        )

    def _round(self, key: Key, *, rank: int, size: int, op: str, root: int) -> _Round:
        """The open round of `key`, made when this is its first contribution."""
        failed = self._failed.get(key)
        if failed is not None:
            raise type(failed)(str(failed))
        rnd = self._rounds.get(key)
        if rnd is None:
            loop = asyncio.get_running_loop()
            rnd = _Round(op, root, size, done=loop.create_future())
            rnd.timer = loop.call_later(self.timeout_s, self._expire, key, rnd)
            self._rounds[key] = rnd
        elif (rnd.op, rnd.root) != (op, root):
            raise CollectiveError(
                f"rank {rank} called {_describe(op, root)} as collective #{key[1]}, but another "
                f"rank called {_describe(rnd.op, rnd.root)}: every rank must call the same "
                "collectives in the same order"
            )
        return rnd

    def _check_share(self, key: Key, rank: int, size: int, adding: int) -> None:
        """Refuse `rank`'s call (only it) when its contributions would wait in more than
        `ROUNDS_PER_RANK` unfinished rounds, or hold more than its share of the bytes."""
        generation, seq = key
        mine = [
            (k, len(r.values[rank]))
            for k, r in self._rounds.items()
            if k[0] == generation and rank in r.values and r.done is not None and not r.done.done()
        ]
        if len(mine) >= ROUNDS_PER_RANK:
            numbers = ", ".join(f"#{k[1]}" for k, _ in mine)
            raise CapacityError(
                f"rank {rank} called collective #{seq} of generation {generation} while its "
                f"contributions wait in {len(mine)} unfinished ones ({numbers}), the most the "
                f"scheduler keeps per rank ({ROUNDS_PER_RANK}): ranks that call the same "
                "collectives in the same order are never more than one apart"
            )
        share = min(self.max_bytes, max(self.max_bytes // max(size, 1), 2 * MAX_ANSWER_BYTES))
        held = sum(n for _, n in mine)
        if held + adding > share:
            raise CapacityError(
                f"rank {rank}'s {adding} bytes for collective #{seq} of generation {generation} "
                f"would make its open contributions {held + adding} bytes, past its share "
                f"({share} bytes of CLUSTER_COLLECTIVE_MAX_BYTES={self.max_bytes}): send less "
                "per call"
            )

    def _add(self, key: Key, rnd: _Round, rank: int, value: bytes) -> None:
        """Take `rank`'s contribution, or fail the round when it would pass a cap."""
        generation, seq = key
        try:
            self._check_share(key, rank, rnd.size, len(value))
        except CapacityError:
            if not rnd.values:
                self._forget(key, rnd)  # made for this call: nothing of it is kept
            raise
        problem: ClusterError | None = None
        if self.held_bytes + len(value) > self.max_bytes:
            problem = CapacityError(
                f"collective #{seq} of generation {generation}: rank {rank}'s {len(value)} bytes "
                f"would make the scheduler hold {self.held_bytes + len(value)} bytes of open "
                f"collectives, past its cap (CLUSTER_COLLECTIVE_MAX_BYTES={self.max_bytes}); "
                "collectives are for coordination: send less per call (tensors go through a "
                "data-plane library), or start the scheduler with a larger "
                "CLUSTER_COLLECTIVE_MAX_BYTES"
            )
        elif rnd.op == ALLGATHER and rnd.held + len(value) > MAX_ANSWER_BYTES:
            problem = CollectiveError(
                f"allgather #{seq} of generation {generation} gathers more than "
                f"{MAX_ANSWER_BYTES} bytes, which its answer cannot carry (a message holds at "
                "most 64 MiB): gather less per call"
            )
        if problem is not None:
            self._fail_round(key, rnd, problem)
            raise type(problem)(str(problem))
        assert rnd.done is not None
        rnd.values[rank] = value
        rnd.held += len(value)
        self.held_bytes += len(value)
        if len(rnd.values) == rnd.size and not rnd.done.done():
            rnd.done.set_result([rnd.values[r] for r in range(rnd.size)])
            if rnd.timer is not None:
                rnd.timer.cancel()

    def _abandoned(self, key: Key, rnd: _Round, rank: int) -> None:
        """`rank`'s call was cancelled (its caller gone, or its deadline past). Not an answer: a
        call made again gets it. Before the round is complete, the contribution is taken back
        when no other call of that rank waits for it, so that what nobody waits for is not
        held (the call made again brings it back)."""
        assert rnd.done is not None
        if rnd.done.done() or rnd.waiting[rank] > 1:
            return
        value = rnd.values.pop(rank, None)
        if value is not None:
            rnd.held -= len(value)
            if self._rounds.get(key) is rnd:
                self.held_bytes -= len(value)
        if not rnd.values:
            self._forget(key, rnd)

    def _fail_round(self, key: Key, rnd: _Round, error: ClusterError) -> None:
        self._forget(key, rnd)
        self._failed[key] = error
        if len(self._failed) > _FAILED_KEPT:
            self._failed.popitem(last=False)
        _fail(rnd, error)

    def _forget(self, key: Key, rnd: _Round) -> None:
        # fail_all may have replaced this round under the same key: forget only our own.
        if self._rounds.get(key) is rnd:
            del self._rounds[key]
            self.held_bytes -= rnd.held
            if rnd.timer is not None:
                rnd.timer.cancel()

    def cut_off(self, generation: int, seq: int) -> bool:
        """True when an unfinished round of `generation` has another number than `seq`: ranks
        that call the same collectives in the same order never do that, unless some of them got
        an answer the others can no longer get (the scheduler was restarted in between)."""
        return any(
            key[0] == generation and key[1] != seq and rnd.done is not None and not rnd.done.done()
            for key, rnd in self._rounds.items()
        )

    def fail_all(self, reason: str, kind: type[ClusterError] = JobFailedError) -> None:
        """Fail every open round: a node died or left, or the job ended."""
        for rnd in self._rounds.values():
            _fail(rnd, kind(reason))
        self._rounds.clear()
        self._failed.clear()
        self.held_bytes = 0


def _fail(rnd: _Round, error: ClusterError) -> None:
    if rnd.timer is not None:
        rnd.timer.cancel()
    if rnd.done is not None and not rnd.done.done():
        rnd.done.set_exception(error)
        # Mark retrieved: a round nobody waits on any more must not log a warning.
        rnd.done.exception()


def _describe(op: str, root: int) -> str:
    return f"broadcast(root={root})" if op == BROADCAST else op
