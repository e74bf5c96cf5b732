"""A real scheduler's /metrics for tests: start one with metrics on, form its job, scrape it."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from cluster.protocol import version
from cluster.protocol.config import ObserveConfig
from cluster.scheduler import CoreSettings, SchedulerServer
from cluster.scheduler.machine.state import NodeRole, Registration
from tests.aio import BOUND_S
from tests.credentials import digest

ON = ObserveConfig(metrics_port=0)


def settings(workers: int = 2, *, recovery: bool = False) -> CoreSettings:
    return CoreSettings(
        worker_num=workers,
        server_num=0,
        node_timeout_s=5.0,
        topo_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        recovery=recovery,
    )


def reg(node_id: str, workers: int = 2) -> Registration:
    """Worker `node_id` of a job of `workers`, with its own credential."""
    return Registration(
        node_id,
        NodeRole.WORKER,
        "127.0.0.1",
        6000 + int(node_id),
        1,
        workers,
        0,
        protocol_revision=version.PROTOCOL_REVISION,
        credential_digest=digest(node_id, 1),
    )


async def scrape(server: SchedulerServer) -> dict[str, list[Sample]]:
    """Every sample of /metrics by sample name (the scrape runs off the loop, as Prometheus's)."""
    port = server.observing.metrics_port
    assert port is not None

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    text = await asyncio.wait_for(asyncio.to_thread(get), BOUND_S * 2)
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float:
    found = [s.value for s in samples.get(name, []) if labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{labels}: {found} in {samples.get(name)}"
    return found[0]


async def form(server: SchedulerServer, workers: int = 2) -> None:
    for i in range(workers):
        await asyncio.wait_for(server.core.register(reg(str(i), workers)), BOUND_S)
