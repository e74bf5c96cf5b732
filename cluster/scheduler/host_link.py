"""A host's link: the Watch streams of all of a relay's workers on the relay's one `HostWatch`
call.

Each worker's Watch ends at its relay, which attaches it to the link as a slot: the worker's own
request and call metadata. The servicer runs the slot as the Watch call it stands for (the same
admission, the same proof, the same refusals), with a `SlotContext` in place of the call's
context, and the events the slot yields are written by the link's one writer: an event that goes
to many slots (a broadcast, serialized once by the core) goes down once for all of them. A slot
ends with the status its Watch call would have ended with (`SlotEnd`), or, detached by the relay
(its worker went away), is cancelled as a call is when its node goes: the node's stream ends and
the core is told at once.

What a link costs the scheduler per worker is a task and its Watch coroutine, not a gRPC call,
an HTTP/2 stream and their buffers. No grpc and no wire here: the servicer parses and builds the
messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc

from cluster.protocol.value import frozen, mutable

# A metadatum as gRPC gives it: (key, value).
Metadatum = tuple[str, Any]

# What a link holds for its one writer at most before its slots and its reader wait for room
# (`HostLink.room`): items (an event for a slot, a slot's end) one a slot on average, and bytes
# as a follower may have waiting (`cluster.protocol.config.DEFAULT_FOLLOWER_MAX_BYTES`). An
# event shared by slots counts its bytes once; each item counts `ITEM_BYTES` for itself.
PENDING_BYTES = 4 * 1024 * 1024
ITEM_BYTES = 128
# How long a link, at the scheduler's stop, waits for its slots' ends to be written before it
# is closed (each slot's stream then ends as a cancelled call's).
END_S = 0.5


class SlotContext:
    """What the servicer's Watch reads from and tells its call, for one slot: the peer is the
    relay's connection, the metadata the worker's own; its end is recorded for `SlotEnd`."""

    __slots__ = ("_metadata", "_peer", "answer", "code", "details", "trailing")

    def __init__(self, peer: str, metadata: tuple[Metadatum, ...]) -> None:
        self._peer = peer
        self._metadata = metadata
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple[Metadatum, ...] = ()
        self.answer = b""  # a finish slot's answer, serialized

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[Metadatum, ...]:
        return self._metadata

    def set_trailing_metadata(self, trailing_metadata: Iterable[Metadatum], /) -> None:
        self.trailing = tuple(trailing_metadata)

    def set_code(self, code: grpc.StatusCode, /) -> None:
        self.code = code

    def set_details(self, details: str, /) -> None:
        self.details = details


@frozen
class SlotEnd:
    """How a slot's stream ended: what its Watch call would have ended with."""

    slot: int
    code: grpc.StatusCode
    details: str
    trailing: tuple[Metadatum, ...] = ()
    answer: bytes = b""


@mutable
class Down:
    """One message down the link: an event for `slots` (None: only ends), then `ended`."""

    slots: list[int]
    event: bytes | None
    ended: list[SlotEnd]


class HostLink:
    """The slots of one HostWatch call: a task per attached Watch, the events they yield queued
    for the call's one writer (`batches`), in order per slot, an event shared by slots sent once.
    At most `max_slots` at once: an attach past that ends at once, RESOURCE_EXHAUSTED.

    What waits for the writer is bounded (`max_pending` items, `max_bytes`): past either a slot
    waits for room before it takes its Watch's next event, as a Watch call waits for its reader,
    and so does the call's reader before it reads the relay's next message (`room`). A relay
    that does not read is not read: what the link holds for it stays about twice the bounds
    (what the writer took, and what came since) and a batch's ends and a slot's one event."""

    def __init__(
        self, max_slots: int, max_pending: int | None = None, max_bytes: int = PENDING_BYTES
    ) -> None:
        self.max_slots = max_slots
        self.max_pending = max_slots if max_pending is None else max_pending
        self.max_bytes = max_bytes
        self.waiting = 0  # the slots and readers that wait for room now
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._pending: list[tuple[int, bytes | SlotEnd]] = []
        self._bytes = 0
        self._held: set[int] = set()  # id() of the events in _pending
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def attach(self, slot: int, events: AsyncIterator[bytes], context: SlotContext) -> None:
        """Run the Watch `events` of `slot`; it ends with what `context` was told."""
        if slot in self._tasks:
            self.end(SlotEnd(slot, grpc.StatusCode.INVALID_ARGUMENT, f"slot {slot} is open"))
            return
        if len(self._tasks) >= self.max_slots:
            self.end(
                SlotEnd(
                    slot,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a host link carries at most {self.max_slots} Watch streams at once",
                )
            )
            return
        self._tasks[slot] = asyncio.ensure_future(self._run(slot, events, context))

    async def _run(self, slot: int, events: AsyncIterator[bytes], context: SlotContext) -> None:
        try:
            async for event in events:
                await self.room()
                self._put(slot, event)
        finally:
            self._tasks.pop(slot, None)
        self.end(SlotEnd(slot, context.code, context.details, context.trailing, context.answer))

    def detach(self, slot: int) -> None:
        """The relay's worker went away: its stream ends as a cancelled call's (nothing sent)."""
        task = self._tasks.pop(slot, None)
        if task is not None:
            task.cancel()

    def end(self, ended: SlotEnd) -> None:
        self._put(ended.slot, ended)

    def held(self) -> tuple[int, int]:
        """The items and bytes waiting for the writer."""
        return len(self._pending), self._bytes

    async def room(self) -> None:
        """Return when what waits for the writer is under its bounds, or the link is closed."""
        if self._closed or self._room.is_set():
            return
        self.waiting += 1
        try:
            await self._room.wait()
        finally:
            self.waiting -= 1

    def _put(self, slot: int, item: bytes | SlotEnd) -> None:
        self._pending.append((slot, item))
        self._bytes += ITEM_BYTES
        if isinstance(item, SlotEnd):
            self._bytes += len(item.details) + len(item.answer)
        elif id(item) not in self._held:
            self._held.add(id(item))
            self._bytes += len(item)
        if len(self._pending) >= self.max_pending or self._bytes >= self.max_bytes:
            self._room.clear()
        self._wake.set()

    def close(self) -> None:
        """The call ended: every slot's stream ends as a cancelled call's."""
        self._closed = True
        for task in list(self._tasks.values()):
            task.cancel()
        self._tasks.clear()
        self._wake.set()
        self._room.set()

    async def batches(self, done: asyncio.Future[None]) -> AsyncIterator[list[Down]]:
        """What to write, in batches, until the link is closed, or `done` (the relay half-closed
        its side) with no slot left open."""
        while True:
            if not self._pending:
                if self._closed or (done.done() and not self._tasks):
                    return
                self._wake.clear()
                waiting = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait((waiting, done), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                continue
            yield self.take()

    def take(self) -> list[Down]:
        """What is waiting to be written, as messages (`grouped`), taken."""
        pending, self._pending = self._pending, []
        self._bytes = 0
        self._held.clear()
        self._room.set()
        return grouped(pending)


def grouped(pending: list[tuple[int, bytes | SlotEnd]]) -> list[Down]:
    """`pending` as messages: one per distinct event (by identity: the core serializes a
    broadcast once), each slot's events in their order, the ends in the last message."""
    messages: list[Down] = []
    latest: dict[int, int] = {}  # id(event) -> the index of the last message that carries it
    last_of: dict[int, int] = {}  # slot -> the index of its last event's message
    ended: list[SlotEnd] = []
    for slot, item in pending:
        if isinstance(item, SlotEnd):
            ended.append(item)
            continue
        at = latest.get(id(item))
        if at is not None and last_of.get(slot, -1) < at:  # (equal: it is there already)
            messages[at].slots.append(slot)
        else:
            at = len(messages)
            messages.append(Down([slot], item, []))
            latest[id(item)] = at
        last_of[slot] = at
    if ended:
        if messages:
            messages[-1].ended.extend(ended)
        else:
            messages.append(Down([], None, ended))
    return messages
