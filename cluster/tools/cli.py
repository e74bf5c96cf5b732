"""`mscluster`: the command line. Thin: it parses arguments and calls the library.

    mscluster run [options] SCRIPT [ARGS...]   start a job's local processes (like msrun/torchrun;
                                               msrun's option names work too: --worker_num=8)
    mscluster scheduler [options]              a standalone scheduler
    mscluster relay --socket unix:PATH         one host's relay for its workers (CLUSTER_RELAY)
    mscluster status --addr HOST:PORT          what a running job looks like (--watch: live)
    mscluster events [--file PATH | --addr HOST:PORT[,...]] [--follow]   the job's events

`status` and `events --addr` prove the job secret when the job has one: --secret-file, else
--log-dir's job.secret, else CLUSTER_JOB_SECRET_FILE, else logs/job.secret
(`cluster.tools.reading` finds it).
    mscluster certs --out DIR                  a CA, p12 files, a CRL and ssl.json for trials
    mscluster chaos [options] -- RUN-OPTIONS SCRIPT [ARGS...]   a training run under faults

Exit codes: 0 success, 1 the job failed, 2 a usage or configuration error, 128+N a signal.

grpc reads its TLS cipher list only when it is first imported, so the commands import what
speaks grpc only once they have set GRPC_SSL_CIPHER_SUITES from the TLS config.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from argparse import SUPPRESS
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cluster
from cluster.api import excepthook, runtime
from cluster.protocol.config import ClusterConfig, TLSOptions, join_address
from cluster.protocol.display import safe
from cluster.protocol.environment import from_env, sched_addresses_from_env, tls_options_from_env
from cluster.protocol.errors import (
    ClusterError,
    ConfigError,
    ReadRefusedError,
    SchedulerUnreachableError,
)
from cluster.protocol.parse import split_address
from cluster.tools import placement, slurm
from cluster.tools.launch_plan import LaunchOptions, max_restarts_for
from cluster.worker import orphan

if TYPE_CHECKING:
    from cluster.tools.reading import ReadSecret
    from cluster.tools.status import JobView
    from cluster.transport import tls

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT
# The distribution that installs this command (pyproject.toml's name; the import name is cluster).
DISTRIBUTION = "mscluster-grpc"
VERSION_HELP = "show the program's version number and exit"  # argparse's own words


def _scheduler_config(args: argparse.Namespace) -> ClusterConfig:
    env = dict(os.environ)
    env["MS_ROLE"] = "MS_SCHED"
    overrides = {
        "MS_SCHED_HOST": args.host,
        "MS_WORKER_NUM": args.worker_num,
        "MS_SERVER_NUM": args.server_num,
        "MS_NODE_TIMEOUT": args.node_timeout,
        "MS_TOPO_TIMEOUT": args.topo_timeout,
        "MS_RECOVERY_PATH": args.recovery_path,
        "MS_ENABLE_RECOVERY": "1" if args.recovery_path else None,
        "CLUSTER_METRICS_PORT": args.metrics_port,
        "CLUSTER_EVENT_LOG": args.event_log,
        "CLUSTER_STATE_URL": args.state_url,
        "CLUSTER_LEASE_S": args.lease,
    }
    env.update({k: str(v) for k, v in overrides.items() if v is not None})
    env.setdefault("MS_SCHED_HOST", "127.0.0.1")
    # Port 0 (any free port, logged at start) is allowed here, not in the launch contract.
    port = args.port if args.port is not None else env.get("MS_SCHED_PORT")
    env["MS_SCHED_PORT"] = "1" if str(port) == "0" else str(port or "")
    config = from_env(env)
    return dataclasses.replace(config, sched_port=0) if str(port) == "0" else config


def _apply_ciphers(options: TLSOptions | None) -> None:
    """Give grpc ssl.json's cipher list (`tls.apply_cipher_suites`) before anything imports
    it, as cluster.init() does: a command that imports grpc first fails on a cipher_list of its
    own."""
    if options is not None:
        from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

        tls.apply_cipher_suites(tls.load_settings(options.config_path))


def _cmd_scheduler(args: argparse.Namespace) -> int:
    config = _scheduler_config(args)
    _apply_ciphers(config.tls)
    if config.recovery is not None:
        from cluster.storage.recovery_dir import check_recovery_path  # noqa: PLC0415 - tempfile

        check_recovery_path(config.recovery)
    orphan.watch_launcher()
    runtime.configure_logging("scheduler", config.observe)
    from cluster.scheduler import server  # noqa: PLC0415 - after TLS set grpc's ciphers

    server.run_and_exit(config)


def _cmd_relay(args: argparse.Namespace) -> int:
    from cluster.tools import relay  # noqa: PLC0415 - the relay's own process

    settings = relay.settings_from_env(os.environ, args.socket, args.scheduler)
    _apply_ciphers(settings.tls)
    orphan.watch_launcher()
    return relay.run(settings)


def _cmd_run(args: argparse.Namespace) -> int:
    args.tls_config = args.tls_config or os.environ.get("CLUSTER_TLS_CONFIG") or None
    if args.tls_config:
        # This process polls the scheduler over TLS too: same cipher list as the children.
        from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

        os.environ.update(tls.launch_environment(Path(args.tls_config).resolve()))
    from cluster.tools import launch  # noqa: PLC0415 - imports grpc

    where = placement.place(_requested(args), slurm.allocation_from_env(os.environ))
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


def _cmd_status(args: argparse.Namespace) -> int:
    addrs = _split_addrs(args.addr or default_scheduler_addr(os.environ))
    identity = _client_identity(args)
    secret = _reader_secret(args)
    if args.watch:
        from cluster.tools import watch  # noqa: PLC0415 - imports grpc

        return watch.run(addrs, identity, interval_s=args.interval, out=sys.stdout, secret=secret)
    try:
        view = asyncio.run(_status(addrs, identity, secret))
    except SchedulerUnreachableError as exc:
        print(f"mscluster: {safe(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while it asks
        return EXIT_INTERRUPTED
    from cluster.tools import status  # noqa: PLC0415

    print(view.to_json() if args.json else status.render(view))
    return 0


def _to_stderr(line: str) -> None:
    print(safe(line), file=sys.stderr, flush=True)


def _cmd_events(args: argparse.Namespace) -> int:
    from cluster.tools import events  # noqa: PLC0415 - imports grpc

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
        print(f"mscluster: {safe(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return events.exit_status(last, follow=args.follow)


def _cmd_certs(args: argparse.Namespace) -> int:
    from cluster.transport import certs  # noqa: PLC0415 - only this command needs key generation

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is not a directory: give a directory to write to")
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


def _cmd_chaos(args: argparse.Namespace) -> int:
    from cluster.tools import chaos_run  # noqa: PLC0415 - the command's own

    remainder = list(args.run_options)
    if remainder[:1] == ["--"]:
        remainder = remainder[1:]
    run_parser = argparse.ArgumentParser(prog="mscluster chaos -- ", add_help=False)
    _add_run_arguments(run_parser)
    run = _parse(run_parser, remainder)
    chaos_run.refuse_run_options(vars(run))
    where = placement.place(_requested(run), None)  # the whole job here, whatever Slurm says
    if where.local_worker_num != where.worker_num or where.node_rank >= 0:
        raise ConfigError(
            "mscluster chaos runs the whole job on this host: give --local-worker-num equal to "
            "--worker-num, and no --node-rank"
        )
    report = chaos_run.run_chaos(chaos_run.spec_of(args, run, where.worker_num, where.log_dir))
    return 0 if report.ok else 1


def _add_run_arguments(run: argparse.ArgumentParser) -> None:
    _add_placement_arguments(run)
    _add_join_arguments(run)
    _add_job_arguments(run)
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _add_placement_arguments(run: argparse.ArgumentParser) -> None:
    """Where the job's processes go. Each option also under msrun's name (--worker_num), so
    that an msrun line runs as it is."""
    run.add_argument(
        "--worker-num",
        "--worker_num",
        type=int,
        help="workers in the whole job (8; under Slurm: nodes x --local-worker-num)",
    )
    run.add_argument(
        "--local-worker-num",
        "--local_worker_num",
        type=int,
        help="workers on this host (--worker-num; under Slurm: SLURM_GPUS_ON_NODE, else 1)",
    )
    run.add_argument(
        "--master-addr",
        "--master_addr",
        help="scheduler host (127.0.0.1; under Slurm: the first node of the step); with standby "
        "schedulers every host, the first one's first (h1,h2: the workers get MS_SCHED_HOST=h1,h2)",
    )
    run.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        help="scheduler port (8118; under Slurm: one per job step, 10000-29999)",
    )
    run.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        help="this host's index; its workers get node ids node_rank*local_worker_num+i "
        "(under Slurm: SLURM_NODEID)",
    )
    run.add_argument(
        "--log-dir",
        "--log_dir",
        help="where scheduler.log, worker_<i>.log go (logs; Slurm: logs/<job>.<step>[/node<R>])",
    )


def _add_join_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--join",
        action="store_true",
        help="also stream the workers' output, prefixed by rank (msrun's --join=True; "
        "--join=False: logs only; the launcher always waits for the job)",
    )
    # msrun's --join takes a value. Whole words, matched before argparse splits at "=", so that
    # a bare --join still leaves the next word to be the script.
    for word, action in (("True", "store_true"), ("False", "store_false")):
        for spelling in (word, word.lower()):
            run.add_argument(
                f"--join={spelling}", dest="join", action=action, default=False, help=SUPPRESS
            )


def _add_job_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--cluster-time-out",
        "--cluster_time_out",
        type=float,
        help="seconds for all workers to register (MS_TOPO_TIMEOUT)",
    )
    run.add_argument("--node-timeout", type=float, help="heartbeat timeout (MS_NODE_TIMEOUT)")
    run.add_argument("--enable-recovery", action="store_true", help="MS_ENABLE_RECOVERY=1")
    run.add_argument("--recovery-path", help="MS_RECOVERY_PATH (default LOG_DIR/recovery)")
    run.add_argument(
        "--state-url",
        help="the scheduler keeps the job's state in etcd (CLUSTER_STATE_URL: "
        "etcd://HOST:PORT[,HOST:PORT...]/PREFIX); implies --enable-recovery",
    )
    run.add_argument("--lease", type=int, help="with --state-url: CLUSTER_LEASE_S (default 5)")
    run.add_argument(
        "--max-restarts",
        type=int,
        help="restart a failed local worker, and this host's scheduler when it was killed, up to "
        "K times each (default: 1 with recovery on, else 0)",
    )
    run.add_argument("--spares", type=int, default=0, help="hot spare workers here (CLUSTER_SPARE)")
    run.add_argument("--tls-config", help="ssl.json for mutual TLS (CLUSTER_TLS_CONFIG)")
    run.add_argument(
        "--no-relay",
        dest="relay",
        action="store_false",
        help="no relay: each local worker connects to the scheduler itself (by default, with 2 "
        "or more local workers, they share one connection through this host's relay)",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        help="the scheduler serves Prometheus metrics on this port (CLUSTER_METRICS_PORT; off)",
    )


def _add_run_options(run: argparse.ArgumentParser) -> None:
    """`mscluster run`: the launcher's options, then the script and its arguments."""
    _add_run_arguments(run)
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would start on this host (processes, node ids, ranks, environment "
        "without secrets, logs) and exit",
    )
    run.set_defaults(func=_cmd_run)


def _add_scheduler_options(sched: argparse.ArgumentParser) -> None:
    """`mscluster scheduler`: one standalone scheduler."""
    sched.add_argument("--host", help="address to listen on (MS_SCHED_HOST; default 127.0.0.1)")
    sched.add_argument("--port", type=int, help="port to listen on, 0 for any (MS_SCHED_PORT)")
    sched.add_argument("--worker-num", type=int, help="number of workers (MS_WORKER_NUM)")
    sched.add_argument("--server-num", type=int, help="number of parameter servers")
    sched.add_argument("--node-timeout", type=float, help="seconds (MS_NODE_TIMEOUT)")
    sched.add_argument("--topo-timeout", type=float, help="seconds (MS_TOPO_TIMEOUT)")
    sched.add_argument(
        "--recovery-path",
        help="recovery on, the job's state in this directory (MS_ENABLE_RECOVERY, "
        "MS_RECOVERY_PATH); started again with it, the scheduler resumes the job",
    )
    sched.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port, 0 for any (CLUSTER_METRICS_PORT; off)",
    )
    sched.add_argument("--event-log", help="append the job's events here (CLUSTER_EVENT_LOG)")
    sched.add_argument(
        "--state-url",
        help="keep the job's state in etcd: etcd://HOST:PORT[,HOST:PORT...]/PREFIX or etcds:// "
        "(CLUSTER_STATE_URL); recovery on, and any number of schedulers with the same URL: one "
        "leads, the others stand by",
    )
    sched.add_argument(
        "--lease",
        type=int,
        help="seconds of the leader's etcd lease (CLUSTER_LEASE_S; default 5): a dead leader's "
        "standby takes over within about this long",
    )
    sched.set_defaults(func=_cmd_scheduler)


def _add_relay_options(relay: argparse.ArgumentParser) -> None:
    """`mscluster relay`: one host's relay for its workers."""
    relay.add_argument("--socket", required=True, help="the local socket to serve (unix:PATH)")
    relay.add_argument(
        "--scheduler", help="HOST:PORT (default: MS_SCHED_HOST and MS_SCHED_PORT, the first)"
    )
    relay.set_defaults(func=_cmd_relay)


def _add_status_options(stat: argparse.ArgumentParser) -> None:
    """`mscluster status`: a running job's nodes, ranks and health."""
    stat.add_argument(
        "--addr",
        help="the scheduler's HOST:PORT; with standbys, any of them or several, comma-separated "
        "(each is tried; a standby names the leader, which answers); default: MS_SCHED_HOST and "
        f"MS_SCHED_PORT, else this host's scheduler on 127.0.0.1:{placement.DEFAULT_MASTER_PORT} "
        "(mscluster run's default)",
    )
    stat.add_argument("--json", action="store_true", help="machine-readable output")
    stat.add_argument("--tls-config", help="ssl.json, when the job uses TLS (CLUSTER_TLS_CONFIG)")
    stat.add_argument(
        "--watch",
        action="store_true",
        help="refresh until the job ends, changes highlighted (plain lines when not a terminal)",
    )
    stat.add_argument("--interval", type=float, default=1.0, help="--watch: seconds (1)")
    _add_reader_options(stat)
    stat.set_defaults(func=_cmd_status)


def _add_reader_options(reader: argparse.ArgumentParser, *, events: bool = False) -> None:
    """How `status` and `events --addr` prove the job secret to a scheduler that asks for it."""
    reader.add_argument(
        "--secret-file",
        help="the job's secret file, to prove to a job with a secret that this reader may read "
        "it (`mscluster run` writes LOG_DIR/job.secret); default: --log-dir's job.secret, "
        "else CLUSTER_JOB_SECRET_FILE, else logs/job.secret when there",
    )
    reader.add_argument(
        "--log-dir",
        help="the job's log directory of `mscluster run` (logs): its job.secret proves this "
        "reader" + ("; without --addr its events.jsonl is read" if events else ""),
    )


def _add_events_options(ev: argparse.ArgumentParser) -> None:
    """`mscluster events`: the job's events from the log or a running scheduler."""
    where = ev.add_mutually_exclusive_group()
    where.add_argument("--file", help="an event log (default LOG_DIR/events.jsonl)")
    where.add_argument(
        "--addr",
        help="a running scheduler's HOST:PORT; with standbys, several, comma-separated (the "
        "leader among them is read, and a follow moves to the next leader)",
    )
    ev.add_argument(
        "--follow",
        action="store_true",
        help="then each new event, until the job's last (exit 1 when the job failed)",
    )
    ev.add_argument("--json", action="store_true", help="the JSON lines, not a table")
    ev.add_argument("--tls-config", help="with --addr: ssl.json, when the job uses TLS")
    _add_reader_options(ev, events=True)
    ev.set_defaults(func=_cmd_events)


def _add_certs_options(cert: argparse.ArgumentParser) -> None:
    """`mscluster certs`: test certificates and ssl.json."""
    cert.add_argument("--out", required=True, help="directory to write to")
    cert.add_argument(
        "--host",
        action="append",
        help="another name or address of the scheduler for its certificate (repeatable); "
        "127.0.0.1, ::1 and localhost are always in",
    )
    cert.add_argument("--force", action="store_true", help="overwrite existing files")
    cert.set_defaults(func=_cmd_certs)


def _add_chaos_options(chaos: argparse.ArgumentParser) -> None:
    """`mscluster chaos`: a job under random faults."""
    chaos.add_argument(
        "--faults",
        default="kill,stop,scheduler",
        help="of kill,stop,scheduler,partition (kill,stop,scheduler; partition needs root)",
    )
    chaos.add_argument("--every", type=float, default=5.0, help="mean seconds between faults (5)")
    chaos.add_argument("--seed", type=int, default=0, help="random seed (0)")
    chaos.add_argument("--duration", type=float, default=60.0, help="seconds of faults (60)")
    chaos.add_argument("--count", type=int, help="stop after this many faults (no limit)")
    chaos.add_argument(
        "--standbys",
        type=int,
        default=0,
        help="standby schedulers beside the first, on 127.0.0.2, 127.0.0.3, ... (needs "
        "--state-url etcd://... among the run options); the scheduler fault kills the leader (0)",
    )
    chaos.add_argument("--report", help="the JSON report (default LOG_DIR/chaos-report.json)")
    chaos.add_argument("run_options", nargs=argparse.REMAINDER, help="-- mscluster run options")
    chaos.set_defaults(func=_cmd_chaos)


def _version() -> str:
    """`mscluster --version`: the installed distribution's, else the package's own."""
    # importlib.metadata (email, zipfile, csv) and its look through sys.path: only when asked.
    from importlib import metadata  # noqa: PLC0415

    try:
        return f"{DISTRIBUTION} {metadata.version(DISTRIBUTION)}"
    except metadata.PackageNotFoundError:  # run from a checkout, not installed under this name
        return f"{DISTRIBUTION} {cluster.__version__}"


class _VersionAction(argparse.Action):
    """argparse's "version" action, with the version found only when it is asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_: Any) -> None:
        super().__init__(option_strings, SUPPRESS, default=SUPPRESS, nargs=0, help=VERSION_HELP)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(_version())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mscluster", description="Scheduler/worker networking for distributed training."
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="start the local processes of a job (like msrun / torchrun)",
        description="Start the scheduler (when --master-addr is this host and --node-rank is 0 "
        "or unset) and this host's workers of SCRIPT; watch them; stop them all together.",
    )
    _add_run_options(run)
    sched = commands.add_parser(
        "scheduler",
        help="run a standalone scheduler for one job",
        description="Serve one job until every worker finished (exit 0) or it failed (exit 1). "
        "Options default to the MS_* environment variables.",
    )
    _add_scheduler_options(sched)
    relay = commands.add_parser(
        "relay",
        help="serve this host's workers on a local socket, over one connection to the scheduler",
        description="Forward the calls of the workers that reach --socket (CLUSTER_RELAY="
        "unix:PATH) to the scheduler over one connection, each with its own proof; the job is "
        "MS_WORKER_NUM's, the scheduler MS_SCHED_HOST:MS_SCHED_PORT's, TLS CLUSTER_TLS_CONFIG's.",
    )
    _add_relay_options(relay)
    stat = commands.add_parser(
        "status",
        help="show a running job's nodes, ranks and health",
        description="Ask the scheduler at --addr for the job's phase, generation and nodes.",
    )
    _add_status_options(stat)
    ev = commands.add_parser(
        "events",
        help="show the job's events (formed, failed, rejoined, ...) as a table",
        description="The job's events, from the event log `mscluster run` writes "
        "(LOG_DIR/events.jsonl; default logs/events.jsonl) or the scheduler's CLUSTER_EVENT_LOG, "
        "or from a running scheduler (--addr).",
    )
    _add_events_options(ev)
    cert = commands.add_parser(
        "certs",
        help="make a CA, p12 files, a CRL and ssl.json for tests and first trials",
        description="Write DIR/ca.pem, server.p12, client.p12, client-revoked.p12, crl.pem, the "
        "p12 passwords (server.pass, client.pass) and DIR/ssl.json, a complete TLS config for "
        "`mscluster run --tls-config DIR/ssl.json`. Not for production keys: see certs/README.md.",
    )
    _add_certs_options(cert)
    chaos = commands.add_parser(
        "chaos",
        help="run a job under random faults and report how it coped",
        description="Run the whole job of `mscluster run` options on this host with recovery on, "
        "inject faults at random moments (reproducible with --seed), restart what was killed, "
        "and report each fault's detection and recovery time and the steps lost; exit 0 only "
        "when the job finished correctly. The run options follow `--`.",
    )
    _add_chaos_options(chaos)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is answered with the closest known one."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        known = _known_options(parser, getattr(args, "command", None))
        hints = []
        import difflib  # noqa: PLC0415 - only for a mistyped option

        for word in unknown:
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.75)
            hints.append(f"{word} (did you mean {close[0]}?)" if close else word)
        parser.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def _known_options(parser: argparse.ArgumentParser, command: str | None) -> list[str]:
    """The option strings of `parser` and of its subcommand `command`."""
    known: list[str] = []
    for action in parser._actions:
        known += action.option_strings
        if isinstance(action.choices, dict) and command in action.choices:
            known += _known_options(action.choices[command], None)
    return known


def main(argv: Sequence[str] | None = None) -> int:
    excepthook.install()
    args = _parse(build_parser(), argv)
    try:
        code: int = args.func(args)
    except ReadRefusedError as exc:  # one line that says which secret to give
        print(f"mscluster: {safe(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except ClusterError as exc:
        print(f"mscluster: {type(exc).__name__}: {safe(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the last net: a file or socket the command could not use
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"mscluster: {safe(where)}{safe(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C that no command took: its exit, without a traceback
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
