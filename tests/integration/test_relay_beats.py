"""A host relay's batched beats reach a real scheduler whatever the host's workers and the length
of their ids (`cluster.transport.relay.HostBeats`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from cluster.scheduler import SchedulerServer
from cluster.scheduler.machine.member_bounds import BeatGate
from cluster.tools.relay import Relay, RelaySettings
from cluster.v1 import scheduler_pb2 as pb
from tests.aio import eventually
from tests.integration.test_relay import make_agent, settings

# Workers of a host besides the real one, each with an id of 128 characters: their batch names
# about 290 KiB, past the 256 KiB the scheduler takes of one HostBeats message.
OTHERS = 2000


class _Beating:
    """The context of a local worker's Heartbeat call, as the relay's handler uses it."""

    code = None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, trailing: object) -> None:
        pass

    def set_code(self, code: object) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        pass


async def _beats(nodes: list[tuple[str, int]]) -> AsyncIterator[bytes]:
    for node_id, incarnation in nodes:
        yield pb.HeartbeatRequest(node_id=node_id, incarnation=incarnation).SerializeToString()


async def test_a_workers_beat_counts_among_thousands_of_long_ids_behind_its_relay(
    short_dir: Path,
) -> None:
    """A real worker behind a real relay, its host's other 2,000 workers beating with
    128-character ids at the same time: the relay's batch of them all is past the scheduler's
    limit for one message, and the scheduler still counts the worker's beat (it took every
    message of the batch: none refused at its edge)."""
    # The worker's own beats: none in the test's time.
    quiet = dataclasses.replace(settings(1), node_timeout_s=120.0, heartbeat_interval_s=60.0)
    async with SchedulerServer(quiet) as srv:
        address = f"unix:{short_dir / 'r.sock'}"
        relay = Relay(RelaySettings(address, f"127.0.0.1:{srv.port}", 1, 30.0))
        await relay.start()
        said: list[str] = []
        agent = make_agent(srv.port, 1, "a", said, CLUSTER_RELAY=address)
        try:
            await asyncio.wait_for(agent.start(), 20)
            member = srv.core.state.members["a"]
            # Two rounds of beats at once: taken however soon (a beat sooner than a quarter
            # of the interval is dropped otherwise, `MemberLimits.beat`).
            srv.core.bounds.beats = BeatGate(0.0)
            host = [("n" * 120 + f"{i:08d}", (1 << 62) + i) for i in range(OTHERS)]
            host.append(("a", agent.identity.incarnation))
            beats = relay._forwarder.beats  # type: ignore[attr-defined]
            for _ in range(2):
                before = member.last_seen
                context = _Beating()
                assert await beats.local(_beats(host), context) == b""
                assert context.code is None
                await eventually(lambda b=before: member.last_seen != b, "a's beat counted")
            assert srv.gate.refusals.counts == {}
            assert said == []
        finally:
            await agent.close()
            await relay.stop()
