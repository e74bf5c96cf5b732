"""Rounds of the control-plane collectives (barrier, allgather, broadcast).

Every rank of a generation calls the same collectives in the same order, each numbered by a
per-process sequence number. A round collects one contribution per rank; when the last one
arrives every caller gets its answer, and the round is forgotten once every rank has been
answered. A node failure or the end of the job fails every open round at once, so no caller
waits on a peer that will never come.

What the rounds hold is bounded. A rank contributes once per round: the same bytes again are
the same call made again (after a lost connection) and get the same answer; other bytes are
refused. At most `MAX_OPEN_ROUNDS` rounds of a generation are open at once: ranks that call the
same collectives in the same order are never more than one round apart (a rank that has
contributed to round k waits for its answer before it can call k+1), so two rounds can be open
(k, answered to some ranks only, and k+1) and four leave room. The bytes held by all open rounds
are capped (CLUSTER_COLLECTIVE_MAX_BYTES); a contribution past the cap fails its round for every
rank in it, with a `CapacityError` naming the cap, and a rank that comes to that round later
gets the same error instead of waiting.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from cluster.protocol.admission import ALLGATHER, BARRIER, BROADCAST
from cluster.protocol.config import DEFAULT_COLLECTIVE_MAX_BYTES
from cluster.protocol.errors import CapacityError, ClusterError, CollectiveError, JobFailedError

__all__ = ["ALLGATHER", "BARRIER", "BROADCAST", "MAX_OPEN_ROUNDS", "ExchangeTable"]

MAX_OPEN_ROUNDS = 4
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


class ExchangeTable:
    def __init__(self, max_bytes: int = DEFAULT_COLLECTIVE_MAX_BYTES) -> None:
        self._rounds: dict[Key, _Round] = {}
        self.max_bytes = max_bytes
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

    def _round(self, key: Key, *, rank: int, size: int, op: str, root: int) -> _Round:
        """The open round of `key`, made when this is its first contribution."""
        failed = self._failed.get(key)
        if failed is not None:
            raise type(failed)(str(failed))
        rnd = self._rounds.get(key)
        if rnd is None:
            generation, seq = key
            open_rounds = sum(1 for g, _ in self._rounds if g == generation)
            if open_rounds >= MAX_OPEN_ROUNDS:
                raise CapacityError(
                    f"rank {rank} called collective #{seq} of generation {generation} while "
                    f"{open_rounds} others are open, the most the scheduler keeps "
                    f"({MAX_OPEN_ROUNDS}): ranks that call the same collectives in the same order "
                    "are never more than one apart"
                )
            rnd = _Round(op, root, size, done=asyncio.get_running_loop().create_future())
            self._rounds[key] = rnd
        elif (rnd.op, rnd.root) != (op, root):
            raise CollectiveError(
                f"rank {rank} called {_describe(op, root)} as collective #{key[1]}, but another "
                f"rank called {_describe(rnd.op, rnd.root)}: every rank must call the same "
                "collectives in the same order"
            )
        return rnd

    def _add(self, key: Key, rnd: _Round, rank: int, value: bytes) -> None:
        """Take `rank`'s contribution, or fail the round when it would pass a cap."""
        generation, seq = key
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
    if rnd.done is not None and not rnd.done.done():
        rnd.done.set_exception(error)
        # Mark retrieved: a round nobody waits on any more must not log a warning.
        rnd.done.exception()


def _describe(op: str, root: int) -> str:
    return f"broadcast(root={root})" if op == BROADCAST else op
