"""What a CheckpointManager's writer knows of the rank's files (`checkpoint_listing`): a save
costs the same however many steps are kept, and files changed behind the manager's back are
still seen, by its saves or by its listings."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError
from cluster.storage import checkpoint_files
from cluster.storage.served import ServedCheckpoints
from cluster.testing import wait_until
from tests.procs import run_as_a_user

OLDER = 300


def manager(tmp_path: Path, reports: list[list[int]]) -> CheckpointManager:
    config = CheckpointConfig(keep_checkpoint_max=OLDER + 1000)  # nothing pruned
    return CheckpointManager(tmp_path, "net", config, rank=0, recovery=False, report=reports.append)


def older_steps(tmp_path: Path) -> None:
    """Steps 1 to OLDER on disk, complete (copies of one file: the cheap check reads only the
    preamble, the size and the footer)."""
    with manager(tmp_path, []) as first:
        first.save(1, {"a": 1})
    for step in range(2, OLDER + 1):
        shutil.copy(first.path(1), first.path(step))


def test_a_save_checks_none_of_the_older_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 300 steps kept, the first save of a new manager checks each older file once; the
    next 20 check none (each save's report still names every step held). A save listed the
    directory and opened every file in it twice (to prune, to report): its cost grew with the
    steps kept, 0.9 ms a save with 10 against 104 ms with 5,000 (tmpfs)."""
    older_steps(tmp_path)
    checked: list[str] = []
    check = checkpoint_files.examine

    def counted(path: Path) -> bool | str:
        checked.append(path.name)
        return check(path)

    monkeypatch.setattr(checkpoint_files, "examine", counted)
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, reports)
    ckpt.save(OLDER + 1, {"a": OLDER + 1})
    ckpt.flush()
    assert sorted(checked) == [checkpoint_files.file_name("net", s) for s in range(1, OLDER + 1)]
    checked.clear()
    for step in range(OLDER + 2, OLDER + 22):
        ckpt.save(step, {"a": step})
    ckpt.flush()
    assert checked == []
    assert reports[-1] == list(range(1, OLDER + 22))
    assert ckpt.steps() == reports[-1]  # a listing: each file checked again
    ckpt.close()


def test_files_removed_or_added_by_hand_are_seen_by_the_saves_after(tmp_path: Path) -> None:
    """Step 2 removed and step 5 copied in by hand, a temporary left there: the saves after see
    it (at the next one, once the directory's change shows; within a second whatever it
    shows): step 2 is no longer reported, step 5 is, and the temporary is removed."""
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, reports)
    for step in (1, 2, 3):
        ckpt.save(step, {"a": step})
    ckpt.flush()
    ckpt.path(2).unlink()
    shutil.copy(ckpt.path(3), ckpt.path(5))
    temporary = ckpt.directory / ".net-00000009.ckpt.0123abcd.tmp"
    temporary.write_bytes(b"left by a killed save")
    step = 10

    def seen() -> bool:
        nonlocal step
        step += 1
        ckpt.save(step, {"a": step})
        ckpt.flush()
        return reports[-1][:3] == [1, 3, 5] and not temporary.exists()

    wait_until(seen, 30, "a save to see the files changed by hand", poll_s=0.01)
    ckpt.close()


def test_a_file_cut_short_is_reported_until_a_listing_checks_it(tmp_path: Path) -> None:
    """Cut short in place, step 2's file keeps its name: saves do not open it again, and it is
    reported as held (as a file whose bits flipped is, until loaded), until `steps()` checks
    every file: from then on neither `steps()` nor the reports name it."""
    reports: list[list[int]] = []
    ckpt = manager(tmp_path, reports)
    for step in (1, 2, 3):
        ckpt.save(step, {"a": step})
    ckpt.flush()
    path = ckpt.path(2)
    path.write_bytes(path.read_bytes()[:100])
    ckpt.save(4, {"a": 4})
    ckpt.flush()
    assert reports[-1] == [1, 2, 3, 4]
    assert ckpt.steps() == [1, 3, 4]
    ckpt.save(5, {"a": 5})
    ckpt.flush()
    assert reports[-1] == [1, 3, 4, 5]
    ckpt.close()


# A save by a process that cannot read step 2's file: what it reports and what it leaves.
SAVE_BESIDE_UNREADABLE = """
import sys
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
reports = []
config = CheckpointConfig(keep_checkpoint_max=10)
ckpt = CheckpointManager(sys.argv[1], "net", config, rank=0, recovery=False, report=reports.append)
ckpt.save(4, {"a": 4})
ckpt.flush()
print(reports[-1], ckpt.steps(), ckpt.steps())
ckpt.close()
"""


def test_a_file_the_manager_cannot_read_is_not_reported_nor_removed(tmp_path: Path) -> None:
    """Step 2's file is whole, but mode 0 (restored by another user, say): a process that may
    not read it (root without the capabilities that pass over a file's mode, as any user is)
    saves step 4. It reports 1, 3 and 4, and leaves step 2's file where it is: it was taken
    for a torn file and removed, with nothing said, and a chmod could no longer bring it back.
    That step 2 drops out is said in one warning, not at each of the three listings."""
    with manager(tmp_path, []) as first:
        for step in (1, 2, 3):
            first.save(step, {"a": step})
    unreadable = first.path(2)
    unreadable.chmod(0)
    result = run_as_a_user(SAVE_BESIDE_UNREADABLE, tmp_path)
    assert result.stdout.split() == ["[1,", "3,", "4]", *["[1,", "3,", "4]"] * 2], result.stdout
    assert result.stderr.splitlines() == [
        f"the checkpoint {unreadable} cannot be read (Permission denied): step 2 is neither "
        "reported as held nor removed while it cannot; make it a regular file this process can "
        "read, or move it away"
    ]
    assert unreadable.exists()
    unreadable.chmod(0o600)
    with manager(tmp_path, []) as again:
        assert again.steps() == [1, 2, 3, 4]
        assert again.load(2) == {"a": 2}


def test_a_link_in_a_steps_place_is_neither_reported_nor_served_nor_removed(
    tmp_path: Path,
) -> None:
    """Step 3's name is a symbolic link to a whole checkpoint elsewhere. `load` never follows a
    link, so the cheap check does not either: the step is not listed, reported or served to a
    peer (it was, though no `load` of it, a rollback's included, could read it), and a save
    leaves the link and its target alone."""
    reports: list[list[int]] = []
    ckpt = manager(tmp_path / "job", reports)
    for step in (1, 2, 3):
        ckpt.save(step, {"a": step})
    ckpt.flush()
    elsewhere = tmp_path / "elsewhere.ckpt"
    ckpt.path(3).rename(elsewhere)
    ckpt.path(3).symlink_to(elsewhere)
    assert ckpt.steps() == [1, 2]
    with pytest.raises(CheckpointError, match="cannot read the checkpoint"):
        ckpt.load(3)
    ckpt.save(4, {"a": 4})
    ckpt.flush()
    assert reports[-1] == [1, 2, 4]
    assert ckpt.path(3).is_symlink()
    assert checkpoint_files.looks_complete(elsewhere)
    assert ServedCheckpoints(tmp_path / "job", "net", 0).open(0, 3, any_rank=False) is None
    ckpt.close()


def test_a_fifo_in_a_steps_place_is_refused_and_skipped_never_waited_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 3's name is a FIFO: `load(3)` refuses it, naming it and what it is, and `latest()`
    skips it for step 2. Both opened it as a file and waited for a writer for ever."""
    ckpt = manager(tmp_path, [])
    for step in (1, 2):
        ckpt.save(step, {"a": step})
    ckpt.flush()
    fifo = ckpt.path(3)
    os.mkfifo(fifo)
    caplog.set_level(logging.WARNING, logger="cluster.api.checkpoint")
    got: list[object] = []

    def calls() -> None:
        try:
            ckpt.load(3)
        except CheckpointError as exc:
            got.append(str(exc))
        got.append(ckpt.latest())

    caller = threading.Thread(target=calls, daemon=True)
    caller.start()
    caller.join(10)
    blocked = caller.is_alive()
    for _ in range(10):  # a writer that opens the FIFO ends each open that waits there
        if not caller.is_alive():
            break
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        caller.join(1)
    ckpt.close()
    assert not blocked, "load(3) or latest() waited on the FIFO"
    assert got[0] == (
        f"cannot read the checkpoint {fifo} (a FIFO, not a regular file): it was not loaded; "
        "make it a regular file this process can read, or move it away"
    )
    latest = got[1]
    assert isinstance(latest, tuple)
    assert latest[0] == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"the checkpoint {fifo} cannot be read (a FIFO, not a regular file): step 3 is neither "
        "reported as held nor removed while it cannot; make it a regular file this process can "
        "read, or move it away",
        f"skipping a checkpoint: {got[0]}",
    ]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
