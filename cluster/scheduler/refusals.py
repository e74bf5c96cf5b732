"""Refusals of whoever reaches the port: every one counted, few journaled, none kept raw.

A caller that is not a member can send refused calls as fast as it likes. Each refusal counts
(`counts`, by method and reason: what the metrics export at each scrape,
`cluster_edge_refusals_total` and `cluster_registration_refusals_total`), but the journal, the
event log and the scheduler's log hear of a peer address at most once per `INTERVAL_S`, with the
number of refusals since they last did (the count a journaled event carries): what a flood costs
the scheduler's memory and files is bounded by the number of addresses, not by the number of
calls. The addresses remembered are bounded too (the oldest forgotten first). Every message
quoted is already escaped and cut (`cluster.transport.edge.quoted`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from cluster.transport.handlers import peer_host

log = logging.getLogger("cluster.scheduler")

INTERVAL_S = 60.0
# Peer addresses remembered (beyond them, the oldest is forgotten: it may be told once more).
PEERS = 1024


class RefusalLimiter:
    """Decides which refusals are told (journaled and logged) and counts them all."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, interval_s: float = INTERVAL_S
    ) -> None:
        self._clock = clock
        self._interval_s = interval_s
        # peer host -> (when it was last told, refusals since then)
        self._peers: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def refused(self, peer: str, method: str, reason: str) -> int:
        """Count a refusal of `peer`; the number of refusals to tell now (this one and those
        not told before), 0 when it is not to be told."""
        self.counts[(method, reason)] += 1
        host, now = peer_host(peer), self._clock()
        told, untold = self._peers.pop(host, (float("-inf"), 0))
        if now - told < self._interval_s:
            self._peers[host] = (told, untold + 1)
            return 0
        self._peers[host] = (now, 0)
        while len(self._peers) > PEERS:
            self._peers.popitem(last=False)
        return untold + 1

    def log(self, peer: str, method: str, reason: str, message: str) -> int:
        """Count a refusal and log it when it is to be told; the count told (0: not)."""
        count = self.refused(peer, method, reason)
        if count:
            more = f" ({count} refusals of this address since last told)" if count > 1 else ""
            log.info("refused a %s call from %s: %s%s", method, peer_host(peer), message, more)
        return count
