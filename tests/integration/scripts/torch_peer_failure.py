"""With recovery on: two workers make a gloo group with cluster.torch and all_reduce once; then
rank 1 waits to be SIGKILLed while rank 0 all_reduces again, and prints how that ended."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import cluster
import cluster.torch
from cluster.api import runtime

cluster.init()
cluster.torch.init_process_group()
rank = cluster.get_rank()
tensor = torch.tensor([float(rank + 1)], dtype=torch.float64)
dist.all_reduce(tensor)
print(f"rank {rank} sum {tensor.item()} timeout {cluster.torch.default_timeout_s()}", flush=True)
if rank == 1:
    print("rank 1 ready", flush=True)
    time.sleep(120)  # sleep-ok: the test kills this process; this only keeps it alive meanwhile
else:
    print("reducing", flush=True)
    start = time.monotonic()
    try:
        dist.all_reduce(tensor)
        print("all_reduce returned", flush=True)
    except Exception as exc:
        print(f"all_reduce failed after {time.monotonic() - start:.2f} s: {exc}", flush=True)
        # What TrainingLoop.step() asks before it rolls back instead of raising.
        confirmed = runtime.peer_failed(cluster.get_generation(), runtime.failure_wait_s())
        print(f"the scheduler confirms a peer failed: {confirmed}", flush=True)
