"""Who compacts etcd's history (CLUSTER_ETCD_COMPACTION), on a real 3-member etcd. A compaction
is etcd-wide: it drops the history of every key of that etcd, another user's too. With `off`
(the default) the job never compacts, and says once at start that etcd must; with `auto` its
leader compacts, as before, but never past a revision a standby of the job still reads at."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cluster.protocol.state_url import Compaction, EtcdAuth, parse_state_url
from cluster.scheduler import stores
from cluster.scheduler.etcd_store import EtcdStore
from tests.servers._process import ServerError
from tests.servers.etcd import EtcdCluster
from tests.unit.test_etcd_store import LARGE, around
from tests.unit.test_etcd_store import snapshot as chunked

SAVES = 20


def snapshot(revision: int) -> dict[str, Any]:
    return {"cluster_id": "job-a", "revision": revision}


async def open_store(
    etcd: EtcdCluster, compaction: Compaction | None, address: str = "127.0.0.1:1"
) -> EtcdStore:
    """A store of the job on `etcd`, compaction as given (None: the default), that checks
    whether to compact after every write it makes."""
    url = parse_state_url(etcd.state_url())
    if compaction is not None:
        url = dataclasses.replace(url, compaction=compaction)
    store = await stores.open_etcd(url, address, 5)
    assert isinstance(store, EtcdStore)
    store.history.every_bytes = 1
    return store


async def leader(etcd: EtcdCluster, compaction: Compaction | None) -> EtcdStore:
    store = await open_store(etcd, compaction)
    assert await store.acquire() is None
    return store


async def save_many(store: EtcdStore, saves: int = SAVES) -> None:
    token = (await store.load()).token
    for revision in range(saves):
        written = await store.save(snapshot(revision), token)
        assert written.ok
        token = written.current.token


def another_users_key(etcd: EtcdCluster) -> tuple[str, str]:
    """A key outside the job's prefix, written twice; the key and its first revision."""
    key = "/another-user" + etcd.prefix + "config"
    etcd.etcdctl("put", key, "first")
    first = json.loads(etcd.etcdctl("get", key, "-w", "json"))["kvs"][0]["mod_revision"]
    etcd.etcdctl("put", key, "second")
    return key, str(first)


async def test_off_leaves_another_users_old_revision_readable_after_many_saves(
    etcd_cluster: EtcdCluster,
) -> None:
    key, first = another_users_key(etcd_cluster)
    store = await leader(etcd_cluster, None)  # the default: off
    try:
        assert not store.history.compacting
        await save_many(store)
    finally:
        await store.close()
    assert etcd_cluster.etcdctl("get", key, "--rev", first, "--print-value-only") == "first\n"


async def test_auto_compacts_etcds_history(etcd_cluster: EtcdCluster) -> None:
    key, first = another_users_key(etcd_cluster)
    store = await leader(etcd_cluster, "auto")
    try:
        await save_many(store)
    finally:
        await store.close()
    with pytest.raises(ServerError, match="required revision has been compacted"):
        etcd_cluster.etcdctl("get", key, "--rev", first)


@pytest.mark.parametrize("compaction", [None, "off", "auto"])
async def test_a_scheduler_says_once_at_start_who_compacts(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture, compaction: Compaction | None
) -> None:
    """The warning with `off`, through two terms of leading and many saves: once."""
    caplog.set_level(logging.INFO, logger="cluster")
    store = await leader(etcd_cluster, compaction)
    try:
        await save_many(store)
        await store.release()
        assert await store.acquire() is None
        await save_many(store)
    finally:
        await store.close()
    warned = [r for r in caplog.records if "does not compact etcd's history" in r.getMessage()]
    told = [r for r in caplog.records if "the leader compacts etcd's history" in r.getMessage()]
    if compaction == "auto":
        assert (len(warned), len(told)) == (0, 1)
        return
    assert (len(warned), len(told)) == (1, 0)
    (warning,) = warned
    assert warning.levelno == logging.WARNING
    message = warning.getMessage()
    assert "etcd's database grows with every save until etcd compacts it" in message
    assert "--auto-compaction-retention" in message
    assert "CLUSTER_ETCD_COMPACTION=auto" in message


def revisions(etcd: EtcdCluster, under: str) -> list[int]:
    """The mod revisions of the job's keys under `under`."""
    got = json.loads(etcd.etcdctl("get", "--prefix", etcd.prefix + under, "-w", "json"))
    return [int(kv["mod_revision"]) for kv in got.get("kvs", [])]


async def test_the_leader_never_compacts_past_a_revision_a_standby_reads_at(
    etcd_cluster: EtcdCluster,
) -> None:
    """A standby loads a state in chunks (read at the revision its manifest was read at) while
    the leader saves twice, each save compacting up to the one before: past the revision the
    standby reads at, but for its hold. Once the standby has read, its hold is gone."""
    first = await leader(etcd_cluster, "auto")
    standby = await open_store(etcd_cluster, "auto", "127.0.0.2:1")
    try:
        token = (await first.save(chunked(1, LARGE), "")).current.token
        holds: list[list[int]] = []

        async def after_two_saves(request: Callable[[Any], Awaitable[Any]], what: str) -> Any:
            nonlocal token
            holds.append(revisions(etcd_cluster, "reads/"))
            for revision in (2, 3):
                written = await first.save(chunked(revision, LARGE), token)
                assert written.ok
                token = written.current.token
            return await first.connection.call(request, what)

        around(standby, "read chunks", after_two_saves)
        assert (await standby.load()).snapshot == chunked(1, LARGE)
        assert len(holds) == 1  # read at once: nothing it read was compacted
        (held,) = holds[0]
        assert revisions(etcd_cluster, "reads/") == []
        for revision in (4, 5):  # compacts past the hold now
            written = await first.save(chunked(revision, LARGE), token)
            token = written.current.token
        with pytest.raises(ServerError, match="required revision has been compacted"):
            etcd_cluster.etcdctl("get", etcd_cluster.prefix + "state", "--rev", str(held))
    finally:
        await standby.close()
        await first.close()


async def test_a_user_that_may_write_the_jobs_prefix_only_holds_the_history(
    etcd_auth_cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A hold is a key under the job's prefix, on a lease: what such a user may make."""
    etcd = etcd_auth_cluster
    path = tmp_path / "password"
    path.write_text(etcd.password)
    path.chmod(0o600)
    url = dataclasses.replace(
        parse_state_url(etcd.state_url()), auth=EtcdAuth(etcd.user, path), compaction="auto"
    )
    store = await stores.open_etcd(url, "127.0.0.1:1", 5)
    assert isinstance(store, EtcdStore)
    try:
        async with store.history.held():
            assert len(revisions(etcd, "reads/")) == 1
        assert revisions(etcd, "reads/") == []
    finally:
        await store.close()
