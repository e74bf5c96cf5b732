"""`mscluster status` (and `--watch`) and `mscluster events --addr` against real schedulers: a
scheduler whose certificate the reader's CRL revokes is refused before any read; a scheduler
that refuses the reader's certificate is not reported as a job-secret problem; a plaintext
reader of a TLS scheduler is told so on every path; an IPv6 --addr without brackets; a
followed scheduler that goes silent (SIGSTOP) is found by gRPC's pings."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from cluster.protocol.errors import SchedulerUnreachableError
from cluster.protocol.events import JobEvent
from cluster.testing import Process, free_port
from cluster.tools import events
from cluster.transport import certs
from tests.integration.test_tls import EXAMPLE, variant
from tests.procs import Procs, job_env, mscluster

# Every read below is one command: the scheduler waits this long for its workers, well past.
TOPO_S = "120"
READS = (
    ("status",),
    ("status", "--watch", "--interval", "0.2"),
    ("events",),
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


def scheduler(processes: Procs, config: Path | None, host: str = "127.0.0.1") -> Process:
    port = free_port()
    tls = {} if config is None else {"CLUSTER_TLS_CONFIG": str(config)}
    env = job_env(1, port, MS_TOPO_TIMEOUT=TOPO_S, MS_SCHED_HOST=host, **tls)
    sched = processes.start_role("scheduler", "MS_SCHED", EXAMPLE, env)
    sched.wait_for_output("listening on", 20)
    sched.port = port  # type: ignore[attr-defined]
    return sched


def read(what: tuple[str, ...], addr: str, config: Path | None) -> tuple[int, list[str]]:
    """The read `what` of the job at `addr` run to its end: its exit code, its stderr lines."""
    tls = () if config is None else ("--tls-config", str(config))
    done = mscluster(*what, "--addr", addr, *tls, secret_file=None, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr.strip().splitlines()


def revoked_scheduler(processes: Procs, pki: certs.Pki, tmp: Path) -> tuple[Process, Path]:
    """A scheduler serving a certificate of the job's CA that the reader's CRL revokes (an
    impostor holding a revoked key), and the reader's TLS config with that CRL."""
    key, cert = certs.issue(pki.ca, "revoked scheduler", server=True, names=certs.LOCAL_NAMES)
    p12 = certs.write_p12(tmp / "server.p12", key, cert, pki.server_password, pki.ca)
    crl = tmp / "crl.pem"
    crl.write_bytes(certs.crl_pem(pki.ca, [cert]))
    sched_cfg = variant(pki, tmp, "sched", server_cert_path=p12, crl_path=None)
    return scheduler(processes, sched_cfg), variant(pki, tmp, "reader", crl_path=crl)


@pytest.mark.parametrize("what", READS, ids=" ".join)
def test_a_scheduler_with_a_revoked_certificate_is_refused(
    processes: Procs, pki: certs.Pki, tmp_path: Path, what: tuple[str, ...]
) -> None:
    sched, reader_cfg = revoked_scheduler(processes, pki, tmp_path)
    code, lines = read(what, f"127.0.0.1:{sched.port}", reader_cfg)  # type: ignore[attr-defined]
    assert code != 0
    assert len(lines) == 1, lines
    assert "is refused: its certificate (subject CN=revoked scheduler" in lines[0], lines
    assert "is revoked" in lines[0], lines


@pytest.mark.parametrize("what", [("status",), ("events",)], ids=" ".join)
def test_a_refused_reader_certificate_is_not_called_a_secret_problem(
    processes: Procs, pki: certs.Pki, tmp_path: Path, what: tuple[str, ...]
) -> None:
    # The job has no secret at all; the reader has no CRL, so only the scheduler knows.
    sched = scheduler(processes, pki.ssl_json)
    reader_cfg = variant(
        pki, tmp_path, "reader", client_cert_path=pki.revoked_client_p12, crl_path=None
    )
    code, lines = read(what, f"127.0.0.1:{sched.port}", reader_cfg)  # type: ignore[attr-defined]
    assert code == 2
    assert len(lines) == 1, lines
    assert "refused this reader: this node's certificate" in lines[0], lines
    assert "is revoked" in lines[0], lines
    assert "secret" not in lines[0], lines


@pytest.mark.parametrize("what", READS, ids=" ".join)
def test_a_plaintext_reader_of_a_tls_scheduler_is_told_so(
    processes: Procs, pki: certs.Pki, what: tuple[str, ...]
) -> None:
    sched = scheduler(processes, pki.ssl_json)
    addr = f"127.0.0.1:{sched.port}"  # type: ignore[attr-defined]
    # `status` asks two schedulers (the standby setup): the second is not there at all.
    addrs = f"{addr},127.0.0.1:{free_port()}" if what == ("status",) else addr
    code, lines = read(what, addrs, None)
    assert code == 2
    assert len(lines) == 1, lines
    # What a reader does about it: not a worker's remedy (CLUSTER_TLS_CONFIG at its start,
    # or cluster.set_ps_context before cluster.init()).
    assert lines[0].endswith(
        "uses TLS and this reader does not: give it --tls-config naming the job's ssl.json "
        "(or set CLUSTER_TLS_CONFIG)"
    ), lines


@pytest.mark.parametrize("what", READS, ids=" ".join)
def test_a_tls_reader_of_a_plaintext_scheduler_is_told_so(
    processes: Procs, pki: certs.Pki, what: tuple[str, ...]
) -> None:
    sched = scheduler(processes, None)
    code, lines = read(what, f"127.0.0.1:{sched.port}", pki.ssl_json)  # type: ignore[attr-defined]
    assert code == 2
    assert len(lines) == 1, lines
    assert f"does not use TLS, but this reader does (TLS config {pki.ssl_json})" in lines[0]
    assert lines[0].endswith(
        "leave out --tls-config (and CLUSTER_TLS_CONFIG): this job has no TLS"
    ), lines


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_an_ipv6_addr_with_or_without_brackets(processes: Procs) -> None:
    sched = scheduler(processes, None, host="::1")
    port = sched.port  # type: ignore[attr-defined]
    for addr in (f"::1:{port}", f"[::1]:{port}"):
        done = mscluster("status", "--addr", addr, secret_file=None, timeout=60)
        assert done.returncode == 0, (addr, done.stderr)
        assert f"at [::1]:{port}" in done.stdout, done.stdout


async def test_a_followed_scheduler_that_goes_silent_is_found(processes: Procs) -> None:
    # SIGSTOP: the scheduler answers nothing, and its connections stay open (as with a host
    # that lost power, or a partition); only gRPC's pings can find it.
    sched = scheduler(processes, None)
    stream = events.from_scheduler(
        f"127.0.0.1:{sched.port}",  # type: ignore[attr-defined]
        None,
        follow=True,
        reconnect_s=0.0,
        secret=None,
        keepalive_s=1.0,
    )
    first = await asyncio.wait_for(anext(stream), 20)  # the stream is open
    assert first.kind
    sched.signal(signal.SIGSTOP)
    try:
        with pytest.raises(SchedulerUnreachableError, match="no scheduler answers at"):
            await asyncio.wait_for(_drain(stream), 30)
    finally:
        sched.signal(signal.SIGCONT)


async def _drain(stream: AsyncGenerator[JobEvent, None]) -> None:
    async for _ in stream:
        pass
