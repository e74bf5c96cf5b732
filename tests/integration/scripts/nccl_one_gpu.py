"""Every worker of the job reduces a CUDA tensor over NCCL on GPU 0 (`--same-gpu`: the ranks
share it, which NCCL refuses), then calls cluster.finalize() only: prints the sum and whether
torch still has a group."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cluster
import cluster.torch

cluster.init()
torch.cuda.set_device(0)
cluster.torch.init_process_group("nccl")
tensor = torch.ones(4, device="cuda")
dist.all_reduce(tensor)
print(f"rank {cluster.get_rank()} sum {tensor[0].item()}", flush=True)
cluster.finalize()
print(f"after finalize, a group left: {dist.is_initialized()}", flush=True)
