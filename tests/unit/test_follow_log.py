"""`mscluster events --follow` on a file: every `mscluster run` in a directory appends to its
logs/events.jsonl, and the follow goes on to the end of the job running when it began, past
the ends of the earlier ones; a follower that read part of a line that a full disk then had
cut off again reads the line written in its place whole; a log whose writer is gone (no one
holds its lock, it does not grow) is given up, one whose writer is merely quiet is not."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.config import LogRotation
from cluster.protocol.errors import ConfigError, SchedulerUnreachableError
from cluster.protocol.events import JobEvent
from cluster.storage import holder_lock, rotation
from cluster.storage.rotation import RotatingFile
from cluster.tools import events as events_tool
from cluster.tools.testing import Process, wait_until
from tests import tmpfs
from tests.procs import MSCLUSTER, PYTHON, Procs, reader_env
from tests.unit.test_rotation import event, write_until_refused

WAIT_S = 30.0


def line(seq: int, kind: str, **fields: object) -> str:
    return JobEvent(seq, 1_772_366_400.0 + seq, kind, fields).to_json() + "\n"


def follow(processes: Procs, path: Path) -> Process:
    """`mscluster events --follow --json --file PATH`, running."""
    args = [*MSCLUSTER, "events", "--follow", "--json", "--file", str(path)]
    return processes.start("follow", args, reader_env(None))


def shown(followed: Process) -> list[tuple[int, str]]:
    return [(e["seq"], e["event"]) for e in map(json.loads, followed.output.splitlines())]


def test_following_a_log_of_two_runs_follows_the_second_to_its_end(
    tmp_path: Path, processes: Procs
) -> None:
    path = tmp_path / "events.jsonl"
    earlier = [line(1, "started"), line(2, "formed"), line(3, "finished", detail="all done")]
    path.write_text("".join([*earlier, line(4, "started"), line(5, "formed")]))
    followed = follow(processes, path)
    wait_until(
        lambda: '"seq":5' in followed.output or not followed.running, WAIT_S, "seq 5 or the end"
    )
    assert followed.running, followed.output  # the first job's end is history
    with path.open("a") as log:
        log.write(line(6, "job_failed", detail="rank 1 failed"))
    assert followed.wait(WAIT_S) == 1, followed.output  # the followed job failed
    assert shown(followed) == [
        (1, "started"),
        (2, "formed"),
        (3, "finished"),
        (4, "started"),
        (5, "formed"),
        (6, "job_failed"),
    ]


def test_following_a_log_whose_last_job_ended_in_an_old_file_ends_at_once(
    tmp_path: Path, processes: Procs
) -> None:
    path = tmp_path / "events.jsonl"
    rotation.old_file(path, 1).write_text(line(1, "started") + line(2, "finished", detail="ok"))
    path.write_text(line(3, "nodes_back", seconds=0.1))  # rotated after the job's end
    followed = follow(processes, path)
    assert followed.wait(WAIT_S) == 0, followed.output
    assert shown(followed) == [(1, "started"), (2, "finished")]


def reading_at(path: Path) -> list[int]:
    """The offsets of this process's read-only descriptors of `path` (a follower's)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") != str(path):
                continue
            info = dict(
                row.split(":", 1) for row in Path(f"/proc/self/fdinfo/{fd}").read_text().split("\n")
                if ":" in row
            )  # fmt: skip
            if int(info["flags"], 8) & os.O_ACCMODE == os.O_RDONLY:
                found.append(int(info["pos"]))
    return found


def test_a_follower_that_read_a_part_cut_off_again_reads_the_next_event_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tmpfs.mounted("256k") as disk:
        path = disk / "events.jsonl"
        writer = RotatingFile(path, LogRotation(max_bytes=1 << 20, keep=3))
        writer.write(f"{event(1).to_json()}\n".encode())
        got: list[int] = []

        def follow() -> None:
            for found in events_tool.from_file(path, follow=True, poll_s=0.01):
                got.append(found.seq)

        follower = threading.Thread(target=follow, name="follower", daemon=True)
        follower.start()
        wait_until(lambda: got == [1], WAIT_S, "the follower at the first event")
        truncate, cuts = os.ftruncate, []

        def cut_once_read(fd: int, size: int) -> None:
            """The follower reads what landed of the failed write before it is cut off."""
            landed = os.fstat(fd).st_size
            wait_until(lambda: landed in reading_at(path), WAIT_S, "the follower at the part")
            truncate(fd, size)
            cuts.append(landed - size)

        monkeypatch.setattr(rotation.os, "ftruncate", cut_once_read)
        filler = tmpfs.fill(disk)
        seq = 1
        while not cuts and seq < 200:  # until a write lands in part (a page boundary)
            seq = write_until_refused(writer, seq + 1)
        assert cuts, "no write landed in part"
        filler.unlink()
        writer.write(f"{event(seq + 1).to_json()}\n".encode())
        writer.write(f"{event(seq + 2, 'finished').to_json()}\n".encode())
        writer.close()
        follower.join(WAIT_S)
        assert not follower.is_alive()
        written = [JobEvent.from_json(text).seq for text in path.read_text().splitlines()]
        assert written[-2:] == [seq + 1, seq + 2]
        assert got == written  # none lost to the part cut off


def test_a_read_that_goes_on_past_a_cut_gives_the_line_written_in_its_place(
    tmp_path: Path,
) -> None:
    """One readline reads a part that a failed write left, the scheduler cuts it off and
    writes another event in its place, and the readline goes on in that event: the follower
    gives the event written, not a line made of the two (the part's seq with the rest of the
    other's, as a loaded CI run once got)."""
    path = tmp_path / "events.jsonl"
    first, cut_off, placed = line(1, "started"), line(27, "formed"), line(28, "formed")
    part = cut_off.encode()[:-5]  # all but its end: its seq and its time
    path.write_bytes(first.encode() + part)

    class CutAfterThePart(io.FileIO):
        """The follower's reads of `path`; once a read ends at the part's end, the writer
        cuts the part off and writes `placed` in its place, before the next read."""

        cut = False

        def readinto(self, buffer: Any) -> int | None:
            read = super().readinto(buffer)
            if not self.cut and self.tell() == len(first) + len(part):
                self.cut = True
                with path.open("r+b") as writer:
                    writer.truncate(len(first))
                    writer.seek(len(first))
                    writer.write(placed.encode())
            return read

    with io.BufferedReader(CutAfterThePart(path, "r")) as handle:
        tail = events_tool._Tail(handle)
        lines = [tail.line(), tail.line(), tail.line()]
    assert lines == [first, placed, None]


SMALL_CAP = 4096


def test_a_follower_holds_at_most_the_cap_of_a_line_and_reads_past_a_longer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower held a line still being written whole, without bound (a writer of no
    newline grew it forever): it holds at most LINE_MAX_BYTES, reads past a longer line as it
    is written, and gives the event after it."""
    monkeypatch.setattr(events_tool, "LINE_MAX_BYTES", SMALL_CAP)
    monkeypatch.setattr(events_tool, "SKIP_PIECE_BYTES", 512)
    path = tmp_path / "events.jsonl"
    first, after = line(1, "started"), line(2, "formed")
    path.write_text(first + "x" * (SMALL_CAP - 1))
    with path.open("rb") as handle:
        tail = events_tool._Tail(handle)
        assert tail.line() == first
        assert tail.line() is None  # the cap's worth of the long line: held
        with path.open("a") as writer:
            for _ in range(64):
                writer.write("x" * SMALL_CAP)
                writer.flush()
                assert tail.line() is None
                assert len(tail._held) < SMALL_CAP
            writer.write("x\n" + after)
        assert tail.line() == after
        assert tail.line() is None


def test_a_long_line_cut_off_again_is_read_again_from_where_it_began(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line read past (over the cap) that the writer then cuts off: the follower reads the
    line written in its place whole, as it does after a part it held."""
    monkeypatch.setattr(events_tool, "LINE_MAX_BYTES", SMALL_CAP)
    path = tmp_path / "events.jsonl"
    first, placed = line(1, "started"), line(2, "formed")
    path.write_text(first + "x" * 3 * SMALL_CAP)
    with path.open("rb") as handle:
        tail = events_tool._Tail(handle)
        assert [tail.line(), tail.line()] == [first, None]
        with path.open("r+b") as writer:
            writer.truncate(len(first))
            assert tail.line() is None  # the cut seen: back to where the line began
            writer.seek(len(first))
            writer.write(placed.encode())
        assert tail.line() == placed


class Follower:
    """`from_file(path, follow=True)` on a thread: the kinds it yields, then how it ended. It
    gives a writer up after RECONNECT_S (GONE_S here)."""

    def __init__(self, path: Path) -> None:
        self.kinds: list[str] = []
        self.error: Exception | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self._thread.start()

    def _run(self, path: Path) -> None:
        try:
            for found in events_tool.from_file(path, follow=True, poll_s=0.01):
                self.kinds.append(found.kind)
        except Exception as exc:  # told to the test
            self.error = exc
        self.done.set()


GONE_S = 0.3


def test_a_log_that_no_one_holds_and_that_stopped_growing_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its scheduler was SIGKILLed: the kernel let its lock go, and no last event will come."""
    path = tmp_path / "events.jsonl"
    path.write_text(line(1, "started"))
    fd = holder_lock.open_lock(holder_lock.lock_path(path))
    assert holder_lock.try_lock(fd) is None
    os.close(fd)  # the writer's lock let go, as the kernel does for a killed process
    monkeypatch.setattr(events_tool, "RECONNECT_S", GONE_S)
    followed = Follower(path)
    assert followed.done.wait(GONE_S + events_tool.LOCK_ASKED_S + WAIT_S)
    assert followed.kinds == ["started"]
    assert isinstance(followed.error, SchedulerUnreachableError)
    assert f"the event log {path} has no writer: nobody holds events.jsonl.lock" in str(
        followed.error
    )


def test_a_quiet_log_whose_writer_holds_its_lock_is_followed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_tool, "RECONNECT_S", GONE_S)
    path = tmp_path / "events.jsonl"
    path.write_text(line(1, "started"))
    fd = holder_lock.open_lock(holder_lock.lock_path(path))
    try:
        assert holder_lock.try_lock(fd) is None  # a live scheduler, merely quiet
        followed = Follower(path)
        # Past GONE_S and several asks of the lock: still following (the wait is the check).
        assert not followed.done.wait(GONE_S + 3 * events_tool.LOCK_ASKED_S)
        with path.open("a") as log:
            log.write(line(2, "finished", detail="all done"))
        assert followed.done.wait(WAIT_S)
    finally:
        os.close(fd)
    assert followed.error is None
    assert followed.kinds == ["started", "finished"]


# -- a log that is not there yet ---------------------------------------------------------------

# A process holding what a starting job holds in its log directory DIR (argv[1]) until killed:
# `mscluster run`'s launcher.lock (taken before its scheduler starts), or the scheduler's
# events.jsonl.lock (taken before it writes the file).
HOLDING = {
    "launcher.lock": "from cluster.tools.launch_lock import LogDirLock; LogDirLock(d).take(8118)",
    "events.jsonl.lock": (
        "from cluster.storage import holder_lock; "
        "fd = holder_lock.open_lock(d / 'events.jsonl.lock'); "
        "assert holder_lock.try_lock(fd) is None; holder_lock.write_holder(fd)"
    ),
}


def holding(processes: Procs, lock: str, directory: Path) -> Process:
    script = (
        "import signal, sys; from pathlib import Path; d = Path(sys.argv[1]); "
        f"{HOLDING[lock]}; print('held', flush=True); signal.pause()"
    )
    holder = processes.start(
        f"holding-{lock}", [PYTHON, "-c", script, str(directory)], reader_env(None)
    )
    holder.wait_for_output("held", WAIT_S)
    return holder


def test_a_log_that_never_came_and_that_nothing_would_write_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mscluster events --follow` in a directory with no job (a newcomer in the wrong one):
    no file, no lock held; one error that says so and what to give (before: waited forever)."""
    monkeypatch.setattr(events_tool, "RECONNECT_S", GONE_S)
    path = tmp_path / "logs" / "events.jsonl"
    followed = Follower(path)
    assert followed.done.wait(GONE_S + events_tool.LOCK_ASKED_S + WAIT_S)
    assert followed.kinds == []
    assert isinstance(followed.error, ConfigError), followed.error
    said = str(followed.error)
    assert f"no event log appeared at {path} in {GONE_S:g} s" in said
    assert f"holds launcher.lock or events.jsonl.lock in {path.parent}" in said
    assert "--log-dir" in said
    assert "--file" in said
    assert "--addr" in said
    assert not path.exists()  # a reader makes nothing


@pytest.mark.parametrize("lock", sorted(HOLDING))
def test_a_log_not_there_yet_is_waited_for_while_its_job_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: Procs, lock: str
) -> None:
    """A launcher that is starting the job (its launcher.lock held) or a scheduler about to
    write the log (its lock held): the follow waits past the bound, follows the file once it
    comes, to the job's end."""
    monkeypatch.setattr(events_tool, "RECONNECT_S", GONE_S)
    path = tmp_path / "events.jsonl"
    holder = holding(processes, lock, tmp_path)
    followed = Follower(path)
    # Past GONE_S and several asks of the locks: still waiting (the wait is the check).
    assert not followed.done.wait(GONE_S + 3 * events_tool.LOCK_ASKED_S)
    path.write_text(line(1, "started") + line(2, "finished", detail="all done"))
    assert followed.done.wait(WAIT_S)
    assert followed.error is None
    assert followed.kinds == ["started", "finished"]
    holder.kill_group()


def test_a_log_not_there_whose_launcher_was_killed_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: Procs
) -> None:
    """The launcher died before its scheduler wrote the log: the kernel let its lock go, and
    the follow gives up within the bound."""
    monkeypatch.setattr(events_tool, "RECONNECT_S", GONE_S)
    path = tmp_path / "events.jsonl"
    holder = holding(processes, "launcher.lock", tmp_path)
    followed = Follower(path)
    assert not followed.done.wait(GONE_S + 2 * events_tool.LOCK_ASKED_S)
    holder.signal(signal.SIGKILL)
    assert holder.wait(WAIT_S) == -signal.SIGKILL
    assert followed.done.wait(GONE_S + events_tool.LOCK_ASKED_S + WAIT_S)
    assert isinstance(followed.error, ConfigError), followed.error
    assert f"no event log appeared at {path}" in str(followed.error)


def test_a_quiet_log_whose_launcher_runs_is_followed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: Procs
) -> None:
    """Nobody holds events.jsonl.lock (its scheduler was killed), but `mscluster run` holds its
    launcher.lock there (restarting it): followed on past the bound, to the job's end."""
    monkeypatch.setattr(events_tool, "RECONNECT_S", GONE_S)
    path = tmp_path / "events.jsonl"
    path.write_text(line(1, "started"))
    holder = holding(processes, "launcher.lock", tmp_path)
    followed = Follower(path)
    assert not followed.done.wait(GONE_S + 3 * events_tool.LOCK_ASKED_S)
    with path.open("a") as log:
        log.write(line(2, "resumed") + line(3, "finished", detail="all done"))
    assert followed.done.wait(WAIT_S)
    assert followed.error is None
    assert followed.kinds == ["started", "resumed", "finished"]
    holder.kill_group()
