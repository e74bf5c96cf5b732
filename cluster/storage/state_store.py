"""One interface for where a scheduler keeps its job: compare-and-set, as torch elastic's
rendezvous backend has it.

`save(snapshot, token)` writes only when `token` still names what is stored (the token the last
`load` or `save` returned), and returns what is stored either way, so a stale writer learns that
it is stale and what replaced its view. A store is held by one scheduler at a time (`acquire`):
the directory store by a lock on the directory, the etcd store by a leader key on a lease; a
write of a scheduler that does not hold it fails with `FencedError`, whatever its token.

The job's key-value store is kept beside the state, incrementally: `save_kv` writes the keys a
batch changed, never the whole store, and `load_kv` gives back the store of the job named, empty
when what is kept belongs to another job.

Two implementations: `cluster.storage.directory_store` (MS_RECOVERY_PATH) and
`cluster.scheduler.etcd_store` (CLUSTER_STATE_URL=etcd://...); `tests/unit/test_state_store.py`
holds both to the same contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from cluster.protocol.value import frozen

SCHEDULER_KIND = "scheduler"


@frozen
class Stored:
    """What a store holds: the snapshot (None: nothing yet) and the token that names it;
    with no snapshot, what other jobs left there that their processes read again (a phrase
    each, naming the files and their job: `store.left_behind`)."""

    snapshot: dict[str, Any] | None
    token: str = ""
    left: tuple[str, ...] = ()


@frozen
class Written:
    """What `save` did: `ok` when the snapshot was written; `current` is what is stored now."""

    ok: bool
    current: Stored


class StateStore(Protocol):
    # What names the store (the setting), and where the state is, for messages:
    # "MS_RECOVERY_PATH" and "/var/tmp/job1/scheduler.json"; "CLUSTER_STATE_URL" and
    # "etcd://h:p/jobs/a".
    name: str
    where: str
    # Whether a scheduler that finds the store held may wait for it (standby schedulers).
    standby: bool

    async def acquire(self) -> str | None:
        """Hold the store; None when this process holds it now, otherwise who holds it."""
        ...

    async def release(self) -> None:
        """Stop holding the store (a standby may take it at once)."""
        ...

    async def close(self) -> None:
        """Release, and free what the store uses (connections, files)."""
        ...

    async def load(self) -> Stored:
        """What is stored now; StateFileError when it is unusable (torn, foreign, newer)."""
        ...

    async def save(self, snapshot: dict[str, Any], token: str) -> Written:
        """Compare-and-set; FencedError when this process does not hold the store; another
        StateFileError when the write failed (it may be tried again)."""
        ...

    async def load_kv(self, job: str) -> dict[str, bytes]:
        """The key-value store of job `job` (empty when what is kept is another job's)."""
        ...

    async def save_kv(self, job: str, changes: Mapping[str, bytes]) -> None:
        """Set the keys of `changes` (durably, atomically per key) in job `job`'s store, in
        their order: a batch cut short (a crash, a lost answer) keeps a prefix of it."""
        ...

    async def clear_kv(self, job: str) -> None:
        """An empty key-value store for job `job`, replacing whatever was kept."""
        ...
