"""etcd's history under the etcd state store (`etcd_store`), and who compacts it.

etcd keeps every revision of every key until its history is compacted: without compaction,
every save stays in etcd until its space quota is spent, and then etcd refuses every write. A
compaction is etcd-wide: it drops the history of every key of that etcd, other users' too, and
etcd lets any user that may write one key do it. So CLUSTER_ETCD_COMPACTION chooses:

- off (the default): the job never compacts; etcd does (its --auto-compaction-* flags), or its
  operator. Each scheduler says so once, at start (`announce`), with etcd's flag to set.
- auto: the leader compacts it every `every_s`, or once it has written `every_bytes`, whichever
  comes first, up to the revision of its write that landed at the check before: etcd holds
  between one and two such periods of its writes, and every reader of an older revision reads
  again. For an etcd of the job's alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from cluster.protocol.errors import StateFileError
from cluster.protocol.state_url import COMPACTION_ENV
from cluster.scheduler.etcd_client import EtcdConnection

log = logging.getLogger("cluster.scheduler")

COMPACT_EVERY_S = 30.0
COMPACT_EVERY_BYTES = 16 * 1024 * 1024


class EtcdHistory:
    def __init__(self, connection: EtcdConnection) -> None:
        self.connection = connection
        self.compacting = connection.url.compaction == "auto"
        self.every_s = COMPACT_EVERY_S
        self.every_bytes = COMPACT_EVERY_BYTES
        self.clock: Callable[[], float] = time.monotonic
        # When the next check is due, the revision it compacts up to then, and whether the
        # last compaction failed.
        self._due_at = -math.inf
        self._mark = 0
        self._written = 0  # bytes written since the last check
        self._failed = False

    def announce(self) -> None:
        """Say who compacts etcd's history: once, when the scheduler starts."""
        if self.compacting:
            log.info(
                "the leader compacts etcd's history (%s=auto) every %g s, or every %d MiB it "
                "writes: etcd-wide, the history of every key of that etcd, not only this job's",
                COMPACTION_ENV,
                self.every_s,
                self.every_bytes // (1024 * 1024),
            )
            return
        log.warning(
            "this job does not compact etcd's history (%s=off): etcd's database grows with "
            "every save until etcd compacts it, and at its quota (--quota-backend-bytes) etcd "
            "refuses every write; start etcd with --auto-compaction-mode=periodic "
            "--auto-compaction-retention=10m (or compact it yourself: etcdctl compact), or, on "
            "an etcd of this job's alone, set %s=auto",
            COMPACTION_ENV,
            COMPACTION_ENV,
        )

    def count(self, size: int) -> None:
        """`size` bytes written that no write of `wrote` counts (the chunks it names)."""
        self._written += size

    async def wrote(self, revision: int, size: int) -> None:
        """A write of `size` bytes (and of the chunks it names) landed at `revision`: compact
        etcd's history when a check is due (and compaction is on)."""
        if not self.compacting:
            return
        now = self.clock()
        self._written += size
        if now < self._due_at and self._written < self.every_bytes:
            return
        upto, self._mark = self._mark, revision
        self._due_at, self._written = now + self.every_s, 0
        if upto <= 0:
            return
        try:
            await self.connection.call(lambda c: c.compact(upto), "compact etcd's history")
        except StateFileError as exc:
            if "compacted" in str(exc):  # compacted past it already (etcd's auto-compaction)
                return
            if not self._failed:
                log.warning(
                    "cannot compact etcd's history up to revision %d: %s; etcd's database "
                    "grows with every save until it is compacted",
                    upto,
                    exc,
                )
            self._failed = True
            return
        self._failed = False
