"""`mscluster status --watch`: what changed between two views (pure), as lines and as
highlighted cells; and `mscluster events`' table and sources."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rich.console import Console
from rich.live import Live
from rich.text import Text

from cluster.protocol.errors import ConfigError, SchedulerUnreachableError
from cluster.protocol.events import JobEvent
from cluster.scheduler.machine.state import Phase
from cluster.tools import events, watch
from cluster.tools.status import JobView, NodeView
from cluster.tools.watch import HIGHLIGHT, Change, Watcher, changes, lines, table
from tests.aio import BOUND_S


def node(i: int, **changed: object) -> NodeView:
    base = NodeView(
        rank=i,
        node_id=str(i),
        role="worker",
        address=f"127.0.0.1:{6000 + i}",
        state="alive",
        connected=True,
        seconds_since_heartbeat=0.5,
        incarnation=0xA0 + i,
        restarts=0,
        checkpoints=(10, 20),
    )
    return dataclasses.replace(base, **changed)  # type: ignore[arg-type]


def view(*nodes: NodeView, **changed: object) -> JobView:
    base = JobView(
        address="127.0.0.1:8118",
        cluster_id="job-1",
        phase=Phase.READY,
        generation=1,
        worker_num=len(nodes),
        server_num=0,
        registered=len(nodes),
        recovery=True,
        uptime_s=3.0,
        detail="",
        nodes=tuple(nodes),
    )
    return dataclasses.replace(base, **changed)  # type: ignore[arg-type]


def test_the_first_view_and_an_unchanged_one_have_no_changes() -> None:
    first = view(node(0), node(1))
    assert changes(None, first) == []
    aged = view(node(0, seconds_since_heartbeat=4.0), node(1), uptime_s=9.0)
    assert changes(first, aged) == []  # ages and uptime move at every refresh


def test_a_failure_and_a_rejoin_are_the_changes_they_are() -> None:
    before = view(node(0), node(1), node(2))
    failed = view(node(0), node(1), node(2, state="failed", connected=False))
    assert changes(before, failed) == [
        Change("2", "state", "alive", "failed"),
        Change("2", "connected", "yes", "no"),
    ]
    back = view(
        node(0),
        node(1),
        node(2, incarnation=0xBEEF, restarts=1),
        generation=2,
        rollback_step=20,
    )
    assert changes(failed, back) == [
        Change(None, "generation", "1", "2"),
        Change(None, "rollback_step", "0", "20"),
        Change("2", "state", "failed", "alive"),
        Change("2", "connected", "no", "yes"),
        Change("2", "incarnation", "a2", "beef"),
        Change("2", "restarts", "0", "1"),
    ]


def test_nodes_that_come_and_go_and_the_newest_checkpoint() -> None:
    before = view(node(0), node(1), phase=Phase.WAITING, worker_num=3)
    after = view(node(0, checkpoints=(10, 20, 30)), node(2), phase=Phase.WAITING, worker_num=3)
    assert changes(before, after) == [
        Change("0", "checkpoint", "20", "30"),
        Change("2", "state", "new", "alive"),
        Change("1", "state", "alive", "gone"),
    ]


def test_lines_put_the_nodes_that_changed_alike_together() -> None:
    found = [
        Change(None, "generation", "1", "2"),
        *(Change(str(i), "checkpoint", "20", "30") for i in range(10)),
        Change("3", "state", "alive", "failed"),
    ]
    assert lines(found) == [
        "job: generation 1 -> 2",
        "nodes 0, 1, 2, 3, 4, 5, 6, 7 and 2 more: checkpoint 20 -> 30",
        "node 3: state alive -> failed",
    ]


def test_the_table_highlights_exactly_the_changed_cells() -> None:
    before = view(node(0), node(1))
    after = view(node(0), node(1, state="failed", connected=False), generation=2)
    grid = table(after, changes(before, after))
    styled = {
        (column.header, str(cell))
        for column in grid.columns
        for cell in column._cells
        if getattr(cell, "style", "") == HIGHLIGHT
    }
    assert styled == {("state", "failed"), ("stream", "no")}
    title = grid.title
    assert isinstance(title, Text)
    assert [span.style for span in title.spans if span.style == HIGHLIGHT] == [HIGHLIGHT]
    out = io.StringIO()
    Console(file=out, width=160).print(grid)
    assert "job job-1 at 127.0.0.1:8118" in out.getvalue()
    assert "failed" in out.getvalue()


# -- mscluster events: the table and its sources -----------------------------------------------


def test_an_event_row_names_who_and_shows_the_rest() -> None:
    failed = JobEvent(
        5,
        1_700_000_000.0,
        "failed",
        {"rank": 2, "node_id": "2", "cause": "stream_broken", "reason": "it broke"},
    )
    row = events.row(failed)
    assert row.split()[1:5] == ["failed", "rank", "2", "cause=stream_broken"]
    assert row.endswith('reason="it broke"')
    refused = JobEvent(6, 1_700_000_001.0, "guard_refusal", {"node_id": "2", "retry_after_s": 1.5})
    assert "node 2" in events.row(refused)
    assert events.HEADER.split() == ["time", "event", "who", "details"]


def test_a_file_that_is_not_an_event_log_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.log"
    path.write_text("cluster[scheduler]: listening on 127.0.0.1:8118 for 2 workers\n")
    with pytest.raises(ConfigError, match="is not an event log"):
        list(events.from_file(path, follow=False))
    with pytest.raises(ConfigError, match=r"no event log at .*missing.jsonl"):
        list(events.from_file(tmp_path / "missing.jsonl", follow=False))


def test_a_missing_log_names_the_event_logs_below_it(tmp_path: Path) -> None:
    """A job that spans hosts keeps each host's part in logs/node<R>/, a Slurm step in
    logs/<job>.<step>/: the default logs/events.jsonl is not there, and the refusal names
    where event logs are, the newest first."""
    logs = tmp_path / "logs"
    path = logs / "events.jsonl"
    line = JobEvent(1, 1.0, "formed", {"generation": 1}).to_json() + "\n"
    (logs / "node0").mkdir(parents=True)
    (logs / "node0" / "events.jsonl").write_text(line)
    with pytest.raises(ConfigError) as one:
        list(events.from_file(path, follow=False))
    assert str(one.value).endswith(
        f"; one lies below it, in {logs / 'node0'}: give --log-dir {logs / 'node0'}"
    )
    for age, step in enumerate(("12.0/node0", "12.0/node1", "13.0")):  # newer than node0
        (logs / step).mkdir(parents=True)
        (logs / step / "events.jsonl").write_text(line)
        os.utime(logs / step / "events.jsonl", (2e9 - age, 2e9 - age))
    with pytest.raises(ConfigError) as several:
        list(events.from_file(path, follow=False))
    assert str(several.value).endswith(
        f"; event logs lie below it, in {logs / '12.0/node0'}, {logs / '12.0/node1'}, "
        f"{logs / '13.0'} and 1 more (newest first): give one as --log-dir"
    )


def test_a_followed_file_ends_with_the_jobs_last_event(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines_ = [
        JobEvent(1, 1.0, "formed", {"generation": 1}).to_json(),
        "a torn line",
        JobEvent(2, 2.0, "finished", {"detail": "done"}).to_json(),
        JobEvent(3, 3.0, "nodes_back", {"seconds": 0.1}).to_json(),  # after the end
    ]
    path.write_text("\n".join(lines_) + "\n")
    kinds = [e.kind for e in events.from_file(path, follow=True, poll_s=0.01)]
    assert kinds == ["formed", "finished"]


# -- the watch's event stream ------------------------------------------------------------------


async def test_a_watch_opens_its_failed_event_stream_again_and_ends_with_the_job() -> None:
    """The stream refused (CLUSTER_MAX_FOLLOWERS reached: `from_scheduler` fails at once) is
    opened again, and brings the job's end, which the polls never show: the scheduler answers
    with the job running, then, once it has sent the end, exits."""
    opened: list[int] = []

    async def fetch() -> JobView:
        if len(opened) == 2:
            raise SchedulerUnreachableError("no scheduler answers at x")
        return view(node(0), node(1))

    async def follow() -> AsyncIterator[JobEvent]:
        opened.append(len(opened))
        if len(opened) == 1:
            raise SchedulerUnreachableError("the scheduler at x refused: too many followers")
        yield JobEvent(9, 9.0, "finished", {"detail": "all done"})

    out = io.StringIO()
    watcher = Watcher(fetch, follow, out, interval_s=0.01, terminal=False)
    assert await asyncio.wait_for(watcher.run(), watch.RESTART_S + BOUND_S) == 0
    assert len(opened) == 2


# -- the table on a terminal: rows that need a look first, fitted to its size -------------------


def drawn(shown: JobView, before: JobView, width: int, height: int) -> list[str]:
    """The lines a terminal of `width` x `height` shows of the watch's table (as `_live`)."""
    out = io.StringIO()
    terminal = Console(file=out, width=width, height=height, force_terminal=True, color_system=None)
    with Live(console=terminal, auto_refresh=False) as screen:
        screen.update(watch.Fitted(shown, changes(before, shown)), refresh=True)
        text = out.getvalue()
    return text.replace("\x1b[?25l", "").rstrip("\n").split("\n")


def test_a_failed_node_of_many_is_shown_and_counted_on_a_short_terminal() -> None:
    """40 nodes on 24 rows: rank 33 failed comes first, and the rows left out are counted."""
    nodes = [node(i, checkpoints=(100,)) for i in range(40)]
    before = view(*nodes)
    failed = view(
        *nodes[:33], node(33, state="failed", connected=False, checkpoints=(100,)), *nodes[34:]
    )
    screen = drawn(failed, before, 100, 24)
    assert len(screen) <= 24
    assert screen[-1].startswith("└")  # the whole table: no "..." for rows cut by the terminal
    rows = [line for line in screen if line.startswith("│")]
    assert rows[0].split("│")[1].strip() == "33"
    assert "failed" in rows[0]
    assert f"1 failed, 39 alive; {40 - len(rows)} rows not shown" in [s.strip() for s in screen]


def test_ids_and_addresses_are_whole_on_an_80_column_terminal() -> None:
    nodes = [
        node(i, node_id=f"trainer-node-{i:03d}.example", address=f"10.0.0.{i}:{6000 + i}")
        for i in range(3)
    ]
    shown = view(*nodes)
    for width in (80, 60):
        screen = "\n".join(drawn(shown, shown, width, 24))
        assert "…" not in screen, screen
        for n in nodes:
            assert f" {n.node_id} " in screen, screen
        assert all(f" {n.address} " in screen for n in nodes) or width < 80, screen
        assert all(len(line) <= width for line in screen.split("\n"))


def test_a_node_id_wider_than_the_terminal_folds_whole() -> None:
    long_id = "trainer-node-033.example.with.a.very.long.domain.name.of.the.cluster"
    screen = drawn(view(node(0, node_id=long_id)), view(node(0, node_id=long_id)), 40, 24)
    cells = "".join(line.split("│")[2].strip() for line in screen if line.startswith("│"))
    assert cells == long_id
    assert all(len(line) <= 40 for line in screen)


def test_rows_that_need_a_look_come_first() -> None:
    before = view(node(0), node(1), node(2), node(3))
    after = view(
        node(0),
        node(1, checkpoints=(10, 20, 30)),
        node(2, connected=False),
        node(3, state="failed", connected=False),
    )
    assert [n.rank for n in watch.ordered(after.nodes, changes(before, after))] == [3, 2, 1, 0]
    assert (
        watch.summary(after.nodes, 2) == "1 failed, 3 alive (1 without a stream); 2 rows not shown"
    )


# -- the last frame on a terminal when the scheduler exited before a poll saw the end -----------


class Terminal(io.StringIO):
    """What the watch draws on: a terminal (rich draws its frames in place on it)."""

    def isatty(self) -> bool:
        return True


def last_frame(out: str) -> list[str]:
    """The lines of the last frame `Live` drew on a terminal: after its last erase, no styles."""
    frame = out.rsplit("\x1b[2K", 1)[-1]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame)
    return [line.rstrip() for line in plain.replace("\r", "").split("\n") if line.strip()]


async def watched_to_an_end_no_poll_saw(kind: str, detail: str, *nodes: NodeView) -> list[str]:
    """The last frame of a watch on a 160 x 24 terminal whose polls answer `nodes` in a ready
    job until the scheduler sent the job's last event (`kind`), then fail: it has exited."""
    fetched = asyncio.Event()
    sent = False

    async def fetch() -> JobView:
        if sent:
            raise SchedulerUnreachableError("no scheduler answers at 127.0.0.1:8118")
        fetched.set()
        return view(*nodes)

    async def follow() -> AsyncIterator[JobEvent]:
        nonlocal sent
        await fetched.wait()
        sent = True
        yield JobEvent(9, 9.0, kind, {"detail": detail})

    out = Terminal()
    watcher = Watcher(fetch, follow, out, interval_s=BOUND_S, terminal=True)
    code = await asyncio.wait_for(watcher.run(), BOUND_S)
    assert code == (0 if kind == "finished" else 1)
    return last_frame(out.getvalue())


@pytest.fixture
def terminal_160x24(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("LINES", "24")


@pytest.mark.usefixtures("terminal_160x24")
async def test_the_last_frame_of_a_finished_job_shows_it_finished() -> None:
    """The scheduler exited right after the job finished, before a poll saw it: the last
    frame is in the phase the end says, its nodes finished, none with a stream, and it says
    that the rest is the scheduler's last answer (before: `phase ready`, both `alive`, `yes`)."""
    frame = await watched_to_an_end_no_poll_saw(
        "finished", "all 2 nodes finished", node(0), node(1)
    )
    text = " ".join(" ".join(frame).split())  # the title wraps
    assert "phase finished" in text, text
    assert "phase ready" not in text, text
    assert "the job finished: all 2 nodes finished" in text, text
    assert re.search(r"last answer \d+\.\d s before the job finished", text), text
    rows = [line.split("│")[1:-1] for line in frame if line.startswith("│")]
    assert [[cell.strip() for cell in row[3:5]] for row in rows] == [["finished", "no"]] * 2
    assert "2 finished" in text


@pytest.mark.usefixtures("terminal_160x24")
async def test_the_last_frame_of_a_failed_job_shows_no_node_with_a_stream() -> None:
    """The job failed (rank 1 died) and its scheduler exited: the last frame is `failed`, the
    nodes as last seen but none with a stream to the scheduler that is gone."""
    frame = await watched_to_an_end_no_poll_saw(
        "job_failed",
        "rank 1 died",
        node(0),
        node(1, state="failed", connected=False),
    )
    text = " ".join(" ".join(frame).split())
    assert "phase failed" in text, text
    assert "phase ready" not in text, text
    assert "the job failed: rank 1 died" in text, text
    rows = [line.split("│")[1:-1] for line in frame if line.startswith("│")]
    cells = sorted([cell.strip() for cell in row[3:5]] for row in rows)
    assert cells == [["alive", "no"], ["failed", "no"]], text
    assert "yes" not in [cell.strip() for row in rows for cell in row]


async def test_a_watch_that_saw_no_view_before_the_end_says_the_end() -> None:
    """The job's end came before any poll answered (the scheduler exited at once): the watch
    on a terminal ends with the ending, no table (before: it polled on forever)."""

    async def fetch() -> JobView:
        raise SchedulerUnreachableError("no scheduler answers at 127.0.0.1:8118")

    async def follow() -> AsyncIterator[JobEvent]:
        yield JobEvent(9, 9.0, "finished", {"detail": "all 2 nodes finished"})

    out = Terminal()
    watcher = Watcher(fetch, follow, out, interval_s=0.01, terminal=True)
    assert await asyncio.wait_for(watcher.run(), BOUND_S) == 0
    assert "the job finished: all 2 nodes finished" in "\n".join(last_frame(out.getvalue()))


@pytest.mark.parametrize("interval_s", [0.0, 1e-300, 0.05, float("nan"), float("inf"), -1.0])
def test_an_interval_out_of_range_is_refused_before_anything_is_asked(interval_s: float) -> None:
    """`--interval 1e-300` had the view ask the scheduler back to back."""
    with pytest.raises(ConfigError, match=r"--interval .* is out of range: .* from 0\.1 to 86400"):
        watch.run("127.0.0.1:1", None, interval_s=interval_s, out=io.StringIO())
