"""What a worker knows of the job once it has formed. Plain data, no grpc."""

from __future__ import annotations

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
    """This process's view of the job at one generation."""

    generation: int
    rank: int
    local_rank: int
    local_size: int
    peers: tuple[Peer, ...]  # workers, in rank order

    @property
    def size(self) -> int:
        return len(self.peers)
