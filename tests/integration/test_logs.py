"""What the logs of a job hold: the job's own lines, not gRPC's chatter or Python's tracebacks.

- gRPC logs every refused TLS handshake at INFO (`ssl_transport_security.cc ... Handshake
  failed`) unless GRPC_VERBOSITY says otherwise; `cluster` makes ERROR the default, so a
  scheduler probed in plaintext keeps a clean log, and GRPC_VERBOSITY=INFO still shows them.
- A job that fails without recovery (a worker SIGKILLed under `mscluster run`) leaves one
  failure line per process: no traceback, no `CancelledError`, no "never awaited" warning.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from cluster.tools.testing import wait_until
from cluster.transport import certs
from tests.procs import PYTHON, ROOT, Proc, Procs, free_port, job_env

EXAMPLE = [str(ROOT / "examples" / "allgather_check.py")]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
GRPC_HANDSHAKE_LINE = "ssl_transport_security"


def without_verbosity(env: dict[str, str]) -> dict[str, str]:
    """`env` as a user who set no GRPC_VERBOSITY has it (this test process's own was set when
    it imported cluster, and job_env copies it)."""
    return {k: v for k, v in env.items() if k != "GRPC_VERBOSITY"}


def plaintext_knock(port: int) -> None:
    """An HTTP/2 client without TLS: the scheduler's TLS handshake fails on it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(PREFACE)
        while sock.recv(4096):
            pass


@pytest.mark.parametrize("verbosity", ["", "INFO"], ids=["default", "GRPC_VERBOSITY=INFO"])
def test_refused_tls_handshakes_stay_out_of_the_log_unless_asked_for(
    processes: Procs, tmp_path: Path, verbosity: str
) -> None:
    pki = certs.make_pki(tmp_path / "pki")
    port = free_port()
    tls = {"CLUSTER_TLS_CONFIG": str(pki.ssl_json), "MS_TOPO_TIMEOUT": "30"}
    env = without_verbosity(job_env(1, port, **tls))
    if verbosity:
        env["GRPC_VERBOSITY"] = verbosity
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, env)
    sched.wait_for_output("listening on", 30)
    for _ in range(3):
        plaintext_knock(port)
    worker = processes.start_role("worker", "MS_WORKER", EXAMPLE, env)
    assert worker.wait(30) == 0, worker.output
    assert sched.wait(30) == 0, sched.output
    if verbosity:
        assert GRPC_HANDSHAKE_LINE in sched.output  # the control: the knocks were logged
    else:
        assert GRPC_HANDSHAKE_LINE not in sched.output, sched.output
        assert GRPC_HANDSHAKE_LINE not in worker.output


def test_a_job_failing_without_recovery_leaves_no_traceback(
    processes: Procs, tmp_path: Path
) -> None:
    port = free_port()
    logs = tmp_path / "logs"
    run = processes.start(
        "run",
        [
            PYTHON,
            "-m",
            "cluster",
            "run",
            "--worker-num",
            "3",
            "--master-port",
            str(port),
            "--log-dir",
            str(logs),
            *EXAMPLE,
            "--hold",
            "60",
        ],
        without_verbosity({k: v for k, v in os.environ.items() if not k.startswith("MS_")}),
    )
    wait_until(
        lambda: all("allgather rank=" in read(logs / f"worker_{i}.log") for i in range(3)),
        60,
        "every worker in the job",
    )
    status = subprocess.run(
        [PYTHON, "-m", "cluster", "status", "--json", "--addr", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    victim = worker_pid(run, 1)
    os.kill(victim, signal.SIGKILL)
    assert run.wait(30) == 1, run.output
    scheduler_log = read(logs / "scheduler.log")
    assert "job failed: rank 1" in scheduler_log
    for name in ("scheduler", "worker_0", "worker_2"):
        text = read(logs / f"{name}.log")
        for unwanted in ("Traceback", "CancelledError", "never awaited", GRPC_HANDSHAKE_LINE):
            assert unwanted not in text, f"{name}.log:\n{text}"
    assert '"phase": "ready"' in status.stdout


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def worker_pid(run: Proc, node_id: int) -> int:
    """The pid of the launcher's worker with MS_NODE_ID=node_id."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == run.pid and f"MS_NODE_ID={node_id}\0".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with MS_NODE_ID={node_id} under the launcher {run.pid}")
