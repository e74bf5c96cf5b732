"""`mscluster status --watch`: the status table, refreshed until the job ends.

On a terminal the table is redrawn in place (rich), and what changed since the last refresh is
highlighted. Otherwise (a pipe, a file, a CI log) it prints the table once, then one line per
change with the time, and the table again at the end. `changes` (pure) decides what changed:
the job's phase, generation, rollback step and registrations, and per node its rank, state,
stream, incarnation, restarts and newest checkpoint; heartbeat ages move at every refresh and
are shown, not reported.

It refreshes at once when the scheduler reports an event (its WatchEvents stream), so it also
learns of the job's end when the scheduler exits right after it; a stream that fails (refused,
cut, its scheduler away) is opened again. A scheduler that stops answering (a restart) is said
once and asked again, for up to `events.RECONNECT_S` (as `mscluster events --follow --addr`):
then the watch says so in one line and exits 1, the job's end unknown. The watch ends when the
job has ended: exit 0 when it finished, 1 when it failed (or when nothing answered at first,
or for RECONNECT_S since); 130 on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cluster.protocol.display import safe
from cluster.protocol.errors import (
    ClusterError,
    ConfigError,
    EventFieldError,
    SchedulerUnreachableError,
)
from cluster.protocol.events import Ended, JobEvent
from cluster.protocol.records import Phase
from cluster.tools import events, reading, status
from cluster.tools.events import FINAL
from cluster.tools.following import Following
from cluster.tools.status import JobView, NodeView, shown
from cluster.transport import tls

JOB_FIELDS = ("phase", "generation", "rollback_step", "registered")
NODE_FIELDS = ("rank", "state", "connected", "incarnation", "restarts", "checkpoint")
HIGHLIGHT = "bold black on yellow"
# The least time between two opens of the event stream (a refused one is opened again after it).
RESTART_S = 1.0
_OVER = (Phase.FINISHED, Phase.FAILED)


@dataclass(frozen=True)
class Change:
    node_id: str | None  # None: the job itself
    field: str
    before: str
    after: str

    def describe(self) -> str:
        who = "job" if self.node_id is None else f"node {shown(self.node_id)}"
        return f"{who}: {self.field} {shown(self.before)} -> {shown(self.after)}"


def _job_values(view: JobView) -> dict[str, str]:
    return {
        "phase": view.phase.value,
        "generation": str(view.generation),
        "rollback_step": str(view.rollback_step),
        "registered": f"{view.registered}/{view.expected}",
    }


def _node_values(node: NodeView) -> dict[str, str]:
    return {
        "rank": "-" if node.rank is None else str(node.rank),
        "state": shown(node.state),
        "connected": "yes" if node.connected else "no",
        "incarnation": f"{node.incarnation:x}",
        "restarts": str(node.restarts),
        "checkpoint": str(node.checkpoints[-1]) if node.checkpoints else "-",
    }


def changes(before: JobView | None, after: JobView) -> list[Change]:
    """What differs from `before` to `after` (nothing on the first view), job first, then the
    nodes in the order of `after`; a node that left is a change of its state to "gone"."""
    if before is None:
        return []
    found = [
        Change(None, name, old, new)
        for (name, old), new in zip(
            _job_values(before).items(), _job_values(after).values(), strict=True
        )
        if old != new
    ]
    previous = {n.node_id: _node_values(n) for n in before.nodes}
    for node in after.nodes:
        now = _node_values(node)
        was = previous.pop(node.node_id, None)
        if was is None:
            found.append(Change(node.node_id, "state", "new", now["state"]))
            continue
        found.extend(
            Change(node.node_id, k, was[k], now[k]) for k in NODE_FIELDS if was[k] != now[k]
        )
    found.extend(
        Change(node_id, "state", was["state"], "gone") for node_id, was in previous.items()
    )
    return found


def table(view: JobView, changed: list[Change], note: str = "") -> Table:
    """The status as a rich table, the changed cells highlighted."""
    marked = {(c.node_id, c.field) for c in changed}
    title = Text(f"job {shown(view.cluster_id)} at {shown(view.address)}: ")
    for name, value in _job_values(view).items():
        title.append(f"{name.replace('_', ' ')} ")
        title.append(value, style=HIGHLIGHT if (None, name) in marked else "bold")
        title.append("  ")
    if note:
        title.append(shown(note), style="bold red")
    caption = Text(shown(view.detail)) if view.detail else None  # Text: no rich markup in it
    grid = Table(title=title, title_justify="left", caption=caption)
    for column in (
        "rank",
        "node id",
        "address",
        "state",
        "stream",
        "heartbeat",
        "incarnation",
        "restarts",
        "checkpoint",
    ):
        grid.add_column(column)
    for node in view.nodes:
        values = _node_values(node)
        cells = [
            values["rank"],
            shown(node.node_id),
            shown(node.address),
            values["state"],
            values["connected"],
            f"{node.seconds_since_heartbeat:.1f} s",
            values["incarnation"],
            values["restarts"],
            values["checkpoint"],
        ]
        keys = (
            "rank",
            None,
            None,
            "state",
            "connected",
            None,
            "incarnation",
            "restarts",
            "checkpoint",
        )
        grid.add_row(
            *(
                Text(cell, style=HIGHLIGHT if key and (node.node_id, key) in marked else "")
                for cell, key in zip(cells, keys, strict=True)
            )
        )
    return grid


def lines(found: list[Change]) -> list[str]:
    """The changes as lines: the job's one each, and the nodes' that changed alike (the same
    field from the same value to the same value) together in one."""
    out = [c.describe() for c in found if c.node_id is None]
    alike: dict[tuple[str, str, str], list[str]] = {}
    for c in found:
        if c.node_id is not None:
            alike.setdefault((c.field, c.before, c.after), []).append(c.node_id)
    for (name, before, after), ids in alike.items():
        named = ", ".join(map(shown, ids[:8])) + (
            f" and {len(ids) - 8} more" if len(ids) > 8 else ""
        )
        who = f"node {named}" if len(ids) == 1 else f"nodes {named}"
        out.append(f"{who}: {name} {shown(before)} -> {shown(after)}")
    return out


class Watcher:
    """Shows the scheduler's status on `out` every `interval_s`, and at once when an event
    comes (`follow`: the scheduler's events), until the job has ended."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[JobView]],
        follow: Callable[[], AsyncIterator[JobEvent]],
        out: IO[str],
        *,
        interval_s: float,
        terminal: bool,
        reconnect_s: float = events.RECONNECT_S,
    ) -> None:
        """`reconnect_s`: how long a scheduler that does not answer is asked again before the
        watch gives up (SchedulerUnreachableError)."""
        self._fetch = fetch
        self._follow = follow
        self.out = out
        self.interval_s = interval_s
        self.terminal = terminal
        self.reconnect_s = reconnect_s
        self.view: JobView | None = None
        self.ended: Ended | None = None  # the job's last event, once seen
        self._lost_at: float | None = None  # when the scheduler stopped answering
        self._moved = ""  # the last move to another scheduler, not shown yet on a terminal
        self._wake = asyncio.Event()

    def say(self, text: str) -> None:
        """One line about the watch itself (it follows another scheduler now)."""
        self._moved = text
        self._line(text)

    async def run(self) -> int:
        """0 once the job has finished, 1 once it has failed."""
        follower = asyncio.create_task(self._events())
        try:
            return await (self._live() if self.terminal else self._plain())
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    async def _events(self) -> None:
        """The scheduler's events until the job's last, the stream opened again (after
        RESTART_S) whenever it fails: refused (CLUSTER_MAX_FOLLOWERS), cut, or its scheduler
        away for `events.RECONNECT_S`. The poll says whether the scheduler answers."""
        while True:
            with contextlib.suppress(ClusterError):
                async for event in self._follow():
                    if event.kind in FINAL:
                        self.ended = _ended(event)
                    self._wake.set()
                    if self.ended is not None:
                        return
            await asyncio.sleep(max(RESTART_S, self.interval_s))

    async def _poll(self) -> tuple[JobView, list[Change]] | None:
        """The next view and what changed, or None while the scheduler does not answer."""
        try:
            view = await self._fetch()
        except SchedulerUnreachableError as exc:
            if self.ended is not None:  # after the job's end: it has exited
                return None
            now = time.monotonic()
            if self._lost_at is None:
                self._lost_at = now
                self._line(f"scheduler not answering: {exc}")
            elif now - self._lost_at >= self.reconnect_s:
                raise SchedulerUnreachableError(
                    f"the scheduler has not answered for {now - self._lost_at:.0f} s, so the "
                    f"watch stops; the job's end is unknown (last: {exc})"
                ) from None
            return None
        if self._lost_at is not None:
            self._lost_at = None
            if not self._moved:  # a move said it already
                self._line("scheduler answering again")
        if not self.terminal:
            self._moved = ""
        found = changes(self.view, view)
        self.view = view
        return view, found

    async def _pause(self) -> None:
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.interval_s)

    def _code(self, view: JobView | None) -> int:
        if view is not None and view.phase in _OVER:
            return 0 if view.phase is Phase.FINISHED else 1
        return 0 if self.ended is not None and self.ended.ok else 1

    def _ending(self) -> str:
        assert self.ended is not None
        return f"the job {'finished' if self.ended.ok else 'failed'}: {self.ended.detail}"

    def _line(self, text: str) -> None:
        if not self.terminal:
            stamp = datetime.datetime.now().strftime("%H:%M:%S")
            print(f"{stamp} {safe(text)}", file=self.out, flush=True)

    async def _plain(self) -> int:
        while True:
            first = self.view is None
            seen = await self._poll()
            if seen is not None:
                view, found = seen
                if first:
                    print(status.render(view), file=self.out, flush=True)
                for line in lines(found):
                    self._line(line)
                if view.phase in _OVER:
                    self._line(f"the job {view.phase.value}: {view.detail}")
                    print(status.render(view), file=self.out, flush=True)
                    return self._code(view)
            elif self.ended is not None:
                self._line(self._ending())
                return self._code(None)
            await self._pause()

    async def _live(self) -> int:
        with Live(console=Console(file=self.out), auto_refresh=False) as screen:
            while True:
                seen = await self._poll()
                if seen is not None:
                    view, found = seen
                    screen.update(table(view, found, self._moved), refresh=True)
                    if view.phase in _OVER:
                        return self._code(view)
                elif self.view is not None:
                    note = "scheduler not answering" if self.ended is None else self._ending()
                    screen.update(table(self.view, [], note), refresh=True)
                    if self.ended is not None:
                        return self._code(None)
                await self._pause()


def run(
    addresses: str | list[str],
    identity: tls.Identity | None,
    *,
    interval_s: float,
    out: IO[str],
    secret: reading.Secret = reading.FROM_ENV,
) -> int:
    """The whole command: 0 once the job has finished, 1 when it failed, when no scheduler
    answered at first, or when none answered for `events.RECONNECT_S` since. With several
    addresses it follows the leader among them. `secret`: what proves this reader
    (`cluster.tools.reading`)."""
    if not interval_s > 0:
        raise ConfigError(f"--interval {interval_s} must be a positive number of seconds")
    listed = [addresses] if isinstance(addresses, str) else list(addresses)

    async def main() -> int:
        said: list[str] = []
        following = Following(listed, identity, said.append, secret=secret)
        try:
            await following.fetch()  # nothing to watch: say so, exit 1
            said.clear()  # the first leader found is not a move
            watcher = Watcher(
                following.fetch,
                lambda: events.from_scheduler(
                    following.address,
                    identity,
                    follow=True,
                    where=lambda: following.address,
                    secret=following.secret,
                ),
                out,
                interval_s=interval_s,
                terminal=out.isatty(),
                reconnect_s=events.RECONNECT_S,
            )
            following.say = watcher.say
            return await watcher.run()
        finally:
            await following.close()

    try:
        return asyncio.run(main())
    except SchedulerUnreachableError as exc:
        print(f"mscluster: {safe(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _ended(event: JobEvent) -> Ended:
    """The job's last event, read typed; one whose detail is damaged still ends the watch."""
    try:
        view = event.typed()
    except EventFieldError:
        view = None
    return view if isinstance(view, Ended) else Ended(event.kind == "finished", "")
