"""The soak test: random faults of every kind over one training run of examples/train_mlp.py
with 4 workers, through `mscluster chaos`. The final parameters equal the fault-free run's, no
process is left, and no state file is corrupt.

CI runs a short form (CLUSTER_SOAK_FAULTS, default 6 faults); the full soak is 20:

    CLUSTER_SOAK_FAULTS=20 .venv/bin/python -m pytest tests/chaos -m chaos
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cluster.storage import store
from cluster.testing import free_port
from tests.procs import PYTHON, ROOT, private_copy, processes_running

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]

FAULTS = int(os.environ.get("CLUSTER_SOAK_FAULTS", "6"))
STEPS = 60 * FAULTS  # long enough that the faults land while it trains
TRAIN_ARGS = ["--steps", str(STEPS), "--save-every", "10", "--step-delay", "0.04"]


def test_random_faults_of_every_kind_leave_the_result_exact(tmp_path: Path) -> None:
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    clean = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "run", "--worker-num", "4"),
            *("--master-port", str(free_port()), "--log-dir", str(tmp_path / "clean-logs")),
            *(str(script), "--steps", str(STEPS), "--out", str(tmp_path / "clean")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert clean.returncode == 0, clean.stderr
    report_path = tmp_path / "report.json"
    chaos = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "chaos", "--seed", "7", "--every", "2"),
            *("--duration", "600", "--count", str(FAULTS), "--report", str(report_path), "--"),
            *("--worker-num", "4", "--local-worker-num", "4", "--log-dir", str(tmp_path / "logs")),
            *(str(script), *TRAIN_ARGS, "--out", str(tmp_path / "faulty")),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    print(chaos.stderr[-3000:])
    assert chaos.returncode == 0, chaos.stderr
    report = json.loads(report_path.read_text())
    assert report["ok"] is True
    assert len(report["faults"]) == FAULTS
    assert {f["kind"] for f in report["faults"]} == {"kill", "stop", "scheduler"}
    for fault in report["faults"]:
        assert fault["recovered_after_s"] is not None, fault
        if fault["kind"] == "kill":
            assert fault["detected_after_s"] < 3.0, fault
    faulty = (tmp_path / "faulty" / "final.sha256").read_text()
    assert faulty == (tmp_path / "clean" / "final.sha256").read_text()
    assert processes_running(str(script)) == []
    state = tmp_path / "logs" / "state"
    assert store.load(state / "scheduler.json", "scheduler") is not None
    for i in range(4):
        saved = store.load(state / f"worker-{i}.json", "worker")
        assert saved is not None
        assert saved["finished"] is True


def test_faults_stop_when_the_job_ends_before_the_count(tmp_path: Path) -> None:
    """A short job and many faults asked for: chaos stops injecting once a rank finishes (a
    fault then would wait for a recovery a finished job never makes) and reports success."""
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    report_path = tmp_path / "report.json"
    chaos = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "chaos", "--seed", "3", "--every", "0.3"),
            *("--faults", "kill", "--count", "50", "--report", str(report_path), "--"),
            *("--worker-num", "2", "--local-worker-num", "2", "--log-dir", str(tmp_path / "logs")),
            *(str(script), "--steps", "40", "--save-every", "5", "--step-delay", "0.02"),
            *("--out", str(tmp_path / "out")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert chaos.returncode == 0, chaos.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] is True, report
    assert len(report["faults"]) < 50
    assert processes_running(str(script)) == []
