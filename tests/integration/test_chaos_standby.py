"""`mscluster chaos --faults scheduler` with a standby scheduler on a real 3-member etcd: each
scheduler fault kills the scheduler that leads (never the standby), the job comes back on the
standby that takes over, the killed one returns as the new standby, and the report (text, JSON
and chaos-report.html) names both. The trained parameters equal a run without faults."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from cluster.testing import free_port
from tests.procs import PYTHON, ROOT, private_copy, processes_running
from tests.servers.etcd import EtcdCluster

FAULTS = 2
TRAIN = ["--steps", "400", "--save-every", "10", "--step-delay", "0.03"]


def test_scheduler_faults_kill_the_leader_and_the_standby_takes_over(
    tmp_path: Path, etcd_cluster: EtcdCluster
) -> None:
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    clean = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "run", "--worker-num", "4"),
            *("--master-port", str(free_port()), "--log-dir", str(tmp_path / "clean-logs")),
            *(str(script), *TRAIN, "--out", str(tmp_path / "clean")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert clean.returncode == 0, clean.stderr
    logs = tmp_path / "logs"
    chaos = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "chaos", "--faults", "scheduler", "--standbys", "1"),
            *("--seed", "3", "--every", "2", "--count", str(FAULTS), "--"),
            *("--worker-num", "4", "--local-worker-num", "4", "--log-dir", str(logs)),
            *("--state-url", etcd_cluster.state_url(), "--lease", "2"),
            *(str(script), *TRAIN, "--out", str(tmp_path / "faulty")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    print(chaos.stderr[-3000:])
    assert chaos.returncode == 0, chaos.stderr
    report = json.loads((logs / "chaos-report.json").read_text())
    faults = report["faults"]
    assert [f["kind"] for f in faults] == ["scheduler"] * FAULTS
    schedulers = {f["target"].removeprefix("leader ") for f in faults} | {
        f["took_over"] for f in faults
    }
    assert len(schedulers) == 2
    assert all(re.match(r"127\.0\.0\.[12]:\d+$", s) for s in schedulers)
    for fault in faults:
        assert fault["target"].startswith("leader "), fault
        assert fault["took_over"], fault
        assert fault["took_over"] not in fault["target"], fault
        assert fault["detected_after_s"] <= fault["recovered_after_s"], fault
    # The killed leader came back as the standby, so the next fault killed the new leader.
    assert faults[1]["target"] == f"leader {faults[0]['took_over']}"
    assert f"{faults[0]['took_over']} took over" in chaos.stderr
    assert f"{faults[0]['took_over']} took over" in (logs / "chaos-report.html").read_text()
    faulty = (tmp_path / "faulty" / "final.sha256").read_text()
    assert faulty == (tmp_path / "clean" / "final.sha256").read_text()
    assert processes_running(str(script)) == []


def test_standbys_without_a_state_url_are_refused_in_one_line(tmp_path: Path) -> None:
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    done = subprocess.run(
        [
            *(PYTHON, "-m", "cluster", "chaos", "--faults", "scheduler", "--standbys", "1"),
            *("--", "--worker-num", "2", "--local-worker-num", "2", str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "--standbys 1 needs --state-url etcd://" in done.stderr
    assert "Traceback" not in done.stderr
    assert processes_running(str(script)) == []
