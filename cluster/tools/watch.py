"""`mscluster status --watch`: the status table, refreshed until the job ends.

On a terminal the table is redrawn in place (rich), and what changed since the last refresh is
highlighted; it fits the terminal (`Fitted`): the nodes that need a look first, a line that
counts them and the rows left out, and columns left out before a node id is cut. Otherwise (a
pipe, a file, a CI log) it prints the table once, then one line per change with the time, and
the table again at the end. `changes` (pure) decides what changed:
the job's phase, generation, rollback step and registrations, and per node its rank, state,
stream, incarnation, restarts and newest checkpoint; heartbeat ages move at every refresh and
are shown, not reported.

It refreshes at once when the scheduler reports an event (its WatchEvents stream), so it also
learns of the job's end when the scheduler exits right after it; a stream that fails (refused,
cut, its scheduler away) is opened again. A scheduler that stops answering (a restart) is said
once and asked again, for up to `events.RECONNECT_S` (as `mscluster events --follow --addr`):
then the watch says so in one line and exits 1, the job's end unknown. The watch ends when the
job has ended: exit 0 when it finished, 1 when it failed (or when nothing answered at first,
or for RECONNECT_S since); 130 on Ctrl-C. When its event told the end and the scheduler exited
before a poll saw it, the last table is the last answer as the end leaves it (`ended_view`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import io
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import IO

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cluster.protocol.display import listed, safe
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
# The range of --interval: a shorter one would have the view ask the scheduler back to back.
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 86400.0
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


# The table's columns, each with the field of `changes` it shows (None: none).
COLUMNS: dict[str, str | None] = {
    "rank": "rank",
    "node id": None,
    "address": None,
    "state": "state",
    "stream": "connected",
    "heartbeat": None,
    "incarnation": "incarnation",
    "restarts": "restarts",
    "checkpoint": "checkpoint",
}
# Left out, in this order, while the table is wider than the terminal: the least telling first.
# Rank, node id and state always stay, whole (a node id too long for the terminal folds).
LEFT_OUT_FIRST = ("stream", "restarts", "incarnation", "heartbeat", "checkpoint", "address")
_ORDER_OF_STATES = ("failed", "alive", "finished")
_FOLD_MIN = 8  # the narrowest a folded node id column gets


def _cells(node: NodeView) -> dict[str, str]:
    values = _node_values(node)
    return {
        "rank": values["rank"],
        "node id": shown(node.node_id),
        "address": shown(node.address),
        "state": values["state"],
        "stream": values["connected"],
        "heartbeat": f"{node.seconds_since_heartbeat:.1f} s",
        "incarnation": values["incarnation"],
        "restarts": values["restarts"],
        "checkpoint": values["checkpoint"],
    }


def ordered(nodes: tuple[NodeView, ...], changed: list[Change]) -> list[NodeView]:
    """The nodes that need a look first: failed, then alive without a stream, then those that
    changed since the last refresh, then the rest; in rank order within each."""
    moved = {c.node_id for c in changed if c.node_id is not None}

    def concern(node: NodeView) -> int:
        if node.state == "failed":
            return 0
        if node.state == "alive" and not node.connected:
            return 1
        return 2 if node.node_id in moved else 3

    return sorted(nodes, key=concern)


def summary(nodes: tuple[NodeView, ...], hidden: int = 0) -> str:
    """The nodes counted by state ("3 failed, 37 alive"), and the rows left out."""
    counts = collections.Counter(node.state for node in nodes)
    states = [*_ORDER_OF_STATES, *sorted(set(counts) - set(_ORDER_OF_STATES))]
    said = ", ".join(f"{counts[s]} {shown(s)}" for s in states if counts[s]) or "no nodes yet"
    unstreamed = sum(node.state == "alive" and not node.connected for node in nodes)
    if unstreamed:
        said += f" ({unstreamed} without a stream)"
    return said + (f"; {hidden} rows not shown" if hidden else "")


def _fitted(rows: list[dict[str, str]], width: int | None) -> dict[str, int]:
    """The columns to show in `width` (None: all), each with its width: as wide as its widest
    cell, but the node id's when even the fewest columns are too wide (it folds)."""
    natural = {c: max([cell_len(c), *(cell_len(row[c]) for row in rows)]) for c in COLUMNS}

    def needs(columns: dict[str, int]) -> int:  # each with a space either side and a rule
        return sum(w + 3 for w in columns.values()) + 1

    for column in LEFT_OUT_FIRST:
        if width is None or needs(natural) <= width:
            return natural
        del natural[column]
    if width is not None and needs(natural) > width:
        natural["node id"] = max(width - needs(natural) + natural["node id"], _FOLD_MIN)
    return natural


def table(
    view: JobView,
    changed: list[Change],
    note: str = "",
    *,
    width: int | None = None,
    height: int | None = None,
) -> Table:
    """The status as a rich table, the changed cells highlighted, the nodes that need a look
    first (`ordered`), under a line that counts them (`summary`). Fitted to a terminal of
    `width` x `height` (None: any): the least telling columns left out (LEFT_OUT_FIRST) and the
    rows past its height, which the summary counts; node ids and addresses are never cut."""
    nodes = ordered(view.nodes, changed)
    rows = [_cells(node) for node in nodes]
    columns = _fitted(rows, width)
    shown_rows = len(rows)
    if height is not None:
        shown_rows = _rows_fitting(view, columns, rows, width, height, note)
    said = summary(view.nodes, len(rows) - shown_rows)
    grid = _grid(view, changed, note, said, columns, _folds(rows, columns))
    marked = {(c.node_id, c.field) for c in changed}
    for node, cells in zip(nodes[:shown_rows], rows[:shown_rows], strict=True):
        grid.add_row(
            *(
                Text(cells[c], style=HIGHLIGHT if (node.node_id, COLUMNS[c]) in marked else "")
                for c in columns
            )
        )
    return grid


def _grid(
    view: JobView,
    changed: list[Change],
    note: str,
    said: str,
    columns: dict[str, int],
    folds: bool,
) -> Table:
    """The table without its rows: the job in its title, then the summary line `said`; the
    `columns` as wide as they say (a node id that does not fit folds)."""
    marked = {(c.node_id, c.field) for c in changed}
    title = Text(f"job {shown(view.cluster_id)} at {shown(view.address)}: ")
    for name, value in _job_values(view).items():
        title.append(f"{name.replace('_', ' ')} ")
        title.append(value, style=HIGHLIGHT if (None, name) in marked else "bold")
        title.append("  ")
    if note:
        title.append(shown(note), style="bold red")
    failed = any(node.state == "failed" for node in view.nodes)
    title.append("\n" + said, style="bold red" if failed else "bold")
    caption = Text(shown(view.detail)) if view.detail else None  # Text: no rich markup in it
    grid = Table(title=title, title_justify="left", caption=caption)
    for column, wide in columns.items():
        if column == "node id" and folds:  # never cut: folded when it must be
            grid.add_column(column, min_width=wide, max_width=wide, overflow="fold")
        else:
            grid.add_column(column, no_wrap=True, min_width=wide)
    return grid


def _folds(rows: list[dict[str, str]], columns: dict[str, int]) -> bool:
    """Whether a node id is wider than its column (`_fitted`)."""
    return any(cell_len(row["node id"]) > columns["node id"] for row in rows)


class Fitted:
    """The `table` of `view`, fitted to the console that draws it, as it is then (a terminal
    may have been resized): as wide as it is, and no higher."""

    def __init__(self, view: JobView, changed: list[Change], note: str = "") -> None:
        self.view, self.changed, self.note = view, changed, note

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, height = options.max_width, options.size.height
        yield table(self.view, self.changed, self.note, width=width, height=height)


def _rows_fitting(
    view: JobView,
    columns: dict[str, int],
    rows: list[dict[str, str]],
    width: int | None,
    height: int,
    note: str,
) -> int:
    """How many of `rows` fit in `height` lines under the title, the header and the caption
    (measured with the longest summary it may have), a row a line (a folded node id: more)."""
    said = summary(view.nodes, len(rows))
    empty = _grid(view, [], note, said, columns, _folds(rows, columns))
    measuring = Console(file=io.StringIO(), width=width or 1000, height=height)
    room = height - len(measuring.render_lines(empty, pad=False))
    for count, row in enumerate(rows):
        room -= max(-(-cell_len(row["node id"]) // columns["node id"]), 1)
        if room < 0:
            return count
    return len(rows)


def lines(found: list[Change]) -> list[str]:
    """The changes as lines: the job's one each, and the nodes' that changed alike (the same
    field from the same value to the same value) together in one."""
    out = [c.describe() for c in found if c.node_id is None]
    alike: dict[tuple[str, str, str], list[str]] = {}
    for c in found:
        if c.node_id is not None:
            alike.setdefault((c.field, c.before, c.after), []).append(c.node_id)
    for (name, before, after), ids in alike.items():
        named = listed(map(shown, ids), 8)
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
        self._ended_at = 0.0  # when it came (time.monotonic)
        self._seen_at = 0.0  # when `view` came
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
                        self._ended_at = time.monotonic()
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
        self.view, self._seen_at = view, time.monotonic()
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
                    screen.update(Fitted(view, found, self._moved), refresh=True)
                    if view.phase in _OVER:
                        return self._code(view)
                elif self.ended is not None:
                    screen.update(self._last_frame(self.ended), refresh=True)
                    return self._code(None)
                elif self.view is not None:
                    screen.update(Fitted(self.view, [], "scheduler not answering"), refresh=True)
                await self._pause()

    def _last_frame(self, ended: Ended) -> Fitted | Text:
        """The job's end as the scheduler's event said it, its scheduler exited before a poll
        saw it: the last view (`ended_view`), what the end changed in it highlighted, or the
        ending alone when no poll answered at all."""
        if self.view is None:
            return Text(shown(self._ending()), style="bold red")
        last = ended_view(self.view, ended, self._ended_at - self._seen_at)
        return Fitted(last, changes(self.view, last), self._ending())


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
    if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:  # also refuses nan
        raise ConfigError(
            f"--interval {interval_s:g} is out of range: it must be a number of seconds from "
            f"{MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} (each view asks the scheduler once)"
        )
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


def ended_view(view: JobView, ended: Ended, before_s: float) -> JobView:
    """`view`, the scheduler's last answer, `before_s` before the job's end `ended` came and
    its scheduler exited: in the phase the job ended in; no node has a stream (the scheduler is
    gone), and when it finished, every node that held a rank and was alive has finished (the
    scheduler finishes a job only then); the rest as last answered, which its caption says."""

    def after(node: NodeView) -> NodeView:
        done = ended.ok and node.state == "alive" and not node.spare
        return dataclasses.replace(node, state="finished" if done else node.state, connected=False)

    word = "finished" if ended.ok else "failed"
    return dataclasses.replace(
        view,
        phase=Phase.FINISHED if ended.ok else Phase.FAILED,
        detail=f"the scheduler's last answer {max(before_s, 0.0):.1f} s before the job {word}; "
        "it has exited since",
        nodes=tuple(after(node) for node in view.nodes),
    )


def _ended(event: JobEvent) -> Ended:
    """The job's last event, read typed; one whose detail is damaged still ends the watch."""
    try:
        view = event.typed()
    except EventFieldError:
        view = None
    return view if isinstance(view, Ended) else Ended(event.kind == "finished", "")
