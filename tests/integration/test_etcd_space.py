"""etcd's history and its space quota, on a real etcd with a small --quota-backend-bytes. etcd
keeps every revision of every key until it is compacted, and a state save writes the whole
state: a leader that never compacted spent the quota (2 GiB: about 14,000 saves of a 1,024-node
job), after which etcd refused every write while the leader's keepalives still landed, so it
led a frozen job. With CLUSTER_ETCD_COMPACTION=auto the leader compacts its history; when etcd
refuses a write for want of space all the same (its NOSPACE alarm is on), the leader says so,
with what to run, and steps down; once the operator has run it, a scheduler leads the job
again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from cluster.protocol.errors import ClusterError
from cluster.protocol.state_url import parse_state_url
from cluster.scheduler import stores
from cluster.scheduler.etcd_store import EtcdStore
from tests.aio import BOUND_S, eventually
from tests.integration.test_stepping_down import leads, scheduler
from tests.scrape import reg
from tests.servers.etcd import EtcdCluster

QUOTA_BYTES = 16 * 1024 * 1024
NODES = 1024  # a job of this many nodes saves about 150 KiB a time
JUNK = b"j" * (1024 * 1024)  # what another writer puts, again and again, in the same key


def state(revision: int) -> dict[str, Any]:
    nodes = [
        {"node_id": f"n{i}", "host": f"10.0.{i // 256}.{i % 256}", "port": 6000, "rank": i}
        for i in range(NODES)
    ]
    return {"revision": revision, "cluster_id": "job-a", "nodes": nodes}


def db_bytes(etcd: EtcdCluster) -> int:
    return int(json.loads(etcd.etcdctl("endpoint", "status", "-w", "json"))[0]["Status"]["dbSize"])


async def test_a_leader_saving_many_times_the_quota_keeps_saving(
    make_etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    etcd = make_etcd_cluster(1, quota_bytes=QUOTA_BYTES)
    etcd.prefix = "/job/"
    url = dataclasses.replace(parse_state_url(etcd.state_url()), compaction="auto")
    store = await stores.open_etcd(url, "127.0.0.1:1", 30)
    assert isinstance(store, EtcdStore)
    try:
        assert await store.acquire() is None
        # Every 4 MiB written (by default 16 MiB, for etcd's default quota of 2 GiB), or 30 s.
        store.history.every_bytes = 4 * 1024 * 1024
        token = (await store.load()).token
        saves = 3 * QUOTA_BYTES // (150 * 1024)
        for revision in range(saves):
            written = await store.save(state(revision), token)
            assert written.ok
            token = written.current.token
        assert (await store.load()).snapshot == state(saves - 1)
        assert db_bytes(etcd) < QUOTA_BYTES
    finally:
        await store.close()


async def test_a_leader_that_etcd_refuses_for_want_of_space_steps_down_and_leads_once_freed(
    make_etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    etcd = make_etcd_cluster(1, quota_bytes=QUOTA_BYTES)
    etcd.prefix = "/job/"
    async with scheduler(etcd) as first:
        await eventually(lambda: leads(first), "the scheduler to lead", 30)
        ha = first.ha
        assert ha is not None
        with contextlib.suppress(Exception):  # until etcd refuses: NOSPACE
            for _ in range(2 * QUOTA_BYTES // len(JUNK)):
                etcd.etcdctl("put", "/other/junk", stdin=JUNK.decode())
        assert "NOSPACE" in etcd.etcdctl("alarm", "list")
        core = first.core  # the job forms: a save, refused
        formed = asyncio.gather(core.register(reg("0")), core.register(reg("1")))
        await eventually(lambda: not leads(first), "the leader to step down", BOUND_S)
        with contextlib.suppress(ClusterError):
            await asyncio.wait_for(formed, BOUND_S)
        assert "NOSPACE alarm" in ha.leadership.reason
        assert "etcdctl alarm disarm" in ha.leadership.reason
        # What the operator runs (docs/howto/standbys.md, "etcd out of space").
        status = json.loads(etcd.etcdctl("endpoint", "status", "-w", "json"))
        etcd.etcdctl("compact", str(status[0]["Status"]["header"]["revision"]))
        etcd.etcdctl("defrag")
        etcd.etcdctl("alarm", "disarm")
        await eventually(lambda: leads(first), "the scheduler to lead again", 30)
