"""Training throughput of examples/train_torch.py's loop body with and without checkpoints.

One real worker in this process (a real scheduler process beside it), the example's Trainer
(DDP over the gloo group cluster.torch makes, gradients added in rank order), inside a
`cluster.TrainingLoop` whose CheckpointManager reports to the scheduler. Nothing else differs
between the runs: the checkpoint interval, and whether each save waits for the disk.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import cluster
import cluster.torch
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.tools.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
MODES = ("no checkpoint", "every step", "every step, sync (flush)")


class FlushingManager(CheckpointManager):
    """Each save waits until its file is written and reported: a synchronous checkpoint."""

    def save(self, step: int, state: Any) -> Path:
        path = super().save(step, state)
        self.flush()
        return path


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_torch", ROOT / "examples/train_torch.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def join_job(directory: Path) -> subprocess.Popen[bytes]:
    """A scheduler process for a job of one worker, and this process as that worker."""
    env = {
        "MS_WORKER_NUM": "1",
        "MS_SCHED_HOST": "127.0.0.1",
        "MS_SCHED_PORT": str(free_port()),
    }
    log = open(directory / "scheduler.log", "wb")  # noqa: SIM115 - the process keeps it
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "cluster", "scheduler"],
        env={**os.environ, **env, "MS_ROLE": "MS_SCHED"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    os.environ.update({**env, "MS_ROLE": "MS_WORKER"})
    cluster.init()
    return scheduler


def run(
    module: ModuleType, trainer: Any, directory: Path, mode: str, steps: int, delay_s: float
) -> float:
    """Steps per second of one run of `steps` steps."""
    every = steps if mode == MODES[0] else 1
    kind = FlushingManager if mode == MODES[2] else CheckpointManager
    checkpoints = kind(directory, "torch", CheckpointConfig(every, 3), rank=0, recovery=False)
    loop = cluster.TrainingLoop(steps, checkpoints, trainer.get_state, trainer.set_state)
    x, y = module.dataset()
    start = time.perf_counter()
    for step in loop:
        with loop.step():
            rows = module.shard(step, 0, 1)
            trainer.step(x[rows], y[rows])
            if delay_s > 0:
                time.sleep(delay_s)  # train_torch.py --step-delay: a step that waits (a device)
    elapsed = time.perf_counter() - start
    checkpoints.close()
    return steps / elapsed


def throughput(directory: Path, steps: int, repeat: int, delays: list[float]) -> dict[str, Any]:
    module = example()
    scheduler = join_job(directory)
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        trainer = module.Trainer(module.GLOBAL_BATCH, torch.device("cpu"), "gloo")
        rates = {(d, mode): [] for d in delays for mode in MODES}
        for round_ in range(repeat + 1):  # round 0 warms up
            for (delay_s, mode), measured in rates.items():
                where = directory / f"{round_}-{len(measured)}-{delay_s}-{MODES.index(mode)}"
                rate = run(module, trainer, where, mode, steps, delay_s)
                if round_ > 0:
                    measured.append(rate)
        cluster.torch.destroy_process_group()
        cluster.finalize()
        scheduler.wait(30)
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
            scheduler.wait()
    return report(rates, steps, repeat)


def report(rates: dict[tuple[float, str], list[float]], steps: int, repeat: int) -> dict[str, Any]:
    print(
        f"\ntraining throughput, examples/train_torch.py's loop body, 1 worker, {steps} steps a "
        f"run, median of {repeat} runs"
    )
    print(
        f"{'--step-delay':>12}  {'checkpoints':<26}  {'steps/s':>8}  {'ms/step':>8}  {'of none':>7}"
    )
    results: dict[str, Any] = {}
    for (delay_s, mode), measured in rates.items():
        rate = statistics.median(measured)
        base = statistics.median(rates[(delay_s, MODES[0])])
        print(f"{delay_s:12g}  {mode:<26}  {rate:8.1f}  {1e3 / rate:8.2f}  {rate / base:7.0%}")
        results[f"{delay_s} {mode}"] = {"steps_s": rate, "of_none": rate / base, "all": measured}
    return results
