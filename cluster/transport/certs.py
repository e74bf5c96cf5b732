"""A throwaway PKI for tests and first trials: a CA, PKCS#12 identities, a CRL and a ssl.json.

`make_pki(out_dir)` writes everything a TLS job needs (see certs/README.md); the functions below it
let tests make the odd certificates they need (expired, of another CA, revoked, weak keys).
Nothing here is for production: a real cluster's certificates come from the operator's own CA.
The CA's private key is returned to the caller but never written, so a generated directory
cannot be used to issue more certificates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import ipaddress
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import MAX_HOST_CHARS, shown

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey

# The names the scheduler is reached by on one machine; others are added with `hosts`.
LOCAL_NAMES = ("127.0.0.1", "::1", "localhost")
# gRPC's own default TLS 1.2 suites, all ECDHE AEAD: written out so the file shows the key, and
# chosen so that the generated config agrees with a process that imported grpc before `cluster`.
DEFAULT_CIPHER_LIST = (
    "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:"
    "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384"
)
DEFAULT_DAYS = 365
# Files make_pki writes; it refuses to overwrite them unless asked, so that a second run cannot
# silently replace a CA that other machines already trust.
PKI_FILES = (
    "ca.pem",
    "server.p12",
    "client.p12",
    "client-revoked.p12",
    "crl.pem",
    "server.pass",
    "client.pass",
    "ssl.json",
)


@dataclass(frozen=True)
class Authority:
    cert: x509.Certificate
    key: PrivateKey = field(repr=False)


@dataclass(frozen=True)
class Pki:
    """What make_pki wrote, and the CA key (in memory only) for tests that issue more."""

    dir: Path
    ssl_json: Path
    ca: Authority
    ca_pem: Path
    server_p12: Path
    client_p12: Path
    revoked_client_p12: Path
    crl: Path
    server_password_file: Path
    client_password_file: Path
    server_password: bytes = field(repr=False)
    client_password: bytes = field(repr=False)


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class Validity:
    """When a certificate is valid: from `not_before` (by default five minutes ago, so that a
    clock a little behind accepts it) for `days`, or until `not_after` when given."""

    days: int = DEFAULT_DAYS
    not_before: dt.datetime | None = None
    not_after: dt.datetime | None = None

    def span(self) -> tuple[dt.datetime, dt.datetime]:
        """Its first and last moment."""
        start = self.not_before
        if start is None:
            start = now_utc() - dt.timedelta(minutes=5)
        end = self.not_after if self.not_after is not None else start + dt.timedelta(self.days)
        return start, end


def new_key(kind: str = "ec", rsa_bits: int = 2048) -> PrivateKey:
    """An EC P-256 key (fast handshakes), or an RSA key of `rsa_bits`."""
    if kind == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    return rsa.generate_private_key(public_exponent=65537, key_size=rsa_bits)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cluster test PKI"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def new_ca(
    common_name: str = "cluster test CA",
    *,
    validity: Validity = Validity(),
    key: PrivateKey | None = None,
) -> Authority:
    key = key if key is not None else new_key()
    start, end = validity.span()
    name = _name(common_name)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage("digital_signature", "key_cert_sign", "crl_sign"), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


# A DNS name as a certificate holds it: ASCII labels of letters, digits, '-' and '_' (not at
# a label's ends), at most 63 characters each, separated by dots.
_DNS_NAME_RE = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def server_name(name: str, host: str) -> x509.GeneralName:
    """`host` as a server certificate names it: an IP address (an IPv6 one maybe in brackets,
    as the rest of the CLI takes it) or a DNS name of at most MAX_HOST_CHARS; else a
    ConfigError naming `name` (the option) and quoting `host`. Stricter than `check_host`: a
    certificate holds no %zone, and no ':' or brackets in a name."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        address = None
    if address is not None and not getattr(address, "scope_id", None):
        return x509.IPAddress(address)
    if bare == host and len(host) <= MAX_HOST_CHARS and _DNS_NAME_RE.fullmatch(host):
        return x509.DNSName(host)
    raise ConfigError(
        f"{name} {shown(host)} is neither an IP address nor a host name a certificate can hold: "
        "give an address (an IPv6 one maybe in [ ], without a %zone) or a name of at most "
        f"{MAX_HOST_CHARS} ASCII letters, digits, - and _ in labels of at most 63, separated by "
        "dots"
    )


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries = [server_name("a server certificate's name", name) for name in names]
    return x509.SubjectAlternativeName(list(dict.fromkeys(entries)))


def issue(
    ca: Authority,
    common_name: str,
    *,
    server: bool,
    names: Sequence[str] = (),
    validity: Validity = Validity(),
    key: PrivateKey | None = None,
) -> tuple[PrivateKey, x509.Certificate]:
    """A leaf certificate signed by `ca`: for a server (with SANs `names`) or a client."""
    key = key if key is not None else new_key()
    start, end = validity.span()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return key, builder.sign(ca.key, hashes.SHA256())


_KEY_USAGES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
    "encipher_only",
    "decipher_only",
)


def _key_usage(*allowed: str) -> x509.KeyUsage:
    """A key usage extension that allows `allowed` and nothing else."""
    return x509.KeyUsage(**{usage: usage in allowed for usage in _KEY_USAGES})


def p12_bytes(
    key: PrivateKey, cert: x509.Certificate, password: bytes | None, ca: Authority | None = None
) -> bytes:
    encryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    name = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return pkcs12.serialize_key_and_certificates(
        str(name).encode(), key, cert, [ca.cert] if ca is not None else None, encryption
    )


def write_p12(
    path: Path,
    key: PrivateKey,
    cert: x509.Certificate,
    password: bytes | None,
    ca: Authority | None = None,
) -> Path:
    write_private(path, p12_bytes(key, cert, password, ca))
    return path


def crl_pem(
    ca: Authority, revoked: Sequence[x509.Certificate], *, days: int = DEFAULT_DAYS
) -> bytes:
    now = now_utc() - dt.timedelta(minutes=5)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=days))
    )
    for cert in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(cert.serial_number)
            .revocation_date(now)
            .build()
        )
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` with a secret (p12, password) readable by its owner only, from the first
    byte on. The secret goes to a new file beside `path` (O_EXCL and O_NOFOLLOW, mode 0600: no
    file or link already there is opened), synced, then renamed over `path`: a file already at
    `path` keeps neither its place nor its mode, and a link there is replaced, not followed."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def new_password() -> bytes:
    return secrets.token_urlsafe(18).encode()


@dataclass(frozen=True)
class SslJson:
    """The fields of a ssl.json (docs/howto/tls.md); relative paths are taken from the file's
    directory, and a password file left out is not written."""

    server_cert_path: str
    client_cert_path: str
    ca_cert_path: str
    crl_path: str = ""
    cipher_list: str = DEFAULT_CIPHER_LIST
    cert_expire_warning_time_in_day: int = 90
    server_password_file: str | None = None
    client_password_file: str | None = None

    def text(self) -> str:
        """The file's text."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return json.dumps(data, indent=2) + "\n"


# The ssl.json that make_pki writes beside the files it names.
PKI_SSL_JSON = SslJson(
    server_cert_path="server.p12",
    client_cert_path="client.p12",
    ca_cert_path="ca.pem",
    crl_path="crl.pem",
    server_password_file="server.pass",  # noqa: S106 - a file name, not a password
    client_password_file="client.pass",  # noqa: S106 - a file name, not a password
)


def make_pki(
    out_dir: Path,
    *,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    overwrite: bool = False,
) -> Pki:
    """Write a CA, server/client/revoked-client p12 files, a CRL, passwords and ssl.json.

    The server certificate names 127.0.0.1, ::1 and localhost, plus `hosts` (the names or
    addresses by which workers on other machines reach the scheduler). `out_dir/ssl.json` is a
    complete config: `CLUSTER_TLS_CONFIG=out_dir/ssl.json` turns TLS on as it is.

    All or nothing: every file is written and synced in a temporary directory inside
    `out_dir`, then renamed into place. When a write fails (an OSError: a full or read-only
    disk, say), what `out_dir` held stays as it was, and the directories made for it are
    removed.
    """
    out_dir = Path(out_dir)
    existing = held_files(out_dir)
    if existing and not overwrite:
        raise ConfigError(
            f"{out_dir} already holds {', '.join(existing)}: choose an empty directory, or "
            "overwrite on purpose (certificates issued by the old CA stop working)"
        )
    made = _make_dirs(out_dir)
    try:
        stage = Path(tempfile.mkdtemp(prefix=".certs-", dir=out_dir))
        try:
            pki = _write_pki(stage, out_dir, hosts=hosts, days=days)
            for name in PKI_FILES:
                os.replace(stage / name, out_dir / name)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    except BaseException:
        for directory in made:  # the deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    return pki


def held_files(out_dir: Path) -> list[str]:
    """The files of a PKI (`PKI_FILES`) that `out_dir` holds already."""
    return [name for name in PKI_FILES if (Path(out_dir) / name).exists()]


def _make_dirs(path: Path) -> list[Path]:
    """Make directory `path` with its parents; those it made, the deepest first."""
    missing = []
    here = path
    while not here.exists() and not here.is_symlink() and here != here.parent:
        missing.append(here)
        here = here.parent
    path.mkdir(parents=True, exist_ok=True)
    return missing


def _write_pki(stage: Path, out_dir: Path, *, hosts: Sequence[str], days: int) -> Pki:
    """Every file of a PKI, written and synced in `stage`; the Pki as it will be in
    `out_dir`."""
    validity = Validity(days=days)
    ca = new_ca(validity=validity)
    names = list(dict.fromkeys([*LOCAL_NAMES, *hosts]))
    server_key, server_cert = issue(
        ca, "cluster scheduler", server=True, names=names, validity=validity
    )
    client_key, client_cert = issue(ca, "cluster worker", server=False, validity=validity)
    revoked_key, revoked_cert = issue(
        ca, "cluster worker (revoked)", server=False, validity=validity
    )
    server_password, client_password = new_password(), new_password()

    _write_public(stage / "ca.pem", cert_pem(ca.cert))
    write_p12(stage / "server.p12", server_key, server_cert, server_password, ca)
    write_p12(stage / "client.p12", client_key, client_cert, client_password, ca)
    # Same password as client.p12, so that pointing client_cert_path at it is the only change.
    write_p12(stage / "client-revoked.p12", revoked_key, revoked_cert, client_password, ca)
    _write_public(stage / "crl.pem", crl_pem(ca, [revoked_cert], days=days))
    write_private(stage / "server.pass", server_password + b"\n")
    write_private(stage / "client.pass", client_password + b"\n")
    _write_public(stage / "ssl.json", PKI_SSL_JSON.text().encode())
    return Pki(
        dir=out_dir,
        ssl_json=out_dir / "ssl.json",
        ca=ca,
        ca_pem=out_dir / "ca.pem",
        server_p12=out_dir / "server.p12",
        client_p12=out_dir / "client.p12",
        revoked_client_p12=out_dir / "client-revoked.p12",
        crl=out_dir / "crl.pem",
        server_password_file=out_dir / "server.pass",
        client_password_file=out_dir / "client.pass",
        server_password=server_password,
        client_password=client_password,
    )


def _write_public(path: Path, data: bytes) -> None:
    """A new file readable by all (as the umask allows), synced."""
    with path.open("xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
