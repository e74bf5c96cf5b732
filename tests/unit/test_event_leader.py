"""`mscluster events --addr --follow` with standby schedulers: a leader that steps down ends
its followers' streams with the not-leader status (UNAVAILABLE, `cluster-error`
NotLeaderError, `cluster-leader` the new leader's address when known), as a standby answers
every call. The follow goes on at the leader it names, shows no event twice, and never ends
without the job's last event: with no leader to go to, it ends in one line saying so.

The schedulers are fake ones (plain grpc.aio servers on loopback in the test) that end their
streams as the test says, with the real mapping of errors to statuses (`failures.status_of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from cluster.protocol.errors import NotLeaderAnswer, NotLeaderError, SchedulerUnreachableError
from cluster.protocol.events import JobEvent
from cluster.scheduler.convert import job_event_to_pb
from cluster.tools import events
from cluster.transport import failures
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc
from tests.aio import BOUND_S
from tests.procs import MSCLUSTER, reader_env


def event(seq: int, kind: str, at: float, **fields: object) -> JobEvent:
    return JobEvent(seq, 1_772_366_400.0 + at, kind, fields)


OLD_LEADER = [event(1, "started", 0.0), event(2, "formed", 0.5), event(3, "failed", 1.0, rank=1)]
# The new leader's own journal, numbered from 1: it took the job over after the old one's last.
NEW_LEADER = [event(1, "resumed", 2.0), event(2, "leader_change", 2.1, role="leader")]
THE_END = event(3, "finished", 3.0, detail="all 2 nodes finished")


@dataclasses.dataclass
class Stream:
    """One WatchEvents call: the events it sends, then how it ends: "not_leader" (with
    `leader`), "clean" (the stream ends without an error), or "open" (until cancelled)."""

    sent: list[JobEvent]
    end: str = "open"
    leader: str = ""


class FakeScheduler(pb_grpc.SchedulerServicer):  # type: ignore[misc]  # untyped base
    def __init__(self, *streams: Stream) -> None:
        self.streams = list(streams)  # the last one answers every call after the others
        self.asked = 0

    async def Challenge(self, request: Any, context: Any) -> pb.ChallengeResponse:
        return pb.ChallengeResponse()  # no secret to prove

    async def WatchEvents(self, request: Any, context: Any) -> AsyncIterator[pb.JobEvent]:
        stream = self.streams[min(self.asked, len(self.streams) - 1)]
        self.asked += 1
        for sent in stream.sent:
            yield job_event_to_pb(sent)
        if stream.end == "not_leader":
            where = f"the leader is at {stream.leader}" if stream.leader else "none leads"
            code, metadata = failures.status_of(
                NotLeaderError(f"not the leader: {where}", stream.leader)
            )
            await context.abort(code, f"not the leader: {where}", trailing_metadata=metadata)
        elif stream.end == "open":
            await asyncio.Event().wait()  # until the call is cancelled


@contextlib.asynccontextmanager
async def serving(scheduler: FakeScheduler) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(scheduler, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def followed(address: str | list[str], reconnect_s: float = BOUND_S) -> list[JobEvent]:
    stream = events.from_scheduler(address, None, follow=True, reconnect_s=reconnect_s, secret=None)
    return await asyncio.wait_for(_all(stream), 4 * BOUND_S)


async def _all(stream: AsyncIterator[JobEvent]) -> list[JobEvent]:
    return [e async for e in stream]


def seqs(shown: list[JobEvent]) -> list[tuple[int, str]]:
    return [(e.seq, e.kind) for e in shown]


def stepping_down(leader: str) -> FakeScheduler:
    """The old leader: its events, then it steps down naming `leader`; a standby since."""
    return FakeScheduler(Stream(OLD_LEADER, "not_leader", leader), Stream([], "not_leader", leader))


async def test_a_leader_that_steps_down_sends_the_follow_to_the_new_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The new leader's first stream ends before the job's end (it restarted): asked again, it
    # sends its retained events again, and the end.
    new = FakeScheduler(Stream(NEW_LEADER[:1], "clean"), Stream([*NEW_LEADER, THE_END]))
    async with serving(new) as new_address:
        old = stepping_down(new_address)
        async with serving(old) as old_address:
            shown = await followed(old_address)
    assert seqs(shown) == [
        (1, "started"),
        (2, "formed"),
        (3, "failed"),
        (1, "resumed"),  # the new leader's own numbers: shown, and once
        (2, "leader_change"),
        (3, "finished"),
    ]
    assert new.asked == 2
    told = capsys.readouterr().err.splitlines()
    assert told == [
        f"mscluster: following the leader at {new_address} (the scheduler at {old_address} "
        "stands by)"
    ]


async def test_a_leader_that_says_it_gave_up_leading_but_streams_on_is_left() -> None:
    """A scheduler that does not end its followers' streams when it steps down: its own
    `leader_change` to standby is the word (the stream stays open, the job is elsewhere)."""
    gave_up = event(4, "leader_change", 1.5, role="standby", address="a", term=1, detail="lost")
    new = FakeScheduler(Stream([*NEW_LEADER, THE_END]))
    async with serving(new) as new_address:
        old = FakeScheduler(
            Stream([*OLD_LEADER, gave_up], "open"), Stream([], "not_leader", new_address)
        )
        async with serving(old) as old_address:
            shown = await followed(old_address)
    assert seqs(shown) == seqs([*OLD_LEADER, gave_up, *NEW_LEADER, THE_END])


async def test_with_several_addresses_a_standby_naming_none_sends_it_to_the_next() -> None:
    new = FakeScheduler(Stream([*NEW_LEADER, THE_END]))
    async with serving(new) as new_address:
        old = stepping_down("")
        async with serving(old) as old_address:
            shown = await followed([old_address, new_address])
    assert seqs(shown)[3:] == [(1, "resumed"), (2, "leader_change"), (3, "finished")]


async def test_with_no_leader_to_go_to_the_follow_ends_in_one_line_saying_so() -> None:
    old = stepping_down("")
    async with serving(old) as old_address:
        with pytest.raises(NotLeaderAnswer) as ended:
            await followed(old_address, reconnect_s=0.5)
    assert str(ended.value) == f"the scheduler at {old_address} stands by (none leads now)"
    assert old.asked > 2  # asked again meanwhile: a leader may take over


async def test_a_stream_that_ends_before_the_jobs_end_is_never_the_end() -> None:
    restarting = FakeScheduler(Stream(OLD_LEADER, "clean"))
    async with serving(restarting) as address:
        with pytest.raises(
            SchedulerUnreachableError, match="ended its event stream before the job's last"
        ):
            await followed(address, reconnect_s=0.5)


async def test_mscluster_events_follows_the_new_leader_and_exits_0_at_the_end() -> None:
    new = FakeScheduler(Stream([*NEW_LEADER, THE_END]))
    async with serving(new) as new_address:
        old = stepping_down(new_address)
        async with serving(old) as old_address:
            process = await asyncio.create_subprocess_exec(
                *MSCLUSTER, "events", "--follow", "--json", "--addr", old_address,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=reader_env(None),
            )  # fmt: skip
            try:
                out, err = await asyncio.wait_for(process.communicate(), 12 * BOUND_S)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert process.returncode == 0, err.decode()
    shown = [JobEvent.from_json(line) for line in out.decode().splitlines()]
    assert seqs(shown) == seqs([*OLD_LEADER, *NEW_LEADER, THE_END])
    assert err.decode().count("following the leader at") == 1


async def test_the_watchs_event_stream_goes_on_where_its_following_says() -> None:
    """`mscluster status --watch`: its event stream asks `where` (the leader as its `Following`
    finds it) at each connection; a stream that ends before the job's end is asked again
    there, not taken for the end."""
    new = FakeScheduler(Stream([*NEW_LEADER, THE_END]))
    async with serving(new) as new_address:
        old = FakeScheduler(Stream(OLD_LEADER, "clean"), Stream([], "not_leader", new_address))
        async with serving(old) as old_address:
            leader = [old_address]
            stream = events.from_scheduler(
                old_address, None, follow=True, where=lambda: leader[0], secret=None
            )
            first = [await asyncio.wait_for(anext(stream), BOUND_S) for _ in OLD_LEADER]
            leader[0] = new_address  # its Following moved
            rest = await asyncio.wait_for(_all(stream), 4 * BOUND_S)
    assert seqs([*first, *rest]) == seqs([*OLD_LEADER, *NEW_LEADER, THE_END])
