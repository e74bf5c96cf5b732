"""The launch environment, read: `from_env` turns the MS_* and CLUSTER_* variables into a
`ClusterConfig` (`cluster.protocol.config`), and `read_job_secret` reads the job secret's file.

The variable names and defaults are MindSpore's (docs/reference/environment.md); knobs that
MindSpore does not have are named CLUSTER_*. Each function takes the environment as a mapping
(`os.environ` by default for `from_env`); a bad value is a ConfigError that names the variable
and what it must be. The records and their rules are `cluster.protocol.config`'s; the pure
machines import those, never this module. The one check that touches the disk besides the
secret, that a recovery path is safe and writable, is
`cluster.storage.recovery_dir.check_recovery_path`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.protocol.config import (
    DEFAULT_COLLECTIVE_MAX_BYTES,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_FOLLOWER_MAX_BYTES,
    DEFAULT_KV_MAX_BYTES,
    DEFAULT_KV_MAX_KEYS,
    DEFAULT_LOG_KEEP,
    DEFAULT_LOG_MAX_BYTES,
    DEFAULT_MAX_FOLLOWERS,
    DEFAULT_MAX_SPARES,
    DEFAULT_NODE_TIMEOUT_S,
    DEFAULT_PINNED_MAX_BYTES,
    DEFAULT_TOPO_TIMEOUT_S,
    LOG_KEEP_RANGE,
    LOG_MAX_BYTES_RANGE,
    MAX_NODES,
    MIN_HEARTBEAT_INTERVAL_S,
    MIN_NODE_TIMEOUT_S,
    ClusterConfig,
    JobSecretSource,
    Limits,
    LogRotation,
    ObserveConfig,
    RecoveryConfig,
    Role,
    TLSOptions,
    default_heartbeat_interval,
    is_numeric_node_id,
    join_address,
    parse_bool,
    parse_int,
    parse_node_id,
    parse_port,
    parse_seconds,
    secret_mode_ok,
)
from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import check_host, shown, split_address
from cluster.protocol.state_url import DEFAULT_LEASE_S, StateUrl, lease_from_env, state_url_from_env

if TYPE_CHECKING:
    from cluster.protocol.settings import JobSettings


def _require(env: Mapping[str, str], name: str, rule: str) -> str:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise ConfigError(f"{name} is not set: it is required ({rule})")
    return value.strip()


def sched_addresses_from_env(env: Mapping[str, str], *, listed: bool = True) -> tuple[str, ...]:
    """Every scheduler address: CLUSTER_SCHED_ADDRS=h1:p1,h2:p2, else MS_SCHED_HOST=h1,h2 with
    MS_SCHED_PORT. A ConfigError naming the variable for an empty entry or a bad port.

    Without `listed`, CLUSTER_SCHED_ADDRS is not read: it says where workers look for the
    schedulers, and a scheduler listens where MS_SCHED_HOST and MS_SCHED_PORT say.
    """
    given = env.get("CLUSTER_SCHED_ADDRS", "").strip() if listed else ""
    if given:
        entries = [entry.strip() for entry in given.split(",")]
        if not all(entries):
            raise ConfigError(
                f"CLUSTER_SCHED_ADDRS={shown(given)} has an empty entry: list HOST:PORT,HOST:PORT"
            )
        return tuple(
            join_address(*split_address("CLUSTER_SCHED_ADDRS entry", entry)) for entry in entries
        )
    hosts_value = _require(env, "MS_SCHED_HOST", "the scheduler's host name or IP address")
    hosts = [host.strip() for host in hosts_value.split(",")]
    if not all(hosts):
        raise ConfigError(
            f"MS_SCHED_HOST={shown(hosts_value)} has an empty entry: give one host, or several "
            "separated by commas (h1,h2), all listening on MS_SCHED_PORT"
        )
    port = parse_port(
        "MS_SCHED_PORT", _require(env, "MS_SCHED_PORT", "the scheduler's port, 1-65535")
    )
    return tuple(
        join_address(check_host("MS_SCHED_HOST entry", host.strip("[]")), port) for host in hosts
    )


def from_env(env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Parse the launch environment (os.environ by default) into a ClusterConfig."""
    env = os.environ if env is None else env
    role = _role_from_env(env)
    worker_num, server_num = node_counts_from_env(env)
    if role is Role.SERVER and server_num == 0:
        raise ConfigError("MS_ROLE='MS_PSERVER' needs MS_SERVER_NUM >= 1, but MS_SERVER_NUM is 0")
    addresses = sched_addresses_from_env(env, listed=role is not Role.SCHEDULER)
    sched_host, sched_port = split_address("the scheduler address", addresses[0])
    node_id = _node_id_from_env(env, role, worker_num, server_num)
    state_url = state_url_from_env(env) if role is Role.SCHEDULER else None
    recovery = _recovery_from_env(env, role, node_id, state_url)
    topo_timeout = parse_seconds(
        "MS_TOPO_TIMEOUT", env.get("MS_TOPO_TIMEOUT", "") or str(DEFAULT_TOPO_TIMEOUT_S)
    )
    node_timeout = parse_seconds(
        "MS_NODE_TIMEOUT",
        env.get("MS_NODE_TIMEOUT", "") or str(DEFAULT_NODE_TIMEOUT_S),
        minimum=MIN_NODE_TIMEOUT_S,
    )
    observe = observe_from_env(env)
    if role is Role.SCHEDULER:
        check_metrics_port(sched_host, sched_port, observe)
    return ClusterConfig(
        role=role,
        worker_num=worker_num,
        server_num=server_num,
        sched_host=sched_host,
        sched_port=sched_port,
        node_id=node_id,
        recovery=recovery,
        topo_timeout_s=topo_timeout,
        node_timeout_s=node_timeout,
        heartbeat_enabled=not parse_bool(
            "MS_DISABLE_HEARTBEAT", env.get("MS_DISABLE_HEARTBEAT", "0")
        ),
        heartbeat_interval_s=_heartbeat_interval_from_env(
            env, node_timeout, worker_num + server_num
        ),
        tls=tls_options_from_env(env),
        observe=observe,
        job_secret=job_secret_from_env(env),
        limits=limits_from_env(env),
        spare=_spare_from_env(env, role, recovery is not None),
        state_url=state_url,
        lease_s=lease_from_env(env) if state_url is not None else DEFAULT_LEASE_S,
        sched_addresses=addresses if len(addresses) > 1 else (),
        relay=relay_from_env(env) if role is not Role.SCHEDULER else None,
        pinned_max_bytes=pinned_max_from_env(env),
    )


PINNED_MAX_ENV = "CLUSTER_PINNED_MAX_BYTES"


def pinned_max_from_env(env: Mapping[str, str]) -> int:
    """CLUSTER_PINNED_MAX_BYTES: bytes of pinned host memory a worker's snapshots of CUDA
    tensors may hold (0: never pin); read here for every process, so that init() and `mscluster
    run --dry-run` refuse a bad one, not the first checkpoint hours later."""
    raw = env.get(PINNED_MAX_ENV, "").strip()
    return parse_int(PINNED_MAX_ENV, raw, minimum=0) if raw else DEFAULT_PINNED_MAX_BYTES


# A unix socket's path is at most this long (sun_path, with its terminating NUL).
MAX_SOCKET_PATH = 107
RELAY_SCHEME = "unix:"


def relay_from_env(env: Mapping[str, str]) -> str | None:
    """CLUSTER_RELAY: the host relay's local socket, "unix:PATH" (None when unset or empty)."""
    raw = env.get("CLUSTER_RELAY", "").strip()
    if not raw:
        return None
    return relay_address("CLUSTER_RELAY", raw)


def relay_address(name: str, raw: str) -> str:
    """`raw` ("unix:PATH", gRPC's "unix:///PATH", or a bare PATH) as a relay's address
    ("unix:PATH"), or a ConfigError naming `name`."""
    path = raw.removeprefix(RELAY_SCHEME)
    if path.startswith("//"):  # unix://ABSOLUTE-PATH
        path = path[2:]
    if not path:
        raise ConfigError(
            f"{name}={shown(raw)} is not a relay address: give unix:PATH, the path of the relay's "
            "socket (mscluster relay --socket PATH)"
        )
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:  # the bytes as given, in any encoding
        raise ConfigError(
            f"{name}={shown(raw)} is too long for a unix socket: its path must be at most "
            f"{MAX_SOCKET_PATH} bytes"
        )
    if not _utf8(path):
        raise ConfigError(
            f"{name}={shown(raw)} is not UTF-8: gRPC names a unix socket in UTF-8 only; give "
            "the relay's socket a path of UTF-8 characters"
        )
    return RELAY_SCHEME + path


def _utf8(text: str) -> bool:
    """Whether `text` is UTF-8 text: not bytes that are not, which os.environ and sys.argv
    carry as lone surrogates (surrogateescape)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def node_counts_from_env(env: Mapping[str, str]) -> tuple[int, int]:
    """MS_WORKER_NUM and MS_SERVER_NUM, each and together at most MAX_NODES."""
    worker_num = parse_int(
        "MS_WORKER_NUM",
        _require(env, "MS_WORKER_NUM", "the number of workers, >= 1"),
        minimum=1,
        maximum=MAX_NODES,
    )
    server_num = parse_int(
        "MS_SERVER_NUM", env.get("MS_SERVER_NUM", "0") or "0", minimum=0, maximum=MAX_NODES
    )
    if worker_num + server_num > MAX_NODES:
        raise ConfigError(
            f"MS_WORKER_NUM={worker_num} and MS_SERVER_NUM={server_num} make "
            f"{worker_num + server_num} nodes: a job has at most {MAX_NODES}"
        )
    return worker_num, server_num


def _spare_from_env(env: Mapping[str, str], role: Role, recovery: bool) -> bool:
    """CLUSTER_SPARE: only a worker of a job with recovery can be a spare (without recovery
    a failed worker ends the job, so nobody would ever take its rank)."""
    raw = env.get("CLUSTER_SPARE", "").strip()
    spare = parse_bool("CLUSTER_SPARE", raw) if raw else False
    if spare and role is not Role.WORKER:
        raise ConfigError(
            f"CLUSTER_SPARE={raw} is for workers only, but MS_ROLE={role.value!r}: unset it"
        )
    if spare and not recovery:
        raise ConfigError(
            f"CLUSTER_SPARE={raw} needs MS_ENABLE_RECOVERY=1: a spare takes a failed worker's "
            "rank, and without recovery a failed worker ends the job"
        )
    return spare


def _role_from_env(env: Mapping[str, str]) -> Role:
    role_value = _require(env, "MS_ROLE", "one of MS_SCHED, MS_WORKER, MS_PSERVER")
    try:
        return Role(role_value)
    except ValueError:
        raise ConfigError(
            f"MS_ROLE={shown(role_value)} is not a role: it must be one of MS_SCHED, MS_WORKER, "
            "MS_PSERVER"
        ) from None


def _node_id_from_env(
    env: Mapping[str, str], role: Role, worker_num: int, server_num: int
) -> str | None:
    """MS_NODE_ID (None: not given); a numeric one is the rank, so it must be in range."""
    raw_node_id = env.get("MS_NODE_ID", "").strip()
    node_id = parse_node_id("MS_NODE_ID", raw_node_id) if raw_node_id else None
    if node_id is not None and is_numeric_node_id(node_id):
        limit = server_num if role is Role.SERVER else worker_num
        if int(node_id) >= limit and role is not Role.SCHEDULER:
            raise ConfigError(
                f"MS_NODE_ID={shown(raw_node_id)} is numeric, so it is the rank, and must be below "
                f"{'MS_SERVER_NUM' if role is Role.SERVER else 'MS_WORKER_NUM'}={limit}"
            )
    return node_id


def _recovery_from_env(
    env: Mapping[str, str], role: Role, node_id: str | None, state_url: StateUrl | None
) -> RecoveryConfig | None:
    """MS_ENABLE_RECOVERY with its MS_RECOVERY_PATH (a scheduler on a state URL needs none)."""
    recovery_on = parse_bool("MS_ENABLE_RECOVERY", env.get("MS_ENABLE_RECOVERY", "0"))
    path = env.get("MS_RECOVERY_PATH", "").strip()
    if not recovery_on or (state_url is not None and not path):
        return None
    if not path:
        raise ConfigError(
            f"MS_ENABLE_RECOVERY={env.get('MS_ENABLE_RECOVERY', '').strip()} needs "
            "MS_RECOVERY_PATH: set it to a directory where the job's state can be written"
        )
    if node_id is None and role is not Role.SCHEDULER:
        raise ConfigError(
            "MS_ENABLE_RECOVERY=1 needs MS_NODE_ID for every worker and server: a restarted "
            "process is taken back by its node id, so give each one a fixed, unique MS_NODE_ID "
            "(e.g. its rank); mscluster run sets it for you"
        )
    return RecoveryConfig(Path(path))


def _heartbeat_interval_from_env(env: Mapping[str, str], node_timeout: float, nodes: int) -> float:
    """CLUSTER_HEARTBEAT_INTERVAL, shorter than MS_NODE_TIMEOUT; else the default for `nodes`."""
    interval_value = env.get("CLUSTER_HEARTBEAT_INTERVAL", "").strip()
    if not interval_value:
        return default_heartbeat_interval(node_timeout, nodes)
    interval = parse_seconds(
        "CLUSTER_HEARTBEAT_INTERVAL", interval_value, minimum=MIN_HEARTBEAT_INTERVAL_S
    )
    if interval >= node_timeout:
        raise ConfigError(
            f"CLUSTER_HEARTBEAT_INTERVAL={shown(interval_value)} must be shorter than "
            f"MS_NODE_TIMEOUT ({node_timeout:g} s), or every node would time out"
        )
    return interval


def observe_from_env(env: Mapping[str, str]) -> ObserveConfig:
    """CLUSTER_METRICS_PORT, CLUSTER_METRICS_HOST, CLUSTER_EVENT_LOG and
    CLUSTER_WORKER_METRICS_PORT."""
    metrics = env.get("CLUSTER_METRICS_PORT", "").strip()
    metrics_host = env.get("CLUSTER_METRICS_HOST", "").strip()
    event_log = env.get("CLUSTER_EVENT_LOG", "").strip()
    worker = env.get("CLUSTER_WORKER_METRICS_PORT", "").strip()
    log_file = env.get("CLUSTER_LOG_FILE", "").strip()
    return ObserveConfig(
        metrics_port=(
            parse_int("CLUSTER_METRICS_PORT", metrics, minimum=0, maximum=65535)
            if metrics
            else None
        ),
        metrics_host=(
            check_host("CLUSTER_METRICS_HOST", metrics_host).strip("[]") if metrics_host else None
        ),
        event_log=Path(event_log) if event_log else None,
        worker_metrics_port=parse_port("CLUSTER_WORKER_METRICS_PORT", worker) if worker else None,
        log_file=Path(log_file) if log_file else None,
        rotation=log_rotation_from_env(env),
    )


# The hosts that stand for every address of this host, to listen on.
_EVERY_ADDRESS = ("", "0.0.0.0", "::")  # noqa: S104 - compared with, never bound


def check_metrics_port(sched_host: str, sched_port: int, observe: ObserveConfig) -> None:
    """A ConfigError naming both settings when the scheduler's /metrics would listen where its
    gRPC does (the same port, on the same host or on every address): the metrics server,
    started first, would hold the port, and the scheduler's own bind would then fail."""
    if observe.metrics_port != sched_port:
        return
    hosts = {sched_host, sched_host if observe.metrics_host is None else observe.metrics_host}
    if len(hosts) == 2 and not hosts & set(_EVERY_ADDRESS):
        return  # one port on two addresses of the host
    raise ConfigError(
        f"CLUSTER_METRICS_PORT={sched_port} is MS_SCHED_PORT, where "
        "the scheduler itself listens: give the metrics another port (0: any free one)"
    )


def log_rotation_from_env(env: Mapping[str, str]) -> LogRotation:
    """CLUSTER_LOG_MAX_BYTES and CLUSTER_LOG_KEEP, each within its bounds."""
    size = env.get("CLUSTER_LOG_MAX_BYTES", "").strip()
    keep = env.get("CLUSTER_LOG_KEEP", "").strip()
    low, high = LOG_MAX_BYTES_RANGE
    fewest, most = LOG_KEEP_RANGE
    return LogRotation(
        max_bytes=parse_int("CLUSTER_LOG_MAX_BYTES", size, minimum=low, maximum=high)
        if size
        else DEFAULT_LOG_MAX_BYTES,
        keep=parse_int("CLUSTER_LOG_KEEP", keep, minimum=fewest, maximum=most)
        if keep
        else DEFAULT_LOG_KEEP,
    )


def job_secret_from_env(env: Mapping[str, str]) -> JobSecretSource | None:
    """CLUSTER_JOB_SECRET_FILE or CLUSTER_JOB_SECRET; None when neither is set.

    The variable's secret is its bytes as the process got them (`os.fsencode`: bytes that are
    not UTF-8 too), stripped as the file's are, so both forms of one secret are the same bytes
    in every process of the job."""
    path = env.get("CLUSTER_JOB_SECRET_FILE", "").strip()
    if path:
        return JobSecretSource(path=Path(path))
    if "CLUSTER_JOB_SECRET" not in env:
        return None
    value = os.fsencode(env["CLUSTER_JOB_SECRET"]).strip()
    if not value:
        raise ConfigError(
            "CLUSTER_JOB_SECRET is set but empty: an empty secret proves nothing; give every "
            "process of the job the same secret (e.g. `openssl rand -hex 32`), or unset it"
        )
    return JobSecretSource(value=value)


def read_job_secret(source: JobSecretSource, named: str | None = None) -> bytes:
    """The secret itself; ConfigError when its file is missing, empty or readable by others.
    `named`: how messages name the file (default: CLUSTER_JOB_SECRET_FILE=PATH)."""
    if source.path is None:
        assert source.value is not None
        return source.value
    where = named or f"CLUSTER_JOB_SECRET_FILE={str(source.path)!r}"
    try:
        found = source.path.stat()
        data = source.path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where} cannot be read ({exc.strerror}): point it at the job's secret file"
        ) from None
    if not secret_mode_ok(found.st_mode, found.st_uid):
        raise ConfigError(
            f"{where} has mode {found.st_mode & 0o777:o}: others than its owner may read or "
            f"change it, and so join the job; it must be 0600 or stricter: "
            f"`chmod 600 {source.path}`"
        )
    secret = data.rstrip(b"\r\n").strip()
    if not secret:
        raise ConfigError(
            f"{where} is empty: an empty secret proves nothing; write the job's secret in it "
            "(e.g. `openssl rand -hex 32 > FILE`)"
        )
    return secret


def limits_from_env(env: Mapping[str, str]) -> Limits:
    def cap(name: str, default: int) -> int:
        raw = env.get(name, "").strip()
        return parse_int(name, raw, minimum=1) if raw else default

    return Limits(
        kv_max_bytes=cap("CLUSTER_KV_MAX_BYTES", DEFAULT_KV_MAX_BYTES),
        kv_max_keys=cap("CLUSTER_KV_MAX_KEYS", DEFAULT_KV_MAX_KEYS),
        collective_max_bytes=cap("CLUSTER_COLLECTIVE_MAX_BYTES", DEFAULT_COLLECTIVE_MAX_BYTES),
        collective_timeout_s=parse_seconds("CLUSTER_COLLECTIVE_TIMEOUT_S", timeout)
        if (timeout := env.get("CLUSTER_COLLECTIVE_TIMEOUT_S", "").strip())
        else DEFAULT_COLLECTIVE_TIMEOUT_S,
        max_spares=parse_int("CLUSTER_MAX_SPARES", spares, minimum=0)
        if (spares := env.get("CLUSTER_MAX_SPARES", "").strip())
        else DEFAULT_MAX_SPARES,
        max_followers=cap("CLUSTER_MAX_FOLLOWERS", DEFAULT_MAX_FOLLOWERS),
        follower_max_bytes=cap("CLUSTER_FOLLOWER_MAX_BYTES", DEFAULT_FOLLOWER_MAX_BYTES),
        readers_prove_secret=parse_bool("CLUSTER_READERS_PROVE_SECRET", readers)
        if (readers := env.get("CLUSTER_READERS_PROVE_SECRET", "").strip())
        else True,
    )


def tls_options_from_env(
    env: Mapping[str, str], config_path: Path | None = None
) -> TLSOptions | None:
    """TLS from CLUSTER_TLS_CONFIG (or `config_path`) and the CLUSTER_TLS_* password variables.

    None when no ssl.json is named: TLS is off.
    """
    if config_path is None:
        raw = env.get("CLUSTER_TLS_CONFIG", "").strip()
        if not raw:
            return None
        config_path = Path(raw)

    def password(name: str) -> bytes | None:  # its bytes as given, as a password file's are
        value = env.get(name)
        return os.fsencode(value) if value else None

    def path(name: str) -> Path | None:
        value = env.get(name, "").strip()
        return Path(value) if value else None

    server_name = env.get("CLUSTER_TLS_SERVER_NAME", "").strip() or None
    if server_name is not None:
        check_host("CLUSTER_TLS_SERVER_NAME", server_name)
    return TLSOptions(
        config_path=config_path,
        client_password=password("CLUSTER_TLS_CLIENT_PASSWORD"),
        server_password=password("CLUSTER_TLS_SERVER_PASSWORD"),
        client_password_file=path("CLUSTER_TLS_CLIENT_PASSWORD_FILE"),
        server_password_file=path("CLUSTER_TLS_SERVER_PASSWORD_FILE"),
        server_name=server_name,
    )


def job_settings(config: ClusterConfig) -> JobSettings:
    """The settings of `config`'s job (reads the job secret's file, if it names one)."""
    from cluster.protocol.settings import JobSettings  # noqa: PLC0415 - the scheduler's only

    return JobSettings(
        worker_num=config.worker_num,
        server_num=config.server_num,
        node_timeout_s=config.node_timeout_s,
        topo_timeout_s=config.topo_timeout_s,
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_enabled=config.heartbeat_enabled,
        # The state in etcd (CLUSTER_STATE_URL) is recovery too, without MS_RECOVERY_PATH.
        recovery=config.recovery is not None or config.state_url is not None,
        job_secret=None if config.job_secret is None else read_job_secret(config.job_secret),
        limits=config.limits,
    )
