"""One worker, an NCCL group of world size 1 on GPU 0: the agent's abort of the group
(`cluster.torch._abort_when_over`, what the agent runs on a thread of its own when it hears
that the generation is over) is called from another thread while the main thread is blocked in
`.item()` behind a long kernel and an all_reduce, as a survivor's is behind a collective that
a failed peer never joins. Prints how the main thread came back and when, whether the abort
returned, how the group's next collective ended, and whether the loop's release
(`release_process_group`) left a group.

One GPU cannot hold a collective that never completes (NCCL refuses two ranks on one GPU), so
a kernel that keeps the GPU busy (`torch.cuda._sleep`) stands in for the wait; no abort ends a
kernel that is not NCCL's, so `.item()` comes back once it is done.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

import cluster
import cluster.torch
from cluster.api import torch as cluster_torch

KERNEL_CYCLES = int(2e9 * 5)  # about 5 s of a busy GPU (at 2 GHz)
WAIT_S = 120.0

cluster.init()
torch.cuda.set_device(0)
cluster.torch.init_process_group("nccl")
tensor = torch.ones(4, device="cuda")
dist.all_reduce(tensor)
torch.cuda.synchronize()
generation = cluster.get_generation()


def abort_beside() -> None:
    time.sleep(1.0)  # sleep-ok: the main thread is in .item() by then (the fault)
    started = time.monotonic()
    cluster_torch._abort_when_over(generation)
    print(f"abort returned after {time.monotonic() - started:.1f} s", flush=True)


aborter = threading.Thread(target=abort_beside, name=f"cluster-generation-{generation}-over")
torch.cuda._sleep(KERNEL_CYCLES)
dist.all_reduce(tensor)
aborter.start()
started = time.monotonic()
try:
    value = tensor.sum().item()
    came_back = f"returned {value}"
except Exception as exc:
    came_back = f"raised {type(exc).__name__}"
print(f"main thread: .item() {came_back} after {time.monotonic() - started:.1f} s", flush=True)
aborter.join(WAIT_S)
print(f"abort done: {not aborter.is_alive()}", flush=True)
try:
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    print("next all_reduce returned", flush=True)
except Exception as exc:
    print(f"next all_reduce raised {type(exc).__name__}", flush=True)
cluster.torch.release_process_group()  # what the loop's rollback then does
print(f"after release, a group left: {dist.is_initialized()}", flush=True)
cluster.finalize()
