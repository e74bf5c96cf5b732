"""cluster.torch.init_process_group() called once, at the top of the program, before the
TrainingLoop (torchrun's habit), as the module's example once taught; every step all_reduces
ones over the default group. Each rank prints its steps and, at the end, w: 40 steps times the
world size (2) when every step counted once. Checkpoints go under $CK."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import cluster
import cluster.torch

STEPS = 40
cluster.init()
cluster.torch.init_process_group()
rank = cluster.get_rank()
print(f"rank {rank} made its group in generation {cluster.get_generation()}", flush=True)
w = torch.zeros(4, dtype=torch.float64)


def get_state() -> dict[str, Any]:
    return {"w": w.clone()}


def set_state(state: dict[str, Any]) -> None:
    w.copy_(state["w"])


checkpoints = cluster.CheckpointManager(os.environ["CK"], "early", cluster.CheckpointConfig(5, 3))
loop = cluster.TrainingLoop(STEPS, checkpoints, get_state, set_state)
for step in loop:
    with loop.step():
        t = torch.ones(4, dtype=torch.float64)
        dist.all_reduce(t)
        w += t
        print(f"rank {rank} step {step} done", flush=True)
        time.sleep(0.05)  # sleep-ok: a step's work, so that the test's kill lands mid-run
print(f"rank {rank} loop over: w={w[0].item():g}", flush=True)
cluster.finalize()
