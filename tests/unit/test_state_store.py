"""One contract for both state stores (the directory of MS_RECOVERY_PATH, a real 3-member etcd):
load, compare-and-set, holding (lock or leader lease), fencing of a writer that does not hold
the store, the key-value store kept incrementally, and state that is not ours, torn, or another
job's. As torch elastic's rendezvous backends share one test suite."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aetcd
import pytest

from cluster.protocol.errors import ConfigError, FencedError, StateFileError
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import stores
from cluster.scheduler.etcd_store import INLINE_MAX_BYTES, TXN_OPS
from cluster.storage import store as envelope
from cluster.storage.directory_store import DirectoryStore
from cluster.storage.state_store import StateStore
from tests.servers.etcd import EtcdCluster


def snapshot(revision: int, **extra: Any) -> dict[str, Any]:
    return {"cluster_id": "job-a", "revision": revision, "members": [], **extra}


class Backend:
    """Stores on one location, and a way to put raw bytes where the state is kept."""

    name: str

    async def make(self, address: str) -> StateStore:
        raise NotImplementedError

    async def put_raw(self, data: bytes) -> None:
        raise NotImplementedError


class DirectoryBackend(Backend):
    name = "directory"

    def __init__(self, path: Path) -> None:
        self.path = path

    async def make(self, address: str) -> StateStore:
        return DirectoryStore(self.path)

    async def put_raw(self, data: bytes) -> None:
        (self.path / "scheduler.json").write_bytes(data)


class EtcdBackend(Backend):
    name = "etcd"

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self.url = parse_state_url(cluster.state_url())

    async def make(self, address: str) -> StateStore:
        return await stores.open_etcd(self.url, address, lease_s=2)

    async def put_raw(self, data: bytes) -> None:
        host, port = self.url.endpoints[0]
        async with aetcd.Client(host=host, port=port, timeout=10) as client:
            await client.put(f"{self.url.prefix}state".encode(), data)


@pytest.fixture(params=["directory", "etcd"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "directory":
        yield DirectoryBackend(tmp_path)
    else:
        yield EtcdBackend(request.getfixturevalue("etcd_cluster"))


@pytest.fixture
async def opened(backend: Backend) -> AsyncIterator[Callable[[str], Any]]:
    made: list[StateStore] = []

    async def make(address: str = "127.0.0.1:1") -> StateStore:
        store = await backend.make(address)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def held(opened: Callable[[str], Any], address: str = "127.0.0.1:1") -> StateStore:
    store: StateStore = await opened(address)
    assert await store.acquire() is None
    return store


async def test_an_empty_store_holds_nothing(opened: Callable[[str], Any]) -> None:
    store = await held(opened)
    loaded = await store.load()
    assert loaded.snapshot is None
    assert loaded.token == ""


async def test_a_save_with_the_current_token_lands_and_loads_back(
    opened: Callable[[str], Any],
) -> None:
    store = await held(opened)
    first = await store.save(snapshot(1), "")
    assert first.ok
    assert first.current.snapshot == snapshot(1)
    second = await store.save(snapshot(2), first.current.token)
    assert second.ok
    assert second.current.token != first.current.token
    loaded = await store.load()
    assert loaded == second.current


async def test_a_stale_token_writes_nothing_and_gets_what_is_stored(
    opened: Callable[[str], Any],
) -> None:
    store = await held(opened)
    first = await store.save(snapshot(1), "")
    newer = await store.save(snapshot(2), first.current.token)
    stale = await store.save(snapshot(99), first.current.token)
    assert not stale.ok
    assert stale.current == newer.current  # what replaced the stale writer's view
    again = await store.save(snapshot(1), "")  # "nothing stored" is stale too
    assert not again.ok
    assert (await store.load()).snapshot == snapshot(2)


async def test_one_holder_at_a_time_and_a_writer_that_does_not_hold_is_fenced(
    backend: Backend, opened: Callable[[str], Any]
) -> None:
    first = await held(opened, "127.0.0.1:1")
    saved = await first.save(snapshot(1), "")
    second = await opened("127.0.0.2:1")
    if backend.name == "directory":
        with pytest.raises(ConfigError, match="another scheduler"):
            await second.acquire()
    else:
        assert await second.acquire() == "127.0.0.1:1"  # it names the holder: a standby
    with pytest.raises(FencedError):
        await second.save(snapshot(2), saved.current.token)
    with pytest.raises(FencedError):
        await second.save_kv("job-a", {"k": b"v"})

    await first.release()
    assert await second.acquire() is None
    assert (await second.save(snapshot(2), saved.current.token)).ok
    # The first holder, no longer holding, writes nothing (with any token).
    with pytest.raises(FencedError):
        await first.save(snapshot(3), (await first.load()).token)
    assert (await second.load()).snapshot == snapshot(2)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"hello", "not valid JSON|does not hold a value of cluster's"),
        (b'\x00{"format": "cluster-state", "ver', "truncated or corrupt"),
        (b"\x00" + json.dumps({"hello": "world"}).encode(), "not a cluster recovery state"),
    ],
    ids=["not ours", "torn", "foreign json"],
)
async def test_state_that_is_not_ours_or_torn_is_refused_and_left_as_it_is(
    backend: Backend, opened: Callable[[str], Any], raw: bytes, problem: str
) -> None:
    if backend.name == "directory":
        raw = raw.removeprefix(b"\x00")
    await backend.put_raw(raw)
    store = await held(opened)
    with pytest.raises(StateFileError, match=problem):
        await store.load()
    with pytest.raises(StateFileError, match=problem):
        await store.load()  # nothing was changed by reading it


async def test_state_of_a_newer_format_or_another_kind_is_refused(
    backend: Backend, opened: Callable[[str], Any]
) -> None:
    data = json.loads(envelope.encode("scheduler", snapshot(1)))
    prefix = b"" if backend.name == "directory" else b"\x00"
    await backend.put_raw(prefix + json.dumps({**data, "version": 99}).encode())
    store = await held(opened)
    with pytest.raises(StateFileError, match="format version 99"):
        await store.load()
    await backend.put_raw(prefix + json.dumps({**data, "kind": "worker"}).encode())
    with pytest.raises(StateFileError, match="not of a 'scheduler'"):
        await store.load()
    data["payload"]["revision"] = 2  # edited: the checksum no longer matches
    await backend.put_raw(prefix + json.dumps(data).encode())
    with pytest.raises(StateFileError, match="fails its checksum"):
        await store.load()


async def test_a_large_state_is_kept_whole(opened: Callable[[str], Any]) -> None:
    """Over etcd's 1.5 MiB request limit: written in chunks, named by one compare-and-set."""
    store = await held(opened)
    big = snapshot(1, members=[{"node_id": str(i), "pad": "x" * 300} for i in range(8000)])
    first = await store.save(big, "")
    assert first.ok
    assert (await store.load()).snapshot == big
    small = await store.save(snapshot(2), first.current.token)  # its chunks are removed
    assert small.ok
    assert (await store.load()).snapshot == snapshot(2)


async def test_the_key_value_store_is_kept_per_key_and_per_job(
    opened: Callable[[str], Any],
) -> None:
    store = await held(opened)
    assert await store.load_kv("job-a") == {}
    await store.clear_kv("job-a")
    many = {f"key/{i}": str(i).encode() for i in range(3 * TXN_OPS)}
    await store.save_kv("job-a", many)
    await store.save_kv("job-a", {"key/1": b"changed", "empty": b""})
    large = bytes(range(256)) * (4 * 4096)  # 4 MiB, the store's largest value
    assert len(large) > INLINE_MAX_BYTES
    await store.save_kv("job-a", {"large": large})
    expected = {**many, "key/1": b"changed", "empty": b"", "large": large}
    assert await store.load_kv("job-a") == expected
    await store.save_kv("job-a", {"large": b"small now"})
    assert (await store.load_kv("job-a"))["large"] == b"small now"
    # Another job's store is not this one's: empty, and a new job starts with an empty one.
    assert await store.load_kv("job-b") == {}
    await store.clear_kv("job-b")
    assert await store.load_kv("job-a") == {}
    assert await store.load_kv("job-b") == {}


async def test_a_new_holder_reads_the_key_value_store_its_predecessor_kept(
    opened: Callable[[str], Any],
) -> None:
    first = await held(opened, "127.0.0.1:1")
    await first.clear_kv("job-a")
    await first.save_kv("job-a", {"seed": b"42", "large": b"z" * (INLINE_MAX_BYTES + 1)})
    await first.close()
    second = await held(opened, "127.0.0.2:1")
    assert await second.load_kv("job-a") == {"seed": b"42", "large": b"z" * (INLINE_MAX_BYTES + 1)}
