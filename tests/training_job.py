"""A training example (train_mlp.py, train_torch.py) run by hand with recovery on, for tests
that SIGKILL its workers and its scheduler and compare the final parameters."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from cluster.testing import Process, free_port, wait_until
from tests.procs import PYTHON, Procs, job_env

WORKERS = 4
STEPS = 60
NODE_TIMEOUT_S = "2"
STEP_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\d+\.\d+)$", re.MULTILINE)


def train_args(out: Path, *, save_every: int = 5) -> list[str]:
    return [
        *("--steps", str(STEPS), "--save-every", str(save_every)),
        *("--step-delay", "0.03", "--out", str(out)),
    ]


def steps_done(proc: Process) -> int:
    return len(STEP_LINE.findall(proc.output))


@dataclass(frozen=True)
class Bounds:
    """How long a training job's waits may take: for a step, and for a worker's exit."""

    step_s: float = 60
    exit_s: float = 120


class TrainingJob:
    """A scheduler and WORKERS workers of `script` (or `MS_WORKER_NUM` of `env`). With
    `standalone_scheduler` the scheduler is `python -m cluster scheduler` (the script would
    import torch for nothing); otherwise it is the script in the MS_SCHED role, as the launch
    contract has it."""

    def __init__(
        self,
        processes: Procs,
        tmp: Path,
        name: str,
        script: Path,
        *,
        save_every: int = 5,
        standalone_scheduler: bool = False,
        bounds: Bounds | None = None,
        **env: str,
    ) -> None:
        """`bounds`: of a wait for a step, and for a worker's exit; `env`: more variables for
        every process of the job."""
        bounds = bounds or Bounds()
        wait_s, exit_s = bounds.step_s, bounds.exit_s
        self.processes = processes
        self.out = tmp / name
        self.env = job_env(
            WORKERS,
            free_port(),
            MS_ENABLE_RECOVERY="1",
            MS_RECOVERY_PATH=str(tmp / f"{name}-recovery"),
            MS_NODE_TIMEOUT=NODE_TIMEOUT_S,
            **env,
        )
        self.args = [str(script), *train_args(self.out, save_every=save_every)]
        self.name = name
        self.standalone_scheduler = standalone_scheduler
        self.wait_s = wait_s
        self.exit_s = exit_s
        self.scheduler = self.start_scheduler()
        self.workers = [self.start_worker(i) for i in range(int(self.env["MS_WORKER_NUM"]))]

    def _next_name(self, prefix: str) -> str:
        index = sum(1 for p in self.processes.started if p.name.startswith(prefix))
        return f"{prefix}{index}"

    def start_scheduler(self) -> Process:
        name = self._next_name(f"{self.name}-sched")
        if self.standalone_scheduler:
            return self.processes.start(name, [PYTHON, "-m", "cluster", "scheduler"], self.env)
        return self.processes.start_role(name, "MS_SCHED", self.args, self.env)

    def start_worker(self, i: int) -> Process:
        return self.processes.start_role(
            self._next_name(f"{self.name}-w{i}."),
            "MS_WORKER",
            self.args,
            {**self.env, "MS_NODE_ID": str(i)},
        )

    def kill_worker_at(self, i: int, step: int) -> None:
        victim = self.workers[i]
        wait_until(lambda: steps_done(victim) >= step, self.wait_s, f"worker {i} at step {step}")
        victim.popen.send_signal(signal.SIGKILL)
        victim.wait(10)
        self.workers[i] = self.start_worker(i)

    def kill_scheduler_at(self, step: int) -> None:
        wait_until(lambda: steps_done(self.workers[0]) >= step, self.wait_s, f"step {step}")
        self.scheduler.popen.send_signal(signal.SIGKILL)
        self.scheduler.wait(10)
        self.scheduler = self.start_scheduler()

    def final_hash(self) -> str:
        for worker in self.workers:
            assert worker.wait(self.exit_s) == 0, worker.output
        assert self.scheduler.wait(30) == 0, self.scheduler.output
        return (self.out / "final.sha256").read_text().strip()
