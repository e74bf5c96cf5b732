"""A peer table laid out for reading in place, shared by the workers of one host.

Behind a host's relay, a large job's whole table reaches the host once (`cluster.transport.relay`),
and the relay writes it here once per generation, into a sealed memory file (`memfd`): every
worker of the host maps the same pages read-only and reads the rows it needs where they lie. A
worker's formation then costs it O(1) (its own row, `topology.find_row`; any peer by rank,
`Topology.peer`), not the O(N) of inflating and parsing the whole table; it reads every row only
when it asks for all of them (`Topology.peers`). The host holds one copy, however many workers
it runs, and the kernel frees it with the last mapping: a relay killed leaves nothing behind.

The layout, little-endian, every section 8-byte aligned:

    header   magic "CLPTBL1\\0", the table's digest (32 bytes, the SHA-256 it is named by in the
             event stream), rows n, the sizes of the node id and host blobs (u32 each)
    u32[n]   ranks, ports, local ranks, local sizes, roles (columns in rank order, as sent)
    u32[n+1] node id offsets into its blob, then host offsets into its blob
    bytes    the node ids (UTF-8, back to back), then the hosts

`open_shared` checks what it can in O(1): the magic, the digest asked for, and that every section
lies in the file (a file of another table, or a short one, is refused: `SharedTableError`).
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Protocol, overload

from cluster.protocol.errors import SharedTableError
from cluster.protocol.topology import PeerColumns

MAGIC = b"CLPTBL1\0"
_HEADER = struct.Struct("<8s32sIII4x")  # padded to 56 bytes: the columns start 8-aligned
_INT_COLUMNS = ("ranks", "ports", "local_ranks", "local_sizes", "roles")
_LITTLE = sys.byteorder == "little"


class Columns(PeerColumns, Protocol):
    """The columns a table file holds: a `PeerColumns`, with the roles."""

    @property
    def roles(self) -> Sequence[int]: ...


def _padded(size: int) -> int:
    return -size % 8


def _u32(values: Sequence[int]) -> bytes:
    column = values if isinstance(values, array) else array("I", values)
    if not _LITTLE:
        column.byteswap()  # pragma: no cover - big-endian hosts
    data = column.tobytes()
    return data + b"\0" * _padded(len(data))


def _strings(values: Sequence[str]) -> tuple[bytes, bytes]:
    """(offsets, blob) of a string column."""
    joined = "".join(values)
    blob = joined.encode()
    # Where every string is ASCII, bytes and characters count alike: no string encoded alone.
    encoded = values if len(blob) == len(joined) else [value.encode() for value in values]
    offsets = array("I", itertools.accumulate(map(len, encoded), initial=0))
    return _u32(offsets), blob + b"\0" * _padded(len(blob))


def layout(table: Columns, digest: bytes) -> bytes:
    """The bytes of the table file of `table`, named by `digest`."""
    n = len(table.node_ids)
    for column in (*_INT_COLUMNS, "hosts"):
        if len(getattr(table, column)) != n:
            raise ValueError(f"a peer table whose column {column} is not {n} long")
    id_offsets, ids = _strings(table.node_ids)
    host_offsets, hosts = _strings(table.hosts)
    parts = [_HEADER.pack(MAGIC, digest, n, len(ids), len(hosts))]
    parts += [_u32(getattr(table, column)) for column in _INT_COLUMNS]
    parts += [id_offsets, host_offsets, ids, hosts]
    return b"".join(parts)


def create_shared(table: Columns, digest: bytes) -> int:
    """A sealed memory file holding `table` (named by `digest`): its descriptor, open for
    reading and (by another process of this user) reopening as /proc/PID/fd/FD. OSError when
    the system has none (not Linux) or no memory for it."""
    data = layout(table, digest)
    if not hasattr(os, "memfd_create"):
        raise OSError(errno.ENOSYS, "this system has no memfd_create")
    fd = os.memfd_create("cluster-peer-table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        import fcntl  # noqa: PLC0415 - Linux only, as memfd_create

        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Strings(Sequence[str]):
    """A string column read in place: offsets into a blob."""

    def __init__(self, offsets: Sequence[int], blob: memoryview) -> None:
        self._offsets = offsets
        self._blob = blob

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        if isinstance(index, slice):
            return self._rows(range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("a peer table row out of range")
        start, end = self._offsets[index], self._offsets[index + 1]
        if not start <= end <= len(self._blob):
            raise SharedTableError(f"the shared peer table is garbled at row {index}")
        return str(self._blob[start:end], "utf-8")

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows(range(len(self))))

    def _rows(self, rows: range) -> list[str]:
        """The strings of `rows`: a run of rows decoded at once (all of them: the whole table
        as objects, `Topology.peers`)."""
        offsets = self._offsets
        if rows.step != 1 or not rows:
            return [self[i] for i in rows]
        base, end = offsets[rows.start], offsets[rows.stop]
        if not base <= end <= len(self._blob):
            raise SharedTableError(f"the shared peer table is garbled at rows {rows}")
        run = str(self._blob[base:end], "utf-8")
        if len(run) != end - base:  # not all ASCII: offsets count bytes, not characters
            return [self[i] for i in rows]
        return [run[offsets[i] - base : offsets[i + 1] - base] for i in rows]


class MappedTable:
    """A table file mapped read-only: its columns, read where they lie (`Columns`)."""

    def __init__(self, mapped: mmap.mmap, rows: int, id_size: int, host_size: int) -> None:
        self._mapped = mapped  # kept open as long as the columns are read
        view = memoryview(mapped)
        at = _HEADER.size
        ints: list[Sequence[int]] = []
        for _ in _INT_COLUMNS:
            ints.append(_column(view, at, rows))
            at += 4 * rows + _padded(4 * rows)
        self.ranks, self.ports, self.local_ranks, self.local_sizes, self.roles = ints
        id_offsets = _column(view, at, rows + 1)
        at += 4 * (rows + 1) + _padded(4 * (rows + 1))
        host_offsets = _column(view, at, rows + 1)
        at += 4 * (rows + 1) + _padded(4 * (rows + 1))
        self.node_ids = _Strings(id_offsets, view[at : at + id_size])
        at += id_size + _padded(id_size)
        self.hosts = _Strings(host_offsets, view[at : at + host_size])


def _column(view: memoryview, at: int, count: int) -> Sequence[int]:
    part = view[at : at + 4 * count]
    if _LITTLE:
        return part.cast("I")
    swapped = array("I", part)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped  # pragma: no cover


def _size(rows: int, id_size: int, host_size: int) -> int:
    def section(size: int) -> int:
        return size + _padded(size)

    columns = len(_INT_COLUMNS) * section(4 * rows) + 2 * section(4 * (rows + 1))
    return _HEADER.size + columns + section(id_size) + section(host_size)


def open_shared(path: str, digest: bytes) -> MappedTable:
    """The table file at `path` (the relay's /proc/PID/fd/FD), mapped; OSError when it cannot
    be opened or mapped, SharedTableError when it is not the table of `digest`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise SharedTableError(f"the shared peer table {path} is short ({size} bytes)")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    magic, named, rows, id_size, host_size = _HEADER.unpack_from(mapped)
    if magic != MAGIC or named != digest:
        mapped.close()
        raise SharedTableError(f"the shared peer table {path} is not the table {digest.hex()[:16]}")
    if _size(rows, id_size, host_size) > size:
        mapped.close()
        raise SharedTableError(f"the shared peer table {path} is short ({size} bytes)")
    return MappedTable(mapped, rows, id_size, host_size)
