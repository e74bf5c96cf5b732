"""A worker that rolls back by hand, without TrainingLoop, as docs/guide/checkpoints.md shows:
after a failure it loads the generation's rollback step (`cluster.get_rollback_step()`) and
discards its checkpoints past it (`discard_newer(step)`), no generation number given.

    MS_ROLE=MS_WORKER MS_NODE_ID=<rank> ... python put_back_by_hand.py CKPT_DIR

Two ranks; the test kills rank 1 twice and starts it again each time (generations 2 and 3).

- Generation 1: each rank saves steps 10 and 20 (`saved rank=<r>`); rank 1 then waits to be
  killed, rank 0 for generation 2.
- Generation 2 (rollback step 20): the new rank 1 rolls back by hand, saves step 30 and says
  so in the store, then waits to be killed. Rank 0 first saves step 30 of the run the job
  abandoned (a loop a save ahead when the job re-formed: the write lands once generation 2 is
  heard) and prints the step every rank holds the scheduler answered to that report
  (`late step=30 held_by_all=<step>`); then it rolls back by hand (`put back step=20`) and saves
  step 30 of the new run (`saved 30 in generation 2`).
- Generation 3: both roll back by hand (`generation 3 rollback=<step> rank=<r>`), pass a
  barrier and finish.
"""

from __future__ import annotations

import sys

import numpy as np

import cluster

LIMIT_S = 120.0

cluster.init()
rank = cluster.get_rank()
store = cluster.kv_store()
checkpoints = cluster.CheckpointManager(
    sys.argv[1], "p", cluster.CheckpointConfig(save_checkpoint_steps=10, keep_checkpoint_max=5)
)


def save(step: int) -> None:
    checkpoints.save(step, {"w": np.full(4, step)})
    checkpoints.flush()  # written, reported and answered


def roll_back() -> int:
    """The documented hand rollback: the rollback step's state back, the steps past it gone."""
    step = cluster.get_rollback_step()
    assert int(checkpoints.load(step)["w"][0]) == step
    checkpoints.discard_newer(step)
    return step


generation = cluster.get_generation()
if generation == 1:
    save(10)
    save(20)
    print(f"saved rank={rank}", flush=True)
    if rank == 1:
        store.wait("never", LIMIT_S)  # killed here
        sys.exit("rank 1 was not killed")
    cluster.wait_for_generation(1, LIMIT_S)
    store.wait("rank 1 saved 30", LIMIT_S)
    save(30)  # the abandoned run's step 30
    print(f"late step=30 held_by_all={checkpoints._writes.held_by_all}", flush=True)
    print(f"put back step={roll_back()}", flush=True)
    save(30)  # the new run's
    print("saved 30 in generation 2", flush=True)
    cluster.wait_for_generation(2, LIMIT_S)
elif generation == 2:  # rank 1, started again
    roll_back()
    save(30)
    store.set("rank 1 saved 30", b"1")
    store.wait("never", LIMIT_S)  # killed here
    sys.exit("rank 1 was not killed again")
print(f"generation {cluster.get_generation()} rollback={roll_back()} rank={rank}", flush=True)
cluster.barrier()
cluster.finalize()
