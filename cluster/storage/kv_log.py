"""The job's key-value store on disk: an append-only log of batches, compacted when it grows.

`MS_RECOVERY_PATH/kv.log` starts with a header line naming the format and the job
(`cluster-kv 2 <job id>`), followed by records, one per key set:

    b"KV" | body length (u32, big-endian) | XXH32 of the six bytes before (u32) | body |
    XXH3-128 of the body (16 bytes)
    body = key length (u32) | key (UTF-8) | value

A batch of changes is one write and one fsync, so a key set costs a fraction of an fsync however
many arrive together, and never a rewrite of the whole store. A crash mid-append leaves a torn
last record: it was never acknowledged (the answer waits for the fsync), so loading drops it and
the next append overwrites it. A record's header carries its own check, so its length is
trusted or known damaged without looking at what follows: a header that checks out and whose
record runs past the end of the file is a torn tail, whatever its value holds (a member may set
a value that holds encoded records, ending exactly where a crash cuts it); a header that fails
its check, a complete record that fails its checksum, or anything that is not a record, is
corruption: reported, never half-loaded nor cut. A header cut short at the end of the file, or
a tail of zeros, is torn.

Version 1 logs, whose headers had no check, are read with their rule: a record whose length
runs past the end is taken for torn only when no chain of whole records begins after its header
and reaches exactly the end of the file, and its own bytes to the end are not one whole record
(otherwise its length was damaged). Such a log is rewritten in version 2 at its first append.

The log is compacted: it knows the size of the newest record of each key, so what a compacted
log would hold (`live`: the header and one record per key) is exact, whatever was rewritten.
Once the file is larger than twice that and than COMPACT_MIN_BYTES (`needs_compaction`), it is
rewritten atomically with one record per key (`atomic.write_atomically`: a crash leaves the old
log or the new one). A key rewritten forever keeps the log under max(COMPACT_MIN_BYTES, 2 x
live) plus one batch, and a compaction rewrites at most half of what was appended since the last
one. The file is never opened through a link (`atomic.open_no_follow`).

A compaction that fails (no room for the temporary copy) fails no append: the batch is durable
once fsynced. The failure is logged once, the log stays as it is, and a later append tries the
compaction again (and logs once when it succeeds).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import xxhash

from cluster.protocol.errors import FencedError, StateFileError
from cluster.storage import atomic

FILE_NAME = "kv.log"
FORMAT = b"cluster-kv"
VERSION = 2
MAGIC = b"KV"
_LENGTH = struct.Struct(">I")
_DIGEST = 16
# A record's header: its magic and body length, and from version 2 their XXH32.
_HEAD_BYTES = {1: 6, 2: 10}
COMPACT_MIN_BYTES = 4 * 1024 * 1024
ADVICE = "move it away (the job's key-value store is then empty after a restart)"

_log = logging.getLogger(__name__)


def needs_compaction(size: int, live: int) -> bool:
    """Whether a log of `size` bytes whose compacted form holds `live` bytes is rewritten."""
    return size > max(COMPACT_MIN_BYTES, 2 * live)


def record_size(key: str, value: bytes, version: int = VERSION) -> int:
    """The bytes of `encode_record(key, value, version)`."""
    return _HEAD_BYTES[version] + _LENGTH.size + len(key.encode()) + len(value) + _DIGEST


def _header(job: str) -> bytes:
    return b"%s %d %s\n" % (FORMAT, VERSION, job.encode())


def encode_record(key: str, value: bytes, version: int = VERSION) -> bytes:
    raw_key = key.encode()
    body = _LENGTH.pack(len(raw_key)) + raw_key + value
    return _record_head(len(body), version) + body + xxhash.xxh3_128_digest(body)


def _record_head(length: int, version: int) -> bytes:
    lead = MAGIC + _LENGTH.pack(length)
    return lead if version == 1 else lead + _head_check(lead)


def _head_check(lead: bytes | memoryview) -> bytes:
    return _LENGTH.pack(xxhash.xxh32_intdigest(lead))


def _checks_out(view: memoryview, at: int, length: int, head: int = 6) -> bool:
    """Whether the record at `at`, its header `head` bytes and its body `length`, lies whole
    in `view` and verifies."""
    end = at + head + length + _DIGEST
    if length < 4 or end > len(view):
        return False
    return xxhash.xxh3_128_digest(view[at + head : end - _DIGEST]) == view[end - _DIGEST : end]


def _damaged_length(data: bytes, at: int, length: int) -> str:
    """Why the version-1 record at `at`, whose `length` runs past the end of `data`, is whole
    records behind a damaged length rather than a torn tail ('' when it is torn): a whole record
    begins after its header, or its own bytes to the end verify as one record."""
    whole = _next_whole_record(data, at + 6)
    if whole is not None:
        follows = f"a whole record follows at byte {whole}"
    elif _checks_out(memoryview(data), at, len(data) - at - 6 - _DIGEST):
        follows = "its bytes to the end of the file are a whole record"
    else:
        return ""
    return f"a record's length, {length} bytes, runs past the end of the log, yet {follows}"


def _next_whole_record(data: bytes, start: int) -> int | None:
    """Where the first version-1 record at or after `start` begins from which whole records
    (each its magic, a length within `data`, its checksum) follow one another to exactly the
    end of `data`; None when there is none. Records that stop short of the end are bytes of a value
    (a torn last record whose value holds encoded records), not saved records: a saved record
    is followed by the next one or by the end of the log."""
    view = memoryview(data)
    dead: set[int] = set()  # starts of chains that stop short of the end
    at = data.find(MAGIC, start)
    while at != -1 and at + 6 <= len(data):
        if _reaches_the_end(view, at, dead):
            return at
        at = data.find(MAGIC, at + 1)
    return None


def _reaches_the_end(view: memoryview, at: int, dead: set[int]) -> bool:
    """Whether whole records follow one another from `at` to exactly the end of `view`; the
    starts walked are added to `dead` when they do not (so no start is walked twice)."""
    walked = []
    while at < len(view) and at not in dead:
        walked.append(at)
        if at + 6 > len(view) or view[at : at + 2] != MAGIC:
            break
        (length,) = _LENGTH.unpack(view[at + 2 : at + 6])
        if not _checks_out(view, at, length):
            break
        at += 6 + length + _DIGEST
    if at == len(view):
        return True
    dead.update(walked)
    return False


def _torn_head(data: bytes, at: int, size: int) -> bool:
    """Whether what lies at `at`, where a record's header of `size` bytes is due, is the start
    of one cut short: less than a header before the end of the file or a tail of zeros (a file
    grown before its last bytes landed)."""
    written = data[at:].rstrip(b"\0")
    return len(written) < size and MAGIC.startswith(written[:2])


def _read_from_start(fd: int) -> bytes:
    """Every byte of the file open at `fd`; OSError."""
    with open(fd, "rb", closefd=False) as file:
        file.seek(0)
        return file.read()


def _names(path: Path, fd: int) -> bool:
    """Whether `path` names the file open at `fd` (False when it cannot be told)."""
    try:
        return atomic.names_open_file(path, fd)
    except OSError:
        return False


class KvLog:
    """The log of one directory; one writer at a time (the scheduler holding its lock)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME
        self._job: str | None = None  # the job of the log on disk, once read or written
        self._version = VERSION  # the format of its records
        self._size = 0  # bytes of the file that hold the header and whole records
        self._record_sizes: dict[str, int] = {}  # the size of the newest record of each key
        self._live = 0  # the header and the newest record of each key: the compacted size
        self._compaction_failing = False  # the last compaction failed (and was logged)
        # The log read or written, held open while `_job` is set: appends go to this file only.
        self._file: int | None = None

    def load(self, job: str) -> dict[str, bytes]:
        """The store of `job`; empty when the log is missing or another job's. The log read is
        held open from then on (`close`): `append` writes to that file only."""
        try:
            fd = atomic.open_regular(self.path)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise self._unreadable(exc) from None
        try:
            values = self._parse(_read_from_start(fd), job)
        except OSError as exc:
            os.close(fd)
            raise self._unreadable(exc) from None
        except BaseException:
            os.close(fd)
            raise
        if values is None:
            os.close(fd)
            return {}  # another job's: the next clear replaces it
        self._hold(fd)
        return values

    def _parse(self, data: bytes, job: str) -> dict[str, bytes] | None:
        """The store in `data`, a whole log, and its counts taken; None when it is another
        job's log."""
        line, newline, _ = data.partition(b"\n")
        parts = line.split(b" ", 2)
        if not newline or len(parts) != 3 or parts[0] != FORMAT:
            raise StateFileError(f"{self.path} is not a cluster key-value log: {ADVICE}")
        if not parts[1].isdigit() or not 1 <= int(parts[1]) <= VERSION:
            raise StateFileError(
                f"the key-value log {self.path} has format version "
                f"{parts[1].decode(errors='replace')!r}, but this "
                f"cluster reads versions 1 to {VERSION}: {ADVICE}"
            )
        if parts[2].decode(errors="replace") != job:
            return None
        version = int(parts[1])
        values, end = self._records(data, len(line) + 1, version)
        self._job, self._size, self._version = job, end, version
        self._count(values, len(line) + 1)
        return values

    def _count(self, values: Mapping[str, bytes], header: int) -> None:
        """Take the sizes of a log of `values` in this log's version, after a `header`."""
        self._record_sizes = {k: record_size(k, v, self._version) for k, v in values.items()}
        self._live = header + sum(self._record_sizes.values())

    def _unreadable(self, exc: OSError) -> StateFileError:
        return StateFileError(atomic.unreadable("the key-value log", self.path, exc, ADVICE))

    def _records(self, data: bytes, start: int, version: int) -> tuple[dict[str, bytes], int]:
        """Every whole record from `start`, in `version`'s format, and where they end (a torn
        tail is dropped)."""
        values: dict[str, bytes] = {}
        view = memoryview(data)  # slices of a view copy nothing: each value is copied once
        size, at = _HEAD_BYTES[version], start
        while at < len(data):
            head = data[at : at + size]
            whole = len(head) == size and head[:2] == MAGIC
            if not whole or (version > 1 and _head_check(head[:6]) != head[6:]):
                if _torn_head(data, at, size):
                    break  # a torn tail: never acknowledged
                why = "a record's header fails its check" if whole else "no record starts there"
                raise self._corrupt(at, why)
            (length,) = _LENGTH.unpack(head[2:6])
            end = at + size + length + _DIGEST
            if end > len(data):
                damaged = _damaged_length(data, at, length) if version == 1 else ""
                if not damaged:
                    break  # torn
                raise self._corrupt(at, damaged)
            if not _checks_out(view, at, length, size):
                raise self._corrupt(at, "a record fails its checksum")
            body = view[at + size : at + size + length]
            (key_length,) = _LENGTH.unpack(body[:4])
            try:
                key = str(body[4 : 4 + key_length], "utf-8")
            except UnicodeDecodeError:
                raise self._corrupt(at, "a key is not UTF-8") from None
            values[key] = bytes(body[4 + key_length :])
            at = end
        return values, at

    def _corrupt(self, at: int, what: str) -> StateFileError:
        return StateFileError(
            f"the key-value log {self.path} is corrupt at byte {at} ({what}): {ADVICE}"
        )

    def append(self, job: str, changes: Mapping[str, bytes]) -> None:
        """Add `changes` to `job`'s log, durably (one write, one fsync). StateFileError when the
        batch is not durable; a failed compaction afterwards is logged, never raised."""
        if self._job != job:
            self.reset(job)
        elif self._version != VERSION:
            self._compact_logging_failure()  # an older format's log is rewritten in this one
        records = {k: encode_record(k, v, self._version) for k, v in changes.items()}
        data = b"".join(records.values())
        fd = self._open_own()
        try:
            os.ftruncate(fd, self._size)  # a torn tail from a crash, or a failed write
            os.lseek(fd, self._size, os.SEEK_SET)
            atomic.write_all(fd, data)
            os.fsync(fd)
        except OSError as exc:
            raise self._failed(exc) from None
        finally:
            os.close(fd)
        self._size += len(data)
        for key, record in records.items():
            self._live += len(record) - self._record_sizes.get(key, 0)
            self._record_sizes[key] = len(record)
        if needs_compaction(self._size, self._live):
            self._compact_logging_failure()

    def _open_own(self) -> int:
        """The log at the path, open for writing; FencedError when it is not the file this log
        holds (removed, or replaced by another file or a link: another writer's, perhaps),
        StateFileError when it cannot be opened."""
        try:
            fd = atomic.open_no_follow(self.path, os.O_WRONLY)
        except FileNotFoundError:
            raise self._replaced("nothing is there") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # never followed, as no link is this log's file
                raise self._replaced("a symbolic link is there") from None
            raise self._failed(exc) from None
        try:
            own = self._file is not None and atomic.same_file(os.fstat(fd), os.fstat(self._file))
        except OSError as exc:
            os.close(fd)
            raise self._failed(exc) from None
        if not own:
            os.close(fd)
            raise self._replaced("another file is there")
        return fd

    def _replaced(self, what: str) -> FencedError:
        return FencedError(
            f"cannot save the key-value store to {self.path}: it is not the log this scheduler "
            f"has been writing ({what}); the log or its directory was removed or replaced, and "
            "another scheduler may write there now, so nothing is written to it"
        )

    def _compact_logging_failure(self) -> None:
        """Compact; a failure is logged once until a compaction succeeds again."""
        try:
            self.compact()
        except StateFileError as exc:
            if not self._compaction_failing:
                self._compaction_failing = True
                _log.warning("%s; it is compacted again on a later append", exc)
            return
        if self._compaction_failing:
            self._compaction_failing = False
            _log.info("compacted the key-value log %s again", self.path)

    @property
    def size(self) -> int:
        """The bytes of the log on disk (header and whole records)."""
        return self._size

    @property
    def live(self) -> int:
        """The bytes the log would hold once compacted."""
        return self._live

    def compact(self) -> None:
        """Rewrite the log with the newest value of each key, atomically. StateFileError when it
        cannot; the records stay on disk, in the old log or the new one."""
        job, held = self._job, self._file
        assert job is not None
        assert held is not None
        try:
            values = self._parse(_read_from_start(held), job)
        except OSError as exc:
            raise self._compaction_failed(exc) from None
        if values is None:
            raise StateFileError(f"{self.path} has become another job's key-value log: {ADVICE}")
        header = _header(job)
        data = header + b"".join(encode_record(k, v) for k, v in values.items())

        def compacted() -> None:
            self._version, self._size = VERSION, len(data)
            self._count(values, len(header))  # in this version: `_live` is the size written

        self._replace(data, self._compaction_failed, compacted)

    def reset(self, job: str) -> None:
        """An empty log for `job`, replacing any other, atomically."""
        header = _header(job)

        def emptied() -> None:
            self._job, self._size, self._live = job, len(header), len(header)
            self._version, self._record_sizes = VERSION, {}

        self._replace(header, self._failed, emptied)

    def _replace(
        self, data: bytes, fail: Callable[[OSError], StateFileError], adopt: Callable[[], None]
    ) -> None:
        """Replace the log with `data` atomically, hold the new file and `adopt()` its counts;
        `fail(exc)` when it cannot. A rename that landed before a later step failed is adopted
        all the same: the file held is the one the path names."""
        written: list[int] = []

        def write(fd: int) -> None:
            atomic.write_all(fd, data)
            written.append(os.dup(fd))

        try:
            atomic.write_atomically(self.path, write, fail)
        finally:
            if written and _names(self.path, written[0]):
                self._hold(written[0])
                adopt()
            elif written:
                os.close(written[0])
        atomic.remove_temporaries(self.path)

    def _hold(self, fd: int) -> None:
        if self._file is not None:
            os.close(self._file)
        self._file = fd

    def close(self) -> None:
        """Let the log go: the next `append` starts from a `load` or a new log."""
        if self._file is not None:
            os.close(self._file)
        self._file, self._job = None, None

    def _failed(self, exc: OSError) -> StateFileError:
        return StateFileError(
            f"cannot save the key-value store to {self.path} ({exc.strerror}); what it held "
            "before is unchanged"
        )

    def _compaction_failed(self, exc: OSError) -> StateFileError:
        return StateFileError(
            f"cannot compact the key-value log {self.path} ({exc.strerror}); its records are "
            "saved, uncompacted"
        )
