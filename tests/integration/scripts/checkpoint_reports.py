"""Checkpoints of a one-element state saved in a job, counting the reports the scheduler gets.

    MS_ROLE=MS_WORKER ... python checkpoint_reports.py CKPT_DIR [--saves N] [--keep K]
        [--flush] [--hold GO_FILE] [--return]

Saves steps 1 to N (default 1) under CKPT_DIR with prefix 'p', keeping K (default 3), its
reports going to the scheduler through a counter. `--flush`: then `flush()`, and print one line
`flushed reports=<reports sent> waits=<stats.waits> persisted=<stats.persisted> newest=<step>`.
`--hold GO_FILE`: then wait until GO_FILE exists (the test reads the job's status meanwhile).
Last `cluster.finalize()`, with no flush of its own, and `finalized`; with `--return`, the
program returns instead (the finalize at exit).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import cluster
from cluster.api import runtime
from cluster.testing import wait_until

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--saves", type=int, default=1)
parser.add_argument("--keep", type=int, default=3)
parser.add_argument("--flush", action="store_true")
parser.add_argument("--hold")
parser.add_argument("--return", dest="returns", action="store_true")
args = parser.parse_args()

cluster.init()
sent: list[list[int]] = []


def report(steps: list[int]) -> int:
    sent.append(steps)
    return runtime.report_checkpoints(steps)


config = cluster.CheckpointConfig(keep_checkpoint_max=args.keep)
checkpoints = cluster.CheckpointManager(args.directory, "p", config, report=report)
state = {"w": np.ones(1)}
for step in range(1, args.saves + 1):
    checkpoints.save(step, state)
if args.flush:
    checkpoints.flush()
    stats = checkpoints.stats
    newest = sent[-1][-1] if sent and sent[-1] else 0
    print(
        f"flushed reports={len(sent)} waits={stats.waits} persisted={stats.persisted} "
        f"newest={newest}",
        flush=True,
    )
if args.hold:
    go = Path(args.hold)
    wait_until(go.exists, 120, f"{go} to exist")
if not args.returns:
    cluster.finalize()
    print("finalized", flush=True)
