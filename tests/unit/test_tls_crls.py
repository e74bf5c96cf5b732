"""A CA bundle and its CRLs: every CA's certificates looked up in that CA's own CRL.

`ca_cert_path` may hold several CAs (while rotating), and `crl_path` then holds one CRL per CA,
PEM blocks one after the other. Every certificate and CRL is made here, by cluster.certs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import pkcs12

from cluster.protocol.config import TLSOptions
from cluster.protocol.errors import TLSConfigError
from cluster.transport import certs, tls

REVOKED = "is revoked (the CRL lists it)"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Pki:
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


def old_revoked(pki: certs.Pki) -> x509.Certificate:
    """The certificate the old CA's CRL (pki.crl) revokes."""
    _, cert, _ = pkcs12.load_key_and_certificates(
        pki.revoked_client_p12.read_bytes(), pki.client_password
    )
    assert cert is not None
    return cert


def rotation(pki: certs.Pki, tmp: Path, new: certs.Authority, crls: bytes) -> tuple[Path, Path]:
    """ssl.json of a bundle of pki's CA and `new`, with `crls` as its crl_path; and that file."""
    (tmp / "cas.pem").write_bytes(pki.ca_pem.read_bytes() + certs.cert_pem(new.cert))
    (tmp / "crls.pem").write_bytes(crls)
    config = certs.SslJson(
        server_cert_path=str(pki.server_p12),
        client_cert_path=str(pki.client_p12),
        ca_cert_path="cas.pem",
        crl_path="crls.pem",
        server_password_file=str(pki.server_password_file),
        client_password_file=str(pki.client_password_file),
    )
    (tmp / "ssl.json").write_text(config.text())
    return tmp / "ssl.json", tmp / "crls.pem"


def scheduler(config: Path) -> tls.Identity:
    return tls.load_identity(TLSOptions(config), server=True)


@pytest.mark.parametrize("same_name", [False, True], ids=["new CA", "new CA of the same name"])
def test_each_ca_of_a_bundle_has_its_certificates_looked_up_in_its_own_crl(
    pki: certs.Pki, tmp_path: Path, same_name: bool
) -> None:
    # A CA renewed under the same name (a new key) is a rotation as common as a new name.
    new = certs.new_ca() if same_name else certs.new_ca("the new CA")
    revoked = certs.issue(new, "revoked worker of the new CA", server=False)[1]
    good = certs.issue(new, "worker of the new CA", server=False)[1]
    crls = pki.crl.read_bytes() + certs.crl_pem(new, [revoked])
    check = tls.PeerCheck(scheduler(rotation(pki, tmp_path, new, crls)[0]))
    assert check.problem(revoked) == REVOKED  # in the second CRL of the file
    assert check.problem(old_revoked(pki)) == REVOKED  # in the first
    assert check.problem(good) is None
    assert check.problem(certs.issue(pki.ca, "worker of the old CA", server=False)[1]) is None


def test_a_worker_revoked_by_the_second_ca_stops_at_start(pki: certs.Pki, tmp_path: Path) -> None:
    new = certs.new_ca("the new CA")
    key, cert = certs.issue(new, "worker of the new CA", server=False)
    p12 = certs.write_p12(tmp_path / "w2.p12", key, cert, pki.client_password, new)
    config, _ = rotation(pki, tmp_path, new, pki.crl.read_bytes() + certs.crl_pem(new, [cert]))
    worker = config.with_name("worker.json")
    worker.write_text(config.read_text().replace(str(pki.client_p12), str(p12)))
    with pytest.raises(TLSConfigError, match=r"w2\.p12 .* is revoked: the CRL .*crls\.pem"):
        tls.load_identity(TLSOptions(worker), server=False)


def test_a_crl_block_no_ca_of_the_bundle_signed_is_refused_by_its_place(
    pki: certs.Pki, tmp_path: Path
) -> None:
    new = certs.new_ca("the new CA")
    stranger = certs.crl_pem(certs.new_ca("a stranger"), [])
    crls = pki.crl.read_bytes() + certs.crl_pem(new, []) + stranger
    with pytest.raises(
        TLSConfigError,
        match=r"crls\.pem is not signed by the CA in ca_cert_path: CRL block 3 of 3 \(its "
        r"issuer is CN=a stranger,.*\) is signed by none of its CAs",
    ):
        scheduler(rotation(pki, tmp_path, new, crls)[0])


def test_a_ca_of_the_bundle_without_a_crl_is_said_once_by_name(
    pki: certs.Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    new = certs.new_ca("the new CA")
    revoked = certs.issue(new, "revoked worker of the new CA", server=False)[1]
    caplog.set_level(logging.WARNING, logger="cluster.transport.tls")
    config, crls = rotation(pki, tmp_path, new, certs.crl_pem(new, [revoked]))
    check = tls.PeerCheck(scheduler(config))
    scheduler(config)  # a second identity of the process reads the same file
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "holds no CRL of the CA CN=cluster test CA,O=cluster test PKI" in said[0]
    assert "not checked for revocation" in said[0]
    assert check.problem(revoked) == REVOKED
    # The old CA's CRL added to the file: its certificates are checked from the next call on.
    crls.write_bytes(crls.read_bytes() + pki.crl.read_bytes())
    os.utime(crls, ns=(1, 1))  # a new stamp even within the filesystem's time resolution
    assert check.problem(old_revoked(pki)) == REVOKED
    assert len(caplog.records) == 1


def test_a_der_crl_and_a_file_of_no_crl(pki: certs.Pki, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    der = x509.load_pem_x509_crl(pki.crl.read_bytes()).public_bytes(serialization.Encoding.DER)
    new = certs.new_ca("the new CA")
    check = tls.PeerCheck(scheduler(rotation(pki, tmp_path, new, der)[0]))
    assert check.problem(old_revoked(pki)) == REVOKED
    with pytest.raises(TLSConfigError, match=r"crls\.pem is not a CRL \(PEM or DER expected\)"):
        scheduler(rotation(pki, tmp_path, new, certs.cert_pem(new.cert))[0])
