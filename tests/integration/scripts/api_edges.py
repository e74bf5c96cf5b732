"""A worker for test_api_edges.py: the API at its edges, in the mode API_EDGES names. Each mode
prints one line per call, `name: what came of it`, then every rank passes a barrier.

- reduce: allreduce of bools, small integers and scalars (every rank gives the same values,
  and its rank).
- bytes: allgather_bytes and broadcast_bytes of bytes-like values; rank 1's allgather_bytes of
  a str, and rank 0's broadcast_bytes of one, are refused before the collective its peer is
  already in, which its next call of the same collective completes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import cluster
from cluster.api.collective import allgather_bytes, broadcast_bytes


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
    began = time.monotonic()
    said("broadcast", lambda: broadcast_bytes(bytearray(b"from %d" % rank)))
    print(f"broadcast waited: {time.monotonic() - began:.1f}", flush=True)


MODES: dict[str, Callable[[int], None]] = {"reduce": reduce, "bytes": bytes_like}


def main() -> None:
    cluster.init()
    rank = cluster.get_rank()
    MODES[os.environ["API_EDGES"]](rank)
    cluster.barrier()
    print(f"barrier passed rank={rank}", flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
