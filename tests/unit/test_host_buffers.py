"""The host buffers of snapshots of CUDA tensors: reuse, the pinned bound, the pageable fallback.

Reuse and the bound are checked with a stand-in for page-locking (`page_lock=`, numpy memory
that counts its calls), since this machine has no CUDA; the fallback is checked with torch's
real pinned allocator, which refuses without CUDA (and with the bound, which refuses anywhere).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from cluster.protocol.errors import ConfigError
from cluster.storage import host_buffers
from cluster.storage.checkpoint_tree import encode
from cluster.storage.host_buffers import HostBuffers, pinned_max_from_env
from cluster.storage.snapshot import Snapshot, SnapshotPool

torch = pytest.importorskip("torch")


class FakeLock:
    """Page-locks nothing: hands out numpy memory and counts the calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, nbytes: int) -> tuple[np.ndarray[Any, Any], Any]:
        self.calls.append(nbytes)
        return np.zeros(nbytes, np.uint8), None


def test_a_buffer_given_back_is_reused_for_the_next_that_fits() -> None:
    lock = FakeLock()
    buffers = HostBuffers(1 << 20, page_lock=lock)
    first = buffers.acquire(1000, pinned=True)
    assert first.pinned
    assert first.nbytes == 1000
    first.array[:] = 7
    buffers.release(first)
    again = buffers.acquire(800, pinned=True)
    assert again is first
    assert lock.calls == [1000]
    assert not again.array.any(), "a reused buffer is handed out zeroed"
    bigger = buffers.acquire(2000, pinned=True)  # none free fits: a new one
    assert bigger is not first
    assert lock.calls == [1000, 2000]
    assert buffers.pinned_bytes == 3000
    assert buffers.allocations == 2


def test_the_pinned_bound_is_respected_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    buffers = HostBuffers(3000, page_lock=FakeLock())
    held = buffers.acquire(2000, pinned=True)
    with caplog.at_level(logging.WARNING, "cluster.storage.host_buffers"):
        over = [buffers.acquire(2000, pinned=True) for _ in range(3)]
    assert all(not b.pinned for b in over)
    assert buffers.pinned_bytes == 2000
    warnings = [r for r in caplog.records if "the bound of 3000 bytes" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    # Buffers given back make room: they are unpinned before the bound refuses.
    buffers.release(held)
    assert buffers.acquire(2500, pinned=True).pinned
    assert buffers.pinned_bytes == 2500


def test_pinning_that_fails_falls_back_to_pageable_once_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("torch pins memory here: the fallback is tested where it cannot")
    buffers = HostBuffers(1 << 30)  # torch's real allocator: refuses without CUDA
    with caplog.at_level(logging.WARNING, "cluster.storage.host_buffers"):
        got = [buffers.acquire(4096, pinned=True) for _ in range(3)]
    assert all(not b.pinned and b.nbytes == 4096 and not b.array.any() for b in got)
    assert buffers.pinned_bytes == 0
    warnings = [r for r in caplog.records if "cannot pin host memory" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    buffers.release(got[0])  # a pageable buffer is let go, not kept
    assert buffers.pinned_bytes == 0


def test_pageable_buffers_are_not_counted() -> None:
    lock = FakeLock()
    buffers = HostBuffers(0, page_lock=lock)
    assert not buffers.acquire(100, pinned=False).pinned
    assert lock.calls == []
    assert buffers.pinned_bytes == 0


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_buffers.PINNED_MAX_ENV, raising=False)
    assert pinned_max_from_env() == host_buffers.PINNED_MAX_DEFAULT
    monkeypatch.setenv(host_buffers.PINNED_MAX_ENV, "123")
    assert pinned_max_from_env() == 123
    for bad in ("-1", "lots", "4GiB", "\uff14"):  # as init() reads it
        monkeypatch.setenv(host_buffers.PINNED_MAX_ENV, bad)
        with pytest.raises(ConfigError, match="CLUSTER_PINNED_MAX_BYTES"):
            pinned_max_from_env()


@pytest.fixture
def fresh_process_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's buffers as in a new process: none made, no bound configured (put back
    after the test)."""
    monkeypatch.setattr(host_buffers, "_default", None)
    monkeypatch.setattr(host_buffers, "_configured", None)


@pytest.mark.usefixtures("fresh_process_buffers")
def test_the_configured_bound_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """cluster.init() configures the bound of its config, which may not be the environment's:
    the process's buffers take it, made before or after; without it, the environment's."""
    monkeypatch.setenv(host_buffers.PINNED_MAX_ENV, str(1 << 20))
    assert host_buffers.default_buffers().max_pinned == 1 << 20  # no init: the environment's
    host_buffers.configure(3000)
    assert host_buffers.default_buffers().max_pinned == 3000  # made before: bound again
    monkeypatch.setattr(host_buffers, "_default", None)
    monkeypatch.setenv(host_buffers.PINNED_MAX_ENV, "lots")  # not read once configured
    buffers = host_buffers.default_buffers()
    assert buffers.max_pinned == 3000  # made after
    with caplog.at_level(logging.WARNING, "cluster.storage.host_buffers"):
        over = buffers.acquire(3001, pinned=True)  # refused by the bound, before any pinning
    assert not over.pinned
    assert "the bound of 3000 bytes" in caplog.text
    assert "cannot pin" not in caplog.text


def test_a_lower_bound_frees_the_buffers_given_back_it_leaves_no_room_for() -> None:
    lock = FakeLock()
    buffers = HostBuffers(1 << 20, page_lock=lock)
    held, given_back = buffers.acquire(2000, pinned=True), buffers.acquire(1000, pinned=True)
    buffers.release(given_back)
    buffers.set_max_pinned(2500)
    assert buffers.pinned_bytes == 2000  # the one held stays counted
    assert not buffers.acquire(1000, pinned=True).pinned  # no room under the new bound
    buffers.release(held)
    assert buffers.acquire(2000, pinned=True) is held
    assert lock.calls == [2000, 1000]


def test_a_snapshot_keeps_its_buffer_from_save_to_save_and_gives_it_back() -> None:
    """Host tensors take the pageable path, untouched by the pinned buffers."""
    lock = FakeLock()
    buffers = HostBuffers(1 << 20, page_lock=lock)
    pool = SnapshotPool(1, buffers)
    state = {"w": torch.arange(10, dtype=torch.float32)}
    snapshot = pool.acquire()
    for step in (1, 2):
        snapshot.fill(step, 0, "p", encode(state))
    assert lock.calls == []
    assert snapshot.state()["w"].equal(state["w"])
    pool.release(snapshot)
    pool.clear()
    assert buffers.pinned_bytes == 0


def test_a_snapshot_frees_a_buffer_back_to_its_pool() -> None:
    lock = FakeLock()
    buffers = HostBuffers(1 << 20, page_lock=lock)
    snapshot = Snapshot(buffers)
    snapshot._replace_buffer(4096, pinned=True)  # what fill does for a state on a GPU
    assert buffers.pinned_bytes == 4096
    snapshot.free()
    again = Snapshot(buffers)
    again._replace_buffer(1024, pinned=True)
    assert lock.calls == [4096], "the freed buffer is reused"
    again.free()
    buffers.clear()
    assert buffers.pinned_bytes == 0
