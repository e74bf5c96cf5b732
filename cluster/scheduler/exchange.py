"""The collectives' rounds on the scheduler's loop: what waits, for `machine.rounds`.

The rules (one contribution per rank, the shares and caps, the deadline, what fails a round)
are decided by the pure table `Rounds`; this shell holds, for each open round, the future its
callers wait on and the timer of its deadline, and carries out the table's answers.

A refusal that tells of a change of the job (a rank has finished) waits until the change is
saved (`durable`, the engine's write-ahead wait), as the events that tell of it do.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable

from cluster.protocol.config import DEFAULT_COLLECTIVE_MAX_BYTES, DEFAULT_COLLECTIVE_TIMEOUT_S
from cluster.protocol.errors import ClusterError, PeerFinishedError
from cluster.scheduler.machine.admission import ALLGATHER, BARRIER, BROADCAST, ExchangeTicket
from cluster.scheduler.machine.rounds import (
    ROUNDS_PER_RANK,
    Completed,
    Failed,
    Joined,
    Round,
    Rounds,
    Withdrawn,
)

__all__ = ["ALLGATHER", "BARRIER", "BROADCAST", "ROUNDS_PER_RANK", "ExchangeTable", "Withdrawn"]


class ExchangeTable:
    def __init__(
        self,
        max_bytes: int = DEFAULT_COLLECTIVE_MAX_BYTES,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        durable: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`durable`: waits until what the job decided so far is saved (None: nothing is)."""
        self.rounds = Rounds(max_bytes, timeout_s)
        self._durable = durable
        # Per open round: what its callers wait on, and its deadline's timer.
        self._waits: dict[Round, tuple[asyncio.Future[list[bytes]], asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self.rounds.open)

    @property
    def held_bytes(self) -> int:
        return self.rounds.held_bytes

    @property
    def max_bytes(self) -> int:
        return self.rounds.max_bytes

    @property
    def timeout_s(self) -> float:
        return self.rounds.timeout_s

    async def contribute(
        self,
        *,
        generation: int,
        seq: int,
        ticket: ExchangeTicket,
        op: str,
        root: int,
        value: bytes | Withdrawn,
    ) -> list[bytes]:
        """The admitted caller's (`ticket`) contribution to round `seq` of `generation`; its
        answer once the round completes. A `Withdrawn` value fails the round for every rank
        (`Rounds.withdraw`)."""
        loop = asyncio.get_running_loop()
        rank, key, now = ticket.rank, (generation, seq), loop.time()
        joined: Joined | None
        if ticket.closed:  # a rank finished: only a call made again of an answered round
            joined = None
            if not isinstance(value, Withdrawn):
                joined = self.rounds.made_again(key, rank=rank, op=op, root=root, value=value)
            if joined is None:
                if self._durable is not None:
                    await self._durable()  # it tells of the rank's finish: once that is saved
                raise PeerFinishedError(ticket.closed)
        elif isinstance(value, Withdrawn):
            joined = self.rounds.withdraw(
                key, rank=rank, size=ticket.size, op=op, root=root, reason=value.reason, now=now
            )
        else:
            joined = self.rounds.join(
                key, rank=rank, size=ticket.size, op=op, root=root, value=value, now=now
            )
        rnd = joined.round
        done = self._wait_of(rnd, loop)
        if isinstance(joined, Failed):
            self._settle(rnd, joined.error)
            self._drop_if_forgotten(rnd)
            raise copy.copy(joined.error)  # each caller its own, with what it carries
        if isinstance(joined, Completed):
            self._settle(rnd, joined.gathered)
        try:
            gathered = await asyncio.shield(done)
        except asyncio.CancelledError:
            self.rounds.abandoned(rnd, rank)
            self._drop_if_forgotten(rnd)
            raise
        except ClusterError:
            self.rounds.answered(rnd, rank)
            self._drop_if_forgotten(rnd)
            raise
        self.rounds.answered(rnd, rank)
        self._drop_if_forgotten(rnd)
        return rnd.answer_for(gathered)

    def _wait_of(self, rnd: Round, loop: asyncio.AbstractEventLoop) -> asyncio.Future[list[bytes]]:
        """The future `rnd`'s callers wait on, made (with its deadline) at its first call."""
        held = self._waits.get(rnd)
        if held is None:
            delay = max(self.rounds.due(rnd) - loop.time(), 0.0)
            held = (loop.create_future(), loop.call_later(delay, self._expire, rnd))
            self._waits[rnd] = held
        return held[0]

    def _expire(self, rnd: Round) -> None:
        error = self.rounds.expire(rnd)
        if error is not None:
            self._settle(rnd, error)

    def _settle(self, rnd: Round, outcome: list[bytes] | ClusterError) -> None:
        """Every caller of `rnd` gets `outcome`; its deadline no longer runs."""
        held = self._waits.get(rnd)
        if held is None:
            return
        done, timer = held
        timer.cancel()
        if done.done():
            return
        if isinstance(outcome, ClusterError):
            done.set_exception(outcome)
            done.exception()  # retrieved: a round nobody waits on any more logs nothing
        else:
            done.set_result(outcome)

    def _drop_if_forgotten(self, rnd: Round) -> None:
        """Once the table has forgotten `rnd` and nobody waits on it, drop its future."""
        if self.rounds.open.get(rnd.key) is not rnd and not any(rnd.waiting.values()):
            held = self._waits.pop(rnd, None)
            if held is not None:
                held[1].cancel()

    def cut_off(self, generation: int, seq: int, rank: int) -> bool:
        """See `Rounds.cut_off`."""
        return self.rounds.cut_off(generation, seq, rank)

    def answered_before(self, generation: int, rank: int, answered: int) -> int | None:
        """See `Rounds.answered_before`."""
        return self.rounds.answered_before(generation, rank, answered)

    def fail_all(self, error: ClusterError, *, keep_answer: bool = False) -> None:
        """Fail every open round with `error`, as it is (a NotLeaderError keeps the leader it
        names): a node died or left, the job ended, this scheduler stood down
        (`Rounds.fail_all`)."""
        for rnd in self.rounds.fail_all(error, keep_answer=keep_answer):
            self._settle(rnd, error)
