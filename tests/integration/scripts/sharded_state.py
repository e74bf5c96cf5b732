"""A recoverable loop whose state differs per rank (`CheckpointConfig(replicated=False)`, as
optimizer shards do): each step adds rank + 1 to this rank's shard, and every rank meets the
others at a barrier. Checkpoints go to CKPT_DIR/rank_<r>/ every step; it prints `at step k` as
each step begins.

    MS_ROLE=MS_WORKER ... python sharded_state.py CKPT_DIR [--steps N] [--step-delay S] [--early]

`--early`: the CheckpointManager is made before `cluster.init()` (its rank is the job's once the
loop connects it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import cluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--early", action="store_true")
    args = parser.parse_args()
    # Kept generously: a rank's reports lag its saves, so the job's rollback step can be several
    # steps behind the newest step a fast rank has written (with 3 kept, a survivor had pruned it).
    config = cluster.CheckpointConfig(
        save_checkpoint_steps=1, keep_checkpoint_max=10, replicated=False
    )
    early = cluster.CheckpointManager(args.directory, "shard", config) if args.early else None
    cluster.init()
    rank = cluster.get_rank()
    state = {"shard": np.zeros(1000)}
    checkpoints = early or cluster.CheckpointManager(args.directory, "shard", config)
    loop = cluster.TrainingLoop(args.steps, checkpoints, lambda: state, state.update)
    for step in loop:
        with loop.step():
            print(f"at step {step}", flush=True)
            state["shard"] = state["shard"] + (rank + 1)
            cluster.barrier()
            time.sleep(args.step_delay)  # sleep-ok: the step's work, as examples/train_mlp.py
    print(f"rank {rank} final shard {state['shard'][0]}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
