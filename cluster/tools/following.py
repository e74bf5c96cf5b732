"""Which scheduler `mscluster status --watch` asks: the leader, among every address it was given.

It asks the scheduler that answered last on one open channel. When that one stops answering
or stands by (its lease was lost, or it handed the job over), it asks the others in turn
(`status.fetch_any`: a standby's answer names the leader, asked next) and, once another
scheduler answers as the leader, follows that one from then on and says so in one line. The
event stream follows the same address (`address`, read at each reconnection); `mscluster
events --addr` makes the same moves on its own (`cluster.tools.events.from_scheduler`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from cluster.protocol.errors import NotLeaderAnswer, SchedulerUnreachableError
from cluster.tools import reading, status
from cluster.tools.status import JobView
from cluster.transport import channel as scheduler_channel
from cluster.transport import tls

# How often a channel reconnects while its scheduler is away (first, most; ms).
RECONNECT_MS = (100, 1000)


def moved(address: str, before: str, why: SchedulerUnreachableError) -> str:
    """The line that says a reader follows the leader at `address` now, and why it left the
    scheduler at `before`."""
    said = "stands by" if isinstance(why, NotLeaderAnswer) else "does not answer"
    return f"following the leader at {address} (the scheduler at {before} {said})"


class Following:
    def __init__(
        self,
        addresses: list[str],
        identity: tls.Identity | None,
        say: Callable[[str], None],
        *,
        timeout_s: float = status.STATUS_TIMEOUT_S,
        secret: reading.Secret = reading.FROM_ENV,
    ) -> None:
        """`secret`: what proves this reader (`cluster.tools.reading`)."""
        self.addresses = list(addresses)
        self.address = self.addresses[0]  # the scheduler followed now
        self._identity = identity
        self.say = say  # where a move is said
        self._timeout_s = timeout_s
        self.secret = reading.resolve(secret)
        self._channel: Any = None

    def _opened(self) -> Any:
        if self._channel is None:
            options = scheduler_channel.reconnect_options(*RECONNECT_MS)
            self._channel = scheduler_channel.open_channel(self.address, self._identity, options)
        return self._channel

    async def fetch(self) -> JobView:
        """The leader's view; SchedulerUnreachableError when no scheduler answers as the leader."""
        try:
            return await status.fetch_checked(
                self._opened(), self.address, self._identity, self._timeout_s, self.secret
            )
        except SchedulerUnreachableError as exc:
            if len(self.addresses) == 1:
                raise
            named = exc.leader if isinstance(exc, NotLeaderAnswer) and exc.leader else None
            others = [a for a in self.addresses if a != self.address]
            order = [*([named] if named else []), *others, self.address]
            view = await status.fetch_any(order, self._identity, self._timeout_s, self.secret)
            await self._follow(view.address, exc)
            return view

    async def _follow(self, address: str, why: SchedulerUnreachableError) -> None:
        if address == self.address:
            return
        before, self.address = self.address, address
        await self.close()
        self.say(moved(address, before, why))

    async def close(self) -> None:
        opened, self._channel = self._channel, None
        if opened is not None:
            with contextlib.suppress(Exception):
                await opened.close()
