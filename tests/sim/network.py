"""The simulated network between the workers and the scheduler, and between the schedulers and
etcd (with standbys): one link per worker or scheduler, driven from the simulation's seed.

A unary call (register, heartbeat, report, and its answer) is a datagram: it may be delayed,
dropped, duplicated (a client's retry) and overtaken by a later one. A node's event stream is
TCP: in order, never duplicated; while its link is cut, what is sent on it waits, and arrives
when the link heals (or never, when the stream breaks first). A cut link drops the datagrams
sent or arriving while it is cut.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any

SCHED = "sched"  # the job's scheduler: the one that leads, when there are standbys
ETCD = "etcd"
HUBS = (SCHED, ETCD)  # a link is named by its other end
# A datagram's delays: most are quick, some are slower than a heartbeat (they are overtaken).
DELAYS_S = (0.001, 0.001, 0.01, 0.05, 0.2, 1.5, 4.0)
# etcd's: mostly quick, at times slower than a leader's margin (half a second of a 5 s lease).
ETCD_DELAYS_S = (0.001, 0.001, 0.01, 0.05, 0.2, 1.0)
DROP = 0.05
DUPLICATE = 0.05


@dataclass(order=True)
class Packet:
    at: float
    seq: int
    src: str = field(compare=False)
    dst: str = field(compare=False)
    body: tuple[Any, ...] = field(compare=False)
    stream: bool = field(compare=False, default=False)

    @property
    def node(self) -> str:
        """The worker (or scheduler) end of its link."""
        return self.dst if self.src in HUBS else self.src


@dataclass
class Network:
    rng: random.Random
    faults: bool = True
    queue: list[Packet] = field(default_factory=list)
    cut: set[str] = field(default_factory=set)  # nodes whose link is down
    held: dict[str, list[Packet]] = field(default_factory=dict)  # stream packets on a cut link
    tail: dict[str, float] = field(default_factory=dict)  # the last arrival on each stream
    seq: int = 0

    def send(
        self, now: float, src: str, dst: str, body: tuple[Any, ...], *, stream: bool = False
    ) -> None:
        node = dst if src in HUBS else src
        if not stream and node in self.cut:
            return
        if self.faults and not stream and self.rng.random() < DROP:
            return
        copies = 2 if self.faults and not stream and self.rng.random() < DUPLICATE else 1
        for _ in range(copies):
            delays = ETCD_DELAYS_S if ETCD in (src, dst) else DELAYS_S
            delay = self.rng.choice(delays) if self.faults else delays[0]
            at = now + delay
            if stream:
                at = self.tail[dst] = max(at, self.tail.get(dst, 0.0))
            self.seq += 1
            heapq.heappush(self.queue, Packet(at, self.seq, src, dst, body, stream))

    def next_at(self) -> float:
        return self.queue[0].at if self.queue else float("inf")

    def due(self, now: float) -> Packet | None:
        """The next packet that arrives by `now` (None: none)."""
        while self.queue and self.queue[0].at <= now:
            packet = heapq.heappop(self.queue)
            if packet.node not in self.cut:
                return packet
            if packet.stream:
                self.held.setdefault(packet.node, []).append(packet)
        return None

    def partition(self, node: str) -> None:
        self.cut.add(node)

    def heal(self, node: str, now: float) -> None:
        self.cut.discard(node)
        for packet in self.held.pop(node, []):
            heapq.heappush(
                self.queue, Packet(now, packet.seq, packet.src, packet.dst, packet.body, True)
            )

    def break_stream(self, node: str) -> None:
        """The node's event stream broke: what was on its way on it is lost."""
        self.queue = [p for p in self.queue if not (p.stream and p.dst == node)]
        heapq.heapify(self.queue)
        self.held.pop(node, None)
        self.tail.pop(node, None)

    def drop_scheduler(self) -> None:
        """The scheduler died: every connection to it is gone, and what was in flight."""
        self.queue = [p for p in self.queue if SCHED not in (p.src, p.dst)]
        heapq.heapify(self.queue)
        self.held.clear()
        self.tail.clear()

    def calm(self, now: float) -> None:
        """Faults stop: every link heals and no packet is lost, duplicated or slow."""
        self.faults = False
        for node in sorted(self.cut):
            self.heal(node, now)
