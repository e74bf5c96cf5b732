"""A worker's stream moving back to its host's relay: a move the worker gives up on fails
nobody, whatever the scheduler made of it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.state import NodeState
from cluster.tools.relay import Relay, RelaySettings
from cluster.transport.relay import Context, HostLinks
from cluster.worker import watch_stream
from tests.aio import eventually
from tests.integration.test_relay import back_direct_from_a_stopped_relay, settings, slots

MOVE_S = 2.0  # RELAY_MOVE_S, the bound on a move's answer while the direct stream lasts
HELD_S = 3.0  # how late a slow relay passes the scheduler's answer to a registration


def answers_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relays made from now on are slow: each Watch's first message (the scheduler's answer to
    the registration) reaches the worker HELD_S late, after RELAY_MOVE_S; the scheduler has
    accepted the registration and opened its stream by then."""
    watch = HostLinks.watch

    async def held(self: HostLinks, request: bytes, context: Context) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(watch(self, request, context)) as items:
            first = True
            async for item in items:
                if first:
                    await asyncio.sleep(HELD_S)  # sleep-ok: the relay's lateness is the fault
                first = False
                yield item

    monkeypatch.setattr(HostLinks, "watch", held)


async def test_a_move_to_a_relay_slow_to_answer_fails_nobody(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery on; two workers went direct when their relay stopped. The relay comes back slow:
    it passes the scheduler's answers late. Each worker registers again through it
    (`_back_to_relay`): the scheduler accepts, opens the relay stream (now the node's current
    one) and ends the direct stream as superseded; the answer waits in the relay past
    RELAY_MOVE_S. Giving the move up then (cancelling the call: the relay detaches the slot)
    would end the node's current stream: the scheduler would disconnect a healthy node
    (NodeFailed, a new generation; recovery off, the job's end). The worker waits for the
    answer instead: both move, and the generation stays."""
    monkeypatch.setattr(watch_stream, "RELAY_MOVE_S", MOVE_S)
    async with SchedulerServer(dataclasses.replace(settings(2), recovery=True)) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        said: list[str] = []
        agents = await back_direct_from_a_stopped_relay(srv, address, said)
        state = srv.core.state
        generation = state.generation
        answers_held(monkeypatch)
        again = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 2, 30.0))
        await again.start()

        def moved() -> bool:
            through = (a._stream._move is None and a._link.route.relay == address for a in agents)
            return slots(again) == 2 and all(through)

        failed = lambda: state.generation != generation  # noqa: E731
        try:
            await eventually(lambda: moved() or failed(), "both streams through the relay", 20)
            assert not failed(), said  # the moves failed nobody
            gathers = (a.exchange("allgather", n.encode()) for a, n in zip(agents, "ab"))
            done = await asyncio.wait_for(asyncio.gather(*gathers), 10)
            assert done == [[b"a", b"b"]] * 2
            assert state.generation == generation, said
            assert all(m.state is NodeState.ALIVE for m in state.members.values())
            await asyncio.gather(*(a.close() for a in agents))
        finally:
            await again.stop()
