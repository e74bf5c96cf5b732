"""A program that calls cluster.barrier() before its TrainingLoop: in generation 1 every rank
does, but a spare promoted into generation 2 runs the program from its start, and its barrier
meets rank 0's first collective of generation 2, the loop's resume allgather. Rank 0 makes
that allgather only once the spare's barrier is on its way (a kv key the spare sets first, and
a moment), so that rank 0's call is the one the scheduler finds mismatched. Rank 1 waits to be
killed at step 5; checkpoints go under $CK. The loop's error is raised as it is, once the
program has said which error of the scheduler it was raised for (its cause's type)."""

from __future__ import annotations

import os
import time
from typing import Any

import cluster
from cluster.api import training

cluster.init()
rank = cluster.get_rank()
if cluster.get_generation() > 1:
    cluster.kv_store().set("newcomer", "here")
cluster.barrier()
state = {"n": 0}


def get_state() -> dict[str, Any]:
    return dict(state)


def set_state(saved: dict[str, Any]) -> None:
    state.update(saved)


def after_the_newcomers_barrier() -> None:
    if rank == 0:
        cluster.kv_store().wait("newcomer", 60)
        time.sleep(2)  # sleep-ok: the spare's barrier reaches the scheduler first (the fault)


checkpoints = cluster.CheckpointManager(os.environ["CK"], "before", cluster.CheckpointConfig(5, 3))
loop = cluster.TrainingLoop(30, checkpoints, get_state, set_state)
training.remake_at_resume(after_the_newcomers_barrier)
try:
    for step in loop:
        with loop.step():
            state["n"] += 1
            cluster.barrier()
            print(f"rank {rank} step {step} done", flush=True)
            if rank == 1 and step == 5:
                time.sleep(120)  # sleep-ok: the test kills this process; this keeps it meanwhile
except cluster.ConfigError as exc:
    print(f"rank {rank} loop raised for {type(exc.__cause__).__name__}", flush=True)
    raise
cluster.finalize()
