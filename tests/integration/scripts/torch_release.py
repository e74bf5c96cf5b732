"""Two workers make a gloo group with cluster.torch; rank 1 then posts a recv from rank 0 and
waits in it; rank 0 never sends but releases its group (what a TrainingLoop does when its
generation is over): rank 1 prints how long its recv took to fail (the group's timeout is 30 s)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import cluster
import cluster.torch

cluster.init()
cluster.torch.init_process_group(timeout_s=30)
rank = cluster.get_rank()
tensor = torch.zeros(4, dtype=torch.float64)
dist.all_reduce(tensor)  # every connection is up
if rank == 0:
    cluster.barrier()  # rank 1's recv is posted
    cluster.torch.release_process_group()
    print(f"rank 0 released; group left: {dist.is_initialized()}", flush=True)
else:
    pending = dist.irecv(tensor, src=0)
    start = time.monotonic()
    cluster.barrier()
    try:
        pending.wait()
        print("recv returned", flush=True)
    except Exception as exc:
        print(f"recv failed after {time.monotonic() - start:.2f} s: {exc}", flush=True)
cluster.barrier()
cluster.finalize()
