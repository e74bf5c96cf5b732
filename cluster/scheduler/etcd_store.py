"""The state store on etcd v3 (CLUSTER_STATE_URL=etcd://...): fenced, compare-and-set writes.

Keys under the job's PREFIX:

    leader, schedulers/<address>    leadership (`etcd_election`)
    state                           the scheduler's state: the envelope of `storage.store`
    kvjob                           the job whose key-value store is kept
    kv/<key>                        one etcd key per key of the job's key-value store
    stateblob/<id>/<n>, kvblob/<id>/<n>   chunks of a value too large for one request
    reads/<id>                      a scheduler's hold on etcd's history (`etcd_history`)

Every write is one transaction conditioned on the create revision of this scheduler's leader
key (its fence): a scheduler whose lease ended, or that never led, writes nothing, and learns
so (`FencedError`). A state save is also conditioned on the state key's mod revision (the
compare-and-set token) and answers with what is stored either way.

etcd refuses a request over 1.5 MiB by default, and a transaction of more than 128 operations:
a value over INLINE_MAX_BYTES (a large state, a key-value value of up to 4 MiB) is written as
chunks first, each in a fenced transaction of its own, then named by a small manifest written
with the compare-and-set, and read at the revision the manifest was read at (a save that
replaces them meanwhile does not tear the read). A refused save removes its chunks at once; the
chunks of a save whose outcome is unknown go with the next save that lands; whatever a leader
left unnamed (it died, or lost its lease, between writing chunks and naming them) is removed by
the next leader when it starts leading (`collect_garbage`). A batch of key-value changes goes in
transactions of at most TXN_OPS operations and TXN_BYTES bytes: each key is set atomically, and
the batch is acknowledged once all of them are. After each write that lands, the leader
compacts etcd's history when it is due (`etcd_history`).
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import xxhash

from cluster.protocol.errors import FencedError, StateFileError
from cluster.scheduler.etcd_client import EtcdConnection, describe, no_space
from cluster.scheduler.etcd_election import EtcdElection
from cluster.scheduler.etcd_history import EtcdHistory
from cluster.storage import store
from cluster.storage.state_store import SCHEDULER_KIND, Stored, Written

log = logging.getLogger("cluster.scheduler")
# What a state found damaged while this scheduler leads calls for: nothing of the operator's (a
# scheduler that reads it to lead the job is refused instead, `EtcdStore._advice`).
_SAVED_AGAIN = "this scheduler leads the job and saves its state there again, so the job goes on"

INLINE = b"\x00"
CHUNKED = b"\x01"
INLINE_MAX_BYTES = 512 * 1024
CHUNK_BYTES = 1024 * 1024
TXN_BYTES = 1024 * 1024
TXN_OPS = 64
PAGE_KEYS = 64  # a key-value page read at once: at most 32 MiB of inline values
LIST_KEYS = 16384  # keys listed at once (keys only)
READ_TRIES = 3  # reads of a value whose chunks' revision etcd compacted meanwhile
UNKNOWN_KEPT = 16  # chunk sets of saves with an unknown outcome, removed by the next one


# A transaction's comparisons and operations, built on the client's `transactions` when sent.
Op = Callable[[Any], Any]


def _created(key: bytes, revision: int) -> Op:
    return lambda t: t.create(key) == revision


def _modified(key: bytes, revision: int) -> Op:
    return lambda t: t.mod(key) == revision


def _holds(key: bytes, value: bytes) -> Op:
    return lambda t: t.value(key) == value


def _put(key: bytes, value: bytes) -> Op:
    return lambda t: t.put(key, value)


def _get(key: bytes) -> Op:
    return lambda t: t.get(key)


def _delete_prefix(prefix: bytes) -> Op:
    return lambda t: t.delete(prefix, range_end=range_end(prefix))


def range_end(prefix: bytes) -> bytes:
    """The end of the key range of `prefix` (etcd's convention: the prefix plus one)."""
    last = bytearray(prefix)
    while last and last[-1] == 0xFF:
        last.pop()
    last[-1] += 1
    return bytes(last)


class EtcdStore:
    standby = True

    def __init__(self, connection: EtcdConnection, election: EtcdElection) -> None:
        self.connection = connection
        self.election = election
        self.name = "CLUSTER_STATE_URL"
        self.where = str(connection.url)
        prefix = connection.url.prefix.encode()
        self.state_key = prefix + b"state"
        self.state_blobs = prefix + b"stateblob/"
        self.kv_job_key = prefix + b"kvjob"
        self.kv_prefix = prefix + b"kv/"
        self.kv_blobs = prefix + b"kvblob/"
        self.damaged_prefix = prefix + b"damaged/"  # states found damaged, kept for a look
        self._advice = f"delete it (etcdctl del {self.state_key.decode()}) to start a new job"
        self._torn_advice = (
            f"check that no scheduler leads the job (etcdctl get {prefix.decode()}leader shows "
            f"no key) and then {self._advice}"
        )
        self._state_blob: str | None = None  # the chunks of the stored state, if any
        # Chunks of this scheduler's state saves whose outcome is unknown: unnamed once a
        # later save lands.
        self._unknown_blobs: set[str] = set()
        self._kv_blob: dict[str, str] = {}  # key-value keys stored as chunks -> their id
        self.history = EtcdHistory(connection)  # compacted after the writes that land

    # -- holding ---------------------------------------------------------------------------

    async def acquire(self) -> str | None:
        leader = await self.election.campaign()
        return None if leader is None else leader.address or "(changing)"

    async def release(self) -> None:
        await self.election.resign()

    async def close(self) -> None:
        await self.election.close()
        await self.connection.close()

    def _fence(self) -> int:
        fence = self.election.fence
        if fence is None:
            raise FencedError(f"this scheduler does not lead the job in {self.where}")
        return fence

    async def _txn(
        self, compare: list[Any], success: list[Any], failure: list[Any], what: str
    ) -> tuple[bool, list[Any]]:
        async def attempt(client: Any) -> tuple[bool, list[Any]]:
            t = client.transactions
            return await client.transaction(  # type: ignore[no-any-return]
                compare=[c(t) for c in compare],
                success=[op(t) for op in success],
                failure=[op(t) for op in failure],
            )

        try:
            return await self.connection.call(attempt, what)
        except StateFileError as exc:
            if not no_space(exc):
                raise
            raise FencedError(
                f"{exc}; this scheduler stops leading the job, which it could not change"
            ) from None

    def _fenced(self, responses: list[Any], fence: int) -> None:
        """Raise FencedError when the leader key in `responses[0]` is not ours any more."""
        got = responses[0] if responses else []
        if not got or got[0][1].create_revision != fence:
            self.election.fence = None
            raise FencedError(
                f"this scheduler no longer leads the job in {self.where} (its lease ended, "
                "and another scheduler may lead): its view of the job is stale"
            )

    # -- the state -------------------------------------------------------------------------

    async def load(self) -> Stored:
        """The state, its chunks read at the revision its manifest was read at: held from the
        job's leader's compaction meanwhile (a standby's load races the leader's saves)."""
        async with self.history.held():
            for _ in range(READ_TRIES):
                got = await self.connection.call(lambda c: c.get(self.state_key), "read the state")
                if got is None:
                    self._state_blob = None
                    return Stored(None, "")
                stored = await self._decode_state(got.value, got.mod_revision, got.header.revision)
                if stored is not None:
                    return stored
        raise StateFileError(
            f"cannot read the state in {self.where}: etcd compacted its revision before its "
            f"chunks were read, {READ_TRIES} times"
        )

    async def _decode_state(
        self, raw: bytes, revision: int, read_at: int, advice: str | None = None
    ) -> Stored | None:
        """The state `raw` holds (its chunks read at revision `read_at`); None when etcd
        compacted that revision meanwhile. StateFileError ends with `advice` (by default what
        a scheduler that reads it to lead the job is advised)."""
        where = f"{self.where} (key {self.state_key.decode()})"
        torn = self._torn_advice if advice is None else advice
        value = await self._value(raw, read_at, self.state_blobs, where, torn)
        if value is None:
            return None
        data, blob = value
        snapshot = store.decode(data, SCHEDULER_KIND, where, advice or self._advice)
        self._state_blob = blob
        return Stored(snapshot, str(revision))

    async def save(self, snapshot: dict[str, Any], token: str) -> Written:
        return await self._save(snapshot, token, mend=True)

    async def _save(self, snapshot: dict[str, Any], token: str, *, mend: bool) -> Written:
        """Save `snapshot` over the state of `token`; where the state found in its place is
        damaged while this scheduler leads (`mend`), keep it aside and save over it once."""
        fence = self._fence()
        unknown = self._unknown_blobs
        value, blob = await self._stored_form(
            store.encode(SCHEDULER_KIND, snapshot), self.state_blobs, fence, unknown
        )
        leader, state = self.election.leader_key, self.state_key
        unnamed = {b for b in (self._state_blob, *unknown) if b is not None and b != blob}
        gone = [self._chunks_gone(self.state_blobs, b) for b in unnamed]
        ok, responses = await self._txn(
            [_created(leader, fence), _modified(state, int(token or 0))],
            [_put(state, value), *gone, _get(leader)],
            [_get(leader), _get(state)],
            "save the state",
        )  # raising StateFileError: its outcome is unknown, its chunks stay in `unknown`
        if ok:
            self._landed(blob, unnamed)
            revision = responses[-1][0][1].header.revision
            await self.history.wrote(revision, len(value))
            return Written(True, Stored(snapshot, str(revision)))
        self._fenced(responses, fence)
        raw, meta = responses[1][0] if responses[1] else (None, None)
        if raw == value and meta is not None:
            # Our own transaction, which landed once already: its answer was lost and it was
            # sent again (to another member), where its compare no longer held.
            self._landed(blob, unnamed)
            return Written(True, Stored(snapshot, str(meta.mod_revision)))
        await self._drop(self.state_blobs, blob, fence)
        unknown.discard(blob or "")
        if meta is None:
            self._state_blob = None
            return Written(False, Stored(None, ""))
        try:
            current = await self._decode_state(
                raw or b"", meta.mod_revision, meta.header.revision, _SAVED_AGAIN
            )
        except StateFileError as exc:
            if not mend:
                raise
            await self._keep_damaged(raw or b"", meta.mod_revision, str(exc))
            return await self._save(snapshot, str(meta.mod_revision), mend=False)
        return Written(False, current or await self.load())

    async def _keep_damaged(self, raw: bytes, revision: int, why: str) -> None:
        """The state key holds what no scheduler saves whole (torn, edited, foreign) while this
        one leads, so no other scheduler wrote it, and waiting cannot mend it: keep its value
        under `damaged/` for the operator and say so, once; the save then writes over it."""
        kept = self.damaged_prefix + f"state-{revision}".encode()
        await self.connection.call(lambda c: c.put(kept, raw), "keep the damaged state")
        log.warning("%s; the damaged value is kept at key %s", why, kept.decode())

    def _landed(self, blob: str | None, unnamed: set[str]) -> None:
        """A state save naming chunks `blob` landed, removing chunk sets `unnamed`."""
        self._state_blob = blob
        self._unknown_blobs -= {*unnamed, blob or ""}

    def _chunks_gone(self, blobs: bytes, blob: str) -> Op:
        return _delete_prefix(blobs + blob.encode() + b"/")

    async def _drop(self, blobs: bytes, blob: str | None, fence: int) -> None:
        """Remove the chunks of a write that was refused (best effort: what stays is removed
        by the next leader)."""
        if blob is None:
            return
        try:
            await self._txn(
                [_created(self.election.leader_key, fence)],
                [self._chunks_gone(blobs, blob)],
                [],
                "remove the chunks of a refused write",
            )
        except StateFileError as exc:
            log.warning(
                "cannot remove the chunks of a refused write (%s); the next leader does", exc
            )

    # -- values and their chunks -----------------------------------------------------------

    async def _stored_form(
        self, data: bytes, blobs: bytes, fence: int, unknown: set[str] | None = None
    ) -> tuple[bytes, str | None]:
        """`data` as it goes in its key: inline, or a manifest of chunks written first (their
        id is in `unknown` from before the first is written, while there is room)."""
        if len(data) <= INLINE_MAX_BYTES:
            return INLINE + data, None
        blob = uuid.uuid4().hex
        if unknown is not None and len(unknown) < UNKNOWN_KEPT:
            unknown.add(blob)
        leader = self.election.leader_key
        for n, start in enumerate(range(0, len(data), CHUNK_BYTES)):
            key = blobs + f"{blob}/{n:06d}".encode()
            chunk = data[start : start + CHUNK_BYTES]
            ok, responses = await self._txn(
                [lambda t: t.create(leader) == fence],
                [lambda t, k=key, c=chunk: t.put(k, c)],
                [lambda t: t.get(leader)],
                "save a chunk",
            )
            if not ok:
                self._fenced(responses, fence)
            self.history.count(len(chunk))
        manifest = {"id": blob, "size": len(data), "xxh3": xxhash.xxh3_128_hexdigest(data)}
        return CHUNKED + json.dumps(manifest).encode(), blob

    async def _value(
        self, raw: bytes, read_at: int, blobs: bytes, where: str, advice: str
    ) -> tuple[bytes, str | None] | None:
        """The data a key holds (its chunks gathered at revision `read_at`, the one the key was
        read at, and checked) and its chunks' id; None when etcd compacted that revision."""
        if raw[:1] == INLINE:
            return raw[1:], None
        if raw[:1] != CHUNKED:
            raise StateFileError(f"{where} does not hold a value of cluster's: {advice}")
        try:
            manifest = json.loads(raw[1:])
            blob, size, digest = str(manifest["id"]), int(manifest["size"]), manifest["xxh3"]
        except (ValueError, KeyError, TypeError):
            raise StateFileError(f"{where} holds a torn chunk manifest: {advice}") from None
        chunks = blobs + blob.encode() + b"/"
        found = await self.connection.call(
            functools.partial(_range_at, start=chunks, end=range_end(chunks), revision=read_at),
            "read chunks",
        )
        if found is None:
            return None
        data = b"".join(kv.value for kv in found.kvs)
        if len(data) != size or xxhash.xxh3_128_hexdigest(data) != digest:
            raise StateFileError(
                f"{where} names chunks that are missing or torn ({len(data)} of {size} bytes "
                f"found): {advice}"
            )
        return data, blob

    # -- the key-value store ---------------------------------------------------------------

    async def load_kv(self, job: str) -> dict[str, bytes]:
        """The key-value store of `job`, as it was at one revision (the one its owner key was
        read at): the keys listed first, then their values read in sub-ranges of PAGE_KEYS
        keys each. etcd counts every key from a range's start to its end for a read, whatever
        its limit: pages that each run to the end of the store would read it quadratically.
        A new leader loads it before it writes, while no other scheduler of the job may write
        (their leader keys are gone): no compaction of the job's needs holding off meanwhile."""
        for _ in range(READ_TRIES):
            owner = await self.connection.call(
                lambda c: c.get(self.kv_job_key), "read the kv owner"
            )
            if owner is None or owner.value != job.encode():
                return {}
            loaded = await self._kv_at(owner.header.revision)
            if loaded is not None:
                return loaded
        raise StateFileError(
            f"cannot read the key-value store in {self.where}: etcd compacted the revision it "
            f"was read at before it was read whole, {READ_TRIES} times"
        )

    async def _kv_at(self, revision: int) -> dict[str, bytes] | None:
        """The key-value store at `revision`; None when etcd compacted it meanwhile."""
        keys = await self._kv_keys(revision)
        if keys is None:
            return None
        values: dict[str, bytes] = {}
        blobs: dict[str, str] = {}
        for first in range(0, len(keys), PAGE_KEYS):
            page = keys[first : first + PAGE_KEYS]
            found = await self.connection.call(
                functools.partial(
                    _range_at, start=page[0], end=page[-1] + b"\x00", revision=revision
                ),
                "read the key-value store",
            )
            if found is None:
                return None
            for kv in found.kvs:
                key = kv.key[len(self.kv_prefix) :].decode(errors="replace")
                got = await self._kv_value(key, kv.value, revision)
                if got is None:
                    continue  # deleted since (its chunks' revision was compacted)
                values[key], blob = got
                if blob is not None:
                    blobs[key] = blob
        self._kv_blob = blobs
        return values

    async def _kv_keys(self, revision: int) -> list[bytes] | None:
        """Every key of the key-value store at `revision`, in order (None: compacted)."""
        keys: list[bytes] = []
        start, end = self.kv_prefix, range_end(self.kv_prefix)
        while True:
            listed = await self.connection.call(
                functools.partial(
                    _range_at,
                    start=start,
                    end=end,
                    revision=revision,
                    limit=LIST_KEYS,
                    keys_only=True,
                ),
                "list the key-value store",
            )
            if listed is None:
                return None
            keys.extend(kv.key for kv in listed.kvs)
            if not listed.more or not listed.kvs:
                return keys
            start = listed.kvs[-1].key + b"\x00"

    async def _kv_value(
        self, key: str, raw: bytes, read_at: int
    ) -> tuple[bytes, str | None] | None:
        """The value of key-value key `key`, read as `raw` at revision `read_at`; read again
        when etcd compacted that revision before its chunks were read; None once it is gone."""
        where = f"{self.where} (key-value key {key!r})"
        advice = "delete it to go on without that key"
        name = self.kv_prefix + key.encode()
        for _ in range(READ_TRIES):
            value = await self._value(raw, read_at, self.kv_blobs, where, advice)
            if value is not None:
                return value
            got = await self.connection.call(lambda c: c.get(name), "read a key-value key")
            if got is None:
                return None
            raw, read_at = got.value, got.header.revision
        raise StateFileError(
            f"cannot read {where}: etcd compacted its revision before its chunks were read, "
            f"{READ_TRIES} times"
        )

    async def save_kv(self, job: str, changes: Mapping[str, bytes]) -> None:
        fence = self._fence()
        batch: list[Op] = []
        size = 0
        written: dict[str, str | None] = {}
        for key, value in changes.items():
            stored, blob = await self._stored_form(value, self.kv_blobs, fence)
            ops = [_put(self.kv_prefix + key.encode(), stored)]
            old = self._kv_blob.get(key)
            if old is not None:
                chunks = self.kv_blobs + old.encode() + b"/"
                ops.append(_delete_prefix(chunks))
            if batch and (len(batch) + len(ops) > TXN_OPS or size + len(stored) > TXN_BYTES):
                await self._kv_txn(job, fence, batch, written, size)
                batch, size, written = [], 0, {}
            batch.extend(ops)
            size += len(stored) + len(key)
            written[key] = blob
        if batch:
            await self._kv_txn(job, fence, batch, written, size)

    async def _kv_txn(
        self, job: str, fence: int, ops: list[Op], written: dict[str, str | None], size: int
    ) -> None:
        leader, owner = self.election.leader_key, self.kv_job_key
        ok, responses = await self._txn(
            [_created(leader, fence), _holds(owner, job.encode())],
            [*ops, _get(leader)],
            [_get(leader)],
            "save key-value changes",
        )
        if not ok:
            self._fenced(responses, fence)
            for blob in written.values():
                await self._drop(self.kv_blobs, blob, fence)
            raise FencedError(
                f"the key-value store in {self.where} is no longer job {job}'s: another "
                "scheduler started a new job there"
            )
        for key, blob in written.items():
            if blob is None:
                self._kv_blob.pop(key, None)
            else:
                self._kv_blob[key] = blob
        await self.history.wrote(responses[-1][0][1].header.revision, size)

    async def clear_kv(self, job: str) -> None:
        fence = self._fence()
        leader, kv, blobs, owner = (
            self.election.leader_key,
            self.kv_prefix,
            self.kv_blobs,
            self.kv_job_key,
        )
        ok, responses = await self._txn(
            [_created(leader, fence)],
            [_delete_prefix(kv), _delete_prefix(blobs), _put(owner, job.encode())],
            [_get(leader)],
            "clear the key-value store",
        )
        if not ok:
            self._fenced(responses, fence)
        self._kv_blob = {}

    async def collect_garbage(self) -> int:
        """Remove the chunks no key names (a leader died, lost its lease, or lost a save's
        answer between writing chunks and naming them); the number of chunk sets removed.
        Only while no save of this scheduler is under way (a save's chunks are unnamed until
        it lands): a new leader calls it after its first save, before saving in the background.
        The named ones are those this store read or wrote (`load`, `load_kv`, saves)."""
        fence = self._fence()
        named = {*self._kv_blob.values(), self._state_blob}
        removed = 0
        for blobs in (self.state_blobs, self.kv_blobs):
            found = await self.connection.call(
                functools.partial(_range, start=blobs, end=range_end(blobs), keys_only=True),
                "list chunks",
            )
            ids = {kv.key[len(blobs) :].split(b"/", 1)[0].decode() for kv in found.kvs}
            unnamed = sorted(ids - named)
            for first in range(0, len(unnamed), TXN_OPS):
                batch = unnamed[first : first + TXN_OPS]
                ok, responses = await self._txn(
                    [_created(self.election.leader_key, fence)],
                    [self._chunks_gone(blobs, blob) for blob in batch],
                    [_get(self.election.leader_key)],
                    "remove unnamed chunks",
                )
                if not ok:
                    self._fenced(responses, fence)
                removed += len(batch)
        self._unknown_blobs.clear()
        return removed


async def _range(
    client: Any,
    *,
    start: bytes,
    end: bytes,
    limit: int = 0,
    keys_only: bool = False,
    revision: int = 0,
) -> Any:
    """One page of a range read (aetcd's get_prefix reads it all at once), at `revision` (0:
    the latest)."""
    from aetcd import rpc  # noqa: PLC0415 - aetcd only when an etcd URL is used

    request = rpc.RangeRequest(
        key=start, range_end=end, limit=limit, keys_only=keys_only, revision=revision
    )
    return await client.kvstub.Range(request, timeout=client._timeout, metadata=client.metadata)


async def _range_at(
    client: Any,
    *,
    start: bytes,
    end: bytes,
    revision: int,
    limit: int = 0,
    keys_only: bool = False,
) -> Any:
    """One page of a range read as it was at `revision`; None when etcd compacted it."""
    try:
        return await _range(
            client, start=start, end=end, revision=revision, limit=limit, keys_only=keys_only
        )
    except Exception as exc:
        if "compacted" in describe(exc):
            return None
        raise
