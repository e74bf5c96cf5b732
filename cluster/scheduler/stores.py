"""The state store a scheduler uses, made from its settings: the directory of MS_RECOVERY_PATH,
or etcd (CLUSTER_STATE_URL), with the etcd client's TLS files opened here.

An unreachable or misconfigured etcd is found here, at start, and said in one line (a
ConfigError), not as a traceback from the first save.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cluster.protocol.config import TLSOptions
from cluster.protocol.errors import ConfigError, EtcdRefused, StateFileError
from cluster.protocol.state_url import PASSWORD_FILE_ENV, EtcdAuth, StateUrl
from cluster.storage.directory_store import DirectoryStore
from cluster.storage.state_store import StateStore
from cluster.transport import tls as tls_module


def directory(path: Path) -> DirectoryStore:
    return DirectoryStore(path)


def etcd_credentials(url: StateUrl, job_tls: TLSOptions | None) -> object | None:
    """PEM files of CLUSTER_ETCD_*_FILE, the rest from the job's ssl.json (its CA and its
    client certificate); None for plaintext etcd."""
    from cluster.scheduler.etcd_client import EtcdCredentials  # noqa: PLC0415 - etcd only

    if not url.tls:
        return None
    files = url.tls_files

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{what}={str(path)!r} cannot be read ({exc.strerror})") from None

    ca = None if files.ca_file is None else read(files.ca_file, "CLUSTER_ETCD_CA_FILE")
    chain = None if files.cert_file is None else read(files.cert_file, "CLUSTER_ETCD_CERT_FILE")
    key = None if files.key_file is None else read(files.key_file, "CLUSTER_ETCD_KEY_FILE")
    if (ca is None or chain is None) and job_tls is not None:
        identity = tls_module.load_identity(job_tls, server=False)
        ca = ca if ca is not None else identity.ca_pem
        if chain is None:
            chain, key = identity.chain_pem, identity.key_pem
    if ca is None:
        raise ConfigError(
            f"the state URL {url} uses TLS (etcds://) but names no CA: set "
            "CLUSTER_ETCD_CA_FILE (and CLUSTER_ETCD_CERT_FILE / CLUSTER_ETCD_KEY_FILE for a "
            "client certificate), or give the job a TLS config (CLUSTER_TLS_CONFIG)"
        )
    return EtcdCredentials(ca, chain, key)


def etcd_login(auth: EtcdAuth | None) -> tuple[str, str] | None:
    """(user, password) for etcd's authentication, the password read from its file: a
    ConfigError when the file is missing, empty, or open to anyone but its owner."""
    if auth is None:
        return None
    path = auth.password_file
    where = f"{PASSWORD_FILE_ENV}={str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be read ({exc.strerror}): point it at the file that holds the "
            "etcd user's password"
        ) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        data = file.read(4097)
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{where} is not a regular file: point it at the password file")
    if mode & 0o077 and not _kubernetes_secret(info):
        raise ConfigError(
            f"{where} is open to other users (mode {stat.S_IMODE(mode):04o}), so etcd's "
            f"password is too: `chmod 600 {path}` (0600 or stricter)"
        )
    password = data.decode("utf-8", errors="replace").rstrip("\r\n")
    if not password or len(data) > 4096:
        raise ConfigError(
            f"{where} is {'empty' if not password else 'over 4 KiB'}: write the "
            "etcd user's password in it, alone on one line"
        )
    return auth.user, password


def _kubernetes_secret(info: os.stat_result) -> bool:
    """A file only root and this process's own group may read, as the kubelet mounts a Secret
    for a pod's fsGroup (root:fsGroup, 0440): no other user of the host is in that group."""
    groups = {os.getegid(), *os.getgroups()}
    return info.st_mode & 0o077 == 0o040 and info.st_uid == 0 and info.st_gid in groups


async def open_etcd(
    url: StateUrl, address: str, lease_s: int, job_tls: TLSOptions | None = None
) -> StateStore:
    """The etcd store of `url` for the scheduler serving at `address`, its etcd reachable:
    ConfigError in one line when it is not (or refuses this client)."""
    from cluster.scheduler.etcd_client import EtcdConnection, EtcdCredentials  # noqa: PLC0415
    from cluster.scheduler.etcd_election import EtcdElection  # noqa: PLC0415
    from cluster.scheduler.etcd_store import EtcdStore  # noqa: PLC0415

    credentials = etcd_credentials(url, job_tls)
    assert credentials is None or isinstance(credentials, EtcdCredentials)
    connection = EtcdConnection(
        url, credentials, timeout_s=request_timeout(lease_s), login=etcd_login(url.auth)
    )
    store = EtcdStore(connection, EtcdElection(connection, address, lease_s))
    try:
        await store.election.leader()  # one read: is etcd there, and does it take us?
    except EtcdRefused as exc:
        await store.close()
        raise ConfigError(str(exc)) from None
    except StateFileError as exc:
        await store.close()
        raise ConfigError(
            f"the state URL {str(url)!r} cannot be used: {exc}; is etcd running there, and "
            "does it take this client (etcds:// and its certificates)?"
        ) from None
    store.history.announce()
    return store


def request_timeout(lease_s: int) -> float:
    """How long one etcd request may take before another member is tried: well within the
    lease, so that a leader cut off from one member keeps its lease through another."""
    return max(0.5, min(2.0, lease_s / 4))


def advertised(host: str, port: int) -> str:
    """The address a scheduler bound to `host` is reached at, for its leader key."""
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - naming the wildcard, not binding it
        host = os.uname().nodename
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
