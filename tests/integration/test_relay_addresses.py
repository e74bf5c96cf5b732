"""A relay takes a worker for its job's scheduler however either spells it: a relay given
`localhost:PORT` serves the workers given `127.0.0.1:PORT`, and still refuses a worker of
another scheduler, saying both lists as written and as resolved."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cluster.testing import free_port
from tests.procs import MSCLUSTER, ROOT, Procs, example_error_line, job_env

EXAMPLE = str(ROOT / "examples" / "allgather_check.py")


def _localhost_is_loopback() -> bool:
    try:
        infos = socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return any(info[4][0] == "127.0.0.1" for info in infos)


@pytest.mark.skipif(not _localhost_is_loopback(), reason="localhost does not resolve to 127.0.0.1")
def test_a_relay_given_a_name_serves_the_workers_given_its_address(
    processes: Procs, short_dir: Path
) -> None:
    """A real scheduler on 127.0.0.1 and a real relay (`mscluster relay`) given
    MS_SCHED_HOST=localhost: a worker given MS_SCHED_HOST=127.0.0.1 through that relay joins
    and its job finishes. A worker for another port (another scheduler, running), first, is
    refused with one line that names both lists, what localhost resolved to, and the fix; the
    relay says it in its log. (Once the job finished, a relay started by hand exits.)"""
    port, other_port = free_port(), free_port()
    for name, at in (("sched", port), ("sched-other", other_port)):
        processes.start(name, [*MSCLUSTER, "scheduler"], job_env(1, at, MS_ROLE="MS_SCHED"))
    relay_address = f"unix:{short_dir / 'r.sock'}"
    relay = processes.start(
        "relay",
        [*MSCLUSTER, "relay", "--socket", relay_address],
        job_env(1, port, MS_SCHED_HOST="localhost"),
    )
    relay.wait_for_output(f"mscluster relay: serving {relay_address}", 30)

    other = job_env(1, other_port, MS_ROLE="MS_WORKER", CLUSTER_RELAY=relay_address)
    line = example_error_line(other)
    assert f"this worker is for the scheduler at 127.0.0.1:{other_port}" in line, line
    assert f"forwards to the scheduler at localhost:{port} (resolved here: localhost is " in line
    assert "127.0.0.1" in line.split("resolved here:")[1], line
    assert "it is another job's relay" in line, line
    relay.wait_for_output(
        f"mscluster relay: refused a worker's calls (the scheduler at 127.0.0.1:{other_port}): "
        f"this relay forwards to the scheduler at localhost:{port} (resolved here: localhost is ",
        10,
    )

    ours = job_env(1, port, MS_ROLE="MS_WORKER", CLUSTER_RELAY=relay_address)
    worker = processes.start("worker", [*MSCLUSTER[:1], EXAMPLE], ours)
    assert worker.wait(60) == 0, worker.output
    assert "allgather rank=0 size=1 result=[0]" in worker.output
    assert "relay" not in worker.output  # through it, not direct: nothing said of it
    assert relay.wait(30) == 0, relay.output
