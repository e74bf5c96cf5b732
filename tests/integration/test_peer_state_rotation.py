"""A worker's state server follows its TLS files as the scheduler does: a p12 renewed on disk
is what new connections get, with real handshakes and real fetches on loopback; files that do
not check out leave the last good certificate in use, said in one line; a CRL renewed on disk
refuses the next call of a certificate it revokes.

Each test makes its own PKI (it replaces files in it) with cluster.certs; no key is committed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.protocol.config import TLSOptions
from cluster.transport import certs, tls
from cluster.worker import state_fetch
from cluster.worker.session import BackgroundLoop
from tests.integration.test_tls import pem_files
from tests.integration.test_tls_rotation import renew, served
from tests.unit.test_peer_state import Served, saved, state, wanted

CHANGED = "state server: the TLS files changed: new connections get server_cert_path"
KEPT = "new connections still get the previous certificate"


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-peer-state-rotation")
    yield background
    background.stop()


class Peer:
    """A member's side: fetches rank 1's state from `server`, and the serial of the certificate
    a new handshake with it sees."""

    def __init__(self, loop: BackgroundLoop, pki: certs.Pki, server: Served, tmp: Path) -> None:
        self.loop = loop
        self.pki = pki
        self.server = server
        self.pem = pem_files(pki.client_p12, pki.client_password, tmp)
        identity = tls.load_identity(TLSOptions(pki.ssl_json), server=False)
        # The job's server certificate names the scheduler (`localhost` here), not the peer.
        self.client = state_fetch.Client(identity, "localhost")
        self.dest = tmp / "newcomer" / "net.ckpt"
        self.dest.parent.mkdir()

    def fetch(self) -> str | None:
        """None when the whole state came, else why not."""
        try:
            state_fetch.fetch(self.loop, [self.server.holder], wanted(), self.dest, self.client)
        except state_fetch.NotFetched as exc:
            return str(exc)
        self.dest.unlink()
        return None

    async def serial(self) -> int | str:
        return await asyncio.to_thread(served, self.server.server.port, self.pki, self.pem)


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_a_state_server_serves_a_p12_renewed_after_its_certificate_expired(
    loop: BackgroundLoop, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server starts with a certificate that expires within seconds; once it has, a peer's
    fetch fails its handshake; the p12 renewed on disk (renamed into place) is what the next
    handshake sees, and the peer's fetch succeeds, without a restart."""
    pki = certs.make_pki(tmp_path / "pki")
    ends = certs.now_utc().replace(microsecond=0) + dt.timedelta(seconds=3)
    first = renew(pki, certs.Validity(not_after=ends))
    caplog.set_level(logging.INFO, logger="cluster")
    saved(tmp_path / "peer", 2, state())
    identity = tls.load_identity(TLSOptions(pki.ssl_json), server=True)
    server = Served(loop, tmp_path / "peer", 2, identity)
    try:
        peer = Peer(loop, pki, server, tmp_path)
        assert await peer.serial() == first
        assert await asyncio.to_thread(peer.fetch) is None
        left_s = (ends - certs.now_utc()).total_seconds()
        await asyncio.sleep(max(left_s, 0) + 1.0)  # sleep-ok: the certificate's expiry is the fault
        assert "certificate has expired" in str(await peer.serial())
        assert await asyncio.to_thread(peer.fetch) is not None

        second = renew(pki)
        assert second != first
        assert await peer.serial() == second
        assert await asyncio.to_thread(peer.fetch) is None
        assert server.server.sent == 2
    finally:
        server.close()
    [line] = lines(caplog, CHANGED)  # one reload, however many connections
    assert f"serial {second:#x}" in line


async def test_a_broken_p12_leaves_the_state_server_on_its_last_good_certificate(
    loop: BackgroundLoop, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Half a p12 (a copy caught in the middle), then one of another password: the server
    keeps serving the certificate it had, says so in one line per version of the file naming
    the file and what is wrong, and takes the next good p12."""
    pki = certs.make_pki(tmp_path / "pki")
    caplog.set_level(logging.WARNING, logger="cluster")
    saved(tmp_path / "peer", 2, state())
    identity = tls.load_identity(TLSOptions(pki.ssl_json), server=True)
    first = identity.cert.serial_number
    good = pki.server_p12.read_bytes()
    server = Served(loop, tmp_path / "peer", 2, identity)
    try:
        peer = Peer(loop, pki, server, tmp_path)
        certs.write_private(pki.server_p12, good[: len(good) // 2])
        assert await peer.serial() == first
        assert await asyncio.to_thread(peer.fetch) is None
        assert await peer.serial() == first
        [line] = lines(caplog, KEPT)
        assert line.startswith(f"state server: server_cert_path {pki.server_p12} is cut short: ")
        assert f"serial {first:#x}, valid until" in line

        key, cert = certs.issue(pki.ca, "other password", server=True, names=certs.LOCAL_NAMES)
        certs.write_p12(pki.server_p12, key, cert, b"not the password", pki.ca)
        assert await peer.serial() == first
        assert await asyncio.to_thread(peer.fetch) is None
        line = lines(caplog, KEPT)[1]
        assert line.startswith(
            f"state server: wrong password for server_cert_path {pki.server_p12}"
        )

        renewed = renew(pki)
        assert await peer.serial() == renewed
        assert await asyncio.to_thread(peer.fetch) is None
    finally:
        server.close()
    assert len(lines(caplog, KEPT)) == 2


async def test_a_crl_renewed_on_disk_refuses_the_next_fetch_of_a_certificate_it_revokes(
    loop: BackgroundLoop, tmp_path: Path
) -> None:
    pki = certs.make_pki(tmp_path / "pki")
    saved(tmp_path / "peer", 2, state())
    identity = tls.load_identity(TLSOptions(pki.ssl_json), server=True)
    server = Served(loop, tmp_path / "peer", 2, identity)
    try:
        peer = Peer(loop, pki, server, tmp_path)
        assert await asyncio.to_thread(peer.fetch) is None
        member = tls.load_identity(TLSOptions(pki.ssl_json), server=False).cert
        renewed = pki.crl.with_name("crl.pem.new")
        renewed.write_bytes(certs.crl_pem(pki.ca, [member]))
        renewed.replace(pki.crl)
        why = await asyncio.to_thread(peer.fetch)
        assert why is not None
        assert "UNAUTHENTICATED" in why
        assert "revoked" in why
    finally:
        server.close()
