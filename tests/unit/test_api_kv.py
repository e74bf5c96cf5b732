"""The key-value store's checks in the caller, before anything is sent: keys the scheduler takes
(UTF-8, 1-1024 bytes), str values with a UTF-8 form, and waits no larger than the scheduler
reads. Without `cluster.init()`, a call that passes them goes on to say so (NotInitializedError).
The same against a real scheduler: tests/integration/test_api_edges.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cluster.api.collective import (
    MAX_KV_KEY_BYTES,
    MAX_KV_WAIT_BYTES,
    KeyValueStore,
    _wait_request_bytes,
)
from cluster.protocol.errors import CapacityError, CollectiveError, NotInitializedError
from cluster.scheduler.machine.kv import MAX_KEY_BYTES
from cluster.v1 import scheduler_pb2 as pb
from tests.integration.scripts.api_edges import keys_making

kv = KeyValueStore()
CALLS: dict[str, Callable[[str], Any]] = {
    "set": lambda key: kv.set(key, b"1"),
    "get": kv.get,
    "wait": lambda key: kv.wait(key, 1),
    "add": kv.add,
}


def test_the_key_limit_is_the_schedulers() -> None:
    assert MAX_KV_KEY_BYTES == MAX_KEY_BYTES


@pytest.mark.parametrize("method", sorted(CALLS))
def test_a_key_without_utf8_is_refused_naming_it(method: str) -> None:
    with pytest.raises(CollectiveError) as refused:
        CALLS[method]("a\ud800")
    assert str(refused.value) == (
        f"kv_store().{method}: key 'a\\ud800' has no UTF-8 form (surrogates not allowed at index "
        "1, '\\ud800'): keys and str values must be valid text; pass bytes for a value that is not"
    )


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize(("key", "size"), [("", 0), ("k" * 1025, 1025), ("é" * 513, 1026)])
def test_a_key_of_no_bytes_or_past_1024_bytes_is_refused(method: str, key: str, size: int) -> None:
    with pytest.raises(CollectiveError, match=rf"is {size} bytes long in UTF-8; a key must be "):
        CALLS[method](key)


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize("key", ["k", "k" * 1024, "é" * 512, "ключ🔑"])
def test_a_key_of_1_to_1024_bytes_is_taken(method: str, key: str) -> None:
    with pytest.raises(NotInitializedError):
        CALLS[method](key)


def test_a_str_value_without_utf8_is_refused() -> None:
    with pytest.raises(CollectiveError, match=r"^kv_store\(\).set: value '\\udfff' has no UTF-8"):
        kv.set("key", "\udfff")


@pytest.mark.parametrize(
    "sizes", [[1], [127], [128], [1024], [10] * 1000, [1, 127, 128, 300, 1024, 5]]
)
def test_a_waits_size_is_what_protobuf_encodes(sizes: list[int]) -> None:
    keys = ["k" * n for n in sizes]
    assert _wait_request_bytes(sizes) == pb.KvWaitRequest(keys=keys, timeout_s=1.5).ByteSize()


def test_a_wait_past_what_the_scheduler_reads_is_refused_naming_the_limit() -> None:
    at_limit = keys_making(MAX_KV_WAIT_BYTES)
    assert pb.KvWaitRequest(keys=at_limit, timeout_s=1).ByteSize() == MAX_KV_WAIT_BYTES
    with pytest.raises(NotInitializedError):
        kv.wait(at_limit, 1)
    over = keys_making(MAX_KV_WAIT_BYTES + 1)
    with pytest.raises(CapacityError) as refused:
        kv.wait(over, 1)
    assert str(refused.value) == (
        f"kv_store().wait: its {len(over):,} keys make a request of 262,145 bytes, more than the "
        "262,144 (256 KiB) the scheduler takes for one wait; nothing was sent: wait for the keys "
        "in batches, one wait after another"
    )


def test_a_wait_of_many_short_keys_is_refused_before_it_is_sent() -> None:
    """The review's: 100,000 keys m0, m1, ..."""
    with pytest.raises(CapacityError, match=r"its 100,000 keys make a request of 788,899 bytes"):
        kv.wait([f"m{i}" for i in range(100_000)], 1)
