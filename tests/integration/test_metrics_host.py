"""Where the scheduler's /metrics listens: on the scheduler's own host by default, and on the
address CLUSTER_METRICS_HOST (`mscluster scheduler --metrics-host`) names when given one, a
private address away from the job's (the port is plain HTTP, open to whoever reaches it). Real
servers on loopback addresses: the port answers there and is refused elsewhere."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import urllib.request
from pathlib import Path

import pytest

from cluster.protocol.config import ObserveConfig
from cluster.scheduler import SchedulerServer
from cluster.testing import free_port
from tests.procs import MSCLUSTER, ROOT, Procs, job_env, mscluster
from tests.scrape import settings

BOUND_S = 30.0
SCRIPT = ROOT / "examples" / "allgather_check.py"


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


@pytest.mark.parametrize("metrics_host", [None, "127.0.0.2"])
def test_mscluster_run_on_a_metrics_port_in_use_starts_nothing(
    tmp_path: Path, metrics_host: str | None
) -> None:
    """--metrics-port taken where the scheduler would serve it (its host, or the
    CLUSTER_METRICS_HOST it inherits): the launcher started the job, the scheduler exited 2 and
    the job failed (exit 1). It is refused now in one line naming the option, the port and the
    address, exit 2, as a --master-port in use is, and nothing is started."""
    with socket.socket() as taken:
        taken.bind((metrics_host or "127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "CLUSTER_"))}
        if metrics_host is not None:
            env["CLUSTER_METRICS_HOST"] = metrics_host
        logs = tmp_path / "logs"
        result = mscluster(
            *("run", "--worker-num", "2", "--master-port", str(free_port())),
            *("--log-dir", str(logs), "--metrics-port", str(port), str(SCRIPT)),
            secret_file=None,
            env=env,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"mscluster: ConfigError: --metrics-port {port} is already in use on "
        f"{metrics_host or '127.0.0.1'}: stop what listens there or choose another port "
        "(0: any free one)"
    ]
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written
