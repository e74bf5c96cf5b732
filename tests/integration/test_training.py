"""Training that survives faults: examples/train_mlp.py with SIGKILLs of workers and of the
scheduler ends with bit-for-bit the parameters of the run without faults."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.procs import (
    PYTHON,
    ROOT,
    Proc,
    Procs,
    free_port,
    job_env,
    private_copy,
    processes_running,
    wait_until,
)

pytest.importorskip("numpy")

TRAIN = ROOT / "examples" / "train_mlp.py"
WORKERS = 4
STEPS = 60
NODE_TIMEOUT_S = "2"
STEP_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\d+\.\d+)$", re.MULTILINE)


def train_args(out: Path) -> list[str]:
    return [
        "--steps",
        str(STEPS),
        "--save-every",
        "5",
        "--step-delay",
        "0.03",
        "--out",
        str(out),
    ]


def steps_done(proc: Proc) -> int:
    return len(STEP_LINE.findall(proc.output))


class Job:
    """A scheduler and WORKERS workers of train_mlp.py started by hand, recovery on."""

    def __init__(self, processes: Procs, tmp: Path, name: str) -> None:
        self.processes = processes
        self.out = tmp / name
        self.env = job_env(
            WORKERS,
            free_port(),
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(tmp / f"{name}-recovery"),
            MS_NODE_TIMEOUT=NODE_TIMEOUT_S,
        )
        self.args = [str(TRAIN), *train_args(self.out)]
        self.name = name
        self.scheduler = self.start_scheduler()
        self.workers = [self.start_worker(i) for i in range(WORKERS)]

    def start_scheduler(self) -> Proc:
        index = sum(1 for p in self.processes.started if p.name.startswith(f"{self.name}-sched"))
        return self.processes.start_role(
            f"{self.name}-sched{index}", "MS_SCHED", self.args, self.env
        )

    def start_worker(self, i: int) -> Proc:
        index = sum(1 for p in self.processes.started if p.name.startswith(f"{self.name}-w{i}."))
        return self.processes.start_role(
            f"{self.name}-w{i}.{index}", "MS_WORKER", self.args, {**self.env, "MS_NODE_ID": str(i)}
        )

    def kill_worker_at(self, i: int, step: int) -> None:
        victim = self.workers[i]
        wait_until(lambda: steps_done(victim) >= step, 60, f"worker {i} at step {step}")
        victim.popen.send_signal(signal.SIGKILL)
        victim.wait(10)
        self.workers[i] = self.start_worker(i)

    def kill_scheduler_at(self, step: int) -> None:
        wait_until(lambda: steps_done(self.workers[0]) >= step, 60, f"step {step}")
        self.scheduler.popen.send_signal(signal.SIGKILL)
        self.scheduler.wait(10)
        self.scheduler = self.start_scheduler()

    def final_hash(self) -> str:
        for worker in self.workers:
            assert worker.wait(120) == 0, worker.output
        assert self.scheduler.wait(30) == 0, self.scheduler.output
        return (self.out / "final.sha256").read_text().strip()


@pytest.fixture(scope="module")
def fault_free_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("fault-free")
    procs = Procs(tmp)
    try:
        job = Job(procs, tmp, "clean")
        digest = job.final_hash()
        lines = STEP_LINE.findall(job.workers[0].output)
        assert len(lines) == STEPS
        assert lines[0][:2] == ("1", "1")
        assert float(lines[-1][2]) < float(lines[0][2])  # it learns
        return digest
    finally:
        procs.kill_all()


def test_fault_free_runs_are_reproducible(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    assert Job(processes, tmp_path, "again").final_hash() == fault_free_hash


def test_worker_killed_mid_run_rejoins_and_the_result_is_exact(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    job = Job(processes, tmp_path, "kill1")
    job.kill_worker_at(2, 23)
    assert job.final_hash() == fault_free_hash
    restarted = job.workers[2]
    assert "resuming from step 20" in restarted.output
    assert "a peer failed" in job.workers[0].output


def test_scheduler_killed_mid_run_and_restarted_the_result_is_exact(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    job = Job(processes, tmp_path, "sched")
    job.kill_scheduler_at(17)
    assert job.final_hash() == fault_free_hash
    assert "resuming job" in job.scheduler.output


def test_same_worker_killed_twice_and_two_workers_killed(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    job = Job(processes, tmp_path, "many")
    job.kill_worker_at(1, 12)
    job.kill_worker_at(1, 8)  # counted in the new process's own output
    job.kill_worker_at(3, 30)
    job.kill_worker_at(0, 40)
    assert job.final_hash() == fault_free_hash


def test_worker_killed_while_saving_every_step(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    """With a checkpoint every step, a kill lands in or next to a checkpoint write."""
    job = Job(processes, tmp_path, "ckpt")
    job.args[job.args.index("--save-every") + 1] = "1"
    job.kill_worker_at(3, 9)
    assert job.final_hash() == fault_free_hash


def test_launcher_restarts_the_killed_worker_and_the_result_is_exact(
    processes: Procs, tmp_path: Path, fault_free_hash: str
) -> None:
    script = private_copy(tmp_path, TRAIN)
    out = tmp_path / "launched"
    run = processes.start(
        "run",
        [
            PYTHON,
            "-m",
            "cluster",
            "run",
            "--worker-num",
            str(WORKERS),
            "--local-worker-num",
            str(WORKERS),
            "--master-port",
            str(free_port()),
            "--log-dir",
            str(tmp_path / "logs"),
            "--enable-recovery",  # the state goes to LOG_DIR/recovery
            "--max-restarts",
            "2",
            "--node-timeout",
            NODE_TIMEOUT_S,
            str(script),
            *train_args(out),
        ],
        job_env(WORKERS, 0),
    )
    log = tmp_path / "logs" / "worker_1.log"
    wait_until(
        lambda: log.exists() and len(STEP_LINE.findall(log.read_text())) >= 25, 60, "step 25"
    )
    victim = next(
        pid
        for pid in processes_running(str(script))
        if b"MS_NODE_ID=1\x00" in Path(f"/proc/{pid}/environ").read_bytes()
    )
    os.kill(victim, signal.SIGKILL)
    assert run.wait(120) == 0, run.output
    assert (out / "final.sha256").read_text().strip() == fault_free_hash
    assert (tmp_path / "logs" / "recovery" / "scheduler.json").is_file()
