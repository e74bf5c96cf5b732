"""What a certificate of the job is checked against: the CA bundle (`ca_cert_path`) and the CRL
(`crl_path`), and the checks of dates, key sizes and signatures that both TLS sides share.

`cluster.transport.tls` builds identities on these; a running server asks `Revocation` on every
call. Like that module it never imports grpc, and imports cryptography only where a certificate
is read, so that a job without TLS never does.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.protocol.errors import TLSConfigError

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes

log = logging.getLogger("cluster.transport.tls")

MIN_RSA_BITS = 2048


def read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        problem = "does not exist" if isinstance(exc, FileNotFoundError) else "cannot be read"
        raise TLSConfigError(f"{what} {path} {problem} ({exc.strerror})") from None


def file_state(path: Path) -> tuple[int, int, int]:
    """What tells that a file changed: its modification time, size and inode (a file renamed
    into place is a new inode, even within the filesystem's time resolution)."""
    try:
        info = path.stat()
    except OSError:
        return (-1, -1, -1)
    return (info.st_mtime_ns, info.st_size, info.st_ino)


def describe(cert: x509.Certificate) -> str:
    return f"subject {cert.subject.rfc4514_string()}, serial {cert.serial_number:#x}"


def utc_date(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def check_dates(cert: x509.Certificate, what: str, now: dt.datetime) -> None:
    if now < cert.not_valid_before_utc:
        raise TLSConfigError(
            f"{what} is not yet valid: it is valid from {utc_date(cert.not_valid_before_utc)} "
            "(or this machine's clock is wrong)"
        )
    if now > cert.not_valid_after_utc:
        raise TLSConfigError(
            f"{what} has expired: it was valid until {utc_date(cert.not_valid_after_utc)}"
        )


def check_key_size(public_key: CertificatePublicKeyTypes, what: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: PLC0415 - TLS only

    if isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size < MIN_RSA_BITS:
        raise TLSConfigError(
            f"{what} has a {public_key.key_size}-bit RSA key, too weak: use at least "
            f"{MIN_RSA_BITS} bits"
        )


def signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    from cryptography.exceptions import InvalidSignature  # noqa: PLC0415 - TLS only

    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def chains_to(
    cert: x509.Certificate, extra: list[x509.Certificate], cas: tuple[x509.Certificate, ...]
) -> bool:
    """Whether `cert` leads to one of `cas`, directly or through intermediates in the p12."""
    current = cert
    for _ in range(len(extra) + 1):
        if any(signed_by(current, ca) for ca in cas):
            return True
        parent = next((c for c in extra if c != current and signed_by(current, c)), None)
        if parent is None:
            return False
        current = parent
    return False


def load_cas(path: Path, now: dt.datetime) -> tuple[x509.Certificate, ...]:
    from cryptography import x509  # noqa: PLC0415 - TLS only

    data = read_file(path, "ca_cert_path")
    try:
        cas = tuple(x509.load_pem_x509_certificates(data))
    except ValueError:
        try:
            cas = (x509.load_der_x509_certificate(data),)
        except ValueError:
            raise TLSConfigError(
                f"ca_cert_path {path} holds no certificate (PEM or DER expected)"
            ) from None
    for ca in cas:
        what = f"the CA certificate {describe(ca)} in {path}"
        check_dates(ca, what, now)
        check_key_size(ca.public_key(), what)
    return cas


# -- the CRL ---------------------------------------------------------------------------------


# A PEM CRL block; a file of several holds one per CA of the bundle (or more).
_PEM_CRL = re.compile(rb"-----BEGIN X509 CRL-----.+?-----END X509 CRL-----", re.DOTALL)
# The CAs already said to have no CRL, by CRL file, its stamp and the CA's fingerprint: said once
# per version of the file, however many identities of the process load it.
_said_uncovered: set[tuple[str, tuple[int, int, int], bytes]] = set()


@dataclass(frozen=True, eq=False)  # one object per version of the file: compared by identity
class Crls:
    """The CRLs of a crl_path, each with the CA of the bundle that signed it."""

    signed: tuple[tuple[x509.Certificate, x509.CertificateRevocationList], ...]

    def revoked(self, cert: x509.Certificate) -> bool:
        """Whether a CRL of the CA that issued `cert` lists it."""
        return any(
            crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None
            for ca, crl in self.signed
            if ca.subject == cert.issuer and signed_by(cert, ca)
        )

    def overdue(self, now: dt.datetime) -> list[x509.CertificateRevocationList]:
        """The CRLs past their next-update date."""
        return [
            crl
            for _, crl in self.signed
            if crl.next_update_utc is not None and crl.next_update_utc < now
        ]


class Revocation:
    """The CRLs of the CAs of the bundle, from one file (PEM blocks, one or more, or one DER
    CRL), read again when the file changes, so that a revocation takes effect on the next call
    without a restart. Each CRL must be signed by a CA of the bundle, and a certificate is
    looked up in the CRLs of the CA that issued it; a CA with no CRL in the file is said once
    (its certificates are not checked for revocation). A changed file that does not check out
    is reported and the last good lists stay in force."""

    def __init__(self, path: Path, cas: tuple[x509.Certificate, ...]) -> None:
        self.path = path
        self._cas = cas
        self._stamp = file_state(self.path)
        self.crls = self._load()

    def _load(self) -> Crls:
        from cryptography import x509  # noqa: PLC0415 - TLS only

        data = read_file(self.path, "crl_path")
        blocks = _PEM_CRL.findall(data)
        if not blocks:
            try:
                return self._signed([(x509.load_der_x509_crl(data), "the CRL")])
            except ValueError:
                raise TLSConfigError(
                    f"crl_path {self.path} is not a CRL (PEM or DER expected)"
                ) from None
        crls = []
        for n, block in enumerate(blocks, 1):
            which = "the CRL" if len(blocks) == 1 else f"CRL block {n} of {len(blocks)}"
            try:
                crls.append((x509.load_pem_x509_crl(block), which))
            except ValueError:
                raise TLSConfigError(f"crl_path {self.path}: {which} is not a valid CRL") from None
        return self._signed(crls)

    def _signed(self, crls: list[tuple[x509.CertificateRevocationList, str]]) -> Crls:
        """Each CRL with the CA that signed it; a TLSConfigError naming one that none did."""
        signed = []
        for crl, which in crls:
            ca = next((ca for ca in self._cas if _signed_crl(crl, ca)), None)
            if ca is None:
                issuer = crl.issuer.rfc4514_string()
                raise TLSConfigError(
                    f"crl_path {self.path} is not signed by the CA in ca_cert_path: {which} "
                    f"(its issuer is {issuer}) is signed by none of its CAs"
                )
            signed.append((ca, crl))
        self._say_uncovered({ca for ca, _ in signed})
        return Crls(tuple(signed))

    def _say_uncovered(self, covered: set[x509.Certificate]) -> None:
        from cryptography.hazmat.primitives import hashes  # noqa: PLC0415 - TLS only

        for ca in self._cas:
            key = (str(self.path), self._stamp, ca.fingerprint(hashes.SHA256()))
            if ca in covered or key in _said_uncovered:
                continue
            if len(_said_uncovered) > 1024:
                _said_uncovered.clear()
            _said_uncovered.add(key)
            log.warning(
                "crl_path %s holds no CRL of the CA %s of ca_cert_path: certificates of that CA "
                "are not checked for revocation; add its CRL to the file",
                self.path,
                ca.subject.rfc4514_string(),
            )

    def current(self) -> Crls:
        stamp = file_state(self.path)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.crls = self._load()
                log.info("reloaded the CRL %s", self.path)
            except TLSConfigError as exc:
                log.warning("%s; the previous CRL stays in force", exc)
        return self.crls

    def revoked(self, cert: x509.Certificate) -> bool:
        return self.current().revoked(cert)


def _signed_crl(crl: x509.CertificateRevocationList, ca: x509.Certificate) -> bool:
    return ca.subject == crl.issuer and crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
