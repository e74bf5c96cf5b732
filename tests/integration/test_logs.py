"""What the logs of a job hold: the job's own lines, not gRPC's chatter.

gRPC logs every refused TLS handshake at INFO (`ssl_transport_security.cc ... Handshake failed`)
unless GRPC_VERBOSITY says otherwise; `cluster` makes ERROR the default, so a scheduler probed
in plaintext keeps a clean log, and GRPC_VERBOSITY=INFO still shows them. (That a job failing
without recovery leaves no traceback in any log, test_launcher.py's SIGKILL test reads.)
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cluster.testing import free_port
from cluster.transport import certs
from tests.procs import ROOT, Procs, job_env

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
