"""One CheckpointManager per rank directory and prefix, with real processes: a second process
is refused with a message naming the directory, the prefix and the holder while the first
holds the lock, and takes it at once after the first is SIGKILLed (or waits for a predecessor
still exiting); in one process, a manager closed or dropped lets the next one in; a forked child
never keeps the lock; a planted file is refused; a file system without locks is said once."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.protocol.errors import CheckpointError
from cluster.storage import checkpoint_lock
from cluster.testing import Process, wait_until
from tests.procs import PYTHON, Procs, job_env

# Holds rank 0's checkpoints of prefix 'mlp' under argv[1] (one saved) until it is killed;
# with --fork, after forking a child that lives on (a data loader's worker).
HOLDER = """
import os, sys, threading
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager

ckpt = CheckpointManager(sys.argv[1], "mlp", CheckpointConfig(), rank=0, recovery=False)
ckpt.save(1, {"step": 1})
ckpt.flush()
if "--fork" in sys.argv:
    child = os.fork()
    if child == 0:
        threading.Event().wait(600)
        os._exit(0)
    print("forked", child, flush=True)
print("holding", flush=True)
threading.Event().wait(600)
"""


def holder(processes: Procs, directory: Path, *flags: str) -> Process:
    proc = processes.start("holder", [PYTHON, "-c", HOLDER, str(directory), *flags], job_env(1, 0))
    proc.wait_for_output("holding", 30)
    return proc


def mlp(directory: Path, prefix: str = "mlp", **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("rank", 0)
    return CheckpointManager(directory, prefix, CheckpointConfig(), recovery=False, **kwargs)


def test_a_second_process_is_refused_while_the_first_holds_it_and_takes_it_once_it_is_killed(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs given one directory and prefix: the second is refused (after its wait) with a
    line naming the directory, the prefix and the holder, and leaves the first's files alone.
    The first SIGKILLed, the kernel has released its lock: taken without any wait."""
    directory = tmp_path / "ckpt"
    first = holder(processes, directory)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.2)
    with pytest.raises(CheckpointError) as refused:
        mlp(directory)
    message = str(refused.value)
    assert f"the checkpoints of prefix 'mlp' in {directory / 'rank_0'} are in use" in message
    host = socket.gethostname()
    assert f"(pid {first.pid} on host {host}, this host, which holds .mlp.lock; " in message
    assert "waited 0.2 s for it to end" in message
    assert message.endswith(
        "give each job its own checkpoint directory or prefix, or stop the other process"
    )
    assert (directory / "rank_0" / "mlp-00000001.ckpt").exists()
    first.signal(signal.SIGKILL)
    first.wait(10)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)  # at once, or refused
    with mlp(directory) as restarted:
        assert restarted.load(1) == {"step": 1}
        restarted.save(2, {"step": 2})
        restarted.flush()
        assert restarted.steps() == [1, 2]


def test_a_newcomer_waits_for_a_predecessor_still_exiting(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A promoted spare on the host of a failed worker that is still ending: it says it waits,
    and takes the lock as soon as the predecessor is gone."""
    directory = tmp_path / "ckpt"
    first = holder(processes, directory)
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 60.0)
    made: list[CheckpointManager | BaseException] = []

    def make() -> None:
        try:
            made.append(mlp(directory))
        except BaseException as exc:
            made.append(exc)

    with caplog.at_level(logging.INFO, logger="cluster.storage.checkpoint_lock"):
        thread = threading.Thread(target=make)
        thread.start()
        try:
            waiting = f"CheckpointManager (pid {first.pid} on host "

            def said() -> bool:
                return any(waiting in r.getMessage() for r in caplog.records)

            wait_until(said, 30, "the newcomer to say it waits")
            assert "waiting up to 60 s for it to end" in caplog.records[-1].getMessage()
            first.signal(signal.SIGKILL)
        finally:
            thread.join(60)
    assert not thread.is_alive()
    newcomer = made[0]
    assert isinstance(newcomer, CheckpointManager), newcomer
    assert newcomer.steps() == [1]
    newcomer.close()


def test_a_forked_child_of_the_holder_does_not_keep_the_lock(
    processes: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ckpt"
    first = holder(processes, directory, "--fork")
    child = int(first.output.split("forked ", 1)[1].split()[0])
    try:
        first.signal(signal.SIGKILL)
        first.wait(10)
        assert Path(f"/proc/{child}").exists()  # the child lives on
        monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
        mlp(directory).close()
    finally:
        os.kill(child, signal.SIGKILL)


def test_in_one_process_a_manager_closed_or_dropped_lets_the_next_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second manager of one rank and prefix is refused at once (nothing to wait for);
    another prefix or another rank in the same directory is independent."""
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 60.0)  # not waited for in one process
    first = mlp(tmp_path)
    first.save(1, {"step": 1})
    ours = r"in use by another CheckpointManager of this process \(pid \d+\): .*close\(\) that"
    with pytest.raises(CheckpointError, match=ours):
        mlp(tmp_path)
    ema = mlp(tmp_path, "mlp-ema")
    other_rank = mlp(tmp_path, rank=1)
    first.close()
    second = mlp(tmp_path)
    assert second.steps() == [1]
    with pytest.raises(CheckpointError, match=ours):
        first.steps()  # used again, a closed manager takes the lock again: second holds it
    del second  # dropped without close(): its lock goes with it
    assert first.steps() == [1]
    first.close()
    ema.close()
    other_rank.close()


def test_a_manager_made_before_init_locks_only_the_rank_it_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker of a host may make its manager before cluster.init() (rank 0 until then):
    none takes rank 0's lock before it uses the files as rank 0."""
    monkeypatch.setattr(checkpoint_lock, "WAIT_S", 0.0)
    early = [mlp(tmp_path, rank=None) for _ in range(3)]
    assert early[0].rank == 0
    early[0].save(1, {"step": 1})  # used outside a job: rank 0's files, locked now
    with pytest.raises(CheckpointError, match="of this process"):
        early[1].steps()
    for manager in early:
        manager.close()


@pytest.mark.parametrize("planted", ["symlink", "hardlink"])
def test_a_planted_lock_file_is_refused_and_never_written(tmp_path: Path, planted: str) -> None:
    rank_dir = tmp_path / "rank_0"
    rank_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("precious\n")
    if planted == "symlink":
        (rank_dir / ".mlp.lock").symlink_to(elsewhere)
        why = "is a symbolic link"
    else:
        os.link(elsewhere, rank_dir / ".mlp.lock")
        why = "is a file with 2 names"
    with pytest.raises(CheckpointError, match=f"{rank_dir / '.mlp.lock'} {why}.*remove it"):
        mlp(tmp_path)
    assert elsewhere.read_text() == "precious\n"


def test_a_file_system_without_locks_is_said_once_and_the_manager_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """flock refused (ENOLCK: NFS without its lock daemon; Lustre without flock says ENOSYS)."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    warnings = caplog.at_level(logging.WARNING, logger="cluster.storage.checkpoint_lock")
    with warnings, mlp(tmp_path) as ckpt:
        ckpt.save(1, {"step": 1})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert f"cannot lock {tmp_path / 'rank_0' / '.mlp.lock'} (No locks available)" in lines[0]
    assert "goes on without the lock" in lines[0]
