"""A worker for test_fuzz.py: joins, serves a checkpoint to its peers, and waits where told.

Each rank saves the checkpoint of step 1 (prefix `fuzz`, under CHECKPOINTS), which starts its
state server and publishes it in the job's key-value store (with recovery on), and sets the key
`fuzz/rank-<rank>`; then it prints `ready rank=<rank>`. Rank 0 gathers at once and waits there
for rank 1; rank 1 first waits until the file GO exists, so that the fuzzer's calls are made
while a collective round is open. Then both pass a barrier, print their generation and finish.

    python tests/integration/scripts/fuzz_target.py GO CHECKPOINTS
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import cluster
from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.testing import wait_until

WAIT_S = 300.0
CONFIG = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("go", type=Path)
    parser.add_argument("checkpoints", type=Path)
    args = parser.parse_args()
    cluster.init()
    rank = cluster.get_rank()
    with CheckpointManager(args.checkpoints, "fuzz", CONFIG) as manager:
        manager.save(1, {"w": np.arange(1000, dtype=np.float64) * (rank + 1)})
        manager.flush()
        cluster.kv_store().set(f"fuzz/rank-{rank}", f"set by rank {rank}".encode())
        print(f"ready rank={rank}", flush=True)
        if rank == 1:
            wait_until(args.go.exists, WAIT_S, f"{args.go} to appear")
        result = cluster.allgather_object(rank)
        print(f"gathered rank={rank} result={result}", flush=True)
        cluster.barrier()
    print(f"done rank={rank} generation={cluster.get_generation()}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
