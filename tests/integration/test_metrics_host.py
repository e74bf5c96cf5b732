"""Where the scheduler's /metrics listens: on the scheduler's own host by default, and on the
address CLUSTER_METRICS_HOST (`mscluster scheduler --metrics-host`) names when given one, a
private address away from the job's (the port is plain HTTP, open to whoever reaches it). Real
servers on loopback addresses: the port answers there and is refused elsewhere."""

from __future__ import annotations

import asyncio
import re
import socket
import urllib.request

import pytest

from cluster.protocol.config import ObserveConfig
from cluster.scheduler import SchedulerServer
from tests.procs import MSCLUSTER, Procs, job_env
from tests.scrape import settings

BOUND_S = 30.0


def answers(host: str, port: int) -> bool:
    """Whether a connection to host:port is taken (False: refused)."""
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def scraped(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


@pytest.mark.parametrize(
    ("metrics_host", "listening", "not_listening"),
    [(None, "127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.2", "127.0.0.1")],
)
async def test_metrics_listen_where_they_are_told(
    metrics_host: str | None, listening: str, not_listening: str
) -> None:
    observe = ObserveConfig(metrics_port=0, metrics_host=metrics_host)
    async with SchedulerServer(settings(), "127.0.0.1", observe=observe) as server:
        port = server.observing.metrics_port
        assert port is not None
        assert "cluster_leader 1.0" in await asyncio.to_thread(scraped, listening, port)
        assert not await asyncio.to_thread(answers, not_listening, port)


def test_mscluster_scheduler_metrics_host(processes: Procs) -> None:
    sched = processes.start(
        "scheduler",
        [
            *MSCLUSTER, "scheduler", "--port", "0", "--worker-num", "1",
            "--metrics-port", "0", "--metrics-host", "127.0.0.2",
        ],
        job_env(1, 1),
    )  # fmt: skip
    sched.wait_for_output("metrics at http://", BOUND_S)
    found = re.search(r"metrics at http://([\d.]+):(\d+)/metrics", sched.output)
    assert found is not None, sched.output
    assert found[1] == "127.0.0.2"
    port = int(found[2])
    assert "cluster_leader 1.0" in scraped("127.0.0.2", port)
    assert not answers("127.0.0.1", port)
