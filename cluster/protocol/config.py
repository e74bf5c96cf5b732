"""The launch environment, parsed and validated in one place.

The variable names and defaults are MindSpore's (docs/reference/environment.md); knobs that
MindSpore does not have are named CLUSTER_*. Parsing is pure (`from_env` takes a mapping); the
one check that touches the disk, that a recovery path is safe (`recovery_path` decides) and
writable, is `cluster.storage.recovery_dir.check_recovery_path`.
"""

from __future__ import annotations

import enum
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import check_host, is_decimal, split_address
from cluster.protocol.state_url import (
    DEFAULT_LEASE_S,
    StateUrl,
    lease_from_env,
    state_url_from_env,
)

DEFAULT_TOPO_TIMEOUT_S = 1800.0
DEFAULT_NODE_TIMEOUT_S = 30.0
# Heartbeats are sent every MS_NODE_TIMEOUT / 5, so that a timeout always spans several missed
# heartbeats, and at least this often. Each one costs both sides CPU for every node, and a
# dead process is seen at once anyway (its connection breaks).
MAX_HEARTBEAT_INTERVAL_S = 5.0
HEARTBEATS_PER_TIMEOUT = 5
# A large job's heartbeats are a steady load on the scheduler (about 0.25 ms of its CPU each,
# one each way per node per interval: 42% of a core for 8,192 nodes beating every 10 s): past
# 500 nodes the interval grows so that it receives at most this many a second. A node or the
# scheduler is taken for hung after MIN_HEARTBEATS_PER_TIMEOUT intervals of silence when that
# is longer than MS_NODE_TIMEOUT (see `silence_limit`); a process stopped or cut off is still
# found within MS_NODE_TIMEOUT, by gRPC's own pings (`cluster.transport.channel.
# keepalive_options`), which cost no Python on either side (benchmarks/heartbeats.py).
MAX_SCHEDULER_BEATS_PER_S = 100
MIN_HEARTBEATS_PER_TIMEOUT = 3

# Caps on what callers can make the scheduler hold (docs/design/security.md).
DEFAULT_KV_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_KV_MAX_KEYS = 100_000
DEFAULT_COLLECTIVE_MAX_BYTES = 1024 * 1024 * 1024
# How long a collective waits for its last rank (CLUSTER_COLLECTIVE_TIMEOUT_S), then fails on
# every rank naming the ranks that never came: 10 minutes, as NCCL process groups in torch.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Spares a scheduler takes at most: enough for the failures between two restarts of a node, few
# enough that registrations cannot exhaust the scheduler (CLUSTER_MAX_SPARES).
DEFAULT_MAX_SPARES = 8
# Readers following the job's events at once (`mscluster events --follow`, status --watch), and
# the bytes of events each may have waiting before it is cut off (CLUSTER_MAX_FOLLOWERS,
# CLUSTER_FOLLOWER_MAX_BYTES): a few people watch a job; a reader that does not read costs at
# most this much.
DEFAULT_MAX_FOLLOWERS = 16
DEFAULT_FOLLOWER_MAX_BYTES = 4 * 1024 * 1024

# The most nodes (MS_WORKER_NUM + MS_SERVER_NUM) a job may have. Every node holds a connection
# to the scheduler, one descriptor of one process, and Linux lets a process have at most
# fs.nr_open = 1,048,576 of them by default; the largest job run so far has 8,192 nodes. Past
# this a number is a typo (10**12 overflowed gRPC's channel arguments), said in one line.
MAX_NODES = 1_000_000

# Files an outsider can make the scheduler write (its event log, its log) rotate at this size,
# keeping this many old files (CLUSTER_LOG_MAX_BYTES, CLUSTER_LOG_KEEP): at most
# (1 + keep) x max bytes each, 256 MiB with the defaults.
DEFAULT_LOG_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_LOG_KEEP = 3
LOG_MAX_BYTES_RANGE = (1024, 1 << 40)
LOG_KEEP_RANGE = (1, 100)

_NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Role(enum.Enum):
    """A process's role, named as in MS_ROLE."""

    SCHEDULER = "MS_SCHED"
    WORKER = "MS_WORKER"
    SERVER = "MS_PSERVER"


@dataclass(frozen=True)
class RecoveryConfig:
    path: Path


@dataclass(frozen=True)
class TLSOptions:
    """Where TLS comes from: the ssl.json and the p12 passwords (docs/howto/tls.md).

    Only the sources: `cluster.tls` opens the files. A password given here (from the environment
    or `set_ps_context`) is never shown in a repr; a password file is preferred to it.
    """

    config_path: Path
    client_password: bytes | None = field(default=None, repr=False)
    server_password: bytes | None = field(default=None, repr=False)
    client_password_file: Path | None = None
    server_password_file: Path | None = None
    # The name the scheduler's certificate is checked against when it is not MS_SCHED_HOST.
    server_name: str | None = None


@dataclass(frozen=True)
class LogRotation:
    """When a log file is full (`max_bytes`) and how many full ones are kept (`keep`): FILE.1
    the newest, FILE.<keep> the oldest."""

    max_bytes: int = DEFAULT_LOG_MAX_BYTES
    keep: int = DEFAULT_LOG_KEEP


@dataclass(frozen=True)
class ObserveConfig:
    """What a process shows of itself (docs/howto/observing.md); all off by default.

    `metrics_port`: the scheduler's Prometheus /metrics (0: any free port, logged);
    `event_log`: the scheduler's JSON-lines event log; `worker_metrics_port`: a worker's
    /metrics on this port + its local rank; `log_file`: the file the scheduler writes its log
    (and its stdout and stderr) to (CLUSTER_LOG_FILE; None: stderr as it is); `rotation`: how
    the event log and the log file rotate.
    """

    metrics_port: int | None = None
    event_log: Path | None = None
    worker_metrics_port: int | None = None
    log_file: Path | None = None
    rotation: LogRotation = field(default_factory=LogRotation)


@dataclass(frozen=True)
class JobSecretSource:
    """Where the job secret comes from: CLUSTER_JOB_SECRET_FILE (preferred) or
    CLUSTER_JOB_SECRET. Only the source: `read_job_secret` opens the file."""

    value: bytes | None = field(default=None, repr=False)
    path: Path | None = None


@dataclass(frozen=True)
class Limits:
    """What the scheduler holds for its callers at most (CLUSTER_KV_MAX_BYTES, ...)."""

    kv_max_bytes: int = DEFAULT_KV_MAX_BYTES
    kv_max_keys: int = DEFAULT_KV_MAX_KEYS
    collective_max_bytes: int = DEFAULT_COLLECTIVE_MAX_BYTES
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    # Spare workers the scheduler takes at most (CLUSTER_MAX_SPARES; 0: none).
    max_spares: int = DEFAULT_MAX_SPARES
    # Event followers at once, and the bytes each may have waiting (CLUSTER_MAX_FOLLOWERS, ...).
    max_followers: int = DEFAULT_MAX_FOLLOWERS
    follower_max_bytes: int = DEFAULT_FOLLOWER_MAX_BYTES
    # With a job secret, Status and WatchEvents need its proof (or a client certificate);
    # CLUSTER_READERS_PROVE_SECRET=0 opens the read side to whoever reaches the port.
    readers_prove_secret: bool = True


@dataclass(frozen=True)
class ClusterConfig:
    role: Role
    worker_num: int
    server_num: int
    sched_host: str
    sched_port: int
    node_id: str | None
    recovery: RecoveryConfig | None
    topo_timeout_s: float
    node_timeout_s: float
    heartbeat_enabled: bool
    heartbeat_interval_s: float
    tls: TLSOptions | None = None
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    job_secret: JobSecretSource | None = None
    limits: Limits = field(default_factory=Limits)
    # CLUSTER_SPARE=1: a worker without a rank, waiting to take a failed worker's.
    spare: bool = False
    # Scheduler: its state in etcd (CLUSTER_STATE_URL; recovery on, standbys possible), and the
    # leader's lease (CLUSTER_LEASE_S).
    state_url: StateUrl | None = None
    lease_s: int = DEFAULT_LEASE_S
    # Every scheduler of the job as "host:port", the leader among them (MS_SCHED_HOST=h1,h2 or
    # CLUSTER_SCHED_ADDRS); empty: the one at sched_host:sched_port.
    sched_addresses: tuple[str, ...] = ()

    @property
    def sched_address(self) -> str:
        host = f"[{self.sched_host}]" if ":" in self.sched_host else self.sched_host
        return f"{host}:{self.sched_port}"

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every scheduler address a worker may try, the first first."""
        return self.sched_addresses or (self.sched_address,)

    @property
    def expected_nodes(self) -> int:
        return self.worker_num + self.server_num


def _require(env: Mapping[str, str], name: str, rule: str) -> str:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise ConfigError(f"{name} is not set: it is required ({rule})")
    return value.strip()


def parse_int(name: str, value: str, *, minimum: int, maximum: int | None = None) -> int:
    """An integer in [minimum, maximum], or a ConfigError naming `name`, `value` and the rule."""
    bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
    try:
        number = int(value.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: it must be {bounds}") from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ConfigError(f"{name}={value!r} is out of range: it must be {bounds}")
    return number


def parse_seconds(name: str, value: str) -> float:
    """A positive, finite number of seconds."""
    try:
        number = float(value.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={value!r} is not a number: it must be a positive number of seconds"
        ) from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(
            f"{name}={value!r} is out of range: it must be a positive number of seconds"
        )
    return number


def parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: use 1/0, true/false, yes/no or on/off")


def parse_port(name: str, value: str) -> int:
    return parse_int(name, value, minimum=1, maximum=65535)


def parse_node_id(name: str, value: str) -> str:
    node_id = value.strip()
    if not _NODE_ID_RE.match(node_id):
        raise ConfigError(
            f"{name}={value!r} is not a valid node id: use 1-128 characters of letters, digits "
            "and . _ : @ -, starting with a letter or digit"
        )
    return canonical_node_id(node_id)


def is_numeric_node_id(node_id: str) -> bool:
    """A node id of ASCII digits is a rank."""
    return is_decimal(node_id)


def join_address(host: str, port: int) -> str:
    """ "host:port", an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def sched_addresses_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """Every scheduler address: CLUSTER_SCHED_ADDRS=h1:p1,h2:p2, else MS_SCHED_HOST=h1,h2 with
    MS_SCHED_PORT. A ConfigError naming the variable for an empty entry or a bad port."""
    listed = env.get("CLUSTER_SCHED_ADDRS", "").strip()
    if listed:
        entries = [entry.strip() for entry in listed.split(",")]
        if not all(entries):
            raise ConfigError(
                f"CLUSTER_SCHED_ADDRS={listed!r} has an empty entry: list HOST:PORT,HOST:PORT"
            )
        return tuple(
            join_address(*split_address("CLUSTER_SCHED_ADDRS entry", entry)) for entry in entries
        )
    hosts_value = _require(env, "MS_SCHED_HOST", "the scheduler's host name or IP address")
    hosts = [host.strip() for host in hosts_value.split(",")]
    if not all(hosts):
        raise ConfigError(
            f"MS_SCHED_HOST={hosts_value!r} has an empty entry: give one host, or several "
            "separated by commas (h1,h2), all listening on MS_SCHED_PORT"
        )
    port = parse_port(
        "MS_SCHED_PORT", _require(env, "MS_SCHED_PORT", "the scheduler's port, 1-65535")
    )
    return tuple(
        join_address(check_host("MS_SCHED_HOST entry", host.strip("[]")), port) for host in hosts
    )


def valid_node_id(node_id: str) -> bool:
    return bool(_NODE_ID_RE.match(node_id))


def canonical_node_id(node_id: str) -> str:
    """A numeric node id is a rank: '007' and '7' are the same node."""
    return str(int(node_id)) if is_numeric_node_id(node_id) else node_id


def from_env(env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Parse the launch environment (os.environ by default) into a ClusterConfig."""
    env = os.environ if env is None else env
    role = _role_from_env(env)
    worker_num, server_num = node_counts_from_env(env)
    if role is Role.SERVER and server_num == 0:
        raise ConfigError("MS_ROLE='MS_PSERVER' needs MS_SERVER_NUM >= 1, but MS_SERVER_NUM is 0")
    addresses = sched_addresses_from_env(env)
    sched_host, sched_port = split_address("the scheduler address", addresses[0])
    node_id = _node_id_from_env(env, role, worker_num, server_num)
    state_url = state_url_from_env(env) if role is Role.SCHEDULER else None
    recovery = _recovery_from_env(env, role, node_id, state_url)
    topo_timeout = parse_seconds(
        "MS_TOPO_TIMEOUT", env.get("MS_TOPO_TIMEOUT", "") or str(DEFAULT_TOPO_TIMEOUT_S)
    )
    node_timeout = parse_seconds(
        "MS_NODE_TIMEOUT", env.get("MS_NODE_TIMEOUT", "") or str(DEFAULT_NODE_TIMEOUT_S)
    )
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
        observe=observe_from_env(env),
        job_secret=job_secret_from_env(env),
        limits=limits_from_env(env),
        spare=_spare_from_env(env, role, recovery is not None),
        state_url=state_url,
        lease_s=lease_from_env(env) if state_url is not None else DEFAULT_LEASE_S,
        sched_addresses=addresses if len(addresses) > 1 else (),
    )


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
            f"MS_ROLE={role_value!r} is not a role: it must be one of MS_SCHED, MS_WORKER, "
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
                f"MS_NODE_ID={raw_node_id!r} is numeric, so it is the rank, and must be below "
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
    interval = parse_seconds("CLUSTER_HEARTBEAT_INTERVAL", interval_value)
    if interval >= node_timeout:
        raise ConfigError(
            f"CLUSTER_HEARTBEAT_INTERVAL={interval_value!r} must be shorter than "
            f"MS_NODE_TIMEOUT ({node_timeout:g} s), or every node would time out"
        )
    return interval


def observe_from_env(env: Mapping[str, str]) -> ObserveConfig:
    """CLUSTER_METRICS_PORT, CLUSTER_EVENT_LOG and CLUSTER_WORKER_METRICS_PORT."""
    metrics = env.get("CLUSTER_METRICS_PORT", "").strip()
    event_log = env.get("CLUSTER_EVENT_LOG", "").strip()
    worker = env.get("CLUSTER_WORKER_METRICS_PORT", "").strip()
    log_file = env.get("CLUSTER_LOG_FILE", "").strip()
    return ObserveConfig(
        metrics_port=(
            parse_int("CLUSTER_METRICS_PORT", metrics, minimum=0, maximum=65535)
            if metrics
            else None
        ),
        event_log=Path(event_log) if event_log else None,
        worker_metrics_port=parse_port("CLUSTER_WORKER_METRICS_PORT", worker) if worker else None,
        log_file=Path(log_file) if log_file else None,
        rotation=log_rotation_from_env(env),
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
    """CLUSTER_JOB_SECRET_FILE or CLUSTER_JOB_SECRET; None when neither is set."""
    path = env.get("CLUSTER_JOB_SECRET_FILE", "").strip()
    if path:
        return JobSecretSource(path=Path(path))
    if "CLUSTER_JOB_SECRET" not in env:
        return None
    value = env["CLUSTER_JOB_SECRET"].strip()
    if not value:
        raise ConfigError(
            "CLUSTER_JOB_SECRET is set but empty: an empty secret proves nothing; give every "
            "process of the job the same secret (e.g. `openssl rand -hex 32`), or unset it"
        )
    return JobSecretSource(value=value.encode())


def secret_mode_ok(mode: int, owner_uid: int) -> bool:
    """A job secret file's mode: 0600 or stricter. One exception, PostgreSQL's for its keys: a
    file root owns may also be read by its group (0640, 0440), as Kubernetes mounts a Secret
    for a pod's fsGroup whatever its defaultMode says; root gives that group the job."""
    if owner_uid == 0:
        return not mode & 0o037
    return not mode & 0o077


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

    def password(name: str) -> bytes | None:
        value = env.get(name)
        return value.encode() if value else None

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


def default_heartbeat_interval(node_timeout_s: float, nodes: int = 1) -> float:
    """Seconds between heartbeats in a job of `nodes` nodes, unless CLUSTER_HEARTBEAT_INTERVAL
    says otherwise."""
    interval = min(MAX_HEARTBEAT_INTERVAL_S, node_timeout_s / HEARTBEATS_PER_TIMEOUT)
    return max(interval, nodes / MAX_SCHEDULER_BEATS_PER_S)


def silence_limit(node_timeout_s: float, heartbeat_interval_s: float) -> float:
    """How long a live node, or the scheduler, may go unheard before the other side takes it
    for hung: MS_NODE_TIMEOUT, or MIN_HEARTBEATS_PER_TIMEOUT heartbeat intervals when that is
    longer (a large job's, see MAX_SCHEDULER_BEATS_PER_S), so that one late beat is never a
    death."""
    return max(node_timeout_s, MIN_HEARTBEATS_PER_TIMEOUT * heartbeat_interval_s)
