"""Rounds of the control-plane collectives (barrier, allgather, broadcast).

Every rank of a generation calls the same collectives in the same order, each numbered by a
per-process sequence number. A round collects one contribution per rank; when the last one
arrives every caller gets its answer, and the round is forgotten once every rank has been
answered. A node failure or the end of the job fails every open round at once, so no caller
waits on a peer that will never come.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cluster.protocol.errors import ClusterError, CollectiveError, JobFailedError

BARRIER = "barrier"
ALLGATHER = "allgather"
BROADCAST = "broadcast"


@dataclass
class _Round:
    op: str
    root: int
    size: int
    values: dict[int, bytes] = field(default_factory=dict)
    answered: int = 0
    done: asyncio.Future[list[bytes]] | None = None


class ExchangeTable:
    def __init__(self) -> None:
        self._rounds: dict[tuple[int, int], _Round] = {}

    def __len__(self) -> int:
        return len(self._rounds)

    async def contribute(
        self, *, generation: int, seq: int, rank: int, size: int, op: str, root: int, value: bytes
    ) -> list[bytes]:
        key = (generation, seq)
        rnd = self._rounds.get(key)
        if rnd is None:
            rnd = _Round(op, root, size, done=asyncio.get_running_loop().create_future())
            self._rounds[key] = rnd
        elif (rnd.op, rnd.root) != (op, root):
            raise CollectiveError(
                f"rank {rank} called {_describe(op, root)} as collective #{seq}, but another "
                f"rank called {_describe(rnd.op, rnd.root)}: every rank must call the same "
                "collectives in the same order"
            )
        assert rnd.done is not None
        rnd.values[rank] = value
        if len(rnd.values) == rnd.size and not rnd.done.done():
            rnd.done.set_result([rnd.values[r] for r in range(rnd.size)])
        try:
            gathered = await asyncio.shield(rnd.done)
        finally:
            rnd.answered += 1
            finished = rnd.answered >= rnd.size or (rnd.done.done() and rnd.done.exception())
            # fail_all may have replaced this round under the same key: forget only our own.
            if finished and self._rounds.get(key) is rnd:
                del self._rounds[key]
        if op == ALLGATHER:
            return gathered
        if op == BROADCAST:
            return [gathered[root]]
        return []

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
            if rnd.done is not None and not rnd.done.done():
                rnd.done.set_exception(kind(reason))
                # Mark retrieved: a round nobody waits on any more must not log a warning.
                rnd.done.exception()
        self._rounds.clear()


def _describe(op: str, root: int) -> str:
    return f"broadcast(root={root})" if op == BROADCAST else op
