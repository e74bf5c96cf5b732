"""Exercise the public API in a real worker and print what it saw as one JSON line."""

from __future__ import annotations

import json
import math
import signal

import cluster
from cluster.api.collective import MAX_WAIT_S

cluster.init()
rank, size = cluster.get_rank(), cluster.get_group_size()
kv = cluster.kv_store()
kv.set(f"addr/{rank}", f"10.0.0.{rank}:{rank + 1000}")
counted = kv.add("arrived", 1)
addresses = [v.decode() for v in kv.wait([f"addr/{r}" for r in range(size)], timeout_s=30)]
cluster.barrier()
final_count = int(kv.get("arrived"))
seed = cluster.broadcast_object({"seed": 1234 + rank}, root=size - 1)
gathered = cluster.allgather_object({"rank": rank, "peers": len(cluster.get_peers())})
try:
    kv.get("never-set")
    missing = "no error"
except KeyError:
    missing = "KeyError"
try:
    kv.wait(["never-set"], timeout_s=0.2)
    wait_timeout = "no error"
except cluster.CollectiveError as exc:
    wait_timeout = str(exc)
kv.set(f"ready/{rank}", "yes")
one_key = [v.decode() for v in kv.wait(f"ready/{rank}", timeout_s=30)]  # one str: one key
# The longest wait allowed is a deadline gRPC holds: answered, not "Deadline Exceeded".
longest = [v.decode() for v in kv.wait(f"ready/{rank}", timeout_s=MAX_WAIT_S)]
refused = {}
for name, bad_call in {
    "set": lambda: kv.set("k", 5),  # type: ignore[arg-type]
    "add": lambda: kv.add("k", 1.5),  # type: ignore[arg-type]
    "add_big": lambda: kv.add("k", 2**63),
    "get": lambda: kv.get(3),  # type: ignore[arg-type]
    "wait": lambda: kv.wait(["k", 3], timeout_s=30),  # type: ignore[list-item]
    "wait_timeout": lambda: kv.wait("k", timeout_s="30"),  # type: ignore[arg-type]
    "wait_inf": lambda: kv.wait("k", timeout_s=math.inf),
    "wait_nan": lambda: kv.wait("k", timeout_s=math.nan),
    "wait_huge": lambda: kv.wait("k", timeout_s=1e300),
    "wait_negative": lambda: kv.wait("k", timeout_s=-1),
}.items():
    try:
        bad_call()
        refused[name] = "no error"
    except cluster.ClusterError as exc:
        refused[name] = f"{type(exc).__name__}: {exc}"
print(
    json.dumps(
        {
            "rank": rank,
            "size": size,
            "local_rank": cluster.get_local_rank(),
            "local_size": cluster.get_local_size(),
            "generation": cluster.get_generation(),
            "rejoin": cluster.is_rejoin(),
            "node_id": cluster.get_node_id(),
            "peers": [[p.rank, p.node_id, p.host, p.port] for p in cluster.get_peers()],
            "counted": counted,
            "final_count": final_count,
            "addresses": addresses,
            "seed": seed,
            "gathered": gathered,
            "missing": missing,
            "wait_timeout": wait_timeout,
            "one_key": one_key,
            "longest": longest,
            "refused": refused,
            "sigusr2_taken": signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL,
        }
    ),
    flush=True,
)
cluster.finalize()
# What the library took it gives back: the signal that ends the process from its agent.
released = signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
print(f"after finalize, SIGUSR2 default: {released}", flush=True)
