"""One real test per server, proving its fixture: the server starts, does its job, and is gone
after the test."""

from __future__ import annotations

import aetcd

from tests.servers.etcd import EtcdCluster


async def _put_then_get(cluster: EtcdCluster, member: int, key: bytes, value: bytes) -> None:
    port = cluster.members[member].client_port
    async with aetcd.Client(host="127.0.0.1", port=port, timeout=10) as client:
        await client.put(key, value)
        got = await client.get(key)
        assert got is not None
        assert got.value == value


async def test_etcd_cluster_keeps_serving_with_its_leader_killed(etcd_cluster: EtcdCluster) -> None:
    assert len(etcd_cluster.endpoints) == 3
    key = f"{etcd_cluster.prefix}greeting".encode()
    await _put_then_get(etcd_cluster, 0, key, b"one")

    leader = etcd_cluster.leader()
    etcd_cluster.kill(leader)
    assert not etcd_cluster.running(leader)
    etcd_cluster.wait_healthy()  # the two others elect a leader
    survivor = (leader + 1) % 3
    await _put_then_get(etcd_cluster, survivor, key, b"two")

    etcd_cluster.restart(leader)
    async with aetcd.Client(
        host="127.0.0.1", port=etcd_cluster.members[leader].client_port, timeout=10
    ) as client:
        got = await client.get(key)
    assert got is not None
    assert got.value == b"two"  # the restarted member caught up
