"""What a certificate of the job is checked against: the CA bundle (`ca_cert_path`) and the CRL
(`crl_path`), and the checks of dates, key sizes and signatures that both TLS sides share.

`cluster.transport.tls` builds identities on these; a running server asks `Revocation` on every
call. Like that module it never imports grpc, and imports cryptography only where a certificate
is read, so that a job without TLS never does.
"""

from __future__ import annotations

import datetime as dt
import logging
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


def file_state(path: Path) -> tuple[int, int]:
    try:
        info = path.stat()
    except OSError:
        return (-1, -1)
    return (info.st_mtime_ns, info.st_size)


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


class Revocation:
    """A CRL signed by the CA, read again when its file changes, so that a revocation takes
    effect on the next call without a restart. A changed file that does not check out is
    reported and the last good list stays in force."""

    def __init__(self, path: Path, cas: tuple[x509.Certificate, ...]) -> None:
        self.path = path
        self._cas = cas
        self._stamp = file_state(self.path)
        self.crl = self._load()

    def _load(self) -> x509.CertificateRevocationList:
        from cryptography import x509  # noqa: PLC0415 - TLS only

        data = read_file(self.path, "crl_path")
        try:
            crl = x509.load_pem_x509_crl(data)
        except ValueError:
            try:
                crl = x509.load_der_x509_crl(data)
            except ValueError:
                raise TLSConfigError(
                    f"crl_path {self.path} is not a CRL (PEM or DER expected)"
                ) from None
        if not any(
            ca.subject == crl.issuer and crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
            for ca in self._cas
        ):
            raise TLSConfigError(
                f"crl_path {self.path} is not signed by the CA in ca_cert_path (its issuer is "
                f"{crl.issuer.rfc4514_string()})"
            )
        return crl

    def current(self) -> x509.CertificateRevocationList:
        stamp = file_state(self.path)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.crl = self._load()
                log.info("reloaded the CRL %s", self.path)
            except TLSConfigError as exc:
                log.warning("%s; the previous CRL stays in force", exc)
        return self.crl

    def revoked(self, cert: x509.Certificate) -> bool:
        crl = self.current()
        return (
            crl.issuer == cert.issuer
            and crl.get_revoked_certificate_by_serial_number(cert.serial_number) is not None
        )
