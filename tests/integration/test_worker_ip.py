"""MindSpore's MS_WORKER_IP, the address a worker networks on (needed with IPv6 on a host of
several NICs), is the address it advertises when CLUSTER_ADVERTISE_HOST is unset, checked as
that one is. Real processes: a scheduler and two workers on loopback addresses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.protocol.errors import ConfigError
from cluster.testing import free_port
from cluster.worker.identity import make_identity
from tests.procs import ROOT, Procs, job_env, mscluster

LIMIT_S = 60
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "finish_on_cue.py")


def test_a_worker_with_ms_worker_ip_is_advertised_there(processes: Procs, tmp_path: Path) -> None:
    """Worker '0' was advertised at 127.0.0.1, the address that routes to the scheduler, with
    MS_WORKER_IP=127.0.0.2; CLUSTER_ADVERTISE_HOST still wins where both are set (worker '1')."""
    port, go = free_port(), tmp_path / "go"
    env = job_env(2, port)
    sched = processes.start_role("sched", "MS_SCHED", ["-m", "cluster", "scheduler"], env)
    workers = [
        processes.start_role(
            f"w{node}", "MS_WORKER", [SCRIPT, str(go)], {**env, "MS_NODE_ID": node, **extra}
        )
        for node, extra in (
            ("0", {"MS_WORKER_IP": "127.0.0.2"}),
            ("1", {"MS_WORKER_IP": "127.0.0.2", "CLUSTER_ADVERTISE_HOST": "127.0.0.3"}),
        )
    ]
    for worker in workers:
        worker.wait_for_output("in rank=", LIMIT_S)
    shown = mscluster("status", "--addr", f"127.0.0.1:{port}", "--json", secret_file=None)
    assert shown.returncode == 0, shown.stderr
    hosts = {
        node["node_id"]: node["address"].rsplit(":", 1)[0]
        for node in json.loads(shown.stdout)["nodes"]
    }
    assert hosts == {"0": "127.0.0.2", "1": "127.0.0.3"}, shown.stdout
    go.touch()
    for proc in (*workers, sched):
        assert proc.wait(LIMIT_S) == 0, proc.output


def test_an_ms_worker_ip_this_worker_cannot_listen_on_is_a_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CLUSTER_ADVERTISE_HOST", raising=False)
    monkeypatch.setenv("MS_WORKER_IP", "192.0.2.7")  # TEST-NET-1: no host's own address
    with pytest.raises(ConfigError) as refused:
        make_identity("0", "127.0.0.1", 1)
    assert str(refused.value).startswith(
        "MS_WORKER_IP '192.0.2.7' is not an address of this host: this worker listens on"
    ), refused.value
