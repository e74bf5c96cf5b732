"""The scheduler's open Watch streams: one mailbox per stream, and heartbeats for the idle ones.

A large job holds one stream per node for its whole life, so what a stream costs while it waits
matters: 1024 streams that each wait on `asyncio.wait_for(queue.get(), interval)` create a task
and a timer per message and per heartbeat. Here a stream waits on one future, and one sweep
(`Streams.idle`, run by the scheduler's monitor) finds the streams that have been quiet for a
heartbeat interval, in time proportional to the number it finds: streams are kept in the order
of their last message.

Messages are events already serialized (a broadcast is serialized once, not once per stream);
the servicer's serializer passes the bytes through.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from cluster.protocol.errors import NotLeaderError
from cluster.scheduler.machine import state


class Superseded:
    """Why a stream ends: its node opened a newer one (see `Streams.open`)."""


SUPERSEDED = Superseded()
# An event to write, or why the stream ends: its node was evicted, this scheduler no longer
# leads the job, or the node opened a newer stream.
Item = bytes | state.Evict | NotLeaderError | Superseded
Key = tuple[str, int]  # (canonical node id, incarnation)


class Mailbox:
    """What is waiting to be written to one stream."""

    __slots__ = ("_items", "_waiter", "last_put")

    def __init__(self, now: float) -> None:
        self._items: collections.deque[Item] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self.last_put = now

    def put(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Streams:
    """The open streams by node, oldest last message first."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._mailboxes: dict[Key, Mailbox] = {}

    def __len__(self) -> int:
        return len(self._mailboxes)

    def open(self, key: Key) -> Mailbox:
        """A new stream of the node `key`, which replaces its old one: that one ends at once.
        Should the node still read the old one (an attempt it gave up on reached the scheduler
        after its newer one, over another connection), it registers again, rather than wait on
        a stream nothing is written to until its silence limit."""
        old = self._mailboxes.pop(key, None)
        if old is not None:
            old.put(SUPERSEDED)
        mailbox = self._mailboxes[key] = Mailbox(self._clock())
        return mailbox

    def close(self, key: Key, mailbox: Mailbox) -> bool:
        """Forget `mailbox`; False when the node has opened a newer stream since (then nothing
        is closed)."""
        if self._mailboxes.get(key) is not mailbox:
            return False
        del self._mailboxes[key]
        return True

    def get(self, key: Key) -> Mailbox | None:
        return self._mailboxes.get(key)

    def put(self, key: Key, item: Item) -> None:
        mailbox = self._mailboxes.get(key)
        if mailbox is not None:
            self._put(key, mailbox, item, self._clock())

    def broadcast(self, item: Item) -> None:
        now = self._clock()
        for mailbox in self._mailboxes.values():
            mailbox.put(item)
            mailbox.last_put = now
        # Every stream just had a message: the order by last message is unchanged.

    def idle(self, interval_s: float, heartbeat: Item) -> None:
        """Send `heartbeat` to every stream that has had no message for `interval_s`."""
        now = self._clock()
        due: list[tuple[Key, Mailbox]] = []
        for key, mailbox in self._mailboxes.items():
            if now - mailbox.last_put < interval_s:
                break  # the rest are newer
            due.append((key, mailbox))
        for key, mailbox in due:
            self._put(key, mailbox, heartbeat, now)

    def _put(self, key: Key, mailbox: Mailbox, item: Item, now: float) -> None:
        mailbox.put(item)
        mailbox.last_put = now
        del self._mailboxes[key]  # to the end: the newest
        self._mailboxes[key] = mailbox
