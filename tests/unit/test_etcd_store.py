"""The etcd state store's own cases, on a real 3-member etcd: a save whose answer was lost and
that was sent again to another member, the chunks of saves that name nothing, and a load that
races a save (the contract both stores share is in test_state_store)."""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aetcd
import pytest

from cluster.protocol.errors import EtcdUnavailable, StateFileError
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import stores
from cluster.scheduler.etcd_store import EtcdStore
from tests.servers.etcd import EtcdCluster

LARGE = 8000  # members: a state over INLINE_MAX_BYTES, saved as chunks


def snapshot(revision: int, members: int = 0) -> dict[str, Any]:
    padded = [{"node_id": str(i), "pad": "x" * 300} for i in range(members)]
    return {"cluster_id": "job-a", "revision": revision, "members": padded}


class Etcd:
    def __init__(self, cluster: EtcdCluster) -> None:
        self.url = parse_state_url(cluster.state_url())
        self.prefix = self.url.prefix.encode()
        self.made: list[EtcdStore] = []

    async def store(self, address: str, *, lead: bool = True) -> EtcdStore:
        made = await stores.open_etcd(self.url, address, lease_s=2)
        assert isinstance(made, EtcdStore)
        self.made.append(made)
        if lead:
            assert await made.acquire() is None
        return made

    async def keys(self, under: str) -> list[bytes]:
        host, port = self.url.endpoints[0]
        async with aetcd.Client(host=host, port=port, timeout=10) as client:
            got = await client.get_prefix(self.prefix + under.encode())
            return sorted(kv.key for kv in got)

    async def put(self, key: str, value: bytes) -> None:
        host, port = self.url.endpoints[0]
        async with aetcd.Client(host=host, port=port, timeout=10) as client:
            await client.put(self.prefix + key.encode(), value)

    async def get(self, key: str) -> bytes | None:
        host, port = self.url.endpoints[0]
        async with aetcd.Client(host=host, port=port, timeout=10) as client:
            got = await client.get(self.prefix + key.encode())
            return None if got is None else bytes(got.value)

    async def compact(self) -> None:
        host, port = self.url.endpoints[0]
        async with aetcd.Client(host=host, port=port, timeout=10) as client:
            latest = await client.get(self.prefix + b"state")
            assert latest is not None
            await client.compact(latest.header.revision, physical=True)


@pytest.fixture
async def etcd(etcd_cluster: EtcdCluster) -> AsyncIterator[Etcd]:
    made = Etcd(etcd_cluster)
    yield made
    for store in made.made:
        await store.close()


def blob_ids(keys: list[bytes]) -> set[bytes]:
    return {key.rsplit(b"/", 2)[-2] for key in keys}


Call = Callable[[Callable[[Any], Awaitable[Any]], str], Awaitable[Any]]


def around(store: EtcdStore, what: str, call: Call) -> Callable[[], None]:
    """Requests `what` of `store` go through `call` from now on; what puts the plain way back."""
    connection = store.connection
    plain = connection.call

    async def routed(request: Callable[[Any], Awaitable[Any]], said: str) -> Any:
        return await (call if said == what else plain)(request, said)

    connection.call = routed  # type: ignore[method-assign]

    def restore() -> None:
        connection.call = plain  # type: ignore[method-assign]

    return restore


@pytest.mark.parametrize("members", [0, LARGE], ids=["inline", "chunked"])
async def test_a_save_sent_again_after_its_answer_was_lost_is_reported_landed(
    etcd: Etcd, members: int
) -> None:
    """What EtcdConnection.call does when a member's answer times out: the same transaction on
    the next member, where its compare (the mod revision it replaced) no longer holds."""
    store = await etcd.store("127.0.0.1:1")
    first = await store.save(snapshot(1), "")

    async def landed_then_sent_again(request: Callable[[Any], Awaitable[Any]], what: str) -> Any:
        await store.connection._request(0, request)  # lands; its answer is lost
        return await store.connection._request(1, request)

    around(store, "save the state", landed_then_sent_again)
    again = await store.save(snapshot(2, members), first.current.token)
    assert again.ok
    assert again.current == await store.load()
    assert again.current.snapshot == snapshot(2, members)
    if members:  # the first save's chunks (none) and no others: only the named ones are left
        assert len(blob_ids(await etcd.keys("stateblob/"))) == 1
    # Fencing is intact: another snapshot with a stale token is refused.
    stale = await store.save(snapshot(3), first.current.token)
    assert not stale.ok
    assert stale.current == again.current


DAMAGED_VALUES = {
    "foreign": b"written behind the leader",
    "corrupt": b"\x00{not json",
    "torn manifest": b"\x01{not json",
}


@pytest.mark.parametrize("damaged", list(DAMAGED_VALUES), ids=list(DAMAGED_VALUES))
async def test_a_state_damaged_while_leading_is_kept_aside_and_saved_over(
    etcd: Etcd, damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The leader holds the leader key, so no other scheduler wrote the damaged value: waiting
    cannot mend it. (A whole state of another job there still fences it: the contract test.)"""
    store = await etcd.store("127.0.0.1:1")
    first = await store.save(snapshot(1), "")
    await etcd.put("state", DAMAGED_VALUES[damaged])
    again = await store.save(snapshot(2), first.current.token)
    assert again.ok
    assert again.current == await store.load()
    assert again.current.snapshot == snapshot(2)
    kept = await etcd.keys("damaged/")
    assert len(kept) == 1
    assert await etcd.get(kept[0][len(etcd.prefix) :].decode()) == DAMAGED_VALUES[damaged]
    said = [r.getMessage() for r in caplog.records if "damaged value is kept" in r.getMessage()]
    assert len(said) == 1
    assert "saves its state there again, so the job goes on" in said[0]
    assert kept[0].decode() in said[0]


async def test_a_refused_chunked_save_removes_its_chunks(etcd: Etcd) -> None:
    store = await etcd.store("127.0.0.1:1")
    first = await store.save(snapshot(1), "")
    newer = await store.save(snapshot(2), first.current.token)
    refused = await store.save(snapshot(3, LARGE), first.current.token)
    assert not refused.ok
    assert refused.current == newer.current
    assert await etcd.keys("stateblob/") == []


async def test_the_chunks_of_a_save_of_unknown_outcome_go_with_the_next_save(
    etcd: Etcd,
) -> None:
    store = await etcd.store("127.0.0.1:1")
    first = await store.save(snapshot(1), "")

    async def unanswered(request: Callable[[Any], Awaitable[Any]], what: str) -> Any:
        raise EtcdUnavailable("no member answered")  # sent nowhere: its chunks name nothing

    restore = around(store, "save the state", unanswered)
    with pytest.raises(EtcdUnavailable):
        await store.save(snapshot(2, LARGE), first.current.token)
    assert len(blob_ids(await etcd.keys("stateblob/"))) == 1
    restore()
    landed = await store.save(snapshot(3, LARGE), first.current.token)
    assert landed.ok
    assert len(blob_ids(await etcd.keys("stateblob/"))) == 1  # the new save's own
    assert (await store.load()).snapshot == snapshot(3, LARGE)


async def test_a_new_leader_removes_the_chunks_no_key_names(etcd: Etcd) -> None:
    """Chunks a leader wrote and never named (it died between), beside named ones."""
    first = await etcd.store("127.0.0.1:1")
    await first.clear_kv("job-a")
    await first.save_kv("job-a", {"large": b"z" * (2 * 1024 * 1024)})
    saved = await first.save(snapshot(1, LARGE), "")
    await etcd.put("stateblob/orphan/000000", b"a chunk")
    await etcd.put("kvblob/orphan/000000", b"a chunk")
    await first.close()
    second = await etcd.store("127.0.0.2:1")
    assert (await second.load()) == saved.current
    assert await second.load_kv("job-a") == {"large": b"z" * (2 * 1024 * 1024)}
    assert await second.collect_garbage() == 2
    assert b"orphan" not in blob_ids(await etcd.keys("stateblob/"))
    assert b"orphan" not in blob_ids(await etcd.keys("kvblob/"))
    assert (await second.load()) == saved.current
    assert await second.load_kv("job-a") == {"large": b"z" * (2 * 1024 * 1024)}


async def test_a_load_racing_a_save_loads_the_state_whose_manifest_it_read(etcd: Etcd) -> None:
    """A standby reads the manifest, the leader saves (removing the chunks it named), then the
    standby reads the chunks: those of the manifest it read."""
    leader = await etcd.store("127.0.0.1:1")
    standby = await etcd.store("127.0.0.2:1", lead=False)
    first = await leader.save(snapshot(1, LARGE), "")
    raced: list[bool] = []

    async def after_a_save(request: Callable[[Any], Awaitable[Any]], what: str) -> Any:
        if not raced:
            raced.append((await leader.save(snapshot(2, LARGE), first.current.token)).ok)
        return await leader.connection.call(request, what)

    around(standby, "read chunks", after_a_save)
    assert (await standby.load()) == first.current
    assert raced == [True]


async def test_a_load_whose_chunks_revision_was_compacted_reads_again(etcd: Etcd) -> None:
    leader = await etcd.store("127.0.0.1:1")
    standby = await etcd.store("127.0.0.2:1", lead=False)
    first = await leader.save(snapshot(1, LARGE), "")
    newer: list[Any] = []

    async def after_a_save_and_compaction(
        request: Callable[[Any], Awaitable[Any]], what: str
    ) -> Any:
        if not newer:
            newer.append(await leader.save(snapshot(2, LARGE), first.current.token))
            await etcd.compact()
        return await leader.connection.call(request, what)

    around(standby, "read chunks", after_a_save_and_compaction)
    assert (await standby.load()) == newer[0].current


async def test_torn_chunks_advise_checking_that_no_scheduler_leads(etcd: Etcd) -> None:
    leader = await etcd.store("127.0.0.1:1")
    await leader.save(snapshot(1, LARGE), "")
    (chunk,) = (await etcd.keys("stateblob/"))[:1]
    await etcd.put(chunk[len(etcd.prefix) :].decode(), b"torn")
    with pytest.raises(StateFileError, match="missing or torn") as raised:
        await (await etcd.store("127.0.0.2:1", lead=False)).load()
    assert "check that no scheduler leads the job" in str(raised.value)


def spans(store: EtcdStore, keys: list[bytes]) -> list[int]:
    """From now on, how many of `keys` (sorted) each range request of `store` spans: what
    etcd walks for it (etcd 3.4 walks a range's whole span, whatever the request's limit)."""
    counted: list[int] = []
    for index in range(len(store.connection.url.endpoints)):
        stub = store.connection.client(index).kvstub
        plain = stub.Range

        def spy(request: Any, *args: Any, plain: Any = plain, **kwargs: Any) -> Any:
            end = request.range_end or request.key + b"\x00"
            counted.append(bisect.bisect_left(keys, end) - bisect.bisect_left(keys, request.key))
            return plain(request, *args, **kwargs)

        stub.Range = spy
    return counted


async def test_a_new_leader_reads_a_large_key_value_store_in_linear_work(etcd: Etcd) -> None:
    """Each page of the load spans its own keys only, not the rest of the store: the keys
    etcd walks for the whole load grow with the store, not with its square."""
    count = 3000
    first = await etcd.store("127.0.0.1:1")
    await first.clear_kv("job-a")
    values = {f"k{i:05d}": b"v%d" % i for i in range(count)}
    await first.save_kv("job-a", values)
    await first.close()
    second = await etcd.store("127.0.0.2:1")
    walked = spans(second, sorted(etcd.prefix + b"kv/" + k.encode() for k in values))
    assert await second.load_kv("job-a") == values
    assert sum(walked) <= 3 * count, f"{len(walked)} reads walked {sum(walked)} keys"
