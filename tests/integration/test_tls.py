"""Mutual TLS with real handshakes: jobs, refusals on both sides, cipher and version limits.

Certificates are made by cluster.certs in tmp directories; no key is committed. Processes are
started like MindSpore's launch loop (see test_launch.py), with the CLUSTER_TLS_* environment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from cluster.protocol.config import TLSOptions
from cluster.protocol.environment import from_env
from cluster.protocol.errors import AccessDeniedError, ClusterError, CollectiveError, TLSConfigError
from cluster.scheduler import JobSettings, SchedulerServer
from cluster.testing import Process, free_port
from cluster.transport import certs
from cluster.transport.tls import load_identity
from cluster.worker.agent import WorkerAgent
from cluster.worker.identity import NodeIdentity, new_incarnation
from tests.aio import eventually
from tests.procs import ROOT, Procs, example_error_line, job_env

EXAMPLE = [str(ROOT / "examples" / "allgather_check.py")]
LINE = re.compile(r"^allgather rank=(\d+) size=(\d+) result=(\[.*\])$", re.MULTILINE)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
LISTED = "ECDHE-ECDSA-AES256-GCM-SHA384"
NOT_LISTED = "ECDHE-ECDSA-AES128-GCM-SHA256"  # in gRPC's default list: the config must win


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


def variant(pki: certs.Pki, tmp: Path, name: str, **changes: Any) -> Path:
    """A copy of pki's ssl.json with `changes` (None drops a key), written to tmp/name.json."""
    data = json.loads(pki.ssl_json.read_text())
    for key, value in data.items():
        if key.endswith(("_path", "_file")) and value:
            data[key] = str(pki.dir / value)
    data.update({k: str(v) if isinstance(v, Path) else v for k, v in changes.items()})
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def tls_env(n: int, port: int, config: Path | None, **extra: str) -> dict[str, str]:
    tls = {} if config is None else {"CLUSTER_TLS_CONFIG": str(config)}
    return job_env(n, port, MS_TOPO_TIMEOUT="20", **tls, **extra)


def start_scheduler(processes: Procs, n: int, config: Path | None, **extra: str) -> Process:
    port = free_port()
    sched = processes.start_role(
        "scheduler", "MS_SCHED", EXAMPLE, tls_env(n, port, config, **extra)
    )
    sched.wait_for_output("listening on", 20)
    sched.port = port  # type: ignore[attr-defined]
    return sched


def start_worker(
    processes: Procs, sched: Process, n: int, config: Path | None, name: str
) -> Process:
    env = tls_env(n, sched.port, config)  # type: ignore[attr-defined]
    return processes.start_role(name, "MS_WORKER", EXAMPLE, env)


def one_line(proc: Process) -> str:
    """The process's output is one `cluster: ...` line (and maybe waiting notes): return it."""
    assert "Traceback" not in proc.output, proc.output
    lines = [ln for ln in proc.output.splitlines() if ln.startswith("cluster: ")]
    assert len(lines) == 1, proc.output
    return lines[0]


def pem_bytes(p12: Path, password: bytes) -> bytes:
    """The p12's key and certificate as one PEM text (key first), read in memory."""
    key, cert, _ = pkcs12.load_key_and_certificates(p12.read_bytes(), password)
    assert key is not None
    assert cert is not None
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ) + cert.public_bytes(serialization.Encoding.PEM)


def pem_files(p12: Path, password: bytes, tmp: Path) -> Path:
    """The p12's key and certificate as one PEM file, for openssl and Python's ssl."""
    path = tmp / f"{p12.stem}.pem"
    path.write_bytes(pem_bytes(p12, password))
    return path


def handshake(port: int, ca: Path, cert_pem: Path | None) -> str | None:
    """None when the scheduler takes the connection (answers HTTP/2), else why it did not."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    context.set_alpn_protocols(["h2"])
    if cert_pem is not None:
        context.load_cert_chain(cert_pem)
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
        ):
            conn.sendall(PREFACE)
            head = conn.recv(9)
    except (ssl.SSLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if head[3:4] == b"\x04" else f"closed after the handshake ({head!r})"


def expired_p12(pki: certs.Pki, tmp: Path, *, server: bool) -> Path:
    start = certs.now_utc() - dt.timedelta(days=30)
    key, cert = certs.issue(
        pki.ca,
        "expired",
        server=server,
        names=certs.LOCAL_NAMES,
        validity=certs.Validity(days=10, not_before=start),
    )
    password = pki.server_password if server else pki.client_password
    return certs.write_p12(tmp / f"expired-{server}.p12", key, cert, password, pki.ca)


def finish_job(processes: Procs, sched: Process, n: int, config: Path) -> None:
    workers = [start_worker(processes, sched, n, config, f"good{i}") for i in range(n)]
    for w in workers:
        assert w.wait(30) == 0, w.output
    assert sched.wait(30) == 0, sched.output
    ranks = sorted(int(LINE.search(w.output).group(1)) for w in workers)  # type: ignore[union-attr]
    assert ranks == list(range(n))


# -- jobs --------------------------------------------------------------------------------------


def test_tls_job_of_four_workers_runs_to_the_end(processes: Procs, pki: certs.Pki) -> None:
    sched = start_scheduler(processes, 4, pki.ssl_json)
    assert "mutual TLS" in sched.output
    finish_job(processes, sched, 4, pki.ssl_json)
    for proc in processes.started:
        assert "Traceback" not in proc.output, proc.output


def test_scheduler_refuses_bad_clients_and_keeps_serving(
    processes: Procs, pki: certs.Pki, tmp_path: Path
) -> None:
    sched = start_scheduler(processes, 2, pki.ssl_json)
    port = sched.port  # type: ignore[attr-defined]

    plaintext = start_worker(processes, sched, 2, None, "plaintext")
    assert plaintext.wait(15) != 0  # well before MS_TOPO_TIMEOUT=20
    assert "uses TLS and this node does not" in one_line(plaintext)

    # The worker has no CRL, so only the scheduler can know the certificate is revoked.
    revoked_cfg = variant(
        pki, tmp_path, "revoked", client_cert_path=pki.revoked_client_p12, crl_path=None
    )
    revoked = start_worker(processes, sched, 2, revoked_cfg, "revoked")
    assert revoked.wait(15) != 0
    line = one_line(revoked)
    assert (
        "rejected registration: this node's certificate (subject CN=cluster worker (revoked)"
        in (line)
    )
    assert "is revoked" in line

    # Another CA's certificate, from a worker that trusts both CAs (so it trusts the scheduler).
    other = certs.new_ca("another CA")
    key, cert = certs.issue(other, "stranger", server=False)
    stranger_p12 = certs.write_p12(tmp_path / "stranger.p12", key, cert, pki.client_password)
    bundle = tmp_path / "both-cas.pem"
    bundle.write_bytes(pki.ca_pem.read_bytes() + certs.cert_pem(other.cert))
    stranger_cfg = variant(
        pki, tmp_path, "stranger", client_cert_path=stranger_p12, ca_cert_path=bundle, crl_path=None
    )
    stranger = start_worker(processes, sched, 2, stranger_cfg, "stranger")
    assert stranger.wait(15) != 0
    assert "did not accept this node's certificate" in one_line(stranger) or (
        "refused the TLS handshake" in one_line(stranger)
    )

    # Clients that are not `cluster` workers: no certificate, an expired one.
    assert handshake(port, pki.ca_pem, None) is not None
    expired = pem_files(expired_p12(pki, tmp_path, server=False), pki.client_password, tmp_path)
    assert handshake(port, pki.ca_pem, expired) is not None
    good = pem_files(pki.client_p12, pki.client_password, tmp_path)
    assert handshake(port, pki.ca_pem, good) is None

    finish_job(processes, sched, 2, pki.ssl_json)
    # Told as a refusal at the edge (at most once a minute for the address), never a traceback.
    assert re.search(r"refused a \w+ call from 127\.0\.0\.1: this node's certificate", sched.output)
    assert "Traceback" not in sched.output


@pytest.mark.parametrize("case", ["revoked", "other CA", "plaintext", "other CA, no CRL"])
def test_worker_refuses_a_bad_scheduler(
    processes: Procs, pki: certs.Pki, tmp_path: Path, case: str
) -> None:
    # With a CRL the worker checks the scheduler before its first call; without one, when a
    # call fails (a few seconds), and the message is the same.
    worker_cfg = (
        variant(pki, tmp_path, "no-crl", crl_path=None) if "no CRL" in case else pki.ssl_json
    )
    if case == "revoked":
        key, cert = certs.issue(pki.ca, "revoked scheduler", server=True, names=certs.LOCAL_NAMES)
        p12 = certs.write_p12(tmp_path / "server.p12", key, cert, pki.server_password, pki.ca)
        crl = tmp_path / "crl.pem"
        crl.write_bytes(certs.crl_pem(pki.ca, [cert]))
        sched_cfg: Path | None = variant(
            pki, tmp_path, "sched", server_cert_path=p12, crl_path=None
        )
        worker_cfg = variant(pki, tmp_path, "worker", crl_path=crl)
        expected = "is refused: its certificate (subject CN=revoked scheduler"
    elif case.startswith("other CA"):
        sched_cfg = certs.make_pki(tmp_path / "other").ssl_json
        expected = "its certificate does not check out against ca_cert_path"
    else:
        sched_cfg = None
        expected = "does not use TLS, but this node does"
    sched = start_scheduler(processes, 1, sched_cfg)
    worker = start_worker(processes, sched, 1, worker_cfg, "worker")
    assert worker.wait(15) != 0
    assert expected in one_line(worker)


# -- the TLS handshake itself ------------------------------------------------------------------


def openssl(port: int, tmp: Path, pki: certs.Pki, *args: str) -> str:
    cert = pem_files(pki.client_p12, pki.client_password, tmp)
    command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-alpn", "h2"]
    command += ["-CAfile", str(pki.ca_pem), "-cert", str(cert), "-key", str(cert), *args]
    result = subprocess.run(command, input=b"", capture_output=True, timeout=30, check=False)
    return (result.stdout + result.stderr).decode(errors="replace")


def openssl_has_tls1_1() -> bool:
    if shutil.which("openssl") is None:
        return False
    help_text = subprocess.run(
        ["openssl", "s_client", "-help"], capture_output=True, text=True, timeout=30, check=False
    )
    return "-tls1_1" in help_text.stdout + help_text.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_openssl_old_versions_and_unlisted_suites_fail_the_handshake(
    processes: Procs, pki: certs.Pki, tmp_path: Path
) -> None:
    config = variant(pki, tmp_path, "narrow", cipher_list=LISTED)
    # gRPC logs refused handshakes at INFO: they show the refusal was the scheduler's.
    sched = start_scheduler(processes, 1, config, GRPC_VERBOSITY="INFO")
    port = sched.port  # type: ignore[attr-defined]
    # The control: a TLS 1.2 client offering the listed suite gets it.
    assert f"Cipher is {LISTED}" in openssl(port, tmp_path, pki, "-tls1_2", "-cipher", LISTED)
    unlisted = openssl(port, tmp_path, pki, "-tls1_2", "-cipher", NOT_LISTED)
    assert "Cipher is (NONE)" in unlisted, unlisted
    if openssl_has_tls1_1():
        old = openssl(port, tmp_path, pki, "-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0")
        assert "Cipher is (NONE)" in old, old
    finish_job(processes, sched, 1, config)
    assert "NO_SHARED_CIPHER" in sched.output, sched.output
    if not openssl_has_tls1_1():
        pytest.skip("this openssl cannot speak TLS 1.1; the 1.2 checks passed")
    assert "UNSUPPORTED_PROTOCOL" in sched.output, sched.output


# -- start-up errors: one line -----------------------------------------------------------------


def bad_config(pki: certs.Pki, tmp: Path, case: str, server: bool) -> Path:
    key = "server" if server else "client"
    if case == "wrong password":
        wrong = tmp / "wrong.pass"
        wrong.write_text("not the password\n")
        return variant(pki, tmp, case, **{f"{key}_password_file": wrong})
    if case == "unknown cipher":
        return variant(pki, tmp, case, cipher_list="ECDHE-R SA-AES128-GCM-SHA256:" + LISTED)
    return variant(pki, tmp, case, **{f"{key}_cert_path": expired_p12(pki, tmp, server=server)})


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("wrong password", "cluster: TLSConfigError: wrong password for "),
        ("unknown cipher", "'ECDHE-R SA-AES128-GCM-SHA256' is not a cipher suite name"),
        ("expired", "has expired: it was valid until"),
    ],
)
@pytest.mark.parametrize("role", ["MS_WORKER", "MS_SCHED"])
def test_start_up_errors_are_one_clear_line(
    pki: certs.Pki, tmp_path: Path, case: str, expected: str, role: str
) -> None:
    config = bad_config(pki, tmp_path, case, server=role == "MS_SCHED")
    line = example_error_line({**tls_env(2, free_port(), config), "MS_ROLE": role})
    assert line.startswith("cluster: TLSConfigError: "), line
    assert expected in line, line


# -- in-process: the CRL on every call, expiry re-checks, the server name ----------------------


def settings(n: int) -> JobSettings:
    return JobSettings(
        worker_num=n, server_num=0, node_timeout_s=30, topo_timeout_s=60, heartbeat_interval_s=0.5
    )


def agent(port: int, config: Path, say: Callable[[str], None], **kw: Any) -> WorkerAgent:
    env = {**tls_env(1, port, config), "MS_ROLE": "MS_WORKER", **kw.pop("env", {})}
    identity = NodeIdentity(kw.pop("node_id", "w"), new_incarnation(), "127.0.0.1", 40000)
    on_fatal = kw.pop("on_fatal", lambda _: None)
    return WorkerAgent(from_env(env), identity, say=say, on_fatal=on_fatal, **kw)


async def test_a_certificate_revoked_while_running_is_refused_on_its_next_call(
    pki: certs.Pki, tmp_path: Path
) -> None:
    crl = tmp_path / "crl.pem"
    crl.write_bytes(certs.crl_pem(pki.ca, []))
    config = variant(pki, tmp_path, "live", crl_path=crl)
    identity = load_identity(TLSOptions(config), server=True)
    async with SchedulerServer(settings(1), tls=identity) as server:
        worker = agent(server.port, config, lambda _: None)
        await asyncio.wait_for(worker.start(), 20)
        await worker.kv_set("k", b"v")
        worker_cert = load_identity(TLSOptions(config), server=False).cert
        crl.write_bytes(certs.crl_pem(pki.ca, [worker_cert]))
        os.utime(crl, ns=(1, 1))  # a new stamp even within the filesystem's time resolution
        with pytest.raises(CollectiveError, match=r"this node's certificate .* is revoked"):
            await worker.kv_set("k", b"v2")
        await worker.close()


async def test_a_certificate_revoked_while_only_heartbeating_fails_the_node_saying_so(
    pki: certs.Pki, tmp_path: Path
) -> None:
    """A worker that makes no call but its heartbeats: the scheduler refuses them, and the
    worker fails with the scheduler's words, not, a node timeout later, as one hung or cut off
    (the job of two would fail with "no heartbeat for 3.0 s")."""
    crl = tmp_path / "crl.pem"
    crl.write_bytes(certs.crl_pem(pki.ca, []))
    key, cert = certs.issue(pki.ca, "worker a", server=False)
    p12 = certs.write_p12(tmp_path / "a.p12", key, cert, pki.client_password, pki.ca)
    revoked = variant(pki, tmp_path, "a", client_cert_path=p12, crl_path=crl)
    config = variant(pki, tmp_path, "b", crl_path=crl)
    identity = load_identity(TLSOptions(config), server=True)
    job = dataclasses.replace(settings(2), node_timeout_s=3.0)
    async with SchedulerServer(job, tls=identity) as server:
        fatal: list[ClusterError] = []
        env = {"MS_WORKER_NUM": "2", "MS_NODE_TIMEOUT": "3"}
        a = agent(server.port, revoked, lambda _: None, env=env, node_id="a", on_fatal=fatal.append)
        b = agent(server.port, config, lambda _: None, env=env, node_id="b")
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), 20)
        crl.write_bytes(certs.crl_pem(pki.ca, [cert]))
        os.utime(crl, ns=(1, 1))  # a new stamp even within the filesystem's time resolution
        await eventually(lambda: bool(fatal), "worker a's failure", 10)
        assert isinstance(fatal[0], AccessDeniedError), fatal
        assert re.fullmatch(
            r"heartbeat refused by the scheduler: this node's certificate \(.*\) is revoked "
            r".*: use a valid certificate of the job's CA",
            str(fatal[0]),
        ), fatal
        await asyncio.gather(a.close(), b.close())


async def test_expiry_is_rechecked_while_running(
    pki: certs.Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def soon(server: bool) -> Path:
        key, cert = certs.issue(
            pki.ca, "soon", server=server, names=certs.LOCAL_NAMES, validity=certs.Validity(20)
        )
        password = pki.server_password if server else pki.client_password
        return certs.write_p12(tmp_path / f"soon-{server}.p12", key, cert, password, pki.ca)

    config = variant(
        pki, tmp_path, "soon", server_cert_path=soon(True), client_cert_path=soon(False)
    )
    identity = load_identity(TLSOptions(config), server=True)
    said: list[str] = []
    caplog.set_level(logging.WARNING, logger="cluster.scheduler")
    server = SchedulerServer(settings(1), tls=identity, expiry_check_period_s=0.02)
    async with server:
        worker = agent(server.port, config, said.append, expiry_check_period_s=0.02)
        await asyncio.wait_for(worker.start(), 20)

        def scheduler_warnings() -> int:
            return sum("server_cert_path" in r.getMessage() for r in caplog.records)

        # One warning at start and then one per period, on both sides.
        await eventually(lambda: scheduler_warnings() >= 3, "three scheduler warnings", 10)
        await eventually(
            lambda: sum("client_cert_path" in s for s in said) >= 3, "three client warnings", 10
        )
        await worker.close()
    assert all("expires in 19 days" in s for s in said if "client_cert_path" in s)


async def test_server_name_override(pki: certs.Pki, tmp_path: Path) -> None:
    key, cert = certs.issue(pki.ca, "named", server=True, names=["sched.example"])
    p12 = certs.write_p12(tmp_path / "named.p12", key, cert, pki.server_password, pki.ca)
    config = variant(pki, tmp_path, "named", server_cert_path=p12)
    async with SchedulerServer(
        settings(1), tls=load_identity(TLSOptions(config), server=True)
    ) as s:
        stray = agent(s.port, config, lambda _: None)
        with pytest.raises(
            TLSConfigError, match=r"does not name '127\.0\.0\.1'.*CLUSTER_TLS_SERVER_NAME"
        ):
            await asyncio.wait_for(stray.start(), 20)
        await stray.close()
        named = agent(
            s.port, config, lambda _: None, env={"CLUSTER_TLS_SERVER_NAME": "sched.example"}
        )
        topology = await asyncio.wait_for(named.start(), 20)
        assert topology.size == 1
        await named.close()
