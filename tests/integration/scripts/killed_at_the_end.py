"""A short training loop whose node '1' SIGKILLs itself at the last step, the first time only
(its marker file in DIR exists after): a spare takes rank 1 and the job ends a step later. Node
'1' started again stands for a restart slower than that end: it exits 0 after `--late`
seconds, without joining (a real one would wait for the gone scheduler until its deadline).

    killed_at_the_end.py DIR [--steps N] [--late S]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import cluster

parser = argparse.ArgumentParser()
parser.add_argument("dir", type=Path, help="checkpoints, and node 1's marker")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--late", type=float, default=30.0)
args = parser.parse_args()

marker = args.dir / "killed"
node_1 = os.environ.get("MS_NODE_ID") == "1"
if node_1 and marker.exists():
    time.sleep(args.late)  # sleep-ok: the fault, a restart that comes after the job's end
    sys.exit(0)

cluster.init()
state: dict[str, Any] = {"x": np.zeros(4)}
checkpoints = cluster.CheckpointManager(
    args.dir / "checkpoints", "late", cluster.CheckpointConfig(save_checkpoint_steps=2)
)
loop = cluster.TrainingLoop(args.steps, checkpoints, lambda: state, state.update)
for step in loop:
    with loop.step():
        state["x"] = state["x"] + 1
        if node_1 and step == args.steps - 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        cluster.barrier()
cluster.finalize()
