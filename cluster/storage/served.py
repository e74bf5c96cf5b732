"""What one `CheckpointManager` offers to its peers: its complete checkpoint files, and one
step held in memory, as the bytes of a checkpoint file, in pieces.

A peer that takes a rank without its checkpoints asks a live worker for a step (see
`cluster.worker.state_server`); the worker answers with a `Source`: the file of that step read
from disk exactly as it is (head, payload, footer), or the in-memory step of `serve_memory`
encoded on the fly as the same bytes (the snapshot's head, its buffers, the footer of its
checksum). The receiver verifies the checksum with the ordinary reader, as for any file.

The in-memory step is replaced by the next `set_memory` and withdrawn with None. A stream that
is sending it when it is replaced must not send torn bytes, and the owner may refill the old
snapshot as soon as `set_memory` returns; so the replaced one is copied for the streams still
reading it (copy-on-replace: the copy is paid only when a transfer is under way at that
moment, which is rare, never by the training loop's ordinary steps). Each piece is copied out
under the lock, so every piece comes whole from the snapshot or whole from the copy; they hold
the same bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from cluster.storage import atomic, checkpoint_files
from cluster.storage.snapshot import Snapshot

# The bytes of one piece sent to a peer (one gRPC message).
PIECE_BYTES = 1 << 20


class _Held:
    """The in-memory step, and the streams reading it."""

    def __init__(self, step: int, snapshot: Snapshot) -> None:
        self.step = step
        self.snapshot: Snapshot | None = snapshot
        self.views: list[memoryview] | None = None  # its file's bytes, made by the first reader
        self.copy: bytes | None = None  # made when it is replaced while read
        self.readers = 0
        self.nbytes = snapshot.nbytes

    def pieces(self) -> list[memoryview]:
        if self.copy is not None:
            return [memoryview(self.copy)]
        if self.views is None:
            assert self.snapshot is not None
            self.views = self.snapshot.chunks()  # computes the checksum once
        return self.views

    def detach(self) -> None:
        """Copy the bytes for the readers still at work, and let go of the snapshot."""
        if self.readers > 0 and self.copy is None:
            self.copy = b"".join(self.pieces())
        self.snapshot = None
        self.views = None


class Source:
    """The bytes of one checkpoint file for one peer: `nbytes`, then `pieces()`; `close()`
    (once is enough; more is harmless)."""

    def __init__(self, nbytes: int, pieces: Iterator[bytes], close: Callable[[], None]) -> None:
        self.nbytes = nbytes
        self._pieces = pieces
        self._close: Callable[[], None] | None = close

    def pieces(self) -> Iterator[bytes]:
        return self._pieces

    def close(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            close()


class ServedCheckpoints:
    """The checkpoints of prefix `prefix` under `root` (its `rank_<r>/` directories, this
    rank's and any other a peer may need, e.g. on shared storage) and one step in memory."""

    def __init__(self, root: Path, prefix: str, rank: int) -> None:
        self.root = root
        self.prefix = prefix
        self.rank = rank
        self._lock = threading.Lock()
        self._held: _Held | None = None

    def set_memory(self, step: int, snapshot: Snapshot | None) -> None:
        """Serve `snapshot` as the checkpoint of `step` (None: serve no step from memory).
        The previous one is the caller's again when this returns."""
        held = None if snapshot is None else _Held(step, snapshot)
        with self._lock:
            previous, self._held = self._held, held
            if previous is not None:
                previous.detach()

    def memory_step(self) -> int | None:
        with self._lock:
            return None if self._held is None else self._held.step

    def open(self, rank: int, step: int, *, any_rank: bool) -> Source | None:
        """The bytes of the checkpoint of `step` of `rank` (with `any_rank`, this worker's own
        state will do: the states are replicas); None when this worker holds no such file."""
        if any_rank or rank == self.rank:
            source = self._open_memory(step)
            if source is not None:
                return source
            source = self._open_file(self.rank, step)
            if source is not None or rank == self.rank:
                return source
        return self._open_file(rank, step)

    def _open_memory(self, step: int) -> Source | None:
        with self._lock:
            held = self._held
            if held is None or held.step != step:
                return None
            held.readers += 1

        def pieces() -> Iterator[bytes]:
            offset = 0
            while offset < held.nbytes:
                with self._lock:
                    piece = _cut(held.pieces(), offset, PIECE_BYTES)
                offset += len(piece)
                yield piece

        def close() -> None:
            with self._lock:
                held.readers -= 1

        return Source(held.nbytes, pieces(), close)

    def _open_file(self, rank: int, step: int) -> Source | None:
        directory = checkpoint_files.rank_directory(self.root, rank)
        path = directory / checkpoint_files.file_name(self.prefix, step)
        if not checkpoint_files.looks_complete(path):
            return None
        try:
            # Opened once: a prune or a rename while it is sent does not change what is sent.
            # A regular file only, never waited on: what is there may have changed since it was
            # checked (a FIFO would hold the server's thread for ever).
            fd = atomic.open_regular(path)
        except OSError:
            return None
        nbytes = os.fstat(fd).st_size

        def pieces() -> Iterator[bytes]:
            offset = 0
            while offset < nbytes:
                piece = os.pread(fd, min(PIECE_BYTES, nbytes - offset), offset)
                if not piece:
                    raise OSError(f"{path} ended early")
                offset += len(piece)
                yield piece

        return Source(nbytes, pieces(), lambda: os.close(fd))


def _cut(views: list[memoryview], offset: int, count: int) -> bytes:
    """`count` bytes (fewer at the end) from `offset` of the concatenation of `views`."""
    parts: list[memoryview] = []
    for view in views:
        if offset >= view.nbytes:
            offset -= view.nbytes
            continue
        parts.append(view[offset : offset + count])
        count -= parts[-1].nbytes
        offset = 0
        if count == 0:
            break
    return b"".join(parts)
