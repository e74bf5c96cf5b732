"""One step's checkpoint held in memory: the bytes of its file, in buffers that are reused.

A `Snapshot` is what `CheckpointManager.save` copies a state into before it returns: the file's
head (preamble, header, padding) and its data area, one numpy buffer in which every array lies at
its offset, copied there in one pass (not pickled, whatever its strides or device). The
checksum is computed once, on first use, by whoever needs it first (the background writer), not
by the training loop. The same bytes go to disk (`chunks()` is the file) and could go to a peer
that takes a rank over: the receiver writes them with `checkpoint_files.write` and verifies
them with `checkpoint_files.read`, as for any file. A `TrainingLoop` also keeps the state of
its last step boundary in one (`cluster.api.memory`), and `state()` decodes a copy of it to put
that step back without reading a file.

A `SnapshotPool` owns a fixed number of snapshots and hands out one that nobody holds; holds are
counted (the writer holds a snapshot until it is on disk, the manager holds the newest one, a
peer transfer would hold the one it sends). When every snapshot is held, `acquire` waits: that is
the back-pressure that bounds the memory of a loop that saves faster than the disk writes, and
each wait is counted. Buffers are kept from one save to the next, so a steady state of saves of
the same layout allocates nothing (a fresh buffer costs a page fault per 4 KiB on first touch,
ten times the copy itself). A state with CUDA tensors is copied into a pinned buffer (from
`cluster.storage.host_buffers`, bounded by CLUSTER_PINNED_MAX_BYTES; a snapshot made with
`pin=False` uses pageable memory) on a copy stream (`cluster.storage.device_copy`), complete
when `fill` returns; `state()` puts each tensor back on the device it was copied from.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.storage import checkpoint_files, device_copy
from cluster.storage.background import WAIT_WARNING_S
from cluster.storage.checkpoint_tree import Encoded, allocate, copy_into, decode_state
from cluster.storage.host_buffers import HostBuffer, HostBuffers, default_buffers

_log = logging.getLogger(__name__)


class Snapshot:
    """The checkpoint of `step`, owned by a pool (or by its maker); see the module."""

    def __init__(self, buffers: HostBuffers | None = None, *, pin: bool = True) -> None:
        self.step = 0
        # Whether a state with CUDA tensors goes to a pinned buffer (False: pageable, for a
        # copy made once and read rarely, which should not take from the pinned bound).
        self._pin = pin
        # Whether this step's file is complete on disk (set by the writer after its rename).
        self.persisted = False
        self._head = b""
        self._buffer = np.zeros(0, np.uint8)
        # Where the buffer comes from when pinned (the process's buffers unless given).
        self._buffers = buffers
        self._host: HostBuffer | None = None  # the buffer, when it came from `_buffers`
        self._devices: list[Any] = []  # each entry's CUDA device (None: host)
        self._data_bytes = 0
        self._layout: list[tuple[int, int]] = []
        self._tree: Any = None
        self._entries: list[dict[str, Any]] = []
        self._digest: bytes | None = None
        self._digest_lock = threading.Lock()
        self._holds = 0

    @property
    def nbytes(self) -> int:
        """The size of the checkpoint file these bytes make."""
        return len(self._head) + self._data_bytes + checkpoint_files.FOOTER_SIZE

    def fill(self, step: int, rank: int, prefix: str, encoded: Encoded) -> None:
        """Copy an encoded state into this snapshot's buffers (grown only when too small, or
        made pinned when the state holds CUDA tensors, `pin` is on and the buffer is not)."""
        layout = [(entry["offset"], entry["nbytes"]) for entry in encoded.entries]
        on_device = any(device_copy.cuda_device(source) is not None for source in encoded.sources)
        pinned = on_device and self._pin
        if self._buffer.nbytes < encoded.data_bytes or pinned != (self._host is not None):
            # Zeroed: the padding between arrays is zero, and the pages are touched (faulted
            # in) once, here or by the copies below.
            self._replace_buffer(encoded.data_bytes, pinned=pinned)
        elif layout != self._layout:
            self._zero_gaps(layout, encoded.data_bytes)
        if on_device:
            owner = self._host.owner if self._host is not None else None
            self._devices = device_copy.copy_state(encoded, self._buffer, owner)
        else:
            for entry, source in zip(encoded.entries, encoded.sources, strict=True):
                copy_into(source, entry, self._buffer)
            self._devices = [None] * len(encoded.entries)
        self.step = step
        self.persisted = False
        self._head = checkpoint_files.head(step, rank, prefix, encoded)
        self._data_bytes = encoded.data_bytes
        self._layout = layout
        self._tree, self._entries = encoded.tree, encoded.entries
        with self._digest_lock:
            self._digest = None

    def _replace_buffer(self, nbytes: int, *, pinned: bool) -> None:
        self.free()
        if pinned:
            if self._buffers is None:
                self._buffers = default_buffers()
            self._host = self._buffers.acquire(nbytes, pinned=True)
            self._buffer = self._host.array
        else:
            self._buffer = np.zeros(nbytes, np.uint8)

    def free(self) -> None:
        """Let go of the buffer (a pinned one goes back to its `HostBuffers` for reuse)."""
        if self._host is not None and self._buffers is not None:
            self._buffers.release(self._host)
        self._host = None
        self._buffer = np.zeros(0, np.uint8)
        self._layout = []

    def state(self) -> dict[str, Any]:
        """A decoded copy of the state held: new arrays and tensors, as `checkpoint_files.read`
        makes from the file (without the checksum: these bytes never left this process), and
        the snapshot unchanged, so the same step can be put back again."""
        values = []
        for entry, device in zip(self._entries, self._devices, strict=True):
            start, nbytes = entry["offset"], entry["nbytes"]
            held = self._buffer.data[start : start + nbytes]
            if device is not None:  # straight back to its device, from the held bytes
                values.append(device_copy.to_device(entry, held, device))
                continue
            value, raw = allocate(entry)
            if nbytes:
                raw[:] = held
            values.append(value)
        return decode_state(self._tree, values)

    def _zero_gaps(self, layout: list[tuple[int, int]], data_bytes: int) -> None:
        """Zero the padding of a new layout (it may hold bytes of the old one): files of the
        same state are the same bytes."""
        cursor = 0
        for offset, nbytes in layout:
            self._buffer[cursor:offset] = 0
            cursor = offset + nbytes
        self._buffer[cursor:data_bytes] = 0

    def checksum(self) -> bytes:
        """The checksum in the file's footer (computed on first use, then kept)."""
        with self._digest_lock:
            if self._digest is None:
                hash_ = checkpoint_files.new_hash()
                hash_.update(self._head)
                hash_.update(self._data())
                self._digest = hash_.digest()
            return self._digest

    def chunks(self) -> list[memoryview]:
        """The bytes of the checkpoint file, in order: head, data, footer."""
        footer = checkpoint_files.footer(self.checksum())
        return [memoryview(self._head), self._data(), memoryview(footer)]

    def _data(self) -> memoryview:
        return self._buffer[: self._data_bytes].data


@dataclass(frozen=True)
class PoolStats:
    waits: int  # acquisitions that found every snapshot held
    wait_s: float  # the time they waited, in all


class SnapshotPool:
    """At most `capacity` snapshots, handed out when nobody holds them; see the module."""

    def __init__(self, capacity: int, buffers: HostBuffers | None = None) -> None:
        self._capacity = capacity
        self._buffers = buffers
        self._snapshots: list[Snapshot] = []
        self._latest: Snapshot | None = None  # the newest step copied, held by the pool
        self._changed = threading.Condition()
        self._waits = 0
        self._wait_s = 0.0

    def acquire(self) -> Snapshot:
        """A snapshot nobody holds, held once for the caller; waits while every one is held."""
        with self._changed:
            free = self._free()
            if free is None:
                self._waits += 1
                start = time.monotonic()
                while (free := self._free()) is None:
                    if not self._changed.wait(WAIT_WARNING_S):
                        _log.warning(
                            "a checkpoint save has waited %.0f s for the writer to finish the "
                            "previous ones (a slow or stuck disk?)",
                            time.monotonic() - start,
                        )
                self._wait_s += time.monotonic() - start
            free._holds += 1
            return free

    def _free(self) -> Snapshot | None:
        for snapshot in self._snapshots:
            if snapshot._holds == 0:
                return snapshot
        if len(self._snapshots) < self._capacity:
            self._snapshots.append(Snapshot(self._buffers))
            return self._snapshots[-1]
        return None

    def hold(self, snapshot: Snapshot) -> None:
        with self._changed:
            snapshot._holds += 1

    def release(self, snapshot: Snapshot) -> None:
        with self._changed:
            assert snapshot._holds > 0, "a snapshot released more often than held"
            snapshot._holds -= 1
            self._changed.notify_all()

    def set_latest(self, snapshot: Snapshot | None) -> None:
        """Make `snapshot` the newest step, taking over a hold the caller has on it, and
        release the hold of the one before."""
        with self._changed:
            previous, self._latest = self._latest, snapshot
            if previous is not None:
                previous._holds -= 1
                self._changed.notify_all()

    def hold_latest(self) -> Snapshot | None:
        """The newest step, held for the caller (who releases it), or None."""
        with self._changed:
            if self._latest is not None:
                self._latest._holds += 1
            return self._latest

    def clear(self) -> None:
        """Drop the buffers nobody holds (they are made again when needed); pinned ones are
        unpinned."""
        with self._changed:
            sources = set()
            for snapshot in self._snapshots:
                if snapshot._holds == 0 and snapshot._buffers is not None:
                    sources.add(snapshot._buffers)
                if snapshot._holds == 0:
                    snapshot.free()
            self._snapshots = [s for s in self._snapshots if s._holds > 0]
        for buffers in sources:
            buffers.clear()

    @property
    def stats(self) -> PoolStats:
        with self._changed:
            return PoolStats(self._waits, self._wait_s)
