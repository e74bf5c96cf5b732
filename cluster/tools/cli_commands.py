"""What each `mscluster` subcommand does, once `cli` has parsed its arguments.

Each `cmd_<name>` takes the parsed arguments and returns the command's exit code; a user's
mistake is a ClusterError, which `cli.main` says in one line. grpc reads its TLS cipher list
only when it is first imported, so a command imports what speaks grpc only once it has set
GRPC_SSL_CIPHER_SUITES from the TLS config (`_apply_ciphers`, `tls.launch_environment`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.api import runtime
from cluster.protocol.config import ClusterConfig, TLSOptions, join_address
from cluster.protocol.display import safe
from cluster.protocol.environment import from_env, sched_addresses_from_env, tls_options_from_env
from cluster.protocol.errors import ConfigError, SchedulerUnreachableError
from cluster.protocol.parse import split_address
from cluster.tools import placement, slurm
from cluster.tools.cli_args import add_run_arguments, parse
from cluster.tools.launch_plan import (
    LaunchOptions,
    lease_without_store,
    max_restarts_for,
    seconds_text,
)
from cluster.worker import orphan

if TYPE_CHECKING:
    from cluster.tools.reading import ReadSecret
    from cluster.tools.status import JobView
    from cluster.transport import tls

EXIT_INTERRUPTED = 130  # 128 + SIGINT


# `mscluster scheduler`'s options, by the variable each one gives (its default).
SCHEDULER_OPTIONS = {
    "MS_SCHED_HOST": "--host",
    "MS_SCHED_PORT": "--port",
    "MS_WORKER_NUM": "--worker-num",
    "MS_SERVER_NUM": "--server-num",
    "MS_NODE_TIMEOUT": "--node-timeout",
    "MS_TOPO_TIMEOUT": "--topo-timeout",
    "MS_RECOVERY_PATH": "--recovery-path",
    "CLUSTER_METRICS_PORT": "--metrics-port",
    "CLUSTER_METRICS_HOST": "--metrics-host",
    "CLUSTER_EVENT_LOG": "--event-log",
    "CLUSTER_STATE_URL": "--state-url",
    "CLUSTER_LEASE_S": "--lease",
}
# Where the scheduler listens: what its refusals at a bind name, anywhere in the line.
_BOUND = frozenset(
    {"MS_SCHED_HOST", "MS_SCHED_PORT", "CLUSTER_METRICS_PORT", "CLUSTER_METRICS_HOST"}
)
_VARIABLE_FIRST = re.compile(r"^([A-Z][A-Z0-9_]*)(\W.*)$", re.DOTALL)


def _scheduler_options(args: argparse.Namespace) -> dict[str, object]:
    """The values `mscluster scheduler`'s options were given, by the variable each one sets."""
    options = {
        "MS_SCHED_HOST": args.host,
        "MS_SCHED_PORT": args.port,
        "MS_WORKER_NUM": args.worker_num,
        "MS_SERVER_NUM": args.server_num,
        "MS_NODE_TIMEOUT": args.node_timeout,
        "MS_TOPO_TIMEOUT": args.topo_timeout,
        "MS_RECOVERY_PATH": args.recovery_path,
        "CLUSTER_METRICS_PORT": args.metrics_port,
        "CLUSTER_METRICS_HOST": args.metrics_host,
        "CLUSTER_EVENT_LOG": args.event_log,
        "CLUSTER_STATE_URL": args.state_url,
        "CLUSTER_LEASE_S": args.lease,
    }
    return {name: value for name, value in options.items() if value is not None}


def _scheduler_config(args: argparse.Namespace) -> ClusterConfig:
    """The scheduler's settings: its options, else the variables of its environment. A value
    refused is said as given: an option's by the option (`_as_given`)."""
    env = dict(os.environ)
    env["MS_ROLE"] = "MS_SCHED"
    overrides = _scheduler_options(args)
    given = set(overrides)
    # As typed: a float option's 60 is "60" (`seconds_text`), not "60.0".
    env.update(
        {k: seconds_text(v) if isinstance(v, float) else str(v) for k, v in overrides.items()}
    )
    if args.recovery_path:
        env["MS_ENABLE_RECOVERY"] = "1"
    if args.lease is not None and not env.get("CLUSTER_STATE_URL", "").strip():
        raise lease_without_store("--state-url (or CLUSTER_STATE_URL)")
    env.setdefault("MS_SCHED_HOST", "127.0.0.1")
    # Port 0 (any free port, logged at start) is allowed here, not in the launch contract: the
    # parse is given a stand-in, one the metrics port is not (`check_metrics_port`).
    port = env.get("MS_SCHED_PORT", "")
    stand_in = "2" if env.get("CLUSTER_METRICS_PORT", "").strip() == "1" else "1"
    env["MS_SCHED_PORT"] = stand_in if port.strip() == "0" else port
    try:
        config = from_env(env)
        if config.recovery is not None:
            from cluster.storage.recovery_dir import check_recovery_path  # noqa: PLC0415 - tempfile

            check_recovery_path(config.recovery)
    except ConfigError as exc:
        raise ConfigError(_as_given(str(exc), given)) from None
    return dataclasses.replace(config, sched_port=0) if port.strip() == "0" else config


def _as_given(message: str, given: set[str]) -> str:
    """`message`, a ConfigError that begins with the variable it is about, naming the option
    that gave the value instead (`--worker-num='0' is out of range: ...`), or, where the
    variable is required and unset, that option too; then each variable of where the scheduler
    listens as it was given (`_bound_as_given`). One that names the option already, or any
    other, as it is."""
    found = _VARIABLE_FIRST.match(message)
    if found is not None and found[1] in SCHEDULER_OPTIONS:
        variable, rest = found[1], found[2]
        option = SCHEDULER_OPTIONS[variable]
        if variable in given and option not in message:
            message = option + rest
        elif variable not in given and rest.startswith(" is not set"):
            return f"{option} is not given and {variable}{rest}"
    return _bound_as_given(message, given)


def _bound_as_given(message: str, given: set[str]) -> str:
    """`message`, a ConfigError of the scheduler, naming the option for each variable of where
    it listens (`_BOUND`) that an option gave (`choose another --port`), unless it names that
    option already. The scheduler's own lines name the variables, as the launch contract
    gives them (`cluster.init()` as MS_SCHED, `mscluster run`'s scheduler)."""
    for variable in sorted(given & _BOUND):
        option = SCHEDULER_OPTIONS[variable]
        if option not in message:
            message = re.sub(rf"\b{variable}\b", option, message)
    return message


def _apply_ciphers(options: TLSOptions | None) -> None:
    """Give grpc ssl.json's cipher list (`tls.apply_cipher_suites`) before anything imports
    it, as cluster.init() does: a command that imports grpc first fails on a cipher_list of its
    own."""
    if options is not None:
        from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

        tls.apply_cipher_suites(tls.load_settings(options.config_path))


def cmd_scheduler(args: argparse.Namespace) -> int:
    config = _scheduler_config(args)
    _apply_ciphers(config.tls)
    orphan.watch_launcher()
    runtime.configure_logging("scheduler", config.observe)
    from cluster.scheduler import server  # noqa: PLC0415 - after TLS set grpc's ciphers

    try:
        server.run_and_exit(config)
    except ConfigError as exc:  # a port or a host it cannot bind, a recovery path held, ...
        raise ConfigError(_bound_as_given(str(exc), set(_scheduler_options(args)))) from None


def cmd_relay(args: argparse.Namespace) -> int:
    from cluster.tools import relay  # noqa: PLC0415 - the relay's own process

    settings = relay.settings_from_env(os.environ, args.socket, args.scheduler)
    _apply_ciphers(settings.tls)
    orphan.watch_launcher()
    return relay.run(settings)


def cmd_run(args: argparse.Namespace) -> int:
    args.tls_config = args.tls_config or os.environ.get("CLUSTER_TLS_CONFIG") or None
    if args.tls_config:
        # This process polls the scheduler over TLS too: same cipher list as the children.
        from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

        os.environ.update(tls.launch_environment(Path(args.tls_config).resolve()))
    from cluster.tools import launch, launch_setup  # noqa: PLC0415 - imports grpc

    allocation = slurm.allocation_from_env(os.environ)
    where = placement.place(_requested(args), allocation, host=socket.gethostname())
    recovery = args.enable_recovery or bool(args.state_url)
    options = LaunchOptions(
        script=Path(args.script),
        script_args=tuple(args.script_args),
        worker_num=where.worker_num,
        local_worker_num=where.local_worker_num,
        master_addr=where.master_addr,
        master_port=where.master_port,
        node_rank=where.node_rank,
        log_dir=where.log_dir,
        join=args.join,
        cluster_time_out=args.cluster_time_out,
        node_timeout=args.node_timeout,
        enable_recovery=recovery,
        recovery_path=Path(args.recovery_path) if args.recovery_path else None,
        max_restarts=max_restarts_for(args.max_restarts, recovery=recovery),
        spares=args.spares,
        tls_config=Path(args.tls_config) if args.tls_config else None,
        metrics_port=args.metrics_port,
        state_url=args.state_url,
        lease_s=args.lease,
        allocation=where.allocation,
        master_is_node=where.master_is_node,
        relay=args.relay,
    )
    # msrun's variables of this environment (MS_ENABLE_RECOVERY, ...) as the options' defaults.
    options = launch_setup.settle(options, os.environ, sys.stderr, max_restarts=args.max_restarts)
    return launch.run(options, dry_run=args.dry_run)


def _requested(args: argparse.Namespace) -> placement.Requested:
    return placement.Requested(
        worker_num=args.worker_num,
        local_worker_num=args.local_worker_num,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_rank=args.node_rank,
        log_dir=Path(args.log_dir) if args.log_dir is not None else None,
    )


def _split_addr(addr: str) -> str:
    """--addr HOST:PORT as gRPC reads it: an IPv6 host in brackets (::1:8118 is [::1]:8118)."""
    return join_address(*split_address("--addr", addr))


def _split_addrs(addrs: str) -> list[str]:
    """--addr H:P[,H:P...]: every scheduler of the job (standbys answer with the leader)."""
    return [_split_addr(one.strip()) for one in addrs.split(",") if one.strip()] or [
        _split_addr(addrs)
    ]


async def _status(
    addrs: list[str], identity: tls.Identity | None, secret: ReadSecret | None
) -> JobView:
    from cluster.tools import status  # noqa: PLC0415 - imports grpc

    # A scheduler that speaks the other protocol, or is refused: TLSConfigError (`fetch_any`).
    return await status.fetch_any(addrs, identity, secret=secret)


def _client_identity(args: argparse.Namespace) -> tls.Identity | None:
    """This client's TLS identity when the job uses TLS (--tls-config, CLUSTER_TLS_CONFIG)."""
    options = tls_options_from_env(
        os.environ, Path(args.tls_config).resolve() if args.tls_config else None
    )
    if options is None:
        return None
    from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

    os.environ.update(tls.launch_environment(options.config_path))
    return tls.load_identity(options, server=False)


def _reader_secret(args: argparse.Namespace) -> ReadSecret | None:
    """The job secret this reader proves (after _client_identity: it imports grpc)."""
    from cluster.tools import reading  # noqa: PLC0415 - imports grpc

    return reading.find_secret(
        Path(args.secret_file) if args.secret_file else None,
        Path(args.log_dir) if args.log_dir else None,
    )


def default_scheduler_addr(env: Mapping[str, str]) -> str:
    """Where `mscluster status` looks without --addr: every scheduler the job's environment
    names (`sched_addresses_from_env`: CLUSTER_SCHED_ADDRS, or MS_SCHED_HOST h1,h2 with
    MS_SCHED_PORT, `mscluster run`'s default port when unset), else this host's scheduler at
    that port."""
    port = env.get("MS_SCHED_PORT") or str(placement.DEFAULT_MASTER_PORT)
    located = {**env, "MS_SCHED_HOST": env.get("MS_SCHED_HOST") or "127.0.0.1"}
    return ",".join(sched_addresses_from_env({**located, "MS_SCHED_PORT": port}))


def cmd_status(args: argparse.Namespace) -> int:
    addrs = _split_addrs(args.addr or default_scheduler_addr(os.environ))
    identity = _client_identity(args)
    secret = _reader_secret(args)
    if args.watch:
        from cluster.tools import watch  # noqa: PLC0415 - imports grpc

        return watch.run(addrs, identity, interval_s=args.interval, out=sys.stdout, secret=secret)
    from cluster.tools import status  # noqa: PLC0415 - imports grpc

    try:
        view = asyncio.run(_status(addrs, identity, secret))
    except SchedulerUnreachableError as exc:
        print(f"mscluster: {status.pointed(safe(exc), bool(args.addr))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while it asks
        return EXIT_INTERRUPTED

    print(view.to_json() if args.json else status.render(view))
    return 0


def _to_stderr(line: str) -> None:
    print(safe(line), file=sys.stderr, flush=True)


def cmd_events(args: argparse.Namespace) -> int:
    from cluster.tools import events, status  # noqa: PLC0415 - imports grpc

    try:
        if args.addr is not None:
            addrs, identity = _split_addrs(args.addr), _client_identity(args)
            secret = _reader_secret(args)
            stream = events.from_scheduler(addrs, identity, follow=args.follow, secret=secret)
            last = asyncio.run(events.show_stream(stream, sys.stdout, as_json=args.json))
        else:
            path = Path(args.file) if args.file else events.log_of(args.log_dir)
            found = events.from_file(path, follow=args.follow, say=_to_stderr)
            last = events.show(found, sys.stdout, as_json=args.json)
    except SchedulerUnreachableError as exc:
        print(f"mscluster: {status.pointed(safe(exc), addr_given=True)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return events.exit_status(last, follow=args.follow)


def cmd_certs(args: argparse.Namespace) -> int:
    from cluster.transport import certs  # noqa: PLC0415 - only this command needs key generation

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is not a directory: give a directory to write to")
    for host in args.host or ():
        certs.server_name("--host", host)
    if not args.force and (held := certs.held_files(out)):
        raise ConfigError(
            f"{out} already holds {', '.join(held)}: choose an empty directory, or overwrite "
            "on purpose with mscluster certs --force (certificates of the old CA stop working)"
        )
    try:  # all or nothing: a failed write leaves nothing of the new set
        pki = certs.make_pki(out, hosts=args.host or (), overwrite=args.force)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigError(
            f"--out {str(out)!r}: cannot write the certificates there: "
            f"{exc.strerror or exc}{where}; nothing was written"
        ) from None
    print(f"wrote a CA, server/client/revoked-client p12 files, a CRL and passwords to {out}/")
    print(f"use it: mscluster run --tls-config {pki.ssl_json} ...")
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    from cluster.tools import chaos_run  # noqa: PLC0415 - the command's own

    remainder = list(args.run_options)
    if remainder[:1] == ["--"]:
        remainder = remainder[1:]
    run_parser = argparse.ArgumentParser(prog="mscluster chaos -- ", add_help=False)
    add_run_arguments(run_parser)
    run = parse(run_parser, remainder)
    chaos_run.refuse_run_options(vars(run))
    where = placement.place(_requested(run), None)  # the whole job here, whatever Slurm says
    if where.local_worker_num != where.worker_num or where.node_rank >= 0:
        raise ConfigError(
            "mscluster chaos runs the whole job on this host: give --local-worker-num equal to "
            "--worker-num, and no --node-rank"
        )
    report = chaos_run.run_chaos(chaos_run.spec_of(args, run, where.worker_num, where.log_dir))
    return 0 if report.ok else 1
