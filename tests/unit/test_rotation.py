"""Files that outsiders can make grow stay within a bound: the event log and the scheduler's
log rotate at CLUSTER_LOG_MAX_BYTES, keeping CLUSTER_LOG_KEEP old files, and `mscluster events
--file` reads a rotated journal whole, oldest first, also while following it. A full disk
leaves no torn line in the event log; a log that cannot start a new file loses none."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from cluster.protocol.config import LogRotation
from cluster.protocol.events import JobEvent
from cluster.scheduler.event_file import EventFile, last_seq
from cluster.storage import rotation
from cluster.storage.rotation import RotatingFile, in_order, old_file
from cluster.tools import events as events_tool
from cluster.tools.testing import wait_until
from tests import tmpfs
from tests.procs import PYTHON, ROOT

SMALL = LogRotation(max_bytes=1024, keep=2)


def event(seq: int, kind: str = "registered") -> JobEvent:
    return JobEvent(seq, 1_700_000_000.0 + seq, kind, {"node_id": f"n{seq}", "pad": "x" * 60})


def sizes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.parent.iterdir()}


def test_a_file_rotates_at_its_size_keeps_a_few_and_never_cuts_a_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    writer = RotatingFile(path, SMALL)
    lines = [f"line {i:04d} {'y' * 90}\n".encode() for i in range(100)]
    for line in lines:
        writer.write(line)
    writer.close()
    assert sorted(sizes(path)) == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(size <= SMALL.max_bytes for size in sizes(path).values())
    kept = b"".join(p.read_bytes() for p in in_order(path))
    assert kept == b"".join(lines[-len(kept.splitlines()) :])  # the newest, whole, in order


def test_a_write_larger_than_the_bound_lands_alone(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    writer = RotatingFile(path, SMALL)
    writer.write(b"a\n")
    writer.write(b"b" * 5000 + b"\n")
    writer.write(b"c\n")
    writer.close()
    assert path.read_bytes() == b"c\n"
    assert old_file(path, 1).read_bytes() == b"b" * 5000 + b"\n"
    assert old_file(path, 2).read_bytes() == b"a\n"


def test_a_link_planted_where_the_file_goes_is_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("kept\n")
    path = tmp_path / "events.jsonl"
    path.symlink_to(target)
    with pytest.raises(OSError):
        RotatingFile(path, SMALL).write(b"x\n")
    assert target.read_text() == "kept\n"


def test_the_event_log_rotates_and_mscluster_events_reads_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventFile(path, LogRotation(max_bytes=1024, keep=100))
    for seq in range(1, 41):
        log.write(event(seq).to_json())
    log.write(event(41, "finished").to_json())
    log.close()
    assert len(in_order(path)) > 3
    shown = list(events_tool.from_file(path, follow=False))
    assert [e.seq for e in shown] == list(range(1, 42))
    assert last_seq(path) == 41


def test_a_scheduler_started_again_numbers_on_from_a_rotated_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    writer = RotatingFile(path, SMALL)
    writer.write(f"{event(7).to_json()}\n".encode())
    writer.close()
    path.rename(old_file(path, 1))
    path.write_text("")  # rotated just before the scheduler stopped
    assert last_seq(path) == 7


def test_only_the_newest_keep_files_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventFile(path, SMALL)
    for seq in range(1, 200):
        log.write(event(seq).to_json())
    log.close()
    assert sorted(sizes(path)) == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert sum(sizes(path).values()) <= (1 + SMALL.keep) * SMALL.max_bytes
    shown = [e.seq for e in events_tool.from_file(path, follow=False)]
    assert shown == list(range(shown[0], 200))  # the newest, in order, none twice


def test_a_writer_that_keeps_fewer_removes_the_old_files_past_its_keep(tmp_path: Path) -> None:
    """A scheduler started again with a lower CLUSTER_LOG_KEEP: its first rotation removes the
    old files past its own keep too, and readers see only what it keeps."""
    path = tmp_path / "events.jsonl"
    log = EventFile(path, LogRotation(max_bytes=1024, keep=5))
    for seq in range(1, 400):
        log.write(event(seq).to_json())
    log.close()
    assert len(sizes(path)) == 6
    log = EventFile(path, SMALL)
    for seq in range(400, 430):
        log.write(event(seq).to_json())
    log.close()
    assert sorted(sizes(path)) == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]


def test_following_a_log_goes_on_across_its_rotations(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    writer = RotatingFile(path, SMALL)
    writer.write(f"{event(1).to_json()}\n".encode())
    followed = events_tool.from_file(path, follow=True, poll_s=0.01)
    assert next(followed).seq == 1
    expected = 2
    for seq in range(2, 40):  # 7 events a file: a rotation between two reads, now and then
        writer.write(f"{event(seq).to_json()}\n".encode())
        if seq % 10 == 0:
            got = [next(followed).seq for _ in range(expected, seq + 1)]
            assert got == list(range(expected, seq + 1))
            expected = seq + 1
    writer.write(f"{event(40, 'finished').to_json()}\n".encode())
    assert [e.seq for e in followed] == list(range(expected, 41))
    writer.close()


def test_following_starts_with_the_old_files(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    writer = RotatingFile(path, LogRotation(max_bytes=1024, keep=100))
    for seq in range(1, 30):
        writer.write(f"{event(seq).to_json()}\n".encode())
    writer.write(f"{event(30, 'finished').to_json()}\n".encode())
    writer.close()
    assert old_file(path, 1).exists()
    assert [e.seq for e in events_tool.from_file(path, follow=True, poll_s=0.01)] == list(
        range(1, 31)
    )


LOGGING_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from cluster.api.runtime import configure_logging
    from cluster.protocol.config import LogRotation, ObserveConfig
    path = Path(sys.argv[1])
    configure_logging("scheduler", ObserveConfig(log_file=path, rotation=LogRotation(2048, 2)))
    log = logging.getLogger("cluster.scheduler")
    for i in range(300):
        log.info("refused node %r: line %d", "x" * 40, i)
        if i % 50 == 0:
            print(f"stdout line {i}", flush=True)
            sys.stderr.write(f"stderr line {i}\\n")
    log.info("the last line")
    """
)


def run_script(script: str, path: Path) -> subprocess.CompletedProcess[str]:
    """`script` run by a Python of its own with the log file `path` as its argument."""
    return subprocess.run(
        [PYTHON, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


def test_the_scheduler_log_is_its_stderr_and_it_rotates_it(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.log"
    path.write_text("before logging started\n")  # what the launcher's redirection got
    done = run_script(LOGGING_SCRIPT, path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == done.stderr == ""  # all of it went to the file
    assert sorted(sizes(path)) == ["scheduler.log", "scheduler.log.1", "scheduler.log.2"]
    assert all(size <= 2048 + 200 for size in sizes(path).values())
    text = "".join(p.read_text() for p in in_order(path))
    assert text.endswith("cluster[scheduler]: the last line\n")
    assert "stdout line 250" in text
    assert "stderr line 250" in text


def test_an_unwritable_log_file_is_one_line(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    done = run_script(LOGGING_SCRIPT, blocked / "scheduler.log")
    assert done.returncode != 0
    assert "CLUSTER_LOG_FILE=" in done.stderr
    assert "cannot be written" in done.stderr


def event_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_full_disk_leaves_no_torn_event_and_the_next_one_is_read_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with tmpfs.mounted("256k") as disk, caplog.at_level(logging.INFO, "cluster.scheduler"):
        path = disk / "events.jsonl"
        log = EventFile(path, LogRotation(max_bytes=1 << 20, keep=3))
        for seq in range(1, 13):
            log.write(event(seq).to_json())
        wait_until(lambda: last_seq(path) == 12, 10, "the first 12 events on disk")
        filler = tmpfs.fill(disk)
        for refused in range(13, 13 + 100):  # the last page takes a few, then one lands in part
            log.write(event(refused).to_json())
            wait_until(
                lambda: last_seq(path) == refused or "cannot write" in caplog.text, 10, "a write"
            )
            if "cannot write" in caplog.text:
                break
        else:
            pytest.fail("the full disk took 100 events")
        assert "No space left on device" in caplog.text  # said as before
        assert path.read_bytes().endswith(b"\n")  # what landed of it was cut off again
        assert [JobEvent.from_json(line).seq for line in event_lines(path)] == list(
            range(1, refused)
        )
        filler.unlink()
        log.write(event(refused + 1).to_json())
        wait_until(lambda: "written again" in caplog.text, 10, "the event log written again")
        log.close()
        seqs = [JobEvent.from_json(line).seq for line in event_lines(path)]
        assert seqs == [*range(1, refused), refused + 1]
        assert last_seq(path) == refused + 1


def write_until_refused(writer: RotatingFile, seq: int) -> int:
    """Write events from `seq` on until the full disk refuses one; its number."""
    for number in range(seq, seq + 100):
        try:
            writer.write(f"{event(number).to_json()}\n".encode())
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return number
    pytest.fail("the full disk took 100 events")


def test_a_torn_line_that_cannot_be_cut_off_is_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_truncate(fd: int, size: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with tmpfs.mounted("256k") as disk:
        path = disk / "events.jsonl"
        writer = RotatingFile(path, LogRotation(max_bytes=1 << 20, keep=3))
        writer.write(f"{event(1).to_json()}\n".encode())
        filler = tmpfs.fill(disk)
        monkeypatch.setattr(rotation.os, "ftruncate", no_truncate)
        seq = write_until_refused(writer, 2)
        assert not path.read_bytes().endswith(b"\n")  # torn, and left so
        filler.unlink()
        writer.close()  # as the event log does after a failure: the next write reopens
        again = RotatingFile(path, LogRotation(max_bytes=1 << 20, keep=3))
        again.write(f"{event(seq + 1).to_json()}\n".encode())
        again.close()
        assert JobEvent.from_json(event_lines(path)[-1]).seq == seq + 1
        shown = [e.seq for e in events_tool.from_file(path, follow=False)]
        assert shown == [*range(1, seq), seq + 1]  # the torn line skipped, none glued
        assert last_seq(path) == seq + 1


NO_DESCRIPTORS_SCRIPT = textwrap.dedent(
    """
    import logging, os, resource, sys
    from pathlib import Path
    from cluster.api.runtime import configure_logging
    from cluster.protocol.config import LogRotation, ObserveConfig
    path = Path(sys.argv[1])
    configure_logging("scheduler", ObserveConfig(log_file=path, rotation=LogRotation(300, 3)))
    log = logging.getLogger("cluster.scheduler")
    for i in range(4):
        log.info("early line %d %s", i, "x" * 60)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    while True:  # a connection flood: no descriptor left
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for i in range(6):
        log.info("out of fds %d %s", i, "y" * 60)
    for fd in held:
        os.close(fd)
    for i in range(4):  # two rotations: the early lines are the oldest file kept
        log.info("fds back %d %s", i, "z" * 60)
    """
)


def test_a_log_that_cannot_open_a_new_file_loses_none_of_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.log"
    done = run_script(NO_DESCRIPTORS_SCRIPT, path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == done.stderr == ""
    assert sorted(sizes(path)) == [path.name, *(old_file(path, n).name for n in (1, 2, 3))]
    text = "".join(p.read_text() for p in in_order(path))
    kept = [line for line in text.splitlines() if "early line" in line or "out of fds" in line]
    assert len(kept) == 10  # no rotation while no new file could be opened
    told = [line for line in text.splitlines() if "cannot start a new log file" in line]
    assert len(told) == 1, text
    assert "Too many open files" in told[0]
    assert text.count("rotates again") == 1
    assert text.endswith("fds back 3 " + "z" * 60 + "\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
