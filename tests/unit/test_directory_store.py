"""The directory store lets its lock go only once the writes it started have ended (up to a
bound): a save whose caller was cancelled still lands before the next scheduler can load."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import ConfigError
from cluster.storage import directory_store
from cluster.storage import store as envelope
from cluster.storage.directory_store import STATE_FILE, DirectoryStore
from cluster.storage.state_store import SCHEDULER_KIND
from tests.aio import BOUND_S, eventually


def snapshot(revision: int) -> dict[str, Any]:
    return {"cluster_id": "job-a", "revision": revision, "members": []}


class Gate:
    """Holds every state write on its thread until opened; the write itself is the real one."""

    def __init__(self, save: Callable[..., None]) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self._save = save

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        if self.opened.wait(BOUND_S):
            self._save(*args, **kwargs)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate(envelope.save)
    monkeypatch.setattr(envelope, "save", held.save)
    try:
        yield held
    finally:
        held.opened.set()  # no thread of the test outlives it


async def a_save_whose_caller_is_cancelled(directory: Path, gate: Gate) -> DirectoryStore:
    store = DirectoryStore(directory)
    await store.acquire()
    saving = asyncio.create_task(store.save(snapshot(2), ""))
    await eventually(gate.entered.is_set, "the save's thread to start")
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving
    return store


async def test_close_returns_once_a_cancelled_save_has_landed(tmp_path: Path, gate: Gate) -> None:
    first = await a_save_whose_caller_is_cancelled(tmp_path, gate)
    closing = asyncio.create_task(first.close())
    for _ in range(20):
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    assert not closing.done()  # the save is still held on its thread: so is the lock
    with pytest.raises(ConfigError):
        await DirectoryStore(tmp_path).acquire()
    gate.opened.set()
    await asyncio.wait_for(closing, BOUND_S)
    assert envelope.load(tmp_path / STATE_FILE, SCHEDULER_KIND) == snapshot(2)
    second = DirectoryStore(tmp_path)
    await second.acquire()
    try:
        loaded = await second.load()
        assert loaded.snapshot == snapshot(2)
        assert (await second.save(snapshot(3), loaded.token)).ok  # no rival wrote behind it
    finally:
        await second.close()


async def test_a_write_that_hangs_holds_the_close_back_only_for_the_bound(
    tmp_path: Path,
    gate: Gate,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(directory_store, "WRITE_WAIT_S", 0.1)
    first = await a_save_whose_caller_is_cancelled(tmp_path, gate)
    try:
        await asyncio.wait_for(first.close(), BOUND_S)
        assert "still running after 0.1 s; releasing its lock anyway" in caplog.text
        second = DirectoryStore(tmp_path)
        await second.acquire()  # the lock is free although the write has not ended
        await second.close()
    finally:
        gate.opened.set()  # the write ends before the loop closes
