"""`mscluster chaos` keeps its log directory's lock as `mscluster run` does: a lock file
removed while the run goes on is locked anew within a check, and keeps another run out."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.testing import wait_until
from cluster.tools.launch_lock import LOCK_FILE, LogDirLock
from tests.procs import PYTHON, ROOT, Procs, private_copy


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
    chaos.signal(signal.SIGTERM)
    chaos.wait(60)
