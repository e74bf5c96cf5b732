"""Before `mscluster run` starts anything: check the options, find the scheduler's address and
whether it runs here, and make the plan of this host's processes (`cluster.tools.launch_plan`).

Every failure here is a ConfigError (one line, exit 2) with nothing started. `say` writes the
launcher's lines to a stream that may have gone away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from cluster.protocol.config import (
    MAX_NODES,
    MAX_SECONDS,
    MIN_NODE_TIMEOUT_S,
    RecoveryConfig,
    parse_bool,
    parse_int,
    parse_seconds,
)
from cluster.protocol.environment import (
    from_env,
    job_secret_from_env,
    read_job_secret,
    sched_addresses_from_env,
    tls_options_from_env,
)
from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import check_host, plain_float, shown
from cluster.protocol.state_url import parse_lease, parse_state_url, state_url_from_env
from cluster.storage.recovery_dir import check_recovery_path
from cluster.tools import slurm_io
from cluster.tools.launch_lock import LogDirLock
from cluster.tools.launch_plan import (
    DECIDED,
    OPTION_VARIABLES,
    LaunchOptions,
    Plan,
    bare_host,
    child_environment,
    decided_values,
    lease_without_store,
    make_plan,
    master_host,
    max_restarts_for,
    seconds_text,
)
from cluster.transport import tls


def resolve_host(name: str) -> str:
    """The IP address of `name` (an IPv6 literal with or without its brackets), or a
    ConfigError."""
    try:
        infos = socket.getaddrinfo(bare_host(name), None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(
            f"--master-addr {name!r} does not resolve ({exc.strerror}): use the scheduler host's "
            "IP address or a name this machine can resolve"
        ) from None
    return str(infos[0][4][0])


def is_local_address(ip: str) -> bool:
    """True when `ip` is an address of this host (binding to it works)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def check_ports_free(options: LaunchOptions, plan: Plan) -> None:
    """The ports the scheduler started here would listen on are free: its own (--master-port)
    and, when asked for, its metrics' (--metrics-port; 0, any free one, is always free) where
    it serves them (CLUSTER_METRICS_HOST as it inherits it, else its own host); a ConfigError
    naming the option, before anything is started, otherwise."""
    if plan.scheduler is None:
        return
    check_port_free(plan.ip, options.master_port)
    if options.metrics_port:
        config = from_env(child_environment(os.environ, plan.scheduler))
        host = config.observe.metrics_host or config.sched_host
        check_port_free(host, options.metrics_port, "--metrics-port")


def check_port_free(ip: str, port: int, option: str = "--master-port") -> None:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ConfigError(f"cannot listen on {ip}:{port}: {exc.strerror}") from None
            if option == "--master-port":
                raise ConfigError(
                    f"--master-port {port} is already in use on {ip} (another job's scheduler?): "
                    "stop it or choose another port"
                ) from None
            raise ConfigError(
                f"{option} {port} is already in use on {ip}: stop what listens there or choose "
                "another port (0: any free one)"
            ) from None


def writable_dir(option: str, path: Path, *, make: bool = True) -> None:
    """Check that this process can write in directory `path` (made first, with its parents,
    with `make`): a ConfigError that names `option`, the path and the cause otherwise."""
    try:
        if make:
            path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        cause = exc.strerror or str(exc)
        raise ConfigError(f"{option}: cannot write in {str(path)!r} ({cause})") from None


def settle(
    options: LaunchOptions, env: Mapping[str, str], out: IO[str], *, max_restarts: int | None
) -> LaunchOptions:
    """The options to run with, msrun's way: each of msrun's variables of this environment
    that is an option here (`launch_plan.OPTION_VARIABLES`: `export MS_ENABLE_RECOVERY=1;
    msrun ...`) is that option's value when the option is not given, and --max-restarts
    (`max_restarts`, None: not given) defaults by the recovery that makes. An option given wins
    over its variable: said in one line to `out` when they differ. Where each value came from
    is in the options' notes, which --dry-run shows. A bad value is a ConfigError naming it."""
    changes: dict[str, Any] = {}
    notes: list[str] = []
    overridden: list[str] = []
    for name, (option, attribute) in OPTION_VARIABLES.items():
        raw = env.get(name, "").strip()
        if not raw:
            continue
        given = _given_option(options, attribute)
        value = _inherited_value(name, raw)
        if given is None:
            if value != getattr(options, attribute):
                changes[attribute] = value
                notes.append(f"{_option_text(option, value)}: {name}={raw} of this environment")
        elif value != getattr(options, attribute):
            overridden.append(f"{name}={raw} of this environment is not used: {given} was given")
    settled, said = msrun_values(dataclasses.replace(options, **changes))
    for line in (*overridden, *said):
        say(out, f"mscluster: {line}\n")
    return dataclasses.replace(
        settled,
        max_restarts=max_restarts_for(max_restarts, recovery=settled.enable_recovery),
        notes=(*options.notes, *notes, *overridden, *said),
    )


def msrun_values(options: LaunchOptions) -> tuple[LaunchOptions, list[str]]:
    """msrun's values that mean something else here, taken as msrun takes them, each with the
    line that says so: a --node-rank where every worker runs on this host is ignored (outside a
    Slurm step of several nodes, where it is this node's, and another node's launcher starts
    the same ranks), and a negative --cluster-time-out ('wait without end') is MAX_SECONDS,
    the longest wait a scheduler takes."""
    said: list[str] = []
    o = options
    several_nodes = o.allocation is not None and o.allocation.node_count > 1
    if o.node_rank > 0 and o.local_worker_num == o.worker_num and not several_nodes:
        said.append(
            f"--node-rank {o.node_rank} is ignored, as msrun ignores it: every worker of the job "
            f"runs on this host (--local-worker-num = --worker-num = {o.worker_num})"
        )
        o = dataclasses.replace(o, node_rank=-1)
    if o.cluster_time_out is not None and o.cluster_time_out < 0:
        said.append(
            f"--cluster-time-out {o.cluster_time_out:g} is msrun's 'wait without end': taken as "
            f"{MAX_SECONDS} s (23 days), the longest a scheduler waits"
        )
        o = dataclasses.replace(o, cluster_time_out=float(MAX_SECONDS))
    return o, said


def _given_option(options: LaunchOptions, attribute: str) -> str | None:
    """The option that gave `attribute` its value, as typed (None: not given)."""
    value = getattr(options, attribute)
    if attribute == "enable_recovery":
        if options.state_url is not None:
            return "--state-url (recovery on)"
        return "--enable-recovery" if value else None
    option = next(o for o, a in OPTION_VARIABLES.values() if a == attribute)
    return None if value is None else _option_text(option, value)


def _inherited_value(name: str, raw: str) -> object:
    """The value of msrun's variable `name` (`raw`), read as the launcher's children read it."""
    if name == "MS_ENABLE_RECOVERY":
        return parse_bool(name, raw)
    if name == "MS_RECOVERY_PATH":
        return Path(raw)
    number = plain_float(raw)
    if name == "MS_TOPO_TIMEOUT" and number is not None and number < 0:
        return number  # msrun's 'wait without end' (`msrun_values`)
    minimum = MIN_NODE_TIMEOUT_S if name == "MS_NODE_TIMEOUT" else None
    return parse_seconds(name, raw, minimum=minimum)


def _option_text(option: str, value: object) -> str:
    """`--node-timeout 60`, `--enable-recovery` (a flag on), as typed."""
    if isinstance(value, bool):
        return option
    return f"{option} {seconds_text(value)}" if isinstance(value, float) else f"{option} {value}"


def validate(options: LaunchOptions) -> None:
    """Every check that needs no child process; ConfigError naming the option otherwise."""
    if not 1 <= options.worker_num <= MAX_NODES:
        raise ConfigError(f"--worker-num {options.worker_num} must be between 1 and {MAX_NODES}")
    if not 1 <= options.local_worker_num <= options.worker_num:
        raise ConfigError(
            f"--local-worker-num {options.local_worker_num} must be between 1 and --worker-num "
            f"({options.worker_num})"
        )
    if not all(host.strip() for host in options.master_addr.split(",")):
        raise ConfigError(
            f"--master-addr {options.master_addr!r} has an empty entry: give the scheduler's host, "
            "or every scheduler's host separated by commas (h1,h2)"
        )
    for host in options.master_addr.split(","):
        check_host("--master-addr entry", bare_host(host))
    if not 1 <= options.master_port <= 65535:
        raise ConfigError(f"--master-port {options.master_port} must be between 1 and 65535")
    if not options.script.is_file():
        raise ConfigError(f"script {str(options.script)!r} does not exist (or is not a file)")
    if options.max_restarts < 0:
        raise ConfigError(f"--max-restarts {options.max_restarts} must be >= 0")
    if options.spares < 0:
        raise ConfigError(f"--spares {options.spares} must be >= 0")
    if options.spares and not options.enable_recovery:
        raise ConfigError(
            f"--spares {options.spares} needs --enable-recovery: a spare takes a failed worker's "
            "rank, and without recovery a failed worker ends the job"
        )
    if options.metrics_port is not None and not 0 <= options.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {options.metrics_port} must be between 0 and 65535")
    if options.node_rank < -1:
        raise ConfigError(f"--node-rank {options.node_rank} must be >= 0 (or -1: not given)")
    check_job_settings(options)
    if (
        options.node_rank >= 0
        and (options.node_rank + 1) * options.local_worker_num > options.worker_num
    ):
        raise ConfigError(
            f"--node-rank {options.node_rank} with --local-worker-num {options.local_worker_num} "
            f"would start ranks up to {(options.node_rank + 1) * options.local_worker_num - 1}, "
            f"but --worker-num is {options.worker_num}"
        )


def check_job_settings(options: LaunchOptions) -> None:
    """The options the children read from their environment, through the parsers they use (a
    value they would refuse, and exit 2 once started, is refused now, naming the option)."""
    for option, seconds, minimum in (
        ("--cluster-time-out", options.cluster_time_out, None),
        ("--node-timeout", options.node_timeout, MIN_NODE_TIMEOUT_S),
    ):
        if seconds is not None:  # as job_environment passes it on
            parse_seconds(option, seconds_text(seconds), minimum=minimum)
    check_lease(options.lease_s, options.state_url)
    if options.state_url is not None:
        state_url_from_env(os.environ, options.state_url)


def check_lease(lease_s: int | None, state_url: str | None) -> None:
    """`--lease`, when given: seconds etcd grants, and only with `--state-url` (the lease is
    the leader's hold on the state in etcd); `mscluster run`'s and `mscluster chaos`'s."""
    if lease_s is not None:
        parse_lease(str(lease_s), "--lease")
        if state_url is None:
            raise lease_without_store("--state-url")


def check_inherited(options: LaunchOptions, plan: Plan, inherited: Mapping[str, str]) -> None:
    """A variable of this environment that defines the job (`launch_plan.DECIDED`) is passed on
    only when it says what the launcher's options make of it (an address list naming the same
    schedulers, the same state URL or lease); another is a ConfigError naming it and the option
    that decides it. The launcher does not take one as an option's value: an exported
    CLUSTER_STATE_URL of a finished job would attach a new one to its state."""
    for name, wanted in decided_values(options, plan).items():
        given = inherited.get(name, "").strip()
        if given and (wanted is None or not _same(name, given, wanted)):
            by, unset = DECIDED[name]
            option = f", or give {by}" if name in ("CLUSTER_STATE_URL", "CLUSTER_LEASE_S") else ""
            raise ConfigError(
                f"{name}={shown(given)} is set in this environment, but mscluster run decides it "
                f"({by}: {wanted or unset}), and its processes would take this one instead: "
                f"unset it{option}"
            )


def _same(name: str, given: str, wanted: str) -> bool:
    """Whether `given` and `wanted`, values of `name`, say the same, read as a process reads
    them (a value it would refuse says nothing)."""
    read: dict[str, Callable[[str], object]] = {
        "MS_SERVER_NUM": lambda v: parse_int("MS_SERVER_NUM", v, minimum=0),
        "CLUSTER_SCHED_ADDRS": lambda v: sched_addresses_from_env({"CLUSTER_SCHED_ADDRS": v}),
        "CLUSTER_STATE_URL": lambda v: str(parse_state_url(v)),
        "CLUSTER_LEASE_S": parse_lease,
    }
    try:
        return read[name](given) == read[name](wanted)
    except ConfigError:
        return False


def check_children(plan: Plan, inherited: Mapping[str, str]) -> None:
    """Each planned scheduler and worker's whole environment, read as that process reads it
    (`from_env`): what it would refuse (a variable of this environment, with the job's) is a
    ConfigError now, before anything starts."""
    for process in (plan.scheduler, *plan.workers):
        if process is None:
            continue
        try:
            from_env(child_environment(inherited, process))
        except ConfigError as exc:
            raise ConfigError(f"the {process.name} would refuse its settings: {exc}") from None


def check_paths(options: LaunchOptions, plan: Plan) -> None:
    """--log-dir, and the recovery directory where this host runs the scheduler (with
    recovery on), can be written, with nothing made: where a directory does not exist yet, the
    nearest one above it is probed."""
    could_make("--log-dir", options.log_dir)
    if options.enable_recovery and plan.scheduler is not None:
        option = "--recovery-path" if options.recovery_path is not None else "--log-dir"
        could_make(option, options.job_recovery_path)


def make_paths(
    options: LaunchOptions, plan: Plan, out: IO[str], write: Callable[[], object]
) -> LogDirLock:
    """`check_paths`; then --log-dir made, checked and locked for this launcher
    (`launch_lock`: another launcher holding it is a refusal) before anything is written there,
    the recovery directory made and checked as the scheduler checks it, and `write()` called:
    what the launcher puts in --log-dir before anything starts (the job secret, each file
    written whole or not at all). A refusal on the way (the lock held, the recovery directory's
    owner or mode, a full disk) or a stop signal meanwhile (a Slurm step's secret awaited)
    removes the directories made here: a refused run leaves none behind. The lock returned is
    held until it is released."""
    check_paths(options, plan)
    recovery = options.enable_recovery and plan.scheduler is not None
    option = "--recovery-path" if options.recovery_path is not None else "--log-dir"
    paths = [options.log_dir, *([options.job_recovery_path] if recovery else [])]
    lock = LogDirLock(options.log_dir)
    with _removed_if_refused(paths, lock):
        writable_dir("--log-dir", options.log_dir)
        note = lock.take(options.master_port)  # '' unless this file system has no locks
        if note:
            say(out, note + "\n")
        if recovery:
            try:
                check_recovery_path(RecoveryConfig(options.job_recovery_path))
            except ConfigError as exc:
                raise ConfigError(f"{option}: {exc}") from None
        write()
    return lock


@contextlib.contextmanager
def _removed_if_refused(paths: list[Path], lock: LogDirLock) -> Iterator[None]:
    """On a ConfigError (or a stop signal's KeyboardInterrupt, `launch.run`), let `lock` go and
    remove the directories of `paths` (and those above them) that did not exist before, the
    deepest first (the lock file first where its directory is one of them), and raise it on."""
    missing: set[Path] = set()
    for path in paths:
        here = Path(os.path.abspath(path))
        while not here.exists() and here != here.parent:
            missing.add(here)
            here = here.parent
    try:
        yield
    except (ConfigError, KeyboardInterrupt):
        lock.release(remove=Path(os.path.abspath(lock.directory)) in missing)
        for made in sorted(missing, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


def could_make(option: str, path: Path) -> None:
    """With nothing made: directory `path`, or where it does not exist yet the nearest one above
    it that does, can be written in; a ConfigError naming `option` otherwise."""
    given = Path(os.path.abspath(path))
    here = given
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as exc:
        made = "" if here == given else f", where {str(path)!r} would be made"
        cause = exc.strerror or str(exc)
        raise ConfigError(f"{option}: cannot write in {str(here)!r}{made} ({cause})") from None


def plan_job(options: LaunchOptions) -> Plan:
    """What to start on this host: the master address resolved, whether the scheduler runs
    here, the TLS variables read from the config; a ConfigError where a scheduler to start
    here would refuse its settings, or keeps the job's state in etcd without its client."""
    ip, found = resolve_master(options)
    notes = [*options.notes, *found]
    with_scheduler = is_local_address(ip) and options.node_rank in (-1, 0)
    if with_scheduler and _loopback(ip) and _from_node_list_of_several(options):
        ip = address_for_other_nodes(options, ip, notes)
    tls_env = {}
    if options.tls_config is not None:
        tls_env = tls.launch_environment(options.tls_config.resolve())
    if options.job_secret_file is not None and options.allocation is not None:
        notes.append(
            f"job secret: node 0 writes {options.allocation.secret_path} in the working "
            f"directory, every node copies it to {options.job_secret_file}"
        )
    plan = make_plan(
        options,
        ip=ip,
        with_scheduler=with_scheduler,
        hostname=socket.gethostname(),
        launcher_pid=os.getpid(),
        tls_env=tls_env,
        notes=notes,
    )
    if plan.scheduler is not None and options.state_url is not None:
        # The scheduler started here keeps the job's state in etcd: its client is here, or
        # nothing starts (the scheduler would exit 2 once the workers were up).
        from cluster.scheduler.etcd_client import import_aetcd  # noqa: PLC0415 - etcd only

        import_aetcd("--state-url")
    check_inherited(options, plan, os.environ)
    check_children(plan, os.environ)
    return plan


def launcher_identity(options: LaunchOptions) -> tls.Identity | None:
    """The launcher's own TLS client identity (it reads the job as a worker does), loaded from
    --tls-config and the CLUSTER_TLS_* variables; None without --tls-config. A TLSConfigError
    (a wrong password, a damaged or expired p12) comes before anything is made, and with
    --dry-run too."""
    if options.tls_config is None:
        return None
    tls_options = tls_options_from_env(os.environ, options.tls_config.resolve())
    assert tls_options is not None  # a config path was given
    return tls.load_identity(tls_options, server=False)


def resolve_master(options: LaunchOptions) -> tuple[str, list[str]]:
    """The scheduler's IP address, and how it was found when that is worth saying. A Slurm node
    name that does not resolve is reached at the NodeAddr scontrol shows for it."""
    name = master_host(options.master_addr)
    try:
        return resolve_host(name), []
    except ConfigError:
        if not options.master_is_node:
            raise
    address = slurm_io.node_address(name)
    if address is None:
        raise ConfigError(
            f"the scheduler's node {name!r} (the first of the Slurm node list) does not resolve "
            "here and `scontrol show node` gives no NodeAddr for it: give --master-addr"
        )
    return resolve_host(address), [f"node {name} does not resolve: NodeAddr {address} (scontrol)"]


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.partition("%")[0]).is_loopback


def _from_node_list_of_several(options: LaunchOptions) -> bool:
    """The master address is the first node of a Slurm step of several nodes."""
    allocation = options.allocation
    return options.master_is_node and allocation is not None and allocation.node_count > 1


def address_for_other_nodes(options: LaunchOptions, ip: str, notes: list[str]) -> str:
    """Where the scheduler of a step of several nodes listens when its node's name resolves to
    loopback here (Debian's /etc/hosts maps a host's own name to 127.0.1.1): this host's address
    towards the step's other nodes. Loopback stays when that is loopback too (the nodes share
    this host); a ConfigError saying to give --master-addr when no other node resolves."""
    assert options.allocation is not None
    name = master_host(options.master_addr)
    found = slurm_io.address_towards_peers(options.allocation, options.master_port)
    if found is None:
        raise ConfigError(
            f"the scheduler's node {name!r} resolves to {ip} (loopback) here, which the step's "
            "other nodes cannot reach, and none of them resolves here (nor has a NodeAddr) to "
            "find this host's address towards them: give --master-addr with an address of "
            f"{name} that every node reaches"
        )
    local, peer = found
    if _loopback(local):
        return ip  # the other nodes are on this host
    notes.append(
        f"node {name} resolves to {ip} (loopback) here: the scheduler listens on {local}, this "
        f"host's address towards node {peer}"
    )
    return local


def say(out: IO[str], text: str) -> None:
    """Write `text` to `out` and flush; never raises. A stream that cannot be written (a pipe
    whose reader went away, a terminal hung up) is pointed at /dev/null from then on, so that
    the job goes on, its logs whole, and the interpreter's own flush at exit succeeds too."""
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):  # ValueError: a stream closed in this process
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, out.fileno())
            os.close(null)


def closes_the_job(options: LaunchOptions, plan: Plan, out: IO[str]) -> bool:
    """True when this launcher must make the job's secret (every worker is here, none given);
    a given secret is checked now (one line when it is bad); a job that spans hosts with
    neither a secret nor TLS is said to be open."""
    given = job_secret_from_env(os.environ)
    if given is not None:
        read_job_secret(given)
        return False
    if options.job_secret_file is not None:  # shared by a Slurm step's nodes
        return False
    if options.local_worker_num == options.worker_num and plan.scheduler is not None:
        return True
    if options.tls_config is None:
        say(
            out,
            f"mscluster: the job spans hosts and has no job secret, so any process that "
            f"reaches {plan.address} can join it; to close it, give every host's mscluster "
            "run the same secret (CLUSTER_JOB_SECRET_FILE, a file of mode 0600) or use "
            "--tls-config\n",
        )
    return False


def at(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 address in brackets."""
    bare = bare_host(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"
