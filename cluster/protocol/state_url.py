"""Where a scheduler keeps its job's state: CLUSTER_STATE_URL, CLUSTER_LEASE_S and
CLUSTER_ETCD_COMPACTION, parsed.

    etcd://HOST:PORT[,HOST:PORT...]/PREFIX     etcd v3, plaintext
    etcds://HOST:PORT[,HOST:PORT...]/PREFIX    etcd v3 over TLS (see `EtcdTLS`)

Either may log in to an etcd with authentication on (`EtcdAuth`: CLUSTER_ETCD_USER, the
password in CLUSTER_ETCD_PASSWORD_FILE).

The prefix names the job: every key of its state lives under it, so several jobs share one etcd
cluster with a prefix each. Pure: `parse_state_url` takes a string and raises ConfigError naming
the variable, the value and the rule; nothing here opens a file or a connection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Literal

from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import check_host, is_decimal, plain_float, shown
from cluster.protocol.value import frozen

STATE_URL_ENV = "CLUSTER_STATE_URL"
LEASE_ENV = "CLUSTER_LEASE_S"
# etcd grants leases in whole seconds, and no shorter than 1.5 election timeouts (2 s with
# etcd's defaults): a shorter lease would be lengthened by etcd anyway.
MIN_LEASE_S = 2
MAX_LEASE_S = 3600
# Failover after a leader's death takes about the lease: 5 s keeps it short while a scheduler
# stalled for a few seconds (a swapped-out host, a slow etcd) does not lose its job to a standby.
DEFAULT_LEASE_S = 5
COMPACTION_ENV = "CLUSTER_ETCD_COMPACTION"
# Who compacts etcd's history, which a compaction drops for every key of that etcd, not only the
# job's: "off", etcd itself (its --auto-compaction-* flags) or its operator; "auto", the job's
# leader (`cluster.scheduler.etcd_history`). "off" by default: a job keeps to its prefix, and an
# etcd shared by several users compacts its history once, for all of them.
Compaction = Literal["off", "auto"]
COMPACTIONS: tuple[Compaction, ...] = ("off", "auto")
DEFAULT_COMPACTION: Compaction = "off"
_SCHEMES = {"etcd": False, "etcds": True}
_USAGE = "it must be etcd://HOST:PORT[,HOST:PORT...]/PREFIX (or etcds:// for TLS)"


@frozen
class EtcdTLS:
    """The etcd client's TLS files (PEM), from CLUSTER_ETCD_CA_FILE, CLUSTER_ETCD_CERT_FILE and
    CLUSTER_ETCD_KEY_FILE; any left out come from the job's ssl.json (its CA, its client
    certificate). Only the paths: the transport layer opens them."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


@frozen
class EtcdAuth:
    """etcd's user/password authentication: the user (CLUSTER_ETCD_USER) and the file that holds
    its password (CLUSTER_ETCD_PASSWORD_FILE, 0600 or stricter). Only the path: the scheduler
    opens it (`cluster.scheduler.stores`). Never a password in argv or the environment, where
    `ps e`, /proc/PID/environ, child processes and a pod's spec would show it."""

    user: str
    password_file: Path


USER_ENV = "CLUSTER_ETCD_USER"
PASSWORD_FILE_ENV = "CLUSTER_ETCD_PASSWORD_FILE"  # noqa: S105 - a variable name
# etcd's own limit on a user name is none; this one keeps a name printable in one line.
_MAX_USER_CHARS = 128


@frozen
class StateUrl:
    """A parsed CLUSTER_STATE_URL."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str  # "/jobs/a/": starts and ends with one "/"
    tls: bool = False
    tls_files: EtcdTLS = field(default_factory=EtcdTLS)
    auth: EtcdAuth | None = None
    compaction: Compaction = DEFAULT_COMPACTION

    def __str__(self) -> str:
        hosts = ",".join(_endpoint(host, port) for host, port in self.endpoints)
        return f"{'etcds' if self.tls else 'etcd'}://{hosts}{self.prefix.rstrip('/')}"


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _fail(name: str, value: str, problem: str) -> ConfigError:
    return ConfigError(f"{name}={shown(value)} {problem}: {_USAGE}")


def parse_state_url(value: str, name: str = STATE_URL_ENV) -> StateUrl:
    """`value` as a StateUrl, or ConfigError naming `name`, the value and the rule."""
    text = value.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise _fail(name, value, f"has no known scheme ({shown(scheme)})" if sep else "is no URL")
    hosts, slash, path = rest.partition("/")
    prefix = "/" + "/".join(part for part in path.split("/") if part)
    if not slash or prefix == "/":
        raise _fail(name, value, "has no key prefix (the job's name in etcd)")
    if any(c.isspace() or not c.isprintable() for c in prefix):
        raise _fail(name, value, "has a prefix with spaces or control characters")
    endpoints = tuple(_parse_endpoint(name, value, part) for part in hosts.split(","))
    if len(set(endpoints)) != len(endpoints):
        raise _fail(name, value, "names an endpoint twice")
    return StateUrl(endpoints, prefix + "/", tls=_SCHEMES[scheme])


def _parse_endpoint(name: str, value: str, part: str) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):
        host, close, port_text = part[1:].partition("]")
        port_text = port_text[1:] if close and port_text.startswith(":") else ""
    else:
        host, _, port_text = part.rpartition(":")
    if not host or (":" in host and not part.startswith("[")):
        raise _fail(name, value, f"has an endpoint {shown(part)} without HOST:PORT")
    if not is_decimal(port_text) or not 1 <= int(port_text) <= 65535:
        raise _fail(name, value, f"has an endpoint {shown(part)} whose port is not in 1-65535")
    try:
        check_host(name, host)
    except ConfigError:
        problem = f"has an endpoint {shown(part)} whose host is not a host name or IP address"
        raise _fail(name, value, problem) from None
    return host, int(port_text)


def parse_lease(value: str, name: str = LEASE_ENV) -> int:
    """Seconds of the leader's etcd lease: a whole number in MIN_LEASE_S..MAX_LEASE_S."""
    number = plain_float(value.strip())
    if number is None or not math.isfinite(number) or number != int(number):
        raise ConfigError(
            f"{name}={shown(value)} is not a whole number of seconds: etcd grants leases in seconds"
        )
    if not MIN_LEASE_S <= number <= MAX_LEASE_S:
        raise ConfigError(
            f"{name}={shown(value)} must be between {MIN_LEASE_S} and {MAX_LEASE_S} seconds (etcd "
            f"lengthens a lease shorter than {MIN_LEASE_S} s anyway)"
        )
    return int(number)


def state_url_from_env(env: Mapping[str, str], given: str | None = None) -> StateUrl | None:
    """The state URL (`given`, e.g. --state-url, else CLUSTER_STATE_URL) with the etcd TLS
    files of the environment; None when neither names one."""
    raw = given if given is not None else env.get(STATE_URL_ENV, "")
    if not raw.strip():
        return None
    url = parse_state_url(raw, "--state-url" if given is not None else STATE_URL_ENV)

    def path(var: str) -> Path | None:
        text = env.get(var, "").strip()
        return Path(text) if text else None

    files = EtcdTLS(
        path("CLUSTER_ETCD_CA_FILE"), path("CLUSTER_ETCD_CERT_FILE"), path("CLUSTER_ETCD_KEY_FILE")
    )
    if (files.cert_file is None) != (files.key_file is None):
        raise ConfigError(
            "CLUSTER_ETCD_CERT_FILE and CLUSTER_ETCD_KEY_FILE go together: set both (the etcd "
            "client's certificate and its key) or neither"
        )
    if not url.tls and files != EtcdTLS():
        raise ConfigError(
            f"CLUSTER_ETCD_*_FILE are set, but the state URL {str(url)!r} is plaintext: use "
            "etcds:// to speak TLS to etcd"
        )
    return StateUrl(
        url.endpoints, url.prefix, url.tls, files, etcd_auth_from_env(env), compaction_from_env(env)
    )


def parse_compaction(value: str, name: str = COMPACTION_ENV) -> Compaction:
    """`value` as a compaction mode (any case), or ConfigError naming `name` and the modes."""
    text = value.strip().lower()
    for mode in COMPACTIONS:
        if text == mode:
            return mode
    raise ConfigError(
        f"{name}={shown(value)} is not a compaction mode: it must be off (this job never compacts "
        "etcd's history: etcd does, with --auto-compaction-retention) or auto (the job's leader "
        "compacts it, etcd-wide: for an etcd of this job's alone)"
    )


def compaction_from_env(env: Mapping[str, str]) -> Compaction:
    raw = env.get(COMPACTION_ENV, "").strip()
    return parse_compaction(raw) if raw else DEFAULT_COMPACTION


def etcd_auth_from_env(env: Mapping[str, str]) -> EtcdAuth | None:
    """CLUSTER_ETCD_USER with CLUSTER_ETCD_PASSWORD_FILE; None when neither is set."""
    if env.get("CLUSTER_ETCD_PASSWORD", ""):
        raise ConfigError(
            "CLUSTER_ETCD_PASSWORD is not read (a password in the environment is shown to "
            f"child processes and in a pod's spec): write it to a file, `chmod 600` it and set "
            f"{PASSWORD_FILE_ENV} to its path"
        )
    user = env.get(USER_ENV, "").strip()
    path = env.get(PASSWORD_FILE_ENV, "").strip()
    if not user and not path:
        return None
    if not path:
        raise ConfigError(
            f"{USER_ENV}={shown(user)} needs its password: set {PASSWORD_FILE_ENV} to a file that "
            "holds it (mode 0600)"
        )
    if not user:
        raise ConfigError(
            f"{PASSWORD_FILE_ENV}={path!r} is set without a user: set {USER_ENV} to the etcd "
            "user whose password it holds"
        )
    if len(user) > _MAX_USER_CHARS or any(c.isspace() or not c.isprintable() for c in user):
        raise ConfigError(
            f"{USER_ENV}={user[:_MAX_USER_CHARS]!r} is no etcd user name: at most "
            f"{_MAX_USER_CHARS} printable characters without spaces"
        )
    return EtcdAuth(user, Path(path))


def lease_from_env(env: Mapping[str, str]) -> int:
    raw = env.get(LEASE_ENV, "").strip()
    return parse_lease(raw) if raw else DEFAULT_LEASE_S
