"""A worker for test_api_edges.py: the API at its edges, in the mode API_EDGES names. Each mode
prints one line per call, `name: what came of it`, then every rank passes a barrier.

- reduce: allreduce of bools, small integers and scalars (every rank gives the same values,
  and its rank).
- bytes: allgather_bytes and broadcast_bytes of bytes-like values; rank 1's allgather_bytes of
  a str, and rank 0's broadcast_bytes of one and broadcasts from roots that are not ranks, are
  refused before the collective its peer is already in, which its next call of the same
  collective completes.
- threads: rank 0's thread A waits in an allgather_object; once the test has seen it there (it
  creates the file API_EDGES_GO), rank 0's main thread calls one too and is refused; rank 1
  joins thread A's collective once it has heard of the refusal (a key of the store).
- generation: wait_for_generation past its timeout, with timeouts it refuses, and for a
  generation the job is past.
- kv: the store's calls with keys and values at and past its limits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import cluster
from cluster.api import runtime
from cluster.api.collective import allgather_bytes, broadcast_bytes
from cluster.testing import wait_until
from cluster.transport.edge import MESSAGE_LIMITS

# How long a rank waits for its peer's or the test's cue.
CUE_S = 60.0


def said(name: str, call: Callable[[], Any]) -> None:
    """`name: <result's repr> <its type>`, or `name: <error's type>: <error>`."""
    try:
        got = call()
    except Exception as exc:  # what each call raises is what the test reads
        print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
    else:
        print(f"{name}: {got!r} {type(got).__name__}", flush=True)


def reduce(rank: int) -> None:
    said("bool sum", lambda: cluster.allreduce(np.array([True]), "sum"))
    said("bool mean", lambda: cluster.allreduce(np.array([True]), "mean"))
    said("int8 sum", lambda: cluster.allreduce(np.array([100], dtype=np.int8), "sum"))
    said("int8 mean", lambda: cluster.allreduce(np.array([100], dtype=np.int8), "mean"))
    said("numpy scalar", lambda: cluster.allreduce(np.float64(1.5)))
    said("0-d array", lambda: cluster.allreduce(np.array(1.5)))
    said("number", lambda: cluster.allreduce(2))
    said("ranks", lambda: cluster.allreduce(np.array([rank, 1]), "sum"))


def bytes_like(rank: int) -> None:
    if rank == 1:
        said("str refused", lambda: allgather_bytes("a str"))  # type: ignore[arg-type]
    began = time.monotonic()
    said("bytearray", lambda: allgather_bytes(bytearray(b"a%d" % rank)))
    print(f"bytearray waited: {time.monotonic() - began:.1f}", flush=True)
    said("memoryview", lambda: allgather_bytes(memoryview(b"m%d" % rank)))
    if rank == 0:
        said("broadcast str refused", lambda: broadcast_bytes("a str"))  # type: ignore[arg-type]
        said("root -1 refused", lambda: broadcast_bytes(b"x", root=-1))
        said("root 2 refused", lambda: cluster.broadcast_object("x", root=2))
        said("root True refused", lambda: cluster.broadcast_object("x", root=True))
        said("root 0.0 refused", lambda: broadcast_bytes(b"x", root=0.0))  # type: ignore[arg-type]
        session = runtime.session()  # below the API's check: the message cannot carry -1
        said("agent root -1", lambda: session.call(session.agent.exchange("broadcast", b"", -1)))
    began = time.monotonic()
    said("broadcast", lambda: broadcast_bytes(bytearray(b"from %d" % rank)))
    print(f"broadcast waited: {time.monotonic() - began:.1f}", flush=True)


def threads(rank: int) -> None:
    kv = cluster.kv_store()
    if rank == 0:
        first = threading.Thread(target=said, args=("A", lambda: cluster.allgather_object("A0")))
        first.start()
        go = Path(os.environ["API_EDGES_GO"])
        wait_until(go.exists, CUE_S, "the test's cue: thread A waits in its collective")
        said("B refused", lambda: cluster.allgather_object("B0"))
        kv.set("B refused", "yes")
        first.join(CUE_S)
    else:
        kv.wait("B refused", CUE_S)
        said("A", lambda: cluster.allgather_object("A1"))
    said("after", lambda: cluster.allgather_object(rank))


def generation(rank: int) -> None:
    said("timed out", lambda: cluster.wait_for_generation(1, timeout_s=0.2))
    said("at once", lambda: cluster.wait_for_generation(1, timeout_s=0))
    said("past", lambda: cluster.wait_for_generation(0, timeout_s=0))
    said("negative", lambda: cluster.wait_for_generation(1, timeout_s=-1))
    said("nan", lambda: cluster.wait_for_generation(1, timeout_s=float("nan")))
    said("text", lambda: cluster.wait_for_generation(1, timeout_s="5"))  # type: ignore[arg-type]


def keys_making(request_bytes: int) -> list[str]:
    """Keys of 10 to 21 bytes whose wait is a request of `request_bytes` (with its timeout)."""
    count = (request_bytes - 9) // 12
    last = request_bytes - 9 - 12 * (count - 1) - 2  # the rest, less its tag and length
    return [f"k{i:09d}" for i in range(count - 1)] + ["z" * last]


def kv(rank: int) -> None:
    store = cluster.kv_store()
    said("unicode", lambda: (store.set("ключ🔑", "значение"), store.get("ключ🔑").decode()))
    said("longest key", lambda: (store.set("k" * 1024, b"1"), store.get("k" * 1024)))
    for method, call in [
        ("set", lambda key: store.set(key, b"1")),
        ("get", store.get),
        ("wait", lambda key: store.wait(key, 1)),
        ("add", store.add),
    ]:
        said(f"surrogate {method}", lambda call=call: call("\ud800"))
        said(f"empty {method}", lambda call=call: call(""))
        said(f"long {method}", lambda call=call: call("k" * 1025))
    said("surrogate value", lambda: store.set("v", "\udfff"))
    # The scheduler's answer (a timeout): a wait at the limit is read.
    limit = MESSAGE_LIMITS["KvWait"]
    said("wait at limit", lambda: store.wait(keys_making(limit), 0.1))
    said("wait past limit", lambda: store.wait(keys_making(limit + 1), 0.1))


MODES: dict[str, Callable[[int], None]] = {
    "reduce": reduce,
    "bytes": bytes_like,
    "threads": threads,
    "generation": generation,
    "kv": kv,
}


def main() -> None:
    cluster.init()
    rank = cluster.get_rank()
    MODES[os.environ["API_EDGES"]](rank)
    cluster.barrier()
    print(f"barrier passed rank={rank}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
