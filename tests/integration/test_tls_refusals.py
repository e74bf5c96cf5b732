"""Calls refused for the client's certificate are refusals at the edge: every one counted, told
at a bounded rate, over real mutual-TLS connections to a scheduler on loopback.

Certificates are made by cluster.certs in tmp directories; no key is committed.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from cluster.protocol.config import TLSOptions
from cluster.protocol.events import JobEvent
from cluster.scheduler import JobSettings, SchedulerServer
from cluster.scheduler.refusals import INTERVAL_S, RefusalLimiter
from cluster.transport import certs
from cluster.transport.tls import load_identity
from cluster.v1 import scheduler_pb2 as pb
from cluster.v1 import scheduler_pb2_grpc as pb_grpc

CALLS = 400  # per wave, 100 at once
SETTINGS = JobSettings(
    worker_num=1, server_num=0, node_timeout_s=30, topo_timeout_s=60, heartbeat_interval_s=0.5
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


def credentials(pki: certs.Pki, p12: Path) -> grpc.ChannelCredentials:
    key, cert, _ = pkcs12.load_key_and_certificates(p12.read_bytes(), pki.client_password)
    assert key is not None
    assert cert is not None
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return grpc.ssl_channel_credentials(pki.ca_pem.read_bytes(), key_pem, certs.cert_pem(cert))


async def statuses(port: int, creds: grpc.ChannelCredentials, n: int) -> dict[str, int]:
    """The codes of `n` Status calls on one connection, 100 at a time."""
    codes: dict[str, int] = {}

    async def one(stub: pb_grpc.SchedulerStub) -> None:
        try:
            await stub.Status(pb.StatusRequest(), timeout=10)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        codes[code] = codes.get(code, 0) + 1

    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        for start in range(0, n, 100):
            await asyncio.gather(*(one(stub) for _ in range(min(100, n - start))))
    return codes


async def test_a_flood_of_calls_with_a_revoked_certificate_is_counted_and_told_once_a_minute(
    pki: certs.Pki, caplog: pytest.LogCaptureFixture
) -> None:
    server = SchedulerServer(SETTINGS, tls=load_identity(TLSOptions(pki.ssl_json), server=True))
    now = [1000.0]
    server.gate.refusals = RefusalLimiter(clock=lambda: now[0])
    caplog.set_level(logging.INFO)
    events: list[JobEvent] = []
    revoked = credentials(pki, pki.revoked_client_p12)
    async with server:
        server.core.journal.listeners.append(events.append)
        assert await statuses(server.port, revoked, CALLS) == {"UNAUTHENTICATED": CALLS}
        now[0] += INTERVAL_S  # a minute later, the same address again
        assert await statuses(server.port, revoked, CALLS) == {"UNAUTHENTICATED": CALLS}
    assert server.gate.refusals.counts[("Status", "revoked")] == 2 * CALLS
    told = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(told) == 2, told[:3]
    assert all("refused a Status call from 127.0.0.1: this node's certificate" in t for t in told)
    assert all("is revoked (the CRL lists it)" in t for t in told)
    assert told[1].endswith(f"({CALLS} refusals of this address since last told)")
    refused = [e.fields for e in events if e.kind == "refused"]
    assert [(f["method"], f["reason"], f["count"]) for f in refused] == [
        ("Status", "revoked", 1),
        ("Status", "revoked", CALLS),
    ]


async def test_a_valid_certificate_is_not_refused(pki: certs.Pki) -> None:
    identity = load_identity(TLSOptions(pki.ssl_json), server=True)
    async with SchedulerServer(SETTINGS, tls=identity) as server:
        assert await statuses(server.port, credentials(pki, pki.client_p12), 3) == {"OK": 3}
        assert not server.gate.refusals.counts
