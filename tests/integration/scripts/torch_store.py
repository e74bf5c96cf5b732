"""Two workers make a gloo group with cluster.torch. Rank 0 then checks, within BOUND_S, that
the store the group was made over (its own TCPStore server) no longer accepts connections; both
all_reduce over the group, and cluster.finalize() destroys it.

Prints `rank R store closed: BOOL`, `rank R sum S`; exits 0."""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

import cluster
import cluster.torch

BOUND_S = 5.0


def accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def closed_within(host: str, port: int) -> bool:
    deadline = time.monotonic() + BOUND_S
    while accepts(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # sleep-ok: polling, bounded by BOUND_S
    return True


cluster.init()
rank = cluster.get_rank()
assert cluster.torch.init_process_group("gloo")
# The client store the group keeps names the server it was made over.
server = dist.distributed_c10d._get_default_store()
while isinstance(server, dist.PrefixStore):
    server = server.underlying_store
assert isinstance(server, dist.TCPStore), server
if rank == 0:
    print(f"rank 0 store closed: {closed_within(server.host, server.port)}", flush=True)
cluster.barrier()  # rank 1 reduces once rank 0 has looked
tensor = torch.tensor([float(rank + 1)])
dist.all_reduce(tensor)
print(f"rank {rank} sum {tensor.item()}", flush=True)
cluster.finalize()
print(f"rank {rank} after finalize, a group left: {dist.is_initialized()}", flush=True)
