"""What `mscluster run` starts on this host: each process's role, node id, command, environment
and log file, decided before anything starts.

Pure: the shell (`cluster.tools.launch`) resolves the master address, reads the TLS config and
finds the job secret, then asks `make_plan` what to start, and starts exactly that;
`mscluster run --dry-run` prints the same plan with `render` instead.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster.protocol.config import is_numeric_node_id
from cluster.protocol.environment import sched_addresses_from_env
from cluster.protocol.errors import ConfigError
from cluster.tools.slurm import Allocation
from cluster.tools.table import format_table

HIDDEN = "<hidden>"
# Variables of the launcher's own environment that matter to the job, shown by --dry-run.
SHOWN_PREFIXES = ("CLUSTER_", "GRPC_", "MS_")

# The variables the launcher sets itself, for the job or per process: one of its own
# environment is not passed on (`child_environment`), and --dry-run names those it replaces.
LAUNCHER_SET = (
    *("MS_ROLE", "MS_NODE_ID", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT"),
    # msrun's, which user scripts read (`place`): every process gets RANK_SIZE.
    *("RANK_SIZE", "RANK_ID", "RANK", "LOCAL_RANK", "DEVICE_ID"),
)
# msrun's variables that are the defaults of an option here, with the LaunchOptions field each
# sets: one of the launcher's environment is that option's value unless the option is given
# (`launch_setup.settle`), and its children get the value the options say, never the inherited
# one as it is. Every other MS_* variable (MS_ALLOC_CONF, MS_DEV_SAVE_GRAPHS, ...) is passed on.
OPTION_VARIABLES = {
    "MS_TOPO_TIMEOUT": ("--cluster-time-out", "cluster_time_out"),
    "MS_NODE_TIMEOUT": ("--node-timeout", "node_timeout"),
    "MS_ENABLE_RECOVERY": ("--enable-recovery", "enable_recovery"),
    "MS_RECOVERY_PATH": ("--recovery-path", "recovery_path"),
}


# --max-restarts when not given, with recovery on: a scheduler (or worker) killed once is started
# again and the job goes on; without recovery a restarted scheduler would not know the job.
RESTARTS_WITH_RECOVERY = 1


def max_restarts_for(given: int | None, *, recovery: bool) -> int:
    """--max-restarts as given, else its default: RESTARTS_WITH_RECOVERY with recovery, else 0."""
    if given is not None:
        return given
    return RESTARTS_WITH_RECOVERY if recovery else 0


@dataclass(frozen=True)
class LaunchOptions:
    script: Path
    script_args: tuple[str, ...]
    worker_num: int
    local_worker_num: int
    master_addr: str
    master_port: int
    node_rank: int = -1
    log_dir: Path = Path("logs")
    join: bool = False
    cluster_time_out: float | None = None
    node_timeout: float | None = None
    enable_recovery: bool = False
    recovery_path: Path | None = None
    max_restarts: int = 0
    spares: int = 0  # spare workers started here (CLUSTER_SPARE=1)
    tls_config: Path | None = None
    metrics_port: int | None = None  # the scheduler's /metrics (CLUSTER_METRICS_PORT)
    # The scheduler's state in etcd (CLUSTER_STATE_URL; implies recovery), its lease.
    state_url: str | None = None
    lease_s: int | None = None
    python: str = sys.executable
    # The Slurm allocation the placement came from (None: not under Slurm, or not used).
    allocation: Allocation | None = None
    # The master address is a Slurm node name: reach it at its NodeAddr when it does not resolve.
    master_is_node: bool = False
    # CLUSTER_JOB_SECRET_FILE for every process (None: what the environment gives, if anything).
    job_secret_file: Path | None = None
    # A relay for this host's workers when it starts at least RELAY_FROM of them (--no-relay),
    # and where it serves them: a socket in a private directory the launcher makes (None: none).
    relay: bool = True
    relay_socket: Path | None = None
    # How the options were settled from the environment (`launch_setup.settle`): --dry-run's notes.
    notes: tuple[str, ...] = ()

    @property
    def job_recovery_path(self) -> Path:
        """--recovery-path, or LOG_DIR/recovery: the job's state beside its logs."""
        return self.recovery_path if self.recovery_path is not None else self.log_dir / "recovery"


@dataclass(frozen=True)
class Process:
    name: str  # "scheduler", "worker 0"
    role: str  # MS_SCHED, MS_WORKER
    args: tuple[str, ...]
    env: Mapping[str, str]  # what the launcher sets, on top of its own environment
    log: Path
    node_id: str | None = None
    index: int | None = None  # a worker's index on this host (spares follow the workers)
    spare: bool = False  # started as a spare (CLUSTER_SPARE=1)

    @property
    def rank(self) -> int | None:
        """Known in advance for a numeric node id (it is the rank), else given at registration."""
        if self.node_id is not None and is_numeric_node_id(self.node_id):
            return int(self.node_id)
        return None


@dataclass(frozen=True)
class Plan:
    ip: str  # the scheduler's address
    address: str  # where the scheduler is reached, HOST:PORT
    scheduler: Process | None  # None: it runs on another host
    workers: tuple[Process, ...]
    notes: tuple[str, ...] = field(default=())  # what the shell found out, for --dry-run
    relay: Process | None = None  # this host's relay, started before the workers

    @property
    def processes(self) -> tuple[Process, ...]:
        first = () if self.scheduler is None else (self.scheduler,)
        return (*first, *self.workers, *(() if self.relay is None else (self.relay,)))


# A host that starts at least this many workers (spares counted) starts a relay for them: one
# connection to the scheduler instead of one each. A single worker gains nothing from one.
RELAY_FROM = 2


def wants_relay(options: LaunchOptions) -> bool:
    """Whether this host's workers reach the scheduler through a relay of this launcher."""
    return options.relay and options.local_worker_num + options.spares >= RELAY_FROM


def launcher_name(options: LaunchOptions, hostname: str) -> str:
    """This launcher's part of a job that spans hosts without --node-rank, as its node ids name
    it: `<hostname>-<8 hex digits of the log directory's absolute path, links resolved>`. Two
    launchers of one job on one host hold two log directories (`launch_lock`), so their names
    differ; the same command run again on the same host with the same --log-dir (the host
    rebooted) names its workers as before, and with recovery they rejoin their ranks."""
    path = os.fsencode(options.log_dir.resolve())  # its bytes, UTF-8 or not
    return f"{hostname}-{hashlib.sha256(path).hexdigest()[:8]}"


def node_ids(options: LaunchOptions, hostname: str) -> list[str]:
    """The MS_NODE_ID of each local worker: numeric (so the rank) when it can be; else unique
    across the job's hosts and the same on every run of the launcher (`launcher_name`)."""
    local = options.local_worker_num
    if options.node_rank >= 0:
        return [str(options.node_rank * local + i) for i in range(local)]
    if local == options.worker_num:  # the whole job is here: worker i is rank i
        return [str(i) for i in range(local)]
    return [f"{launcher_name(options, hostname)}-{i:04d}" for i in range(local)]


def spare_ids(options: LaunchOptions, hostname: str) -> list[str]:
    """The MS_NODE_ID of each local spare: never numeric (a numeric id is a rank), unique
    across the job's hosts, the same on every run of the launcher."""
    if options.local_worker_num == options.worker_num:
        return [f"spare-{i}" for i in range(options.spares)]
    if options.node_rank >= 0:
        return [f"spare-{options.node_rank}-{i}" for i in range(options.spares)]
    return [f"spare-{launcher_name(options, hostname)}-{i}" for i in range(options.spares)]


def bare_host(host: str) -> str:
    """`host` as given, without the space around it and the brackets of an IPv6 literal
    (`[::1]` is `::1`)."""
    host = host.strip()
    return host[1:-1].strip() if host.startswith("[") and host.endswith("]") else host


def master_host(master_addr: str) -> str:
    """The scheduler host of `--master-addr h1[,h2...]`: the first (bare, `bare_host`)."""
    return bare_host(master_addr.split(",", maxsplit=1)[0])


def standby_hosts(master_addr: str) -> list[str]:
    """The standby schedulers' hosts of `--master-addr h1,h2,...`: all but the first (bare)."""
    return [bare_host(host) for host in master_addr.split(",")[1:]]


def job_environment(
    options: LaunchOptions, ip: str, launcher_pid: int, tls_env: Mapping[str, str]
) -> dict[str, str]:
    """The variables every process of the job gets from the launcher."""
    o = options
    env = {
        "MS_WORKER_NUM": str(o.worker_num),
        "RANK_SIZE": str(o.worker_num),  # msrun's, for user scripts
        # The standbys' hosts after the master's (--master-addr h1,h2): workers follow the leader.
        "MS_SCHED_HOST": ",".join([ip, *standby_hosts(o.master_addr)]),
        "MS_SCHED_PORT": str(o.master_port),
        "PYTHONUNBUFFERED": "1",
        "CLUSTER_LAUNCHER_PID": str(launcher_pid),  # children stop when the launcher is gone
    }
    if o.cluster_time_out is not None:
        env["MS_TOPO_TIMEOUT"] = seconds_text(o.cluster_time_out)
    if o.node_timeout is not None:
        env["MS_NODE_TIMEOUT"] = seconds_text(o.node_timeout)
    if o.enable_recovery:
        env["MS_ENABLE_RECOVERY"] = "1"
        env["MS_RECOVERY_PATH"] = str(o.job_recovery_path.resolve())
    env.update(tls_env)
    if o.job_secret_file is not None:
        env["CLUSTER_JOB_SECRET_FILE"] = str(o.job_secret_file.resolve())
    return env


def seconds_text(seconds: float) -> str:
    """`seconds` as the launcher passes it on: 1800, 0.5, 2000000 (never 2e+06)."""
    return f"{seconds:.15g}"


def observe_environment(options: LaunchOptions) -> dict[str, str]:
    """The scheduler's: its event log and its log file (which it rotates: the launcher's
    redirection of its output holds only what comes before its logging starts) beside the
    logs, its metrics port when asked for, and its state in etcd (--state-url)."""
    env = {
        "CLUSTER_EVENT_LOG": str((options.log_dir / "events.jsonl").resolve()),
        "CLUSTER_LOG_FILE": str((options.log_dir / "scheduler.log").resolve()),
    }
    if options.metrics_port is not None:
        env["CLUSTER_METRICS_PORT"] = str(options.metrics_port)
    if options.state_url is not None:
        env["CLUSTER_STATE_URL"] = options.state_url
    if options.lease_s is not None:
        env["CLUSTER_LEASE_S"] = str(options.lease_s)
    return env


def make_plan(
    options: LaunchOptions,
    *,
    ip: str,
    with_scheduler: bool,
    hostname: str,
    launcher_pid: int,
    tls_env: Mapping[str, str],
    notes: Sequence[str] = (),
) -> Plan:
    o = options
    base = job_environment(o, ip, launcher_pid, tls_env)
    relay = relay_process(o, base)
    reach = {} if relay is None else {"CLUSTER_RELAY": relay.args[-1]}
    scheduler = None
    if with_scheduler:
        scheduler = Process(
            "scheduler",
            "MS_SCHED",
            (o.python, "-m", "cluster", "scheduler"),  # the script is not imported twice
            {**base, "MS_ROLE": "MS_SCHED", **observe_environment(o)},
            o.log_dir / "scheduler.log",
        )
    workers = tuple(
        Process(
            f"worker {i}",
            "MS_WORKER",
            (o.python, str(o.script), *o.script_args),
            {**base, **reach, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": node_id, **place(node_id, i)},
            o.log_dir / f"worker_{worker_log_name(node_id, i)}.log",
            node_id=node_id,
            index=i,
        )
        for i, node_id in enumerate(node_ids(o, hostname))
    )
    spares = tuple(
        Process(
            f"spare {i}",
            "MS_WORKER",
            (o.python, str(o.script), *o.script_args),
            {**base, **reach, "MS_ROLE": "MS_WORKER", "MS_NODE_ID": node_id, "CLUSTER_SPARE": "1"},
            o.log_dir / f"spare_{spare_log_name(node_id)}.log",
            node_id=node_id,
            index=o.local_worker_num + i,
            spare=True,
        )
        for i, node_id in enumerate(spare_ids(o, hostname))
    )
    workers = workers + spares
    address = f"[{ip}]:{o.master_port}" if ":" in ip else f"{ip}:{o.master_port}"
    return Plan(ip, address, scheduler, workers, tuple(notes), relay)


def worker_log_name(node_id: str, index: int) -> str:
    """What names a worker's log, `worker_<this>.log`, as msrun names it: its planned rank
    where its node id is numeric (worker_2.log on the host of ranks 2 and 3, so that the logs
    of several hosts gathered in one place do not collide), else its index here."""
    return node_id if is_numeric_node_id(node_id) else str(index)


def spare_log_name(node_id: str) -> str:
    """What names a spare's log, `spare_<this>.log`: its node id (`spare_ids`) less `spare-`,
    so unique across the job's hosts as its node id is (`spare_0.log` where the whole job runs
    on this host, `spare_1-0.log` with --node-rank 1, `spare_<hostname>-<h>-0.log` on a host of
    a job ranked at registration), and the logs of several hosts gathered in one place do not
    collide."""
    return node_id.removeprefix("spare-")


def place(node_id: str, index: int) -> dict[str, str]:
    """msrun's variables of a worker's place, which user scripts read: LOCAL_RANK and DEVICE_ID,
    its index among this launcher's workers; RANK_ID and RANK, its planned rank, where its node
    id is numeric (it is the rank then). The rank it holds is `cluster.get_rank()`'s: a worker
    of assigned node ids is ranked at registration, and a spare may take a rank over."""
    env = {"LOCAL_RANK": str(index), "DEVICE_ID": str(index)}
    if is_numeric_node_id(node_id):
        env.update(RANK_ID=node_id, RANK=node_id)
    return env


def relay_process(options: LaunchOptions, base: Mapping[str, str]) -> Process | None:
    """This host's relay, when it has a socket to serve (`LaunchOptions.relay_socket`)."""
    if options.relay_socket is None:
        return None
    address = f"unix:{options.relay_socket}"
    command = (options.python, "-m", "cluster", "relay", "--socket", address)
    return Process("relay", "relay", command, base, options.log_dir / "relay.log")


# Variables that define the job which the launcher decides itself, with what decides them and
# what it makes of them when it sets none: one of its own environment would reach its children
# (all of them, or those it sets it for not) and override its plan, so it is passed on only when
# it says what the launcher's does (`launch_setup.check_inherited`). Those it always sets
# (LAUNCHER_SET, OPTION_VARIABLES) are never passed on.
DECIDED = {
    "MS_SERVER_NUM": ("it starts workers and no server", "0"),
    "CLUSTER_SCHED_ADDRS": ("--master-addr and --master-port", ""),
    "CLUSTER_STATE_URL": ("--state-url", "not given"),
    "CLUSTER_LEASE_S": ("--lease", "not given"),
    "CLUSTER_RELAY": ("the relay it starts", "its relay's socket, for its workers only"),
    "CLUSTER_SPARE": ("--spares", "1 for its spares only"),
}


def decided_values(options: LaunchOptions, plan: Plan) -> dict[str, str | None]:
    """What the launcher makes of each DECIDED variable (None: unset, or per process): the
    schedulers' addresses are those its workers' MS_SCHED_HOST and MS_SCHED_PORT name."""
    sched = {k: plan.workers[0].env[k] for k in ("MS_SCHED_HOST", "MS_SCHED_PORT")}
    return {
        "MS_SERVER_NUM": "0",
        "CLUSTER_SCHED_ADDRS": ",".join(sched_addresses_from_env(sched)),
        "CLUSTER_STATE_URL": options.state_url,
        "CLUSTER_LEASE_S": None if options.lease_s is None else str(options.lease_s),
        "CLUSTER_RELAY": None,
        "CLUSTER_SPARE": None,
    }


def child_environment(inherited: Mapping[str, str], process: Process) -> dict[str, str]:
    """A child's whole environment: the launcher's own without the variables it sets itself
    (LAUNCHER_SET, OPTION_VARIABLES), then the process's."""
    env = {k: v for k, v in inherited.items() if not _set_here(k)}
    env.update(process.env)
    return env


def _set_here(name: str) -> bool:
    """Whether the launcher sets `name` itself, so that an inherited one is not passed on."""
    return name in LAUNCHER_SET or name in OPTION_VARIABLES


def shown_value(name: str, value: str) -> str:
    """`value`, unless `name` holds a secret or a password itself (a *_FILE path is shown)."""
    secret = "SECRET" in name or "PASSWORD" in name
    return HIDDEN if secret and not name.endswith("_FILE") else value


def render(plan: Plan, options: LaunchOptions, inherited: Mapping[str, str]) -> str:
    """What `mscluster run --dry-run` prints: the plan, without any secret's value."""
    o = options
    where = o.allocation.describe() if o.allocation is not None else "the options given"
    lines = [
        "mscluster run --dry-run: nothing is started; this host would run:",
        f"placement: {where}",
        f"scheduler: {plan.address} (--master-addr {o.master_addr}), {_scheduler_here(plan, o)}",
        f"workers: {len(plan.workers) - o.spares} of {o.worker_num} here"
        + (f", and {o.spares} spare{'s' if o.spares > 1 else ''}" if o.spares else "")
        + "; restarts up to "
        f"{o.max_restarts} each; recovery {'on' if o.enable_recovery else 'off'}",
        *(f"note: {note}" for note in plan.notes),
        "",
    ]
    rows = [
        (
            p.name,
            p.role,
            p.node_id or "-",
            "-" if p.rank is None else str(p.rank),
            str(p.log),
            " ".join(p.args),
        )
        for p in plan.processes
    ]
    lines += format_table(("process", "role", "node id", "rank", "log", "command"), rows)
    lines += _environment(plan, inherited)
    return "\n".join(lines)


def _scheduler_here(plan: Plan, options: LaunchOptions) -> str:
    if plan.scheduler is not None:
        return "started here"
    if options.node_rank > 0:
        return f"not started here: this is node rank {options.node_rank}, node 0 starts it"
    return "not started here: the address is not this host's"


def _environment(plan: Plan, inherited: Mapping[str, str]) -> list[str]:
    """The variables every process gets (those all of them share), the scheduler's own, those
    of the launcher's environment passed on that matter, and those it sets itself instead."""
    per_process = {"MS_ROLE", "MS_NODE_ID", "CLUSTER_SPARE", "CLUSTER_RELAY", *place("0", 0)}
    common = {
        k: v
        for k, v in plan.processes[0].env.items()
        if k not in per_process and all(p.env.get(k) == v for p in plan.processes)
    }
    relayed = "" if plan.relay is None else f"; CLUSTER_RELAY={plan.relay.args[-1]} for the workers"
    lines = [
        "",
        "environment of every process (MS_ROLE and MS_NODE_ID as in the table; for each worker "
        "RANK_ID and RANK its rank where the table shows one, LOCAL_RANK and DEVICE_ID its "
        f"index; CLUSTER_SPARE=1 for the spares{relayed}):",
    ]
    lines += [f"  {k}={shown_value(k, v)}" for k, v in sorted(common.items())]
    if plan.scheduler is not None:
        own = {
            k: v for k, v in plan.scheduler.env.items() if k not in per_process and k not in common
        }
        lines.append("the scheduler's own:")
        lines += [f"  {k}={shown_value(k, v)}" for k, v in sorted(own.items())]
    passed = {
        k: v
        for k, v in inherited.items()
        if k.startswith(SHOWN_PREFIXES) and k not in common and not _set_here(k)
    }
    if passed:
        lines.append("passed on from this environment (with the rest of it):")
        lines += [f"  {k}={shown_value(k, v)}" for k, v in sorted(passed.items())]
    replaced = sorted(k for k in inherited if k in LAUNCHER_SET)
    if replaced:
        lines.append(f"not passed on (mscluster run sets its own): {', '.join(replaced)}")
    return lines


def lease_without_store(state_url: str) -> ConfigError:
    """`--lease` given where no state store in etcd is (`state_url`: how one is given)."""
    return ConfigError(
        f"--lease is the leader's hold on a state store in etcd, and this job has none: give "
        f"{state_url} with it, or leave --lease out"
    )
