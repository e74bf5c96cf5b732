"""Checkpoint files: layout, checksum, write, read and verify.

File layout (version 2), integers little-endian:

    preamble  MAGIC, version u32, flags u32 (0), header length u64, file size u64   (32 bytes)
    header    JSON, UTF-8 (format, version, step, rank, prefix, data_bytes, entries, state);
              zero padding to a multiple of 64
    data      each array's bytes at 64-byte-aligned offsets (zero padding between)
    footer    END_MAGIC, XXH3-128 of every byte before the footer                  (24 bytes)

Version 1 (written before the background writer) is the same with a SHA-256 footer (40 bytes);
it is still read and verified, so a job upgraded mid-run keeps its checkpoints. XXH3 (the
`xxhash` package, which releases the GIL while it hashes) checks 100 MB in about 10 ms on one
core, against 70 ms for SHA-256: it is there to catch torn, truncated and damaged files, not
forgeries (a checkpoint directory is as trusted as the code that reads it).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import queue
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import xxhash

from cluster.protocol.errors import CheckpointError, CorruptCheckpointError
from cluster.storage import atomic
from cluster.storage.checkpoint_tree import (
    Encoded,
    aligned,
    allocate,
    check_entry,
    decode_state,
    is_count,
)

FORMAT = "cluster-checkpoint"
VERSION = 2
MAGIC = b"CLCKPT\r\n"
END_MAGIC = b"CLCKEND\n"
SUFFIX = ".ckpt"

PREAMBLE = struct.Struct("<8sIIQQ")
# The checksum of each version: what makes a fresh hash object, and its digest size.
_DIGESTS: dict[int, tuple[Any, int]] = {1: (hashlib.sha256, 32), 2: (xxhash.xxh3_128, 16)}
FOOTER_SIZE = len(END_MAGIC) + _DIGESTS[VERSION][1]
# Reads are hashed in slices of this size, so hashing one slice overlaps reading the next.
_READ_SLICE = 8 << 20


class Hash(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


def new_hash() -> Hash:
    """The checksum of the current version, empty."""
    made: Hash = _DIGESTS[VERSION][0]()
    return made


def rank_directory(root: Path, rank: int) -> Path:
    """Where the checkpoints of `rank` lie under a checkpoint directory."""
    return root / f"rank_{rank}"


def file_name(prefix: str, step: int) -> str:
    """The file name of the checkpoint of `step` (the one canonical spelling)."""
    return f"{prefix}-{step:08d}{SUFFIX}"


def head(step: int, rank: int, prefix: str, encoded: Encoded) -> bytes:
    """Everything before the data: preamble, header, padding (a file of the current version)."""
    header = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "rank": rank,
            "prefix": prefix,
            "data_bytes": encoded.data_bytes,
            "entries": encoded.entries,
            "state": encoded.tree,
        },
        separators=(",", ":"),
    ).encode()
    data_start = aligned(PREAMBLE.size + len(header))
    size = data_start + encoded.data_bytes + FOOTER_SIZE
    preamble = PREAMBLE.pack(MAGIC, VERSION, 0, len(header), size)
    return preamble + header + bytes(data_start - PREAMBLE.size - len(header))


def footer(digest: bytes) -> bytes:
    return END_MAGIC + digest


def write(path: Path, step: int, parts: Iterable[memoryview | bytes]) -> None:
    """Write a checkpoint file made of `parts` (head, data, footer) atomically and durably;
    CheckpointError naming the file and the cause: before the rename, the files there are as
    they were; after it (the directory's fsync failed), the file is in place, not known durable."""

    def write_parts(fd: int) -> None:
        for part in parts:
            atomic.write_all(fd, part)

    def failed(exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"cannot save the checkpoint of step {step} to {path} ({exc.strerror}); the "
            "checkpoints saved before are unchanged"
        )

    def unsynced(exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"the checkpoint of step {step} is in place at {path}, but syncing its directory "
            f"failed ({exc.strerror}): a crash of the host may still lose it; the checkpoints "
            "of other steps are unchanged; check the disk"
        )

    atomic.write_atomically(path, write_parts, failed, unsynced)


def why_unreadable(exc: OSError) -> str:
    """Why a checkpoint file could not be opened or read (`exc`), in words."""
    return "a symbolic link, never followed" if exc.errno == errno.ELOOP else str(exc.strerror)


def looks_complete(path: Path) -> bool | None:
    """Whether the preamble, size and footer are right: a cheap check that the file was written
    whole (`read` verifies the checksum). None when the file cannot be opened or read (no
    permission, an I/O error), or is not a regular file (`atomic.open_regular`: a symbolic
    link, never followed, as `read` never follows one; a FIFO, never waited on): whether it is
    whole is not known, and it is neither a complete checkpoint nor one to remove as torn."""
    found = examine(path)
    return found if isinstance(found, bool) else None


def examine(path: Path) -> bool | str:
    """Whether the file looks complete (`looks_complete`), or, where that cannot be told, why
    (`why_unreadable`: what keeps it from being read)."""
    try:
        fd = atomic.open_regular(path)
    except OSError as exc:
        return why_unreadable(exc)
    try:
        size = os.fstat(fd).st_size
        preamble = os.pread(fd, PREAMBLE.size, 0)
        if size < PREAMBLE.size + len(END_MAGIC) or len(preamble) < PREAMBLE.size:
            return False
        magic, version, _flags, _length, recorded = PREAMBLE.unpack(preamble)
        if magic != MAGIC or version not in _DIGESTS or recorded != size:
            return False
        end = size - len(END_MAGIC) - _DIGESTS[version][1]
        return os.pread(fd, len(END_MAGIC), end) == END_MAGIC
    except OSError as exc:
        return why_unreadable(exc)
    finally:
        os.close(fd)


def read(
    path: Path, step: int, fd: int | None = None, *, rank: int | None = None
) -> dict[str, Any]:
    """The state in the checkpoint file of `step`, verified; CheckpointError naming the file
    when it is unreadable, and its CorruptCheckpointError when it is damaged: torn, corrupt, of
    another step, or (with `rank`) written by another rank. With `fd`, the file read is the one
    open there (from its start; `fd` stays open), `path` only names it: a temporary being
    written, checked before its rename makes it `path`."""
    try:
        opened = os.dup(fd) if fd is not None else atomic.open_regular(path)
        with open(opened, "rb", buffering=0) as file:
            file.seek(0)
            header, state = _read_file(file, step)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"the checkpoint {path} is torn or corrupt ({exc}): it was not loaded; an older "
            "checkpoint may still be whole (CheckpointManager.latest() skips corrupt ones)"
        ) from None
    except OSError as exc:
        raise CheckpointError(
            f"cannot read the checkpoint {path} ({why_unreadable(exc)}): it was not loaded; "
            "make it a regular file this process can read, or move it away"
        ) from None
    if rank is not None and header.get("rank", rank) != rank:
        raise CorruptCheckpointError(
            f"the checkpoint {path} holds the state of rank {header['rank']!r}, not of rank "
            f"{rank}: it was not loaded; one rank's files were saved in another's directory "
            "(a CheckpointManager given the wrong rank=?)"
        )
    return state


def _read_file(file: io.FileIO, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and the state, verified."""
    size = os.fstat(file.fileno()).st_size
    if size < PREAMBLE.size + len(END_MAGIC):
        raise CorruptCheckpointError(f"{size} bytes, shorter than the smallest checkpoint")
    preamble = _read_exactly(file, PREAMBLE.size)
    magic, version, _flags, header_length, recorded = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise CorruptCheckpointError("not a cluster checkpoint: wrong magic bytes")
    if version not in _DIGESTS:
        raise CorruptCheckpointError(
            f"format version {version}; this cluster reads versions 1 to {VERSION}"
        )
    make_hash, digest_size = _DIGESTS[version]
    footer_size = len(END_MAGIC) + digest_size
    if recorded != size:
        raise CorruptCheckpointError(f"{size} bytes, but it was written with {recorded}: truncated")
    if header_length > size - PREAMBLE.size - footer_size:
        raise CorruptCheckpointError(f"header length {header_length} exceeds the file")
    header_data = _read_exactly(file, header_length)
    header = _parse_header(header_data)
    data_start = aligned(PREAMBLE.size + header_length)
    data_bytes = header["data_bytes"]
    if data_start + data_bytes + footer_size != size:
        raise CorruptCheckpointError(
            f"the header's data size {data_bytes} does not match the file size {size}"
        )
    with _Digest(make_hash()) as digest:
        digest.feed(preamble)
        digest.feed(header_data)
        digest.feed(_read_exactly(file, data_start - PREAMBLE.size - header_length))
        values: list[Any] = []
        cursor = 0
        for entry in header["entries"]:
            digest.feed(_read_exactly(file, entry["offset"] - cursor))
            value, raw = allocate(entry)
            for start in range(0, raw.nbytes, _READ_SLICE):
                piece = raw[start : start + _READ_SLICE]
                _read_into(file, piece)
                digest.feed(piece)
            values.append(value)
            cursor = entry["offset"] + entry["nbytes"]
        digest.feed(_read_exactly(file, data_bytes - cursor))
        end = _read_exactly(file, footer_size)
        if end[: len(END_MAGIC)] != END_MAGIC or end[len(END_MAGIC) :] != digest.digest():
            name = "SHA-256" if version == 1 else "XXH3-128 checksum"
            raise CorruptCheckpointError(f"its {name} does not match its content")
    if header["step"] != step:
        raise CorruptCheckpointError(f"it holds step {header['step']!r}, not {step}")
    return header, decode_state(header["state"], values)


def _parse_header(data: bytes) -> dict[str, Any]:
    try:
        header = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptCheckpointError("its header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptCheckpointError("its header is not a cluster checkpoint header")
    if not is_count(header.get("data_bytes")) or not isinstance(header.get("entries"), list):
        raise CorruptCheckpointError("its header lacks the data layout")
    cursor = 0
    for entry in header["entries"]:
        check_entry(entry, cursor)
        cursor = entry["offset"] + entry["nbytes"]
    if cursor > header["data_bytes"]:
        raise CorruptCheckpointError("an array lies past the end of the data")
    return header


class _Digest:
    """A checksum of a stream of buffers, computed on a helper thread: hashing overlaps the
    file's reads (xxhash, hashlib and readinto release the GIL on large buffers)."""

    def __init__(self, hash_: Hash) -> None:
        self._hash = hash_
        self._queue: queue.SimpleQueue[memoryview | bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._hash.update(item)

    def feed(self, data: memoryview | bytes) -> None:
        """Hash `data` next; it must not change until `digest()` returns."""
        self._queue.put(data)

    def digest(self) -> bytes:
        self.close()
        return self._hash.digest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> _Digest:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _read_exactly(file: io.FileIO, count: int) -> bytes:
    data = bytearray(count)
    _read_into(file, memoryview(data))
    return bytes(data)


def _read_into(file: io.FileIO, view: memoryview) -> None:
    while view:
        count = file.readinto(view)
        if not count:
            raise CorruptCheckpointError("it ends early: truncated")
        view = view[count:]
