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

A scheduler of the job that reads at a revision of its choosing while the leader may write (a
standby loading the state at start: the manifest, then its chunks at the manifest's revision)
holds the history for that long (`held`): a key PREFIX/reads/<id> on a lease of its own, put
before it reads, so that the revision it reads at is never older than the key's. The leader
compacts no further than the oldest such key: that mark alone does not keep the read's revision,
as two checks may come within a moment of each other when the leader writes `every_bytes` that
fast. The key goes with its lease, when the read ends or HOLD_TTL_S after its reader died.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

from cluster.protocol.errors import StateFileError
from cluster.protocol.state_url import COMPACTION_ENV
from cluster.scheduler.etcd_client import EtcdConnection

log = logging.getLogger("cluster.scheduler")

COMPACT_EVERY_S = 30.0
COMPACT_EVERY_BYTES = 16 * 1024 * 1024
# The lease of a hold (`held`): how long, at most, a reader that died keeps the leader from
# compacting past it.
HOLD_TTL_S = 60


class EtcdHistory:
    def __init__(self, connection: EtcdConnection) -> None:
        self.connection = connection
        self.compacting = connection.url.compaction == "auto"
        self.holds = connection.url.prefix.encode() + b"reads/"
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
            upto = await self._unheld(upto)
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

    async def _unheld(self, upto: int) -> int:
        """`upto`, or the revision of the oldest hold when that is older."""
        found = await self.connection.call(
            lambda c: c.get_prefix(self.holds, keys_only=True), "list the holds on etcd's history"
        )
        return min([upto, *(int(kv.mod_revision) for kv in found)])

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """The history held from now on, while the body reads at revisions it takes from reads
        made inside it. Best effort: where etcd refuses the hold (its NOSPACE alarm), the body
        reads without it, and reads again what a compaction took."""
        lease = await self._hold()
        try:
            yield
        finally:
            if lease is not None:
                with contextlib.suppress(StateFileError):  # it ends after HOLD_TTL_S anyway
                    await self.connection.call(
                        lambda c: c.revoke_lease(lease), "release a hold on etcd's history"
                    )

    async def _hold(self) -> int | None:
        """The lease of a new hold (its key goes with it); None when etcd refused one."""
        key = self.holds + uuid.uuid4().hex.encode()
        try:
            granted = await self.connection.call(
                lambda c: c.lease(HOLD_TTL_S), "hold etcd's history"
            )
            lease = int(granted.id)
            await self.connection.call(
                lambda c: c.put(key, b"", lease=lease), "hold etcd's history"
            )
        except StateFileError as exc:
            log.info("reading without a hold on etcd's history: %s", exc)
            return None
        return lease
