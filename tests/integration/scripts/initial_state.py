"""A recoverable loop over a numpy state of MIB MiB (replicas): each step adds 1 to it, and the
ranks meet at a barrier; checkpoints go to CKPT_DIR/rank_<r>/ every 2 steps. Every worker prints
`node <id> rank <r> final w <value>` at the end.

    MS_ROLE=MS_WORKER ... python initial_state.py CKPT_DIR [--mib N] [--steps N]
        [--flush-in-step S] [--measure-in-step S] [--told-every-rank-holds] [--die-in-step S]
        [--recovery-argument on|off]

`--flush-in-step S`: in step S, wait until the checkpoints saved so far are written and their
report answered (the loop's next boundary takes the answer in). `--measure-in-step S`: print in
step S the memory the process has allocated beyond the state (tracemalloc, numpy's buffers
included): `grown by X MiB beyond the state`. `--told-every-rank-holds`: node '0''s checkpoints
are reported to nobody, and its report answers that every rank holds its newest step; the
scheduler counts none for it, so every rollback step is 0, and no step is kept in memory
(`memory_snapshot=0`). `--die-in-step S`: node '1', in its first process, exits 1 in step S,
before its barrier. `--recovery-argument`: the manager is made with `recovery=True` (on) or
`recovery=False` (off), whatever the job runs with.
"""

from __future__ import annotations

import argparse
import os
import tracemalloc
from pathlib import Path

import numpy as np

import cluster

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--mib", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--flush-in-step", type=int, default=-1)
    parser.add_argument("--measure-in-step", type=int, default=-1)
    parser.add_argument("--told-every-rank-holds", action="store_true")
    parser.add_argument("--die-in-step", type=int, default=-1)
    parser.add_argument("--recovery-argument", choices=("on", "off"))
    args = parser.parse_args()
    node = os.environ["MS_NODE_ID"]
    told = args.told_every_rank_holds
    config = cluster.CheckpointConfig(
        save_checkpoint_steps=2, keep_checkpoint_max=3, memory_snapshot=0 if told else 1 << 30
    )
    cluster.init()
    report = (lambda held: held[-1] if held else None) if told and node == "0" else None
    given = None if args.recovery_argument is None else args.recovery_argument == "on"
    checkpoints = cluster.CheckpointManager(
        args.directory, "w", config, report=report, recovery=given
    )
    tracemalloc.start()
    state = {"w": np.zeros(args.mib * MIB // 8)}
    base = tracemalloc.get_traced_memory()[0]
    loop = cluster.TrainingLoop(args.steps, checkpoints, lambda: state, state.update)
    for step in loop:
        with loop.step():
            if step == args.die_in_step and node == "1" and not cluster.is_rejoin():
                print(f"node 1 dies in step {step}", flush=True)
                os._exit(1)
            if step == args.flush_in_step:
                checkpoints.flush()
            if step == args.measure_in_step:
                grown = (tracemalloc.get_traced_memory()[0] - base) / MIB
                print(f"grown by {grown:.0f} MiB beyond the state", flush=True)
            state["w"] = state["w"] + 1
            cluster.barrier()
    print(f"node {node} rank {cluster.get_rank()} final w {state['w'][0]}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
