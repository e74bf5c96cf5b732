"""Who compacts etcd's history (CLUSTER_ETCD_COMPACTION), on a real 3-member etcd. A compaction
is etcd-wide: it drops the history of every key of that etcd, another user's too. With `off`
(the default) the job never compacts, and says once at start that etcd must; with `auto` its
leader compacts, as before."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest

from cluster.protocol.state_url import Compaction, parse_state_url
from cluster.scheduler import stores
from cluster.scheduler.etcd_store import EtcdStore
from tests.servers._process import ServerError
from tests.servers.etcd import EtcdCluster

SAVES = 20


def snapshot(revision: int) -> dict[str, Any]:
    return {"cluster_id": "job-a", "revision": revision}


async def leader(etcd: EtcdCluster, compaction: Compaction | None) -> EtcdStore:
    """A leading store of the job on `etcd`, compaction as given (None: the default), that
    checks whether to compact after every write."""
    url = parse_state_url(etcd.state_url())
    if compaction is not None:
        url = dataclasses.replace(url, compaction=compaction)
    store = await stores.open_etcd(url, "127.0.0.1:1", 5)
    assert isinstance(store, EtcdStore)
    assert await store.acquire() is None
    store.history.every_bytes = 1
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
