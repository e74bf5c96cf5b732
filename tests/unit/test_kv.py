"""Unit tests of cluster.scheduler.kv.KvStore."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.errors import CapacityError, CollectiveError
from cluster.scheduler.kv import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    SHARE_FLOOR_BYTES,
    SHARE_FLOOR_KEYS,
    KvStore,
)
from tests.aio import BOUND_S, settle


def waiting(kv: KvStore) -> int:
    return sum(len(w) for w in kv._waiters.values())


# -- set / get --------------------------------------------------------------------------------


def test_set_and_get() -> None:
    kv = KvStore()
    kv.set("a", b"1")
    kv.set("c", b"")
    assert len(kv) == 2
    assert kv.get(["c", "b", "a"]) == ([b"", b"1"], ["b"])
    kv.set("a", b"2")
    assert kv.get(["a"]) == ([b"2"], [])
    assert len(kv) == 2


def test_an_answer_too_large_to_send_is_refused_before_it_is_built() -> None:
    """One 4 MiB key listed 20 times in a 60-byte request: the answer (80 MiB, or gigabytes at
    the request's 256 KiB) was built whole before gRPC refused to send it, the loop blocked
    meanwhile. Refused first, naming the size; a get and a wait that fit are answered."""
    kv = KvStore()
    kv.set("big", b"x" * MAX_VALUE_BYTES)
    many = ["big"] * 20
    with pytest.raises(CapacityError, match=r"^a get of 20 keys would answer 83886080 bytes, more"):
        kv.get(many)
    assert kv.get(
        ["big"] * 15,
    ) == ([b"x" * MAX_VALUE_BYTES] * 15, [])

    async def waited() -> None:
        with pytest.raises(CapacityError, match=r"^a wait of 20 keys would answer"):
            await kv.wait(many, BOUND_S)
        assert waiting(kv) == 0

    asyncio.run(waited())


def test_get_missing() -> None:
    kv = KvStore()
    assert kv.get(["x", "y"]) == ([], ["x", "y"])
    assert kv.get([]) == ([], [])


def test_value_limit() -> None:
    kv = KvStore()
    kv.set("big", b"x" * MAX_VALUE_BYTES)
    with pytest.raises(CollectiveError) as info:
        kv.set("too-big", b"x" * (MAX_VALUE_BYTES + 1))
    assert "'too-big'" in str(info.value)
    assert str(MAX_VALUE_BYTES + 1) in str(info.value)
    assert kv.get(["too-big"]) == ([], ["too-big"])
    assert len(kv) == 1


@pytest.mark.parametrize("key", ["", "k" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2 + 1)])
def test_bad_keys_rejected_by_set(key: str) -> None:
    kv = KvStore()
    with pytest.raises(CollectiveError, match=f"1-{MAX_KEY_BYTES} bytes"):
        kv.set(key, b"v")
    assert len(kv) == 0


def test_longest_key_accepted() -> None:
    kv = KvStore()
    kv.set("k" * MAX_KEY_BYTES, b"v")
    assert kv.get(["k" * MAX_KEY_BYTES]) == ([b"v"], [])


def test_empty_key_rejected_by_add() -> None:
    kv = KvStore()
    with pytest.raises(CollectiveError):
        kv.add("", 1)
    assert len(kv) == 0


async def test_empty_key_rejected_by_wait() -> None:
    kv = KvStore()
    with pytest.raises(CollectiveError, match="bytes long"):
        await asyncio.wait_for(kv.wait(["ok", ""], timeout_s=1.0), BOUND_S)
    assert kv._waiters == {}


# -- add --------------------------------------------------------------------------------------


def test_add_on_missing_key_starts_at_zero() -> None:
    kv = KvStore()
    assert kv.add("n", 5) == 5
    assert kv.get(["n"]) == ([b"5"], [])


def test_add_on_existing_counter() -> None:
    kv = KvStore()
    kv.set("n", b"40")
    assert kv.add("n", 2) == 42
    assert kv.add("n", -50) == -8
    assert kv.add("n", 0) == -8
    assert kv.get(["n"]) == ([b"-8"], [])


@pytest.mark.parametrize("value", [b"hello", b"1.5", b"\xff\xfe", b""])
def test_add_on_non_counter_raises(value: bytes) -> None:
    kv = KvStore()
    kv.set("k", value)
    with pytest.raises(CollectiveError) as info:
        kv.add("k", 1)
    assert "'k'" in str(info.value)
    assert "not a counter" in str(info.value)
    assert kv.get(["k"]) == ([value], [])


# -- wait -------------------------------------------------------------------------------------


async def test_wait_for_present_keys_returns_at_once() -> None:
    kv = KvStore()
    kv.set("a", b"1")
    kv.set("b", b"2")
    assert await asyncio.wait_for(kv.wait(["b", "a", "b"], timeout_s=1.0), BOUND_S) == [
        b"2",
        b"1",
        b"2",
    ]
    assert await asyncio.wait_for(kv.wait([], timeout_s=1.0), BOUND_S) == []


async def test_wait_returns_when_keys_are_set_later() -> None:
    kv = KvStore()
    kv.set("b", b"early")
    task = asyncio.create_task(kv.wait(["a", "b", "c"], timeout_s=60.0))
    await settle(lambda: "a" in kv._waiters)
    kv.set("c", b"3")  # not the key it waits on first: it keeps waiting
    for _ in range(5):  # give it every chance to (wrongly) return
        await asyncio.sleep(0)  # sleep-ok: a yield to the loop, not a wait on time
    assert not task.done()
    assert "a" in kv._waiters
    kv.set("a", b"1")
    assert await asyncio.wait_for(task, BOUND_S) == [b"1", b"early", b"3"]
    assert kv._waiters == {}


async def test_wait_wakes_on_each_missing_key_in_turn() -> None:
    kv = KvStore()
    task = asyncio.create_task(kv.wait(["x", "y"], timeout_s=60.0))
    await settle(lambda: "x" in kv._waiters)
    kv.set("x", b"1")
    await settle(lambda: "y" in kv._waiters)
    assert not task.done()
    kv.set("y", b"2")
    assert await asyncio.wait_for(task, BOUND_S) == [b"1", b"2"]
    assert kv._waiters == {}


async def test_many_waiters_on_one_key_all_wake() -> None:
    kv = KvStore()
    tasks = [asyncio.create_task(kv.wait(["go"], timeout_s=60.0)) for _ in range(5)]
    await settle(lambda: waiting(kv) == 5)
    assert kv.add("go", 1) == 1  # add sets the key too
    results = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
    assert results == [[b"1"]] * 5
    assert kv._waiters == {}


async def test_wait_set_by_another_task_after_an_event() -> None:
    kv = KvStore()
    ready = asyncio.Event()

    async def producer() -> None:
        await ready.wait()
        kv.set("k", b"v")

    waiter = asyncio.create_task(kv.wait(["k"], timeout_s=60.0))
    setter = asyncio.create_task(producer())
    await settle(lambda: "k" in kv._waiters)
    ready.set()
    assert await asyncio.wait_for(waiter, BOUND_S) == [b"v"]
    await asyncio.wait_for(setter, BOUND_S)


async def test_wait_timeout_names_the_missing_key() -> None:
    kv = KvStore()
    kv.set("present", b"1")
    with pytest.raises(CollectiveError) as info:
        await asyncio.wait_for(kv.wait(["present", "absent"], timeout_s=0.01), BOUND_S)
    message = str(info.value)
    assert "timed out after 0.01 s" in message
    assert "'absent'" in message
    assert "'present'" not in message
    assert kv._waiters == {}


async def test_wait_timeout_shows_at_most_five_keys() -> None:
    kv = KvStore()
    keys = [f"k{i}" for i in range(8)]
    with pytest.raises(CollectiveError) as info:
        await asyncio.wait_for(kv.wait(keys, timeout_s=0.0), BOUND_S)
    message = str(info.value)
    assert "'k0', 'k1', 'k2', 'k3', 'k4' and 3 more" in message
    assert "'k5'" not in message
    assert kv._waiters == {}


async def test_no_waiter_leaked_after_timeouts_while_others_wait() -> None:
    kv = KvStore()
    patient = asyncio.create_task(kv.wait(["k"], timeout_s=60.0))
    await settle(lambda: waiting(kv) == 1)
    for _ in range(3):
        with pytest.raises(CollectiveError):
            await asyncio.wait_for(kv.wait(["k"], timeout_s=0.0), BOUND_S)
    assert waiting(kv) == 1  # only the patient one
    kv.set("k", b"v")
    assert await asyncio.wait_for(patient, BOUND_S) == [b"v"]
    assert kv._waiters == {}


async def test_no_waiter_leaked_after_cancel() -> None:
    kv = KvStore()
    task = asyncio.create_task(kv.wait(["k"], timeout_s=60.0))
    await settle(lambda: waiting(kv) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, BOUND_S)
    assert kv._waiters == {}
    kv.set("k", b"v")  # no stale waiter to resolve
    assert kv.get(["k"]) == ([b"v"], [])


# -- caps ---------------------------------------------------------------------------------------


def test_total_bytes_are_capped_and_counted_as_they_change() -> None:
    kv = KvStore(max_bytes=100, max_keys=10)
    kv.set("a", b"x" * 40)  # 41 bytes with its key
    kv.set("b", b"x" * 40)
    assert kv.held_bytes == 82
    with pytest.raises(CapacityError) as info:
        kv.set("c", b"x" * 40)
    message = str(info.value)
    for words in ("'c'", "CLUSTER_KV_MAX_BYTES=100", "82 bytes", "coordination"):
        assert words in message
    assert kv.get(["c"]) == ([], ["c"])
    assert kv.held_bytes == 82
    kv.set("a", b"")  # overwriting gives room back
    assert kv.held_bytes == 42
    kv.set("c", b"x" * 40)
    assert kv.held_bytes == 83


def test_keys_are_capped() -> None:
    kv = KvStore(max_bytes=1000, max_keys=2)
    kv.set("a", b"1")
    kv.add("b", 1)
    with pytest.raises(CapacityError, match=r"CLUSTER_KV_MAX_KEYS=2"):
        kv.set("c", b"1")
    with pytest.raises(CapacityError, match=r"'d'"):
        kv.add("d", 1)
    kv.set("a", b"22")  # an existing key may change
    assert kv.add("b", 5) == 6
    assert len(kv) == 2


def test_a_capacity_error_is_a_collective_error() -> None:
    assert issubclass(CapacityError, CollectiveError)


async def test_pending_waits_are_capped_and_freed() -> None:
    kv = KvStore(max_waits=3)
    waits = [asyncio.create_task(kv.wait([f"k{i}"], BOUND_S)) for i in range(3)]
    await settle(lambda: kv.pending_waits == 3)
    with pytest.raises(CapacityError, match="3 key-value waits are pending"):
        await kv.wait(["k9"], BOUND_S)
    assert await kv.wait([], BOUND_S) == []  # nothing to wait for: answered at once
    kv.set("k0", b"v")
    assert await asyncio.wait_for(waits[0], BOUND_S) == [b"v"]
    for task in waits[1:]:
        task.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
    assert kv.pending_waits == 0
    assert waiting(kv) == 0


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0])
async def test_a_wait_needs_a_number_of_seconds(timeout: float) -> None:
    kv = KvStore()
    with pytest.raises(CollectiveError, match="not a number of seconds"):
        await kv.wait(["k"], timeout)
    assert kv.pending_waits == 0


def test_a_runaway_member_is_refused_at_its_share_and_the_others_go_on() -> None:
    """Four nodes share 64 MiB and 4096 keys: a member that fills its share (16 MiB, 1024 keys,
    the floors) is refused; another member still sets new keys."""
    store = KvStore(max_bytes=64 * 1024 * 1024, max_keys=4096, nodes=4)
    assert (store.byte_share, store.key_share) == (SHARE_FLOOR_BYTES, SHARE_FLOOR_KEYS)
    value = b"x" * (MAX_VALUE_BYTES // 2)
    refused = []
    for i in range(40):
        try:
            store.set(f"flood/{i}", value, "0")
        except CapacityError as exc:
            refused.append(str(exc))
    assert refused
    assert "node '0'" in refused[0]
    assert "past its share" in refused[0]
    store.set("mine", b"v", "1")  # the others go on
    assert store.get(["mine"]) == ([b"v"], [])
    # Rewriting one's own key moves nothing; a key set by another is counted to it.
    store.set("flood/0", b"small", "0")
    store.set("flood/0", value, "0")
    store.set("flood/1", b"taken", "1")
    store.set("flood/39", b"now fits", "0")


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["0", "1", "2"]),
            st.integers(min_value=0, max_value=20),
            st.integers(min_value=0, max_value=300),
        ),
        max_size=200,
    )
)
def test_what_members_hold_adds_up_to_what_the_store_holds(
    sets: list[tuple[str, int, int]],
) -> None:
    store = KvStore(max_bytes=4000, max_keys=16, nodes=3)
    store.byte_share, store.key_share = 1500, 8  # below the floors, to reach them here
    for owner, key, size in sets:
        with contextlib.suppress(CapacityError):
            store.set(f"k{key}", b"v" * size, owner)
    assert sum(store._bytes_of.values()) == store.held_bytes
    assert sum(store._keys_of.values()) == len(store)
    for owner in ("0", "1", "2"):
        assert store._bytes_of[owner] <= 1500
        assert store._keys_of[owner] <= 8


async def test_a_member_waits_within_its_share() -> None:
    store = KvStore(nodes=64)  # 1024 waits in all: 16 for each member
    waits = [asyncio.create_task(store.wait([f"k{i}"], 60.0, "0")) for i in range(16)]
    await settle(lambda: store.pending_waits == 16)
    with pytest.raises(CapacityError, match="its share"):
        await asyncio.wait_for(store.wait(["k99"], 60.0, "0"), BOUND_S)
    other = asyncio.create_task(store.wait(["k0"], 60.0, "1"))  # another member still waits
    store.set("k0", b"v", "1")
    assert await asyncio.wait_for(other, BOUND_S) == [b"v"]
    for task in waits:
        task.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
    assert store.pending_waits == 0
