"""A running scheduler's certificate renewed on disk: new connections get the new one, real
handshakes on loopback; files that do not check out leave the previous one in use.

Each test makes its own PKI (it replaces files in it) with cluster.certs; no key is committed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import socket
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from cluster.protocol.config import TLSOptions
from cluster.scheduler import SchedulerServer
from cluster.transport import certs, tls
from tests.aio import eventually
from tests.integration.test_tls import agent, pem_files, settings

RENEW = "renew the file: the scheduler picks it up for new connections"


def served(port: int, pki: certs.Pki, client_pem: Path) -> int | str:
    """The serial of the certificate the scheduler presents to a new connection, or why the
    handshake failed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(pki.ca_pem)
    context.load_cert_chain(client_pem)
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
        ):
            der = conn.getpeercert(binary_form=True)
    except (ssl.SSLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def renew(pki: certs.Pki, validity: certs.Validity = certs.Validity()) -> int:
    """A new server certificate in place of server.p12 (renamed into place, as a careful
    operator's tools do); its serial."""
    key, cert = certs.issue(
        pki.ca, "renewed scheduler", server=True, names=certs.LOCAL_NAMES, validity=validity
    )
    certs.write_p12(pki.server_p12, key, cert, pki.server_password, pki.ca)
    return cert.serial_number


async def test_an_expired_certificate_renewed_on_disk_is_served_to_new_connections(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = certs.make_pki(tmp_path / "pki")
    ends = certs.now_utc().replace(microsecond=0) + dt.timedelta(seconds=3)
    renew(pki, certs.Validity(not_after=ends))
    client = pem_files(pki.client_p12, pki.client_password, tmp_path)
    caplog.set_level(logging.INFO, logger="cluster")
    identity = tls.load_identity(TLSOptions(pki.ssl_json), server=True)
    async with SchedulerServer(settings(1), tls=identity, expiry_check_period_s=0.05) as server:
        first = await asyncio.to_thread(served, server.port, pki, client)
        assert first == identity.cert.serial_number
        said = [r.getMessage() for r in caplog.records if "expires in" in r.getMessage()]
        assert said[0].endswith(f"(cert_expire_warning_time_in_day=90): {RENEW}")
        left_s = (ends - certs.now_utc()).total_seconds()
        await asyncio.sleep(max(left_s, 0) + 1.0)  # sleep-ok: the certificate's expiry is the fault
        why = await asyncio.to_thread(served, server.port, pki, client)
        assert "certificate has expired" in str(why)
        assert any(
            f"has expired ({tls.utc_date(ends)}): {RENEW}" in r.getMessage() for r in caplog.records
        )

        serial = renew(pki)
        reloading = server.served
        assert reloading is not None
        # The daily check reads the files again too: it warns of the new one, not the old.
        await eventually(lambda: reloading.current.cert.serial_number == serial, "the reload")
        assert tls.expiry_warnings(reloading.current) == []
        assert await asyncio.to_thread(served, server.port, pki, client) == serial
        worker = agent(server.port, pki.ssl_json, lambda _: None)
        topology = await asyncio.wait_for(worker.start(), 20)
        assert topology.size == 1
        await worker.close()
    assert any(
        "the TLS files changed: new connections get server_cert_path" in r.getMessage()
        for r in caplog.records
    )


async def test_files_that_do_not_check_out_leave_the_previous_certificate_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = certs.make_pki(tmp_path / "pki")
    client = pem_files(pki.client_p12, pki.client_password, tmp_path)
    identity = tls.load_identity(TLSOptions(pki.ssl_json), server=True)
    first = identity.cert.serial_number
    caplog.set_level(logging.WARNING, logger="cluster")
    good = pki.server_p12.read_bytes()
    async with SchedulerServer(settings(1), tls=identity) as server:

        async def serial() -> int | str:
            return await asyncio.to_thread(served, server.port, pki, client)

        def kept() -> list[str]:
            return [
                r.getMessage() for r in caplog.records if "still get the previous" in r.getMessage()
            ]

        # Half of a p12, as a copy caught in the middle; then one with another password.
        certs.write_private(pki.server_p12, good[: len(good) // 2])
        assert await serial() == first
        assert await serial() == first
        [line] = kept()  # one line for that version of the file, however many connections
        assert f"server_cert_path {pki.server_p12} is cut short: " in line
        assert f"serial {first:#x}, valid until" in line
        key, cert = certs.issue(pki.ca, "other password", server=True, names=certs.LOCAL_NAMES)
        certs.write_p12(pki.server_p12, key, cert, b"not the password", pki.ca)
        assert await serial() == first
        assert f"wrong password for server_cert_path {pki.server_p12}" in kept()[1]
        # A certificate of another CA: the workers would refuse it.
        stranger = certs.new_ca("a stranger")
        key, cert = certs.issue(stranger, "stranger", server=True, names=certs.LOCAL_NAMES)
        certs.write_p12(pki.server_p12, key, cert, pki.server_password, stranger)
        assert await serial() == first
        assert "is not signed by the CA in ca_cert_path" in kept()[2]
        renewed = renew(pki)
        assert await serial() == renewed
    assert len(kept()) == 3
