"""Two workers make a gloo group with cluster.torch, reduce once, and call cluster.finalize()
only (never destroy_process_group themselves): each prints whether torch still has a group."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cluster
import cluster.torch

cluster.init()
cluster.torch.init_process_group("gloo")
tensor = torch.ones(4)
dist.all_reduce(tensor)
print(f"rank {cluster.get_rank()} sum {tensor[0].item()}", flush=True)
cluster.finalize()
print(f"after finalize, a group left: {dist.is_initialized()}", flush=True)
