"""The job's key-value store on disk: an append-only log of batches, compacted when it grows.

`MS_RECOVERY_PATH/kv.log` starts with a header line naming the format and the job
(`cluster-kv 1 <job id>`), followed by records, one per key set:

    b"KV" | body length (u32, big-endian) | body | XXH3-128 of the body (16 bytes)
    body = key length (u32) | key (UTF-8) | value

A batch of changes is one write and one fsync, so a key set costs a fraction of an fsync however
many arrive together, and never a rewrite of the whole store. A crash mid-append leaves a torn
last record: it was never acknowledged (the answer waits for the fsync), so loading drops it and
the next append overwrites it. A complete record that fails its checksum, or anything that is not
a record, is corruption and is reported, never half-loaded. When the log has grown past twice
what it holds (and past COMPACT_MIN_BYTES), it is rewritten atomically with one record per live
key (`atomic.write_atomically`: a crash leaves the old log or the new one).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import xxhash

from cluster.protocol.errors import StateFileError
from cluster.storage import atomic

FILE_NAME = "kv.log"
FORMAT = b"cluster-kv"
VERSION = 1
MAGIC = b"KV"
_LENGTH = struct.Struct(">I")
_DIGEST = 16
COMPACT_MIN_BYTES = 4 * 1024 * 1024
ADVICE = "move it away (the job's key-value store is then empty after a restart)"


def _header(job: str) -> bytes:
    return b"%s %d %s\n" % (FORMAT, VERSION, job.encode())


def encode_record(key: str, value: bytes) -> bytes:
    raw_key = key.encode()
    body = _LENGTH.pack(len(raw_key)) + raw_key + value
    return MAGIC + _LENGTH.pack(len(body)) + body + xxhash.xxh3_128_digest(body)


class KvLog:
    """The log of one directory; one writer at a time (the scheduler holding its lock)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME
        self._job: str | None = None  # the job of the log on disk, once read or written
        self._size = 0  # bytes of the file that hold whole records (after load or append)
        self._live = 0  # bytes of the newest record of each key (estimate after appends)

    def load(self, job: str) -> dict[str, bytes]:
        """The store of `job`; empty when the log is missing or another job's."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StateFileError(
                f"cannot read the key-value log {self.path} ({exc.strerror})"
            ) from None
        line, newline, _ = data.partition(b"\n")
        parts = line.split(b" ", 2)
        if not newline or len(parts) != 3 or parts[0] != FORMAT:
            raise StateFileError(f"{self.path} is not a cluster key-value log: {ADVICE}")
        if not parts[1].isdigit() or int(parts[1]) > VERSION:
            raise StateFileError(
                f"the key-value log {self.path} has format version {parts[1]!r}, but this "
                f"cluster reads version {VERSION} at most: {ADVICE}"
            )
        if parts[2].decode(errors="replace") != job:
            return {}  # another job's: the next clear replaces it
        values, end = self._records(data, len(line) + 1)
        self._job, self._size = job, end
        self._live = sum(len(encode_record(k, v)) for k, v in values.items())
        return values

    def _records(self, data: bytes, start: int) -> tuple[dict[str, bytes], int]:
        """Every whole record from `start`, and where they end (a torn tail is dropped)."""
        values: dict[str, bytes] = {}
        at = start
        while at < len(data):
            head = data[at : at + 6]
            if len(head) < 6 or head[:2] != MAGIC:
                if not data[at:].strip(b"\0") or (len(head) < 6 and MAGIC.startswith(head[:2])):
                    break  # a torn tail: never acknowledged
                raise self._corrupt(at, "no record starts there")
            (length,) = _LENGTH.unpack(head[2:])
            end = at + 6 + length + _DIGEST
            if end > len(data):
                break  # torn
            body = data[at + 6 : at + 6 + length]
            if xxhash.xxh3_128_digest(body) != data[end - _DIGEST : end] or length < 4:
                raise self._corrupt(at, "a record fails its checksum")
            (key_length,) = _LENGTH.unpack(body[:4])
            try:
                key = body[4 : 4 + key_length].decode()
            except UnicodeDecodeError:
                raise self._corrupt(at, "a key is not UTF-8") from None
            values[key] = body[4 + key_length :]
            at = end
        return values, at

    def _corrupt(self, at: int, what: str) -> StateFileError:
        return StateFileError(
            f"the key-value log {self.path} is corrupt at byte {at} ({what}): {ADVICE}"
        )

    def append(self, job: str, changes: Mapping[str, bytes]) -> None:
        """Add `changes` to `job`'s log, durably (one write, one fsync)."""
        if self._job != job:
            self.reset(job)
        data = b"".join(encode_record(k, v) for k, v in changes.items())
        try:
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, self._size)  # a torn tail from a crash, or a failed write
                os.lseek(fd, self._size, os.SEEK_SET)
                atomic.write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._failed(exc) from None
        self._size += len(data)
        self._live += len(data)  # an upper bound: overwritten keys are counted twice
        if self._size > max(COMPACT_MIN_BYTES, 2 * self._live):
            self.compact()

    def compact(self) -> None:
        """Rewrite the log with the newest value of each key, atomically."""
        assert self._job is not None
        values = self.load(self._job)
        data = _header(self._job) + b"".join(encode_record(k, v) for k, v in values.items())
        atomic.write_atomically(self.path, lambda fd: atomic.write_all(fd, data), self._failed)
        self._size = self._live = len(data)

    def reset(self, job: str) -> None:
        """An empty log for `job`, replacing any other, atomically."""
        header = _header(job)
        atomic.write_atomically(self.path, lambda fd: atomic.write_all(fd, header), self._failed)
        self._job, self._size, self._live = job, len(header), 0

    def _failed(self, exc: OSError) -> StateFileError:
        return StateFileError(
            f"cannot save the key-value store to {self.path} ({exc.strerror}); what it held "
            "before is unchanged"
        )

    def remove_stale_temporaries(self) -> None:
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
