"""The training demo (examples/run_training_demo.sh) touches only its own processes, and fails
when the fault it injected did not land.

It once found "worker 2" by scanning every process of the machine for `examples/train_mlp.py`
with MS_NODE_ID=2: beside another job running that script it SIGKILLed the other job's process,
its own run had no fault, and it still printed `identical`. Here that other job is a decoy: a
process whose command line (`python examples/train_mlp.py ...`) and environment (MS_ROLE,
MS_NODE_ID=2) are the demo's worker 2's. The demo runs a smaller workload (STEPS, KILL_STEP).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from cluster.testing import free_port
from tests.procs import PYTHON, ROOT, Procs, job_env

DEMO = ROOT / "examples" / "run_training_demo.sh"
SMALL = {"STEPS": "40", "KILL_STEP": "15"}

# Another job's worker 2, to the eye: it records every catchable signal it gets, then waits.
DECOY = """\
import signal, sys, time
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(signum, lambda n, _f: print(f"got {signal.Signals(n).name}", flush=True))
print("decoy running", flush=True)
time.sleep(600)  # sleep-ok: the decoy only waits to be looked at
"""


def run_demo(
    tmp_path: Path, sizes: dict[str, str] = SMALL, **extra: str
) -> subprocess.CompletedProcess[str]:
    """The demo script, in `tmp_path/demo`, sized by `sizes` ({}: as the README runs it)."""
    return subprocess.run(
        ["bash", str(DEMO)],
        env={
            **job_env(1, 1),
            "OUT": str(tmp_path / "demo"),
            "PYTHON": PYTHON,
            "PORT": str(free_port()),
            **sizes,
            **extra,
        },
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def start_decoy(processes: Procs, tmp_path: Path) -> subprocess.Popen[bytes]:
    other = tmp_path / "other-job"
    (other / "examples").mkdir(parents=True)
    (other / "examples" / "train_mlp.py").write_text(DECOY)
    args = [sys.executable, "examples/train_mlp.py", "--steps", "120", "--save-every", "10"]
    env = {**job_env(4, free_port()), "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "2"}
    decoy = processes.start("decoy", args, env, cwd=other)
    decoy.wait_for_output("decoy running", 30)
    return decoy.popen


def test_the_demo_beside_another_jobs_worker_2_leaves_it_untouched(
    processes: Procs, tmp_path: Path
) -> None:
    decoy = start_decoy(processes, tmp_path)
    result = run_demo(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert decoy.poll() is None, f"the other job's process exited {decoy.returncode}"
    assert (tmp_path / "decoy.log").read_text() == "decoy running\n"  # no signal either
    assert "sent SIGKILL to worker 2" in result.stdout
    assert str(decoy.pid) not in result.stdout
    assert "was killed by SIGKILL; restarting it" in result.stdout
    assert "identical" in result.stdout
    decoy.send_signal(signal.SIGKILL)


def test_a_demo_whose_kill_did_not_land_fails(tmp_path: Path) -> None:
    """SIGCONT reaches worker 2 (the demo's own) as SIGKILL would, and does nothing to it: the
    faulty run has no restart, no failure, no new generation; the demo must say so and fail,
    not print `identical`."""
    result = run_demo(tmp_path, SIGNAL="CONT")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "sent SIGCONT to worker 2" in result.stdout
    assert (
        "the kill of worker 2 did not land: no restart of worker 2 in the launcher's output"
        in result.stderr
    ), result.stderr
    assert "identical" not in result.stdout


def test_a_demo_whose_port_is_taken_says_why_and_what_to_do(tmp_path: Path) -> None:
    """Another process on the demo's port: its first run fails at once, and the demo shows the
    end of that run's log (the launcher's line naming the port) and says to set PORT, instead
    of exiting with nothing said."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_demo(tmp_path, PORT=str(port))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "demo: the clean run failed (exit status 2); the end of " in result.stderr
    assert f"--master-port {port} is already in use on 127.0.0.1" in result.stderr
    assert "PORT=<port> bash scripts/demo" in result.stderr, result.stderr
    assert "== run 2" not in result.stdout
