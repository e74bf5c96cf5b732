"""The state store of MS_RECOVERY_PATH: today's files and lock behind the `StateStore` interface.

`scheduler.json` (the state, `store.save`/`store.load`), `scheduler.lock` (held while a
scheduler runs on the directory: the store's "acquire") and `kv.log` (the key-value store,
`kv_log`). The compare-and-set token is the SHA-256 of the saved payload. Under the lock this
process is the only writer, so it knows what is on disk: a save checks the file's identity
(inode, size, modification time) against the one it last wrote or read, and reads the file
again only when another process changed it behind the lock.

Every write first checks that `scheduler.lock` at the path is still the file this process holds
locked: once MS_RECOVERY_PATH is removed or replaced while the scheduler runs, another scheduler
can lock the new directory, and this one's writes (state, key-value log) fail with FencedError
instead of landing in that scheduler's files. The key-value log holds its file open and writes
only to it (`KvLog.append`), so a batch never lands in a log that replaced it.

Blocking file I/O runs on a worker thread (an fsync must not stall the scheduler's loop). A write
runs to its end even when its caller is cancelled, and `release` (and `close`) waits for the
writes still running, up to WRITE_WAIT_S, before it lets the lock go: the next holder never sees
a file land after it loaded. A write still running then (a hung filesystem) is logged and left
to land or fail on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from cluster.protocol.config import RecoveryConfig
from cluster.protocol.errors import FencedError, StateFileError
from cluster.storage import atomic, kv_log, store
from cluster.storage.kv_log import KvLog
from cluster.storage.recovery_dir import check_recovery_path
from cluster.storage.state_store import SCHEDULER_KIND, Stored, Written

STATE_FILE = "scheduler.json"
# What a state found damaged while this scheduler runs on the directory calls for: nothing of the
# operator's (at start-up, the file is all a scheduler knows of the job, and it is refused).
_SAVED_AGAIN = (
    "this scheduler holds the directory's lock and saves the job's state there again, so the job "
    "goes on"
)
# How long `release` waits for the writes still running: short, as a stopping scheduler has a few
# seconds before the launcher's SIGKILL (a killed process loses its lock only with its threads).
WRITE_WAIT_S = 1.0
# A file as `file_identity` tells it: (inode, size, mtime in ns).
FileIdentity = tuple[int, int, int]
_T = TypeVar("_T")
_log = logging.getLogger(__name__)


def file_identity(path: Path) -> FileIdentity | None:
    """The file at `path` itself (not followed), as a change to it shows: a file replaced by a
    rename is another inode, one rewritten in place another size or mtime; None when there is
    none."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class DirectoryStore:
    standby = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE
        self.name = "MS_RECOVERY_PATH"
        self.where = str(self.path)
        self._lock = store.RecoveryLock(directory)
        self._held = False
        self._kv = KvLog(directory)
        # What this process last read or wrote: the file's identity and its token.
        self._seen: tuple[FileIdentity | None, str] | None = None
        self._writes: set[asyncio.Future[Any]] = set()  # the writes whose thread still runs

    async def acquire(self) -> str | None:
        # Refused when another user could redirect what is written here (ConfigError, one line).
        await asyncio.to_thread(check_recovery_path, RecoveryConfig(self.directory))
        self._lock.acquire()  # ConfigError naming the holder when another scheduler has it
        self._held = True
        # The only writer from here on: the temporaries that a writer killed mid-write left (a
        # save's, a compaction's copy of the key-value log) are removed.
        for name in (STATE_FILE, kv_log.FILE_NAME):
            atomic.remove_temporaries(self.directory / name)
        return None

    async def release(self) -> None:
        self._held = False  # no write starts from here on
        try:
            if self._writes:
                _, running = await asyncio.wait(set(self._writes), timeout=WRITE_WAIT_S)
                if running:
                    _log.warning(
                        "%d write(s) to %s still running after %g s; releasing its lock anyway "
                        "(a scheduler that takes it now may see them land)",
                        len(running),
                        self.directory,
                        WRITE_WAIT_S,
                    )
        finally:
            self._lock.release()
            self._kv.close()

    async def _write(self, write: Callable[..., _T], *args: Any) -> _T:
        """`write(*args)` on a worker thread, once the lock is seen to be the directory's still
        (`RecoveryLock.check`: FencedError when it was removed or replaced), tracked until its
        thread ends (a cancelled caller stops waiting for it; `release` still does)."""
        future = asyncio.ensure_future(asyncio.to_thread(self._checked, write, *args))
        self._writes.add(future)
        future.add_done_callback(self._ended)
        return await asyncio.shield(future)

    def _checked(self, write: Callable[..., _T], *args: Any) -> _T:
        self._lock.check()
        return write(*args)

    def _ended(self, future: asyncio.Future[Any]) -> None:
        self._writes.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a caller that was cancelled never reads it

    async def close(self) -> None:
        await self.release()

    async def load(self) -> Stored:
        return await asyncio.to_thread(self._load)

    def _load(self) -> Stored:
        identity = file_identity(self.path)
        snapshot = store.load(self.path, SCHEDULER_KIND)
        token = "" if snapshot is None else store.checksum(snapshot)
        self._seen = (identity, token)
        return Stored(snapshot, token, store.left_behind(self.directory) if token == "" else ())

    async def save(self, snapshot: dict[str, Any], token: str) -> Written:
        if not self._held:
            raise FencedError(f"this scheduler does not hold the lock of {self.directory}")
        return await self._write(self._save, snapshot, token)

    def _save(self, snapshot: dict[str, Any], token: str) -> Written:
        current = self._current_token()
        if current is not None and current != token:
            return Written(False, self._load())
        store.save(self.path, SCHEDULER_KIND, snapshot)
        written = store.checksum(snapshot)
        self._seen = (file_identity(self.path), written)
        return Written(True, Stored(snapshot, written))

    def _current_token(self) -> str | None:
        """The token of what is on disk; None when there is no file to read (a disk fault
        behind the lock, not another writer: the save writes it again, or says what the disk
        refused) or it was damaged and is now kept aside (`_keep_damaged`)."""
        try:
            identity = file_identity(self.path)
        except OSError:
            return None
        seen = self._seen
        if seen is not None and seen[0] == identity:
            return seen[1]
        try:
            data = atomic.read_no_follow(self.path)
        except OSError:
            return None  # gone or unreadable (a disk fault, not another writer): rewritten
        try:
            snapshot = store.decode(data, SCHEDULER_KIND, str(self.path), _SAVED_AGAIN)
        except StateFileError as exc:
            self._keep_damaged(str(exc))
            return None
        return store.checksum(snapshot)

    def _keep_damaged(self, why: str) -> None:
        """The state on disk is no state any scheduler saves whole (torn, edited, foreign): no
        other scheduler wrote it, as this one holds the lock, and waiting cannot mend it. Keep
        its bytes beside it for the operator and say so, once: the save then writes the state
        this scheduler holds (a file that cannot be moved is left to the save to replace)."""
        kept = _damaged_name(self.path)
        try:
            self.path.replace(kept)
        except OSError as exc:
            _log.warning("%s; keeping the damaged file failed (%s)", why, exc.strerror)
            return
        _log.warning("%s; the damaged file is kept as %s", why, kept)

    async def load_kv(self, job: str) -> dict[str, bytes]:
        return await asyncio.to_thread(self._kv.load, job)

    async def save_kv(self, job: str, changes: Mapping[str, bytes]) -> None:
        if not self._held:
            raise FencedError(f"this scheduler does not hold the lock of {self.directory}")
        await self._write(self._kv.append, job, dict(changes))

    async def clear_kv(self, job: str) -> None:
        if not self._held:
            raise FencedError(f"this scheduler does not hold the lock of {self.directory}")
        await self._write(self._kv.reset, job)


def _damaged_name(path: Path) -> Path:
    """Where a damaged state file is kept: beside it, named by the UTC time it was found."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = path.with_name(f"{path.name}.damaged-{stamp}")
    number = 1
    while kept.exists():
        number += 1
        kept = path.with_name(f"{path.name}.damaged-{stamp}-{number}")
    return kept
