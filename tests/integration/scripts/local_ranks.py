"""A worker that says where it is on its host: its local rank and local size once in the job,
and again in the next generation; then finishes. A spare says it once promoted (its first
generation is a later one)."""

from __future__ import annotations

import argparse

import cluster

parser = argparse.ArgumentParser()
parser.add_argument("--limit", type=float, default=60.0, help="the longest wait for a generation")
args = parser.parse_args()


def say() -> None:
    print(
        f"node {cluster.get_node_id()} rank {cluster.get_rank()} "
        f"generation {cluster.get_generation()} local_rank {cluster.get_local_rank()} "
        f"local_size {cluster.get_local_size()}",
        flush=True,
    )


cluster.init()
say()
if cluster.get_generation() == 1:
    cluster.wait_for_generation(1, args.limit)
    say()
cluster.finalize()
