"""What a CheckpointManager offers to peers (`cluster.storage.served`): its files as they are on
disk, and `serve_memory`'s in-memory step as the same bytes, never torn when it is replaced
while a peer reads it (copy-on-replace)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

from cluster.api.checkpoint import CheckpointConfig, CheckpointManager
from cluster.storage import checkpoint_files, checkpoint_tree
from cluster.storage.served import PIECE_BYTES, Source
from cluster.storage.snapshot import Snapshot


def manager(tmp_path: Path, rank: int = 0) -> CheckpointManager:
    config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=3)
    return CheckpointManager(tmp_path / "ckpt", "net", config, rank=rank, recovery=False)


def snapshot_of(step: int, rank: int, state: dict[str, np.ndarray]) -> Snapshot:
    snapshot = Snapshot()
    snapshot.fill(step, rank, "net", checkpoint_tree.encode(state))
    return snapshot


def drain(source: Source) -> bytes:
    try:
        return b"".join(source.pieces())
    finally:
        source.close()


def big_state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3 * PIECE_BYTES // 8 + 5, value), "b": np.arange(7.0)}


def test_a_file_is_served_exactly_as_it_is_on_disk(tmp_path: Path) -> None:
    with manager(tmp_path) as checkpoints:
        checkpoints.save(4, big_state(1.5))
        checkpoints.flush()
        source = checkpoints.served.open(0, 4, any_rank=True)
        assert source is not None
        assert drain(source) == checkpoints.path(4).read_bytes()
        assert checkpoints.served.open(0, 5, any_rank=True) is None


def test_another_ranks_file_under_the_same_directory_is_served_for_that_rank(
    tmp_path: Path,
) -> None:
    with manager(tmp_path, rank=1) as holder:
        holder.save(2, {"x": np.arange(3.0)})
    with manager(tmp_path, rank=0) as peer:
        source = peer.served.open(1, 2, any_rank=False)
        assert source is not None
        assert drain(source) == holder.path(2).read_bytes()
        assert peer.served.open(2, 2, any_rank=False) is None


def test_the_memory_step_is_the_bytes_of_its_file(tmp_path: Path) -> None:
    state = big_state(2.0)
    with manager(tmp_path) as checkpoints:
        snapshot = snapshot_of(9, 0, state)
        checkpoints.serve_memory(9, snapshot)
        source = checkpoints.served.open(0, 9, any_rank=True)
        assert source is not None
        assert source.nbytes == snapshot.nbytes
        data = drain(source)
        checkpoints.save(9, state)
        checkpoints.flush()
        assert data == checkpoints.path(9).read_bytes()
        checkpoints.serve_memory(9, None)
        assert checkpoints.served.memory_step() is None


def test_a_memory_step_replaced_while_it_is_read_is_sent_whole(tmp_path: Path) -> None:
    """The owner refills the old snapshot as soon as serve_memory returns; the reader that was
    under way still gets the old step's bytes, whole."""
    old_state, new_state = big_state(3.0), big_state(4.0)
    with manager(tmp_path) as checkpoints:
        snapshot = snapshot_of(5, 0, old_state)
        expected = b"".join(snapshot.chunks())
        checkpoints.serve_memory(5, snapshot)
        source = checkpoints.served.open(0, 5, any_rank=True)
        assert source is not None
        pieces = source.pieces()
        first = next(pieces)
        other = snapshot_of(6, 0, new_state)
        checkpoints.serve_memory(6, other)
        snapshot.fill(7, 0, "net", checkpoint_tree.encode(big_state(9.0)))  # reused at once
        rest = b"".join(pieces)
        source.close()
        assert first + rest == expected
        assert checkpoints.served.open(0, 5, any_rank=True) is None
        fresh = checkpoints.served.open(0, 6, any_rank=True)
        assert fresh is not None
        assert drain(fresh) == b"".join(other.chunks())


def test_the_reader_accepts_a_replicas_file_stored_under_another_rank(tmp_path: Path) -> None:
    """The head names the rank that wrote it; the bytes are kept as sent (the checksum covers
    them), and the reader checks the step and the checksum, not the rank."""
    with manager(tmp_path, rank=3) as writer:
        writer.save(2, {"x": np.arange(4.0)})
    with manager(tmp_path, rank=1) as reader:
        reader.path(2).write_bytes(writer.path(2).read_bytes())
        assert checkpoint_files.looks_complete(reader.path(2))
        assert reader.load(2)["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_fifo_put_in_a_steps_place_after_its_check_is_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What stands in a step's place may change between the check and the open: a FIFO put
    there meanwhile is refused (nothing served), never waited on by the server's thread."""
    with manager(tmp_path) as checkpoints:
        checkpoints.save(4, big_state(1.5))
        checkpoints.flush()
        path = checkpoints.path(4)
        monkeypatch.setattr(checkpoint_files, "looks_complete", lambda path: True)
        path.unlink()
        os.mkfifo(path)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            opened = pool.submit(checkpoints.served.open, 0, 4, any_rank=True)
            try:
                assert opened.result(timeout=10) is None
            finally:  # a writer lets an open that waits go, so that the pool can end
                with contextlib.suppress(OSError):  # (ENXIO: none waits)
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
