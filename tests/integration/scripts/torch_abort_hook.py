"""What the agent does for an NCCL group when it hears that the group's generation is over,
without a GPU: no NCCL here, so a fake stands in for torch's NCCL group (`FakeNcclGroup`, its
`abort()` recorded) and for its making; everything else is real (the job, its scheduler, the
rendezvous store, rank 1's SIGKILL, the spare that takes its rank).

Rank 0 makes a real gloo group first and says how many enders its agent holds; then the "nccl"
group, and says it again. Its main thread then blocks until the group is aborted (as it would
in a CUDA sync behind a collective that rank 1 never joins), waits for generation 2, lets the
agent's threads end, and prints each abort: the thread it ran on and the group it aborted.
Rank 1 waits to be killed; the spare, promoted into generation 2, only finalizes.
"""

from __future__ import annotations

import datetime
import threading
import time

import cluster
import cluster.torch
from cluster.api import runtime
from cluster.api import torch as cluster_torch

BOUND_S = 60.0
aborted = threading.Event()
aborts: list[str] = []


class FakeNcclGroup:
    """Stands in for torch's NCCL ProcessGroup (no GPU here): `abort()` is recorded."""

    def abort(self) -> None:
        group = cluster_torch._current
        generation = None if group is None else group.generation
        aborts.append(f"abort on {threading.current_thread().name} of generation {generation}")
        aborted.set()


def fake_make_group(
    backend: str, store: object, topology: object, timeout: datetime.timedelta
) -> tuple[frozenset[int], FakeNcclGroup]:
    return frozenset(), FakeNcclGroup()


cluster.init()
rank = cluster.get_rank()
if cluster.get_generation() > 1:  # the spare
    cluster.finalize()
    raise SystemExit(0)
enders = runtime.session().agent.generation_end._enders
cluster.torch.init_process_group("gloo")
print(f"rank {rank} enders with a gloo group: {len(enders)}", flush=True)
cluster.torch.destroy_process_group()
cluster_torch._make_group = fake_make_group  # type: ignore[assignment]
cluster.torch.init_process_group("nccl")
print(f"rank {rank} enders with an nccl group: {len(enders)}", flush=True)
if rank == 1:
    time.sleep(120)  # sleep-ok: the test kills this process; this keeps it meanwhile
print("rank 0 blocked", flush=True)
print(f"rank 0 released: {aborted.wait(BOUND_S)}", flush=True)
cluster.wait_for_generation(1, BOUND_S)
for thread in threading.enumerate():
    if thread.name.startswith("cluster-generation-"):
        thread.join(BOUND_S)
for line in aborts:
    print(f"rank 0 {line}", flush=True)
cluster.finalize()
