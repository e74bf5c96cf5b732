"""The scheduler's side of a host link (`cluster.scheduler.host_link`): slots run as Watch
streams, what they yield grouped into messages (an event shared by slots sent once, each slot's
order kept), the slot limit, detach and close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from hypothesis import given
from hypothesis import strategies as st

from cluster.scheduler.host_link import HostLink, SlotContext, SlotEnd, grouped
from tests.aio import eventually, settle

EVENTS = [bytes([i]) * 3 for i in range(4)]  # distinct objects, as the core's serialized events


@st.composite
def pendings(draw: st.DrawFn) -> list[tuple[int, bytes | SlotEnd]]:
    """What slots yield, interleaved: events from a few shared objects, then maybe an end."""
    slots = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6, unique=True))
    streams = {
        slot: [*draw(st.lists(st.sampled_from(EVENTS), max_size=6))]
        + ([SlotEnd(slot, grpc.StatusCode.OK, "")] if draw(st.booleans()) else [])
        for slot in slots
    }
    order = draw(st.permutations([slot for slot, items in streams.items() for _ in items]))
    taken = dict.fromkeys(streams, 0)
    pending: list[tuple[int, bytes | SlotEnd]] = []
    for slot in order:
        pending.append((slot, streams[slot][taken[slot]]))
        taken[slot] += 1
    return pending


def delivered(pending: list[tuple[int, bytes | SlotEnd]]) -> dict[int, list[object]]:
    """What the relay hands each slot, reading the messages in order."""
    got: dict[int, list[object]] = {}
    for down in grouped(pending):
        for slot in down.slots:
            got.setdefault(slot, []).append(down.event)
        for end in down.ended:
            got.setdefault(end.slot, []).append(end)
    return got


@given(pendings())
def test_each_slot_gets_its_own_items_in_their_order(
    pending: list[tuple[int, bytes | SlotEnd]],
) -> None:
    expected: dict[int, list[object]] = {}
    for slot, item in pending:
        expected.setdefault(slot, []).append(item)
    assert delivered(pending) == expected


def test_a_broadcast_goes_down_once_for_all_slots() -> None:
    pending: list[tuple[int, bytes | SlotEnd]] = [
        (slot, event) for event in EVENTS[:2] for slot in range(1, 1025)
    ]
    downs = grouped(pending)
    assert [(len(down.slots), down.event) for down in downs] == [
        (1024, EVENTS[0]),
        (1024, EVENTS[1]),
    ]


async def _forever(opened: list[int], closed: list[int], slot: int) -> AsyncIterator[bytes]:
    opened.append(slot)
    try:
        yield EVENTS[0]
        await asyncio.Event().wait()
    finally:
        closed.append(slot)
    yield b""  # never reached


async def _refused(context: SlotContext) -> AsyncIterator[bytes]:
    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
    context.set_details("no proof")
    return
    yield b""  # an async generator


async def _next_batch(link: HostLink, done: asyncio.Future[None]) -> list[object]:
    batches = link.batches(done)
    try:
        batch = await asyncio.wait_for(anext(batches), 5)
    finally:
        await batches.aclose()
    return [(down.slots, down.event, down.ended) for down in batch]


async def test_slots_past_the_limit_end_at_once_and_a_taken_slot_is_refused() -> None:
    link = HostLink(max_slots=2)
    opened: list[int] = []
    closed: list[int] = []
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    for slot in (1, 2, 3, 1):
        link.attach(slot, _forever(opened, closed, slot), SlotContext("peer", ()))
    batch = await _next_batch(link, done)
    ends = [end for _, _, ended in batch for end in ended]  # type: ignore[attr-defined]
    assert [(end.slot, end.code) for end in ends] == [
        (3, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (1, grpc.StatusCode.INVALID_ARGUMENT),
    ]
    assert "at most 2 Watch streams" in ends[0].details
    assert len(link) == 2
    link.close()
    await eventually(lambda: sorted(closed) == [1, 2], "the cancelled slots' streams closed")


async def _counting(taken: list[int], events: int) -> AsyncIterator[bytes]:
    for i in range(events):
        taken.append(i)
        yield bytes([i])


async def test_a_slot_waits_for_room_when_the_writer_holds_its_bound() -> None:
    """Past `max_pending` items, or `max_bytes`, waiting for the writer, a slot takes no more
    from its Watch until the writer takes them; then it goes on, and its end comes last."""
    for link in (HostLink(max_slots=4, max_pending=3), HostLink(max_slots=4, max_bytes=300)):
        taken: list[int] = []
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        link.attach(1, _counting(taken, 7), SlotContext("peer", ()))
        await settle(lambda: link.waiting == 1)
        assert link.held()[0] == 3  # three items of 129 bytes pass 300 too
        assert len(taken) == link.held()[0] + 1  # and the one it waits to put
        events: list[bytes | None] = []
        ends: list[SlotEnd] = []
        while not ends:
            for down in await _next_batch(link, done):
                events.append(down[1])  # type: ignore[index]
                ends.extend(down[2])  # type: ignore[index]
            assert link.held()[0] <= link.max_pending
        assert events == [bytes([i]) for i in range(7)]
        assert [end.slot for end in ends] == [1]
        link.close()


async def test_a_detached_slot_ends_its_stream_and_sends_nothing() -> None:
    link = HostLink(max_slots=4)
    opened: list[int] = []
    closed: list[int] = []
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    link.attach(7, _forever(opened, closed, 7), SlotContext("peer", ()))
    assert await _next_batch(link, done) == [([7], EVENTS[0], [])]
    link.detach(7)
    await eventually(lambda: closed == [7], "the detached slot's stream closed")
    done.set_result(None)  # the relay half-closed: with no slot open the link ends
    assert [batch async for batch in link.batches(done)] == []


async def test_a_refused_slot_ends_with_what_its_watch_told_its_context() -> None:
    link = HostLink(max_slots=4)
    context = SlotContext("ipv4:10.0.0.1:5", (("cluster-node-id", "a"),))
    link.attach(1, _refused(context), context)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    assert await _next_batch(link, done) == [
        ([], None, [SlotEnd(1, grpc.StatusCode.UNAUTHENTICATED, "no proof")])
    ]
    assert context.peer() == "ipv4:10.0.0.1:5"
    assert context.invocation_metadata() == (("cluster-node-id", "a"),)


class FakeWatch:
    """A slot's Watch, driven by the test: events, an end (OK or refused), or nothing."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[bytes | grpc.StatusCode] = asyncio.Queue()
        self.closed = False

    async def events(self, context: SlotContext) -> AsyncIterator[bytes]:
        try:
            while True:
                item = await self.items.get()
                if isinstance(item, grpc.StatusCode):
                    if item != grpc.StatusCode.OK:
                        context.set_code(item)
                    return
                yield item
        finally:
            self.closed = True


OPS = st.lists(
    st.tuples(
        st.sampled_from(["attach", "event", "end", "refuse", "detach", "take"]),
        st.integers(1, 4),
        st.sampled_from(EVENTS),
    ),
    max_size=40,
)


async def _settle() -> None:
    """Let the slots' tasks take what was put (no time passes: the loop runs what is ready)."""
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: yields the loop, times nothing


async def _run_program(ops: list[tuple[str, int, bytes]]) -> None:
    # Bounds past what a program can put: this is about order and ends; waiting for room is
    # `test_a_slot_waits_for_room_when_the_writer_holds_its_bound`'s.
    link = HostLink(max_slots=3, max_pending=len(ops) + 1)
    watches: dict[int, FakeWatch] = {}
    expected: dict[int, list[object]] = {}
    got: dict[int, list[object]] = {}
    open_slots: set[int] = set()
    number = 0  # a slot number is new on each attach, as the relay's
    ids: dict[int, int] = {}  # the program's slot -> its current number

    def take() -> None:
        for down in link.take():
            for slot in down.slots:
                got.setdefault(slot, []).append(down.event)
            for end in down.ended:
                got.setdefault(end.slot, []).append(end.code)

    for op, which, event in ops:
        slot = ids.get(which)
        if op == "attach" and slot not in open_slots:
            number += 1
            ids[which] = slot = number
            if len(open_slots) >= link.max_slots:
                expected[slot] = [grpc.StatusCode.RESOURCE_EXHAUSTED]
            else:
                watches[slot] = FakeWatch()
                expected[slot] = []
                open_slots.add(slot)
            context = SlotContext("peer", ())
            watch = watches.get(slot, FakeWatch())  # past the limit: never run
            link.attach(slot, watch.events(context), context)
        elif slot in open_slots and op in ("event", "end", "refuse"):
            item = {"event": event, "end": grpc.StatusCode.OK}.get(op, grpc.StatusCode.NOT_FOUND)
            watches[slot].items.put_nowait(item)
            expected[slot].append(item)
            if op != "event":
                open_slots.discard(slot)
        elif slot in open_slots and op == "detach":
            link.detach(slot)
            open_slots.discard(slot)
        await _settle()
        if op == "take":
            take()
    await _settle()
    take()
    link.close()
    await _settle()
    assert got == {slot: items for slot, items in expected.items() if items}
    assert all(watch.closed for slot, watch in watches.items() if slot not in open_slots)
    assert all(watch.closed for watch in watches.values())  # closed with the link


@given(OPS)
def test_a_link_delivers_each_slot_its_events_then_one_end_and_nothing_after(
    ops: list[tuple[str, int, bytes]],
) -> None:
    """Any interleaving of attaches (past the limit too), events, ends, refusals, detaches and
    takes: each slot gets what its Watch yielded, in order, then its end once; a detached slot
    gets nothing more and no end; every Watch is closed once its slot is over."""
    asyncio.run(_run_program(ops))
