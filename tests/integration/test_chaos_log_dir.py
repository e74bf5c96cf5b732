"""`mscluster chaos` keeps its log directory's lock as `mscluster run` does: a lock file
removed while the run goes on is locked anew within a check, and keeps another run out; one
started before that is refused by the directory's own lock, having written nothing."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.testing import free_port, wait_until
from cluster.tools.launch_lock import LOCK_FILE, LogDirLock
from tests.procs import MSCLUSTER, PYTHON, ROOT, Procs, private_copy


def test_a_chaos_run_whose_lock_file_was_removed_locks_a_new_one_that_keeps_others_out(
    processes: Procs, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    chaos = processes.start(
        "chaos",
        [
            PYTHON, "-m", "cluster", "chaos", "--seed", "1", "--every", "60", "--faults", "kill",
            "--duration", "120", "--", "--worker-num", "1", "--log-dir", str(logs),
            str(script), "--steps", "100000", "--step-delay", "0.05", "--out", str(tmp_path / "o"),
        ],
        os.environ,
    )  # fmt: skip
    wait_until((logs / LOCK_FILE).exists, 30, "the chaos run to lock its log directory")
    (logs / LOCK_FILE).unlink()
    chaos.wait_for_output("was removed or replaced while this run held it, so it kept", 30)
    assert "locked the file there anew" in chaos.output
    with pytest.raises(ConfigError, match=f"pid {chaos.pid} on this host"):
        LogDirLock(logs).take(0)

    # Removed again while the chaos run is stopped (it cannot lock it anew first): a launcher
    # started meanwhile is refused by the directory's own lock, and makes or replaces nothing.
    # The run's scheduler goes on while the run is stopped: it has made its files first.
    wait_until(
        lambda: all((logs / name).exists() for name in ("events.jsonl", "state")),
        30,
        "the chaos run's scheduler to make its event log and state",
    )
    chaos.signal(signal.SIGSTOP)
    wait_until(chaos.stopped, 10, "the chaos run to stop")
    (logs / LOCK_FILE).unlink()
    before = own_files(logs)
    late = subprocess.run(
        [*MSCLUSTER, "run", "--log-dir", str(logs), "--master-port", str(free_port()), str(script)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert late.returncode == 2, late.stderr
    assert "(which holds the directory; its launcher.lock was removed or replaced" in late.stderr
    assert own_files(logs) == before
    assert not (logs / LOCK_FILE).exists()
    chaos.signal(signal.SIGCONT)
    chaos.wait_for_output("locked the file there anew", 30)
    chaos.signal(signal.SIGTERM)
    chaos.wait(60)


def own_files(logs: Path) -> dict[str, object]:
    """What a launcher would make or replace among a running chaos run's files: the names,
    and the job secret and pids (inode and bytes); the processes' logs grow meanwhile."""
    found: dict[str, object] = {"names": sorted(p.name for p in logs.iterdir())}
    for name in ("job.secret", "pids"):
        path = logs / name
        found[name] = (path.stat().st_ino, path.read_bytes()) if path.exists() else None
    return found
