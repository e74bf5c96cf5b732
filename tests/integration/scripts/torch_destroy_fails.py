"""One worker makes a gloo group with cluster.torch; torch's destroy_process_group then fails
once (an injected RuntimeError: the error an NCCL teardown may raise, which gloo on a CPU does
not). cluster.torch must still know the group as its own: the next init_process_group of the
generation keeps it (no "group that cluster.torch did not make"), it reduces, and finalize
destroys it. Prints what each call did."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cluster
import cluster.torch

cluster.init()
cluster.torch.init_process_group("gloo")
real_destroy = dist.destroy_process_group


def failing_destroy(*args: object, **kwargs: object) -> None:
    dist.destroy_process_group = real_destroy  # once
    raise RuntimeError("injected: torch's destroy_process_group failed")


dist.destroy_process_group = failing_destroy
try:
    cluster.torch.destroy_process_group()
    print("destroy: no error", flush=True)
except RuntimeError as exc:
    print(f"destroy: {exc}", flush=True)
try:
    print(f"init again: {cluster.torch.init_process_group('gloo')}", flush=True)
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    print(f"sum {tensor[0].item()}", flush=True)
except cluster.ClusterError as exc:
    print(f"init again: {type(exc).__name__}: {exc}", flush=True)
cluster.finalize()
print(f"after finalize, a group left: {dist.is_initialized()}", flush=True)
