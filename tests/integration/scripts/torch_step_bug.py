"""Two workers train with a TrainingLoop over a gloo group (made in set_state and the step, as
the docs have it); at step 3, rank 1 divides by zero inside its step, a bug
of the program, not a peer's failure. Each rank prints its steps and how its all_reduce ended.
Checkpoints go under $CK.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import cluster
import cluster.torch

cluster.init()
rank = cluster.get_rank()
w = torch.zeros(4, dtype=torch.float64)


def get_state() -> dict[str, Any]:
    return {"w": w.clone()}


def set_state(state: dict[str, Any]) -> None:
    w.copy_(state["w"])
    cluster.torch.init_process_group()


checkpoints = cluster.CheckpointManager(os.environ["CK"], "bug", cluster.CheckpointConfig(1, 3))
loop = cluster.TrainingLoop(8, checkpoints, get_state, set_state)
for step in loop:
    with loop.step():
        cluster.torch.init_process_group()
        if rank == 1 and step == 3:
            print(f"rank {rank} divides by zero", flush=True)
            print(1 / 0)
        t = torch.ones(4, dtype=torch.float64)
        try:
            dist.all_reduce(t)
        except Exception as exc:
            print(f"rank {rank} all_reduce raised {type(exc).__name__}", flush=True)
            raise
        w += t
        print(f"rank {rank} step {step} done", flush=True)
cluster.finalize()
