"""The directory store lets its lock go only once the writes it started have ended (up to a
bound): a save whose caller was cancelled still lands before the next scheduler can load."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.errors import ConfigError, FencedError, NotLeaderError
from cluster.scheduler.persist import WriteAheadSaver
from cluster.storage import directory_store
from cluster.storage import store as envelope
from cluster.storage.directory_store import STATE_FILE, DirectoryStore
from cluster.storage.kv_log import KvLog
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


@pytest.mark.parametrize("away", ["removed", "moved away"])
async def test_a_scheduler_whose_directory_was_replaced_saves_nothing_in_the_new_one(
    tmp_path: Path, away: str
) -> None:
    """MS_RECOVERY_PATH is removed (or moved away) under a running scheduler and a second one
    starts on the path made again: the first one's lock no longer keeps the second off, so its
    next key-value and state saves are refused as fenced, and the second's files stay whole."""
    directory = tmp_path / "job"
    directory.mkdir(mode=0o700)
    first = DirectoryStore(directory)
    await first.acquire()
    try:
        await first.load()
        assert await first.load_kv("job-a") == {}
        await first.clear_kv("job-a")
        await first.save_kv("job-a", {"a": b"1"})
        token = (await first.save(snapshot(1), "")).current.token
        if away == "removed":
            shutil.rmtree(directory)
        else:
            directory.rename(tmp_path / "old")
        directory.mkdir(mode=0o700)
        await a_second_scheduler_saves_meanwhile(directory, first, token)
    finally:
        await first.close()
    third = DirectoryStore(directory)
    await third.acquire()
    try:
        assert (await third.load()).snapshot == snapshot(5)
        assert await third.load_kv("job-a") == {"b": b"2", "d": b"4"}
    finally:
        await third.close()
    if away == "moved away":
        old = KvLog(tmp_path / "old")
        assert old.load("job-a") == {"a": b"1"}  # nor did the refused set land there
        old.close()


async def a_second_scheduler_saves_meanwhile(
    directory: Path, first: DirectoryStore, token: str
) -> None:
    second = DirectoryStore(directory)
    await second.acquire()  # the first one's lock is on a file the path no longer names
    try:
        assert (await second.load()).snapshot is None
        assert await second.load_kv("job-a") == {}
        await second.clear_kv("job-a")
        await second.save_kv("job-a", {"b": b"2"})
        assert (await second.save(snapshot(5), "")).ok
        fenced = "the recovery directory .* was removed or replaced while this scheduler ran"
        with pytest.raises(FencedError, match=fenced):
            await first.save_kv("job-a", {"c": b"3" * 64})
        with pytest.raises(FencedError, match=fenced):
            await first.save(snapshot(2), token)
        with pytest.raises(FencedError, match=fenced):
            await first.clear_kv("job-a")
        await second.save_kv("job-a", {"d": b"4"})
    finally:
        await second.close()


async def test_the_saver_of_a_scheduler_whose_directory_was_replaced_stops_for_good(
    tmp_path: Path,
) -> None:
    """The saver writes a batch of key sets before the state: the batch is the first write
    refused, and it fences the saver (the set fails with 'not the leader', nothing more is
    saved), instead of landing in the new directory's key-value log."""
    directory = tmp_path / "job"
    directory.mkdir(mode=0o700)
    first = DirectoryStore(directory)
    await first.acquire()
    saver = WriteAheadSaver(first, lambda: snapshot(1), lambda revision: None)
    saver.keep_kv("job-a", lambda key, value: None)
    try:
        await first.load_kv("job-a")
        await first.clear_kv("job-a")
        await saver.save_first()
        saver.start()
        await asyncio.wait_for(saver.write_kv("a", b"1"), BOUND_S)
        shutil.rmtree(directory)
        directory.mkdir(mode=0o700)
        second = DirectoryStore(directory)
        await second.acquire()
        try:
            await second.clear_kv("job-a")
            await second.save_kv("job-a", {"b": b"2"})
            with pytest.raises(NotLeaderError, match="was removed or replaced"):
                await asyncio.wait_for(saver.write_kv("c", b"3"), BOUND_S)
            assert saver.fenced is not None
            assert "was removed or replaced" in saver.fenced
            await second.save_kv("job-a", {"d": b"4"})
            reader = DirectoryStore(directory)
            assert await reader.load_kv("job-a") == {"b": b"2", "d": b"4"}
            await reader.close()
        finally:
            await second.close()
    finally:
        await saver.stop(0)
        await first.close()
