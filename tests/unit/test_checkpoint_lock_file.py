"""The lock of a CheckpointManager is the file its path names, with real processes: a holder
whose lock file is removed while it holds it learns so at its next save, and either locks the
file there now (no other manager came) or is refused, naming the manager that locked it since,
and writes nothing; a newcomer that locked a file removed before its lock took hold opens the
path anew (`holder_lock.try_lock`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
from pathlib import Path

import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError
from cluster.storage import atomic, checkpoint_lock, holder_lock
from cluster.testing import Process
from tests.aio import BOUND_S
from tests.procs import PYTHON, Procs, job_env

# Holds rank 0's checkpoints of prefix 'mlp' under argv[1] (step 1 saved); at each SIGUSR1 it
# saves the next step and says whether it could. SIGUSR1 is blocked in every thread (the
# manager's too) and only waited for: it never ends the process.
HOLDER = """
import signal, sys
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
ckpt = CheckpointManager(sys.argv[1], "mlp", CheckpointConfig(), rank=0, recovery=False)
ckpt.save(1, {"step": 1})
ckpt.flush()
print("holding", flush=True)
for step in range(2, 10):
    signal.sigwait({signal.SIGUSR1})
    try:
        ckpt.save(step, {"step": step})
        ckpt.flush()
    except CheckpointError as exc:
        print(f"refused {step}:", exc, flush=True)
    else:
        print(f"saved {step}", flush=True)
"""

# Holds the lock file argv[1] (`holder_lock`) until it is killed.
LOCKER = """
import sys, threading
from pathlib import Path
from cluster.storage import holder_lock

fd = holder_lock.open_lock(Path(sys.argv[1]))
assert holder_lock.try_lock(fd) is None
holder_lock.write_holder(fd, role="locker")
print("holding", flush=True)
threading.Event().wait(600)
"""


def holder(processes: Procs, directory: Path) -> Process:
    proc = processes.start("holder", [PYTHON, "-c", HOLDER, str(directory)], job_env(1, 0))
    proc.wait_for_output("holding", 30)
    return proc


def save_next(proc: Process, step: int) -> str:
    """Have the holder save `step`: what it said (`saved N`, or `refused N: ...`)."""
    proc.signal(signal.SIGUSR1)
    proc.wait_for_output(f" {step}", 30)
    return next(line for line in proc.output.splitlines() if f" {step}" in line)


def mlp(directory: Path) -> CheckpointManager:
    return CheckpointManager(directory, "mlp", CheckpointConfig(), rank=0, recovery=False)


def test_a_holder_whose_lock_file_was_removed_is_refused_once_another_locked_the_new_one(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock file removed (by hand) while the holder runs: the next manager makes a new one
    and holds it (nothing of the first is left to see). The first holder's next save finds that
    its path names another file, held by another: it is refused at once, naming that manager,
    and writes nothing, so only one of them ever writes the rank's files."""
    directory = tmp_path / "ckpt"
    first = holder(processes, directory)
    (directory / "rank_0" / ".mlp.lock").unlink()
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    second = mlp(directory)
    try:
        assert second.steps() == [1]
        said = save_next(first, 2)
        assert said.startswith("refused 2: the checkpoints of prefix 'mlp' in "), said
        assert (
            f"in use by another CheckpointManager (pid {os.getpid()} on host "
            f"{socket.gethostname()}, this host, which holds .mlp.lock; locked since the file "
            "this manager held there was removed or replaced): "
        ) in said
        assert "was removed or replaced while this CheckpointManager held it" in first.output
        assert second.steps() == [1]  # the first wrote nothing
        second.save(2, {"step": 2})
        second.flush()
        assert second.steps() == [1, 2]
    finally:
        second.close()


def test_a_holder_whose_lock_file_was_removed_locks_a_new_one_that_keeps_others_out(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No other manager came: the holder's next save says once that the file was removed,
    makes it anew and holds it, and a newcomer after that is refused, naming the holder."""
    directory = tmp_path / "ckpt"
    lock_file = directory / "rank_0" / ".mlp.lock"
    first = holder(processes, directory)
    lock_file.unlink()
    assert save_next(first, 2) == "saved 2"
    assert first.output.count("was removed or replaced while this CheckpointManager") == 1
    assert json.loads(lock_file.read_text())["pid"] == first.pid
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    with pytest.raises(
        CheckpointError, match=f"in use by another CheckpointManager \\(pid {first.pid} "
    ):
        mlp(directory)
    assert save_next(first, 3) == "saved 3"
    assert first.output.count("was removed or replaced while this CheckpointManager") == 1


def test_a_holder_whose_rank_directory_was_removed_makes_it_again_and_saves_on(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank's directory removed, with its checkpoints and the lock file, while the holder
    runs (a clean-up by hand or by a timer): its next save says so once, makes the directory
    again, locks a new file there and goes on saving; a newcomer is refused, naming it. Every
    save failed instead ("No such file or directory"), ending a job that could go on."""
    directory = tmp_path / "ckpt"
    rank_directory = directory / "rank_0"
    first = holder(processes, directory)
    shutil.rmtree(rank_directory)
    assert save_next(first, 2) == "saved 2"
    assert save_next(first, 3) == "saved 3"
    said = f"the checkpoint directory {rank_directory} was removed, with the checkpoints in it"
    assert first.output.count(said) == 1, first.output
    assert sorted(p.name for p in rank_directory.iterdir()) == [
        ".mlp.lock",
        "mlp-00000002.ckpt",
        "mlp-00000003.ckpt",
    ]
    assert json.loads((rank_directory / ".mlp.lock").read_text())["pid"] == first.pid
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    with pytest.raises(
        CheckpointError, match=f"in use by another CheckpointManager \\(pid {first.pid} "
    ):
        mlp(directory)


def test_a_rank_directory_removed_under_a_write_is_made_again_and_the_write_lands_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rank's directory removed while a save waits for the writer (or is written): the
    writer makes it again, locks a new file there and writes the step there, said once. Its
    write failed instead ("No such file or directory"), the next save raised that error, and
    the step was lost though the manager could save on."""
    directory = tmp_path / "ckpt"
    rank_directory = directory / "rank_0"
    ckpt = mlp(directory)
    try:
        ckpt.save(1, {"step": 1})
        ckpt.flush()
        gate = threading.Event()
        ckpt._writes.writer.submit(lambda: gate.wait(BOUND_S) or None)  # holds the writer
        ckpt.save(2, {"step": 2})  # waits behind it
        shutil.rmtree(rank_directory)
        gate.set()
        ckpt.flush()  # the writer meets the directory gone
        ckpt.save(3, {"step": 3})
        ckpt.flush()
        assert ckpt.steps() == [2, 3]
        holder = json.loads((rank_directory / ".mlp.lock").read_text())
        assert holder["pid"] == os.getpid()
        said = f"the checkpoint directory {rank_directory} was removed, with the checkpoints in it"
        assert caplog.text.count(said) == 1, caplog.text
    finally:
        ckpt.close()


def test_a_lock_taken_on_a_file_removed_before_it_took_hold_is_taken_on_the_path_anew(
    processes: Procs, tmp_path: Path
) -> None:
    """The race of `flock` on a file removed between its open and its lock: the lock of the
    removed file keeps no one out. `try_lock` given the path opens the path anew: refused by
    the process that locked the file there since; holding the file there when no one did."""
    path = tmp_path / "x.lock"
    fd = holder_lock.open_lock(path)
    try:
        path.unlink()  # the file this process opened is gone: another makes and locks a new one
        locker = processes.start("locker", [PYTHON, "-c", LOCKER, str(path)], job_env(1, 0))
        locker.wait_for_output("holding", 30)
        found = holder_lock.try_lock(fd, path)
        assert found is not None
        assert found["pid"] == locker.pid
        assert found["role"] == "locker"
        locker.kill_group()
        path.unlink()  # again: gone, and no one locked another
        assert holder_lock.try_lock(fd, path) is None
        assert holder_lock.still_holds(fd, path)  # the file that the path names now
        assert holder_lock.held(path) is True
    finally:
        os.close(fd)


def test_a_manager_whose_lock_file_is_removed_as_it_locks_it_is_refused_by_the_new_ones_holder(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race in a CheckpointManager's lock: its file is removed just after it opened
    it, and another process makes and locks a new one before this one's `flock`. It is
    refused, naming that process, instead of holding a lock that keeps no one out."""
    lockers: list[Process] = []
    real_open_own = atomic.open_own

    def open_then_lose(where: Path) -> tuple[int | None, str]:
        opened = real_open_own(where)
        if not lockers:  # the first open only: the path opened anew is left alone
            where.unlink()
            lockers.append(
                processes.start("locker", [PYTHON, "-c", LOCKER, str(where)], job_env(1, 0))
            )
            lockers[0].wait_for_output("holding", 30)
        return opened

    monkeypatch.setattr(atomic, "open_own", open_then_lose)
    lock = checkpoint_lock.CheckpointLock(tmp_path, "mlp")
    with pytest.raises(CheckpointError) as refused:
        lock.acquire(wait_s=0.0)
    assert f"in use by another CheckpointManager (pid {lockers[0].pid} on host " in str(
        refused.value
    )
    assert not lock.held
    assert lockers[0].running


# Holds rank 0's checkpoints of prefix 'mlp' under argv[1] (step 1 saved), then forks a child
# (a data loader's worker) that tries to save step 2, load step 1 and list the steps through
# the parent's manager, saying what each did; SIGALRM ends a child that waits for ever.
FORKER = """
import os, signal, sys, threading
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError

ckpt = CheckpointManager(sys.argv[1], "mlp", CheckpointConfig(), rank=0, recovery=False)
ckpt.save(1, {"step": 1})
ckpt.flush()
child = os.fork()
if child == 0:
    signal.alarm(5)
    lock_file = os.open(os.devnull, os.O_RDONLY)  # takes the number the lock's copy had
    print("child holds:", ckpt._lock.held, flush=True)
    uses = {"save": lambda: ckpt.save(2, {"step": 2}), "load": lambda: ckpt.load(1)}
    for use in (uses["save"], ckpt.flush, uses["load"], ckpt.steps):
        try:
            use()
        except CheckpointError as exc:
            print("child refused:", exc, flush=True)
        else:
            print("child went on", flush=True)
    os._exit(0)
_, status = os.waitpid(child, 0)
print("child ended", os.waitstatus_to_exitcode(status), flush=True)
print("holding", ckpt._lock.held, flush=True)
threading.Event().wait(600)
"""


def test_a_child_forked_from_the_holder_is_refused_naming_its_parent_and_writes_nothing(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data loader's worker forked by the holder uses the parent's manager: its save, load
    and listing are refused, each with a line naming the parent the lock belongs to (it does
    not hang on a writer thread that stayed in the parent), nothing is written, and the
    parent still holds the lock."""
    directory = tmp_path / "ckpt"
    parent = processes.start("forker", [PYTHON, "-c", FORKER, str(directory)], job_env(1, 0))
    parent.wait_for_output("holding", 30)
    said = parent.output.splitlines()
    assert "child holds: False" in said
    assert "child ended 0" in said
    assert "holding True" in said
    refusals = [line for line in said if line.startswith("child refused: ")]
    assert len(refusals) == 3, said
    for refusal in refusals:
        assert f"are locked by this CheckpointManager in pid {parent.pid}, the process " in refusal
        assert f"the lock belongs to pid {parent.pid}, so a forked child " in refusal
    assert sorted(p.name for p in (directory / "rank_0").iterdir()) == [
        ".mlp.lock",
        "mlp-00000001.ckpt",
    ]
    assert json.loads((directory / "rank_0" / ".mlp.lock").read_text())["pid"] == parent.pid
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    with pytest.raises(CheckpointError, match=f"CheckpointManager \\(pid {parent.pid} on host "):
        mlp(directory)
