"""The launch configuration: its records (`ClusterConfig` and its parts), defaults and rules
(node ids, addresses, values and their ranges), pure. Reading it from the environment is
`cluster.protocol.environment`'s.

The variable names and defaults are MindSpore's (docs/reference/environment.md); knobs that
MindSpore does not have are named CLUSTER_*.
"""

from __future__ import annotations

import enum
import re
from dataclasses import field
from pathlib import Path

from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import is_decimal, plain_float, shown
from cluster.protocol.state_url import (
    DEFAULT_LEASE_S,
    StateUrl,
)
from cluster.protocol.value import frozen

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

# The longest time any variable may give, in seconds (about 23 days): MS_NODE_TIMEOUT becomes
# gRPC's keepalive timeout in milliseconds, KEEPALIVE_SLACK_MS added (`cluster.transport.
# channel.keepalive_ms`), which gRPC takes only as a C int (at most 2,147,483,647 ms, 24.8
# days); every other wait here is as long at most, so that no deadline is a typo's 1e20 s.
MAX_SECONDS = 2_000_000
# The shortest MS_NODE_TIMEOUT: a healthy node, a scheduler busy for a moment, a garbage
# collection, are all silent for tens of milliseconds, and a timeout that short fails the job.
MIN_NODE_TIMEOUT_S = 1
# The shortest CLUSTER_HEARTBEAT_INTERVAL: each beat costs both sides CPU for every node, and
# one every nanosecond keeps a worker's core busy beating (4.7 s of CPU in 5 s).
MIN_HEARTBEAT_INTERVAL_S = 0.1

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
# Readers of the job's events at once (`mscluster events --follow`, status --watch; a read
# without follow counts until it is read to its end), and the bytes of events each follower may
# have waiting before it is cut off (CLUSTER_MAX_FOLLOWERS, CLUSTER_FOLLOWER_MAX_BYTES): a few
# people watch a job; a reader that does not read costs at most this much.
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

# Pinned host memory a worker's snapshots of CUDA tensors may hold in all
# (CLUSTER_PINNED_MAX_BYTES; 0: never pin): two snapshots of a 2 GiB state, one being written,
# one copied (`cluster.storage.host_buffers`).
DEFAULT_PINNED_MAX_BYTES = 4 << 30

# Digits of the longest integer a variable may hold (every bound here is below 10**20).
MAX_INT_DIGITS = 20

_NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Role(enum.Enum):
    """A process's role, named as in MS_ROLE."""

    SCHEDULER = "MS_SCHED"
    WORKER = "MS_WORKER"
    SERVER = "MS_PSERVER"


@frozen
class RecoveryConfig:
    path: Path


@frozen
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


@frozen
class LogRotation:
    """When a log file is full (`max_bytes`) and how many full ones are kept (`keep`): FILE.1
    the newest, FILE.<keep> the oldest."""

    max_bytes: int = DEFAULT_LOG_MAX_BYTES
    keep: int = DEFAULT_LOG_KEEP


@frozen
class ObserveConfig:
    """What a process shows of itself (docs/howto/observing.md); all off by default.

    `metrics_port`: the scheduler's Prometheus /metrics (0: any free port, logged), plain HTTP
    and open to whoever reaches it; `metrics_host`: the address it listens on (None: the
    scheduler's own, MS_SCHED_HOST);
    `event_log`: the scheduler's JSON-lines event log; `worker_metrics_port`: a worker's
    /metrics on this port + its local rank; `log_file`: the file the scheduler writes its log
    (and its stdout and stderr) to (CLUSTER_LOG_FILE; None: stderr as it is); `rotation`: how
    the event log and the log file rotate.
    """

    metrics_port: int | None = None
    metrics_host: str | None = None
    event_log: Path | None = None
    worker_metrics_port: int | None = None
    log_file: Path | None = None
    rotation: LogRotation = field(default_factory=LogRotation)


@frozen
class JobSecretSource:
    """Where the job secret comes from: CLUSTER_JOB_SECRET_FILE (preferred) or
    CLUSTER_JOB_SECRET. Only the source: `read_job_secret` opens the file."""

    value: bytes | None = field(default=None, repr=False)
    path: Path | None = None


@frozen
class Limits:
    """What the scheduler holds for its callers at most (CLUSTER_KV_MAX_BYTES, ...)."""

    kv_max_bytes: int = DEFAULT_KV_MAX_BYTES
    kv_max_keys: int = DEFAULT_KV_MAX_KEYS
    collective_max_bytes: int = DEFAULT_COLLECTIVE_MAX_BYTES
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    # Spare workers the scheduler takes at most (CLUSTER_MAX_SPARES; 0: none).
    max_spares: int = DEFAULT_MAX_SPARES
    # Event readers at once (CLUSTER_MAX_FOLLOWERS), and the bytes each follower may have waiting.
    max_followers: int = DEFAULT_MAX_FOLLOWERS
    follower_max_bytes: int = DEFAULT_FOLLOWER_MAX_BYTES
    # With a job secret, Status and WatchEvents need its proof (or a client certificate);
    # CLUSTER_READERS_PROVE_SECRET=0 opens the read side to whoever reaches the port.
    readers_prove_secret: bool = True


@frozen
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
    # A worker's way to the scheduler through its host's relay (CLUSTER_RELAY=unix:PATH, which
    # `mscluster run` sets); None: direct.
    relay: str | None = None
    # Pinned host memory its snapshots of CUDA tensors may hold (CLUSTER_PINNED_MAX_BYTES).
    pinned_max_bytes: int = DEFAULT_PINNED_MAX_BYTES

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


def parse_int(name: str, value: str, *, minimum: int, maximum: int | None = None) -> int:
    """An integer in [minimum, maximum], or a ConfigError naming `name`, `value` and the rule.

    ASCII digits with an optional leading minus, space around them allowed: int() would also
    take fullwidth digits, '1_000' and '+4', which no other reader of the same value (a port in
    a URL, a HOST:PORT) takes.
    """
    bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
    text = value.strip()
    digits = text.removeprefix("-")
    if not is_decimal(digits):
        raise ConfigError(f"{name}={shown(value)} is not an integer: it must be {bounds}")
    # Past MAX_INT_DIGITS digits a number is out of every range here (and int() refuses one of
    # over 4300 digits).
    too_long = len(digits.lstrip("0")) > MAX_INT_DIGITS
    number = 0 if too_long else int(text, 10)
    if too_long and maximum is None:
        bounds += f", of at most {MAX_INT_DIGITS} digits"
    if too_long or number < minimum or (maximum is not None and number > maximum):
        raise ConfigError(f"{name}={shown(value)} is out of range: it must be {bounds}")
    return number


def parse_seconds(name: str, value: str, *, minimum: float | None = None) -> float:
    """A number of seconds above 0, at least `minimum` when given, and at most MAX_SECONDS,
    written in ASCII (float() would also take fullwidth digits and '1_0'); or a ConfigError
    naming `name`, `value` and the rule."""
    floor = "" if minimum is None else f"at least {minimum:g} and "
    rule = f"it must be a positive number of seconds, {floor}at most {MAX_SECONDS} (23 days)"
    number = plain_float(value.strip())
    if number is None:
        raise ConfigError(f"{name}={shown(value)} is not a number: {rule}")
    if not 0 < number <= MAX_SECONDS or (minimum is not None and number < minimum):
        raise ConfigError(f"{name}={shown(value)} is out of range: {rule}")
    return number


def parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(
        f"{name}={shown(value)} is not a boolean: use 1/0, true/false, yes/no or on/off"
    )


def parse_port(name: str, value: str) -> int:
    return parse_int(name, value, minimum=1, maximum=65535)


def parse_node_id(name: str, value: str) -> str:
    node_id = value.strip()
    if not _NODE_ID_RE.fullmatch(node_id):
        raise ConfigError(
            f"{name}={shown(value)} is not a valid node id: use 1-128 characters of letters, "
            "digits and . _ : @ -, starting with a letter or digit"
        )
    return canonical_node_id(node_id)


def is_numeric_node_id(node_id: str) -> bool:
    """A node id of ASCII digits is a rank."""
    return is_decimal(node_id)


def join_address(host: str, port: int) -> str:
    """ "host:port", an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def valid_node_id(node_id: str) -> bool:
    return bool(_NODE_ID_RE.fullmatch(node_id))


def canonical_node_id(node_id: str) -> str:
    """A numeric node id is a rank: '007' and '7' are the same node."""
    return str(int(node_id)) if is_numeric_node_id(node_id) else node_id


def secret_mode_ok(mode: int, owner_uid: int) -> bool:
    """A job secret file's mode: 0600 or stricter. One exception, PostgreSQL's for its keys: a
    file root owns may also be read by its group (0640, 0440), as Kubernetes mounts a Secret
    for a pod's fsGroup whatever its defaultMode says; root gives that group the job."""
    if owner_uid == 0:
        return not mode & 0o037
    return not mode & 0o077


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
