"""TLS settings and identities: ssl.json, PKCS#12, CA, CRL, cipher list and expiry, all checked.

Two steps, as in uvicorn's Config: `load_settings` reads and checks ssl.json (no secrets), and
`load_identity` opens this process's p12 and checks it against the CA and the CRL (what a
certificate is checked against is in `cluster.transport.trust`). Every failure
is a TLSConfigError that names the file and the problem. This module hands out PEM bytes and an
`ssl.SSLContext`; the gRPC credentials are made in cluster.channel and cluster.scheduler.server.
It never imports grpc, because it must set GRPC_SSL_CIPHER_SUITES before grpc's first import:
grpc reads that variable once, when it is imported.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import ssl
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cluster.protocol.config import TLSOptions
from cluster.protocol.display import safe
from cluster.protocol.errors import TLSConfigError
from cluster.transport.trust import (
    Crls,
    Revocation,
    chains_to,
    check_dates,
    check_key_size,
    describe,
    file_state,
    load_cas,
    read_file,
    utc_date,
)

if TYPE_CHECKING:
    # cryptography costs a process tens of milliseconds to import: the functions that read
    # certificates import it, so that a job without TLS never does (issue 26, "Cheap to start").
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes


CIPHER_ENV = "GRPC_SSL_CIPHER_SUITES"
# What gRPC can negotiate in TLS 1.2: ECDHE key exchange with an AEAD cipher. (Its BoringSSL
# refuses the whole list, as "failed to bind", if one name is unknown, so names are checked here.)
TLS12_SUITES = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-RSA-CHACHA20-POLY1305",
)
# TLS 1.3 suites are all AEAD and always on in gRPC; they cannot be chosen (as in etcd).
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
# The TLS 1.2 part of gRPC's list when GRPC_SSL_CIPHER_SUITES is not set.
GRPC_DEFAULT_SUITES = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES256-GCM-SHA384",
)
MIN_WARNING_DAYS, MAX_WARNING_DAYS, DEFAULT_WARNING_DAYS = 7, 180, 90
EXPIRY_CHECK_PERIOD_S = 24 * 3600.0
# What an expiry warning advises, unless its process says more (the scheduler reloads its files).
RENEW = "renew it"
_PATH_KEYS = ("server_cert_path", "client_cert_path", "ca_cert_path")
_OPTIONAL_KEYS = (
    "crl_path",
    "cipher_list",
    "cert_expire_warning_time_in_day",
    "server_password_file",
    "client_password_file",
)
_PASSWORD_ENV = {True: "CLUSTER_TLS_SERVER_PASSWORD", False: "CLUSTER_TLS_CLIENT_PASSWORD"}


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# -- ssl.json --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSSettings:
    """ssl.json, checked, with its relative paths made absolute."""

    path: Path
    server_cert_path: Path
    client_cert_path: Path
    ca_cert_path: Path
    crl_path: Path | None
    ciphers: tuple[str, ...]
    warning_days: int
    server_password_file: Path | None
    client_password_file: Path | None


def load_settings(path: Path) -> TLSSettings:
    path = Path(path).absolute()
    raw = read_file(path, "the TLS config")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: a JSONDecodeError, bytes that are not UTF-8, an integer of more digits
        # than int() takes (4300); RecursionError: arrays or objects nested thousands deep.
        # (Python's advice after a ';', to raise its digit limit, is not the reader's to take.)
        problem = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise TLSConfigError(
            f"the TLS config {path} is not valid JSON: {problem.split(';')[0]}"
        ) from None
    if not isinstance(data, dict):
        raise TLSConfigError(f"the TLS config {path} must hold a JSON object")
    unknown = sorted(set(data) - set(_PATH_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise TLSConfigError(
            f"the TLS config {path} has unknown keys {', '.join(unknown)}: the keys are "
            f"{', '.join(_PATH_KEYS + _OPTIONAL_KEYS)}"
        )

    def text(key: str, *, required: bool) -> str:
        value = data.get(key, "")
        if not isinstance(value, str) or (required and not value.strip()):
            raise TLSConfigError(
                f"{key} in {path} must be a non-empty string, not {safe(repr(value), 64)}"
            )
        problem = _unnameable(value)
        if problem:
            raise TLSConfigError(
                f"{key} in {path} holds {problem}: no file or cipher name has one; remove it "
                f"from {safe(repr(value), 64)}"
            )
        return value.strip()

    def file(key: str) -> Path | None:
        value = text(key, required=False)
        return path.parent / value if value else None  # relative to the json's directory

    def required_file(key: str) -> Path:
        return path.parent / text(key, required=True)

    server, client, ca = (required_file(key) for key in _PATH_KEYS)
    ciphers = (
        parse_cipher_list(text("cipher_list", required=True), path)
        if "cipher_list" in data
        else GRPC_DEFAULT_SUITES
    )
    return TLSSettings(
        path=path,
        server_cert_path=server,
        client_cert_path=client,
        ca_cert_path=ca,
        crl_path=file("crl_path"),
        ciphers=ciphers,
        warning_days=_warning_days(data.get("cert_expire_warning_time_in_day"), path),
        server_password_file=file("server_password_file"),
        client_password_file=file("client_password_file"),
    )


def _unnameable(value: str) -> str:
    """What in `value` no file name (open() raises ValueError) nor OpenSSL cipher name can
    hold: a NUL, or a surrogate no byte stands for (JSON's "\\ud800"); '' when nothing."""
    if "\0" in value:
        return "a NUL character (\\u0000)"
    try:
        os.fsencode(value)
    except UnicodeEncodeError:
        return "a lone surrogate (\\ud800-\\udfff)"
    return ""


def _warning_days(value: object, path: Path) -> int:
    if value is None:
        return DEFAULT_WARNING_DAYS
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not MIN_WARNING_DAYS <= value <= MAX_WARNING_DAYS
    ):
        raise TLSConfigError(
            f"cert_expire_warning_time_in_day={value!r} in {path} is out of range: it must be "
            f"an integer number of days between {MIN_WARNING_DAYS} and {MAX_WARNING_DAYS}"
        )
    return value


def _cipher_problem(name: str) -> str | None:
    if name in TLS12_SUITES:
        return None
    if name in TLS13_SUITES:
        return "is a TLS 1.3 suite: gRPC always enables those (all AEAD) and cannot list them"
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.set_ciphers(name)
    except (ssl.SSLError, ValueError):  # ValueError: a name OpenSSL cannot be given (a NUL)
        return "is not a cipher suite name (a typo?)"
    return "is not an ECDHE AEAD suite"


def parse_cipher_list(text: str, path: Path) -> tuple[str, ...]:
    """Colon-separated OpenSSL names, each a TLS 1.2 ECDHE AEAD suite gRPC supports."""
    names = [name.strip() for name in text.split(":")]
    problems = [f"{name!r} {_cipher_problem(name)}" for name in names if _cipher_problem(name)]
    if "" in names:
        problems.append("an empty name (a stray ':')")
    if problems:
        raise TLSConfigError(
            f"cipher_list in {path}: {'; '.join(problems)}. Use only these TLS 1.2 suites: "
            f"{':'.join(TLS12_SUITES)}"
        )
    return tuple(dict.fromkeys(names))


def apply_cipher_suites(
    settings: TLSSettings,
    environ: MutableMapping[str, str] = os.environ,
    modules: Mapping[str, object] = sys.modules,
) -> None:
    """Give grpc the cipher list, which it reads from GRPC_SSL_CIPHER_SUITES when imported.

    Before grpc's import: set the variable. After it: check that what grpc read is the same
    list, and say how to fix it when it is not (nothing in this process can change it any more).
    """
    wanted = ":".join(settings.ciphers)
    if "grpc" not in modules:
        environ[CIPHER_ENV] = wanted
        return
    current = environ.get(CIPHER_ENV, "").strip()
    effective = (
        {n for n in current.split(":") if n not in TLS13_SUITES}
        if current
        else set(GRPC_DEFAULT_SUITES)
    )
    if effective != set(settings.ciphers):
        now = f"{CIPHER_ENV}={current}" if current else "gRPC's default list"
        raise TLSConfigError(
            f"cipher_list in {settings.path} cannot take effect: grpc was imported before "
            f"cluster could pass it on, and it uses {now}. Set {CIPHER_ENV}={wanted} in the "
            "environment before the process starts, or call cluster.set_ps_context() or "
            "cluster.init() before anything imports grpc"
        )


def launch_environment(config_path: Path) -> dict[str, str]:
    """The variables a launcher gives its children for TLS (after checking ssl.json).

    CLUSTER_TLS_CONFIG turns TLS on; GRPC_SSL_CIPHER_SUITES lets even a child that imports
    grpc before `cluster` use the configured cipher list.
    """
    settings = load_settings(config_path)
    return {"CLUSTER_TLS_CONFIG": str(settings.path), CIPHER_ENV: ":".join(settings.ciphers)}


# -- this process's identity -----------------------------------------------------------------


def _looks_like_pkcs12(data: bytes) -> bool:
    """A DER PFX: SEQUENCE { version INTEGER 3, ... }, whatever its password."""
    if len(data) < 8 or data[0] != 0x30:
        return False
    start = 2 + (data[1] & 0x7F if data[1] & 0x80 else 0)
    return data[start : start + 3] == b"\x02\x01\x03"


def _whole_der(data: bytes) -> bool:
    """Whether `data` is as long as its outer DER length says (a p12 cut short is not); BER's
    indefinite length says nothing, and passes."""
    size = data[1] & 0x7F
    if data[1] == 0x80:
        return True
    if not data[1] & 0x80:
        return len(data) == 2 + size
    return len(data) == 2 + size + int.from_bytes(data[2 : 2 + size], "big")


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: it holds a key
class Identity:
    """This process's TLS identity, checked: the scheduler's (server p12) or a worker's."""

    settings: TLSSettings
    server: bool
    p12_path: Path
    key: PrivateKeyTypes = field(repr=False)
    key_pem: bytes = field(repr=False)
    chain_pem: bytes
    cert: x509.Certificate
    ca_pem: bytes
    cas: tuple[x509.Certificate, ...]
    revocation: Revocation | None
    # Where it was read from (ssl.json, the passwords): what reads it again when files change.
    options: TLSOptions
    # The name the scheduler's certificate must carry, when it is not the host dialled.
    server_name: str | None = None

    @property
    def what(self) -> str:
        key = "server_cert_path" if self.server else "client_cert_path"
        return f"{key} {self.p12_path}"


def _password(options: TLSOptions, settings: TLSSettings, server: bool) -> bytes | None:
    """The p12 password: a password file named in the environment, else the password itself
    (environment or set_ps_context), else the file named in ssl.json, else none."""
    env_file = options.server_password_file if server else options.client_password_file
    given = options.server_password if server else options.client_password
    json_file = settings.server_password_file if server else settings.client_password_file
    if env_file is not None:
        return _read_password(env_file, f"{_PASSWORD_ENV[server]}_FILE")
    if given is not None:
        return given or None
    if json_file is not None:
        key = "server_password_file" if server else "client_password_file"
        return _read_password(json_file, f"{key} in {settings.path}:")
    return None


def _read_password(path: Path, source: str) -> bytes | None:
    data = read_file(path, f"the password file ({source})")
    return data.rstrip(b"\r\n") or None  # one line; the newline an editor adds is not in it


def load_identity(options: TLSOptions, *, server: bool, now: dt.datetime | None = None) -> Identity:
    """Open and check the scheduler's (server) or a worker's (client) p12 and what it needs."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - TLS only

    settings = load_settings(options.config_path)
    now = now if now is not None else now_utc()
    key_name = "server_cert_path" if server else "client_cert_path"
    path = settings.server_cert_path if server else settings.client_cert_path
    what = f"{key_name} {path}"
    key, cert, extra = _open_p12(
        read_file(path, key_name), _password(options, settings, server), what, server
    )
    check_key_size(cert.public_key(), what)
    check_dates(cert, what, now)
    cas, revocation = _check_trust(cert, extra, settings, what, now)
    intermediates = [c for c in extra if c.subject != c.issuer]
    return Identity(
        settings=settings,
        server=server,
        p12_path=path,
        key=key,
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        chain_pem=b"".join(
            c.public_bytes(serialization.Encoding.PEM) for c in [cert, *intermediates]
        ),
        cert=cert,
        ca_pem=b"".join(ca.public_bytes(serialization.Encoding.PEM) for ca in cas),
        cas=cas,
        revocation=revocation,
        options=options,
        server_name=options.server_name,
    )


def _open_p12(
    data: bytes, password: bytes | None, what: str, server: bool
) -> tuple[PrivateKeyTypes, x509.Certificate, list[x509.Certificate]]:
    """The key, its certificate and the extra certificates of a p12, the key checked to be the
    certificate's; a TLSConfigError that says which of file, password or content is wrong."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - TLS only
    from cryptography.hazmat.primitives.serialization import pkcs12  # noqa: PLC0415 - TLS only

    try:
        key, cert, extra = pkcs12.load_key_and_certificates(data, password)
    except ValueError:
        if not _looks_like_pkcs12(data):
            raise TLSConfigError(f"{what} is not a PKCS#12 (.p12) file") from None
        if not _whole_der(data):
            raise TLSConfigError(
                f"{what} is cut short: {len(data)} bytes of a PKCS#12 file that says it is "
                "longer (a copy not finished?)"
            ) from None
        if password is None:
            raise TLSConfigError(
                f"{what} needs a password and none was given: set "
                f"{_PASSWORD_ENV[server]}_FILE, or pass it to cluster.set_ps_context()"
            ) from None
        raise TLSConfigError(f"wrong password for {what}") from None
    if key is None or cert is None:
        raise TLSConfigError(f"{what} must hold a private key and its certificate")
    if key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise TLSConfigError(f"{what}: the private key does not belong to the certificate")
    return key, cert, list(extra)


def _check_trust(
    cert: x509.Certificate,
    extra: list[x509.Certificate],
    settings: TLSSettings,
    what: str,
    now: dt.datetime,
) -> tuple[tuple[x509.Certificate, ...], Revocation | None]:
    """The job's CAs and its CRL, `cert` checked to chain to one and not to be revoked."""
    cas = load_cas(settings.ca_cert_path, now)
    if not chains_to(cert, extra, cas):
        raise TLSConfigError(
            f"{what} ({describe(cert)}) is not signed by the CA in ca_cert_path "
            f"{settings.ca_cert_path}"
        )
    revocation = Revocation(settings.crl_path, cas) if settings.crl_path else None
    if revocation is not None and revocation.revoked(cert):
        raise TLSConfigError(
            f"{what} ({describe(cert)}) is revoked: the CRL {settings.crl_path} lists it"
        )
    return cas, revocation


_Stamp = tuple[tuple[str, int, int, int], ...]
# Identities already loaded in this process, with the state of their files then: many agents
# in one process (tests, benchmarks) share one instead of each decrypting the p12 again.
_prepared: dict[tuple[TLSOptions, bool], tuple[_Stamp, Identity]] = {}


def files_stamp(options: TLSOptions, settings: TLSSettings, server: bool | None = None) -> _Stamp:
    """The state of every file an identity is read from (what `prepare` and a reloading
    server compare to know that one changed); with `server`, of that side's files only (the
    CRL, read again on its own by `Revocation`, left out)."""
    shared: tuple[Path | None, ...] = (settings.path, settings.ca_cert_path)
    own = {
        True: (settings.server_cert_path, settings.server_password_file),
        False: (settings.client_cert_path, settings.client_password_file),
    }
    given = {True: options.server_password_file, False: options.client_password_file}
    if server is None:
        files = (*shared, settings.crl_path, *own[True], *own[False], *given.values())
    else:
        files = (*shared, *own[server], given[server])
    return tuple((str(path), *file_state(path)) for path in files if path is not None)


def prepare(options: TLSOptions, *, server: bool) -> Identity:
    """Everything a process does before it uses TLS: the cipher list for grpc, then its p12."""
    settings = load_settings(options.config_path)
    apply_cipher_suites(settings)
    stamp = files_stamp(options, settings)
    cached = _prepared.get((options, server))
    if cached is not None and cached[0] == stamp:
        identity, now = cached[1], now_utc()
        check_dates(identity.cert, identity.what, now)  # time passes even when files do not
        for ca in identity.cas:
            check_dates(ca, f"the CA certificate {describe(ca)} in {settings.ca_cert_path}", now)
        return identity
    identity = load_identity(options, server=server)
    _prepared[(options, server)] = (stamp, identity)
    return identity


# -- checks while running --------------------------------------------------------------------


class HasRevocation(Protocol):
    """An identity as a check reads it: an `Identity`, or one that is read again as its files
    change (`cluster.transport.server_tls.ReloadingIdentity`)."""

    @property
    def revocation(self) -> Revocation | None: ...


class PeerCheck:
    """Whether a peer's certificate may still be served: not revoked (by the CRL as it is now)
    and not expired. gRPC verified the CA at the handshake but knows no CRL.

    The scheduler asks on every call, so the answer is kept per certificate: parsing it and
    looking it up in the CRL happen once per certificate and CRL version (a reloaded CRL is a
    new object, which makes every kept answer stale); what remains per call is a dictionary
    lookup, the CRL file's stat, and a comparison with the expiry date.
    """

    _MAX_KEPT = 4096

    def __init__(self, identity: HasRevocation, clock: Callable[[], dt.datetime] = now_utc) -> None:
        self._identity = identity  # its revocation read at each call: a reload may replace it
        self._clock = clock
        self._parsed: dict[bytes, x509.Certificate] = {}
        # Per certificate: its expiry, and whether it is revoked by the CRL object named.
        self._verdicts: dict[int, _Verdict] = {}

    def certificate(self, pem: bytes) -> x509.Certificate:
        cert = self._parsed.get(pem)
        if cert is None:
            if len(self._parsed) > self._MAX_KEPT:
                self._parsed.clear()
                self._verdicts.clear()
            from cryptography import x509  # noqa: PLC0415 - TLS only

            cert = self._parsed[pem] = x509.load_pem_x509_certificate(pem)
        return cert

    def problem(self, cert: x509.Certificate) -> str | None:
        """Why `cert` must be refused now ("is revoked ..."), or None."""
        refusal = self.refusal(cert)
        return None if refusal is None else refusal[1]

    def refusal(self, cert: x509.Certificate) -> tuple[str, str] | None:
        """The reason (`expired`, `revoked`) and the problem for which `cert` must be refused
        now, or None."""
        revocation = self._identity.revocation
        crl = None if revocation is None else revocation.current()
        verdict = self._verdicts.get(id(cert))
        if verdict is None or verdict.cert is not cert or verdict.crl is not crl:
            if len(self._verdicts) > self._MAX_KEPT:
                self._verdicts.clear()
            revoked = crl is not None and crl.revoked(cert)
            verdict = _Verdict(cert, crl, cert.not_valid_after_utc, revoked)
            self._verdicts[id(cert)] = verdict
        if self._clock() > verdict.not_after:
            return "expired", f"expired on {utc_date(verdict.not_after)}"
        if verdict.revoked:
            return "revoked", "is revoked (the CRL lists it)"
        return None


@dataclass(frozen=True)
class _Verdict:
    cert: x509.Certificate  # kept alive, so that id(cert) is not reused while this is kept
    crl: Crls | None
    not_after: dt.datetime
    revoked: bool


def expiry_warnings(
    identity: Identity, now: dt.datetime | None = None, renew: str = RENEW
) -> list[str]:
    """What to tell the operator now: certificates within the warning window (each with the
    advice `renew`), a stale CRL."""
    now = now if now is not None else now_utc()
    window = dt.timedelta(days=identity.settings.warning_days)
    warnings = []
    certs = [(identity.what, identity.cert)] + [
        (f"the CA certificate in {identity.settings.ca_cert_path}", ca) for ca in identity.cas
    ]
    for what, cert in certs:
        left = cert.not_valid_after_utc - now
        if left <= dt.timedelta(0):
            warnings.append(f"{what} has expired ({utc_date(cert.not_valid_after_utc)}): {renew}")
        elif left <= window:
            warnings.append(
                f"{what} expires in {left.days} days, on {utc_date(cert.not_valid_after_utc)} "
                f"(cert_expire_warning_time_in_day={identity.settings.warning_days}): {renew}"
            )
    if identity.revocation is not None:
        for crl in identity.revocation.current().overdue(now):
            warnings.append(
                f"the CRL of {crl.issuer.rfc4514_string()} in {identity.revocation.path} was "
                f"due for an update on {utc_date(crl.next_update_utc or now)}: get a fresh one "
                "from the CA"
            )
    return warnings


async def recheck_expiry(
    identity: Identity | Callable[[], Identity],
    report: Callable[[str], None],
    period_s: float = EXPIRY_CHECK_PERIOD_S,
    clock: Callable[[], dt.datetime] = now_utc,
    renew: str = RENEW,
) -> None:
    """Report `expiry_warnings` every `period_s` (a day) for as long as the process serves, of
    `identity`, or of the one it gives each time when it is a function."""
    while True:
        await asyncio.sleep(period_s)
        current = identity() if callable(identity) else identity
        for warning in expiry_warnings(current, clock(), renew):
            report(warning)
