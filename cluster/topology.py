"""What a worker knows of the job once it has formed. Plain data, no grpc."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """One worker of the job, as every other worker sees it."""

    rank: int
    node_id: str
    host: str
    port: int


@dataclass(frozen=True)
class Topology:
    """This process's view of the job at one generation.

    The peer table is kept in columns, as it arrives, and `peers` builds the Peer records on
    first use: a worker of a large job that never asks for them never pays for them.
    """

    generation: int
    rank: int
    local_rank: int
    local_size: int
    node_ids: tuple[str, ...]  # workers, in rank order
    hosts: tuple[str, ...]
    ports: tuple[int, ...]
    # Where training (re)starts in this generation: the newest checkpoint step every worker holds.
    rollback_step: int = 0
    reason: str = "formed"

    @property
    def size(self) -> int:
        return len(self.node_ids)

    @functools.cached_property
    def peers(self) -> tuple[Peer, ...]:
        return tuple(
            Peer(rank, node_id, host, port)
            for rank, (node_id, host, port) in enumerate(
                zip(self.node_ids, self.hosts, self.ports, strict=True)
            )
        )
