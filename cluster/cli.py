"""`mscluster`: the command line. Thin: it parses arguments and calls the library.

    mscluster run [options] SCRIPT [ARGS...]   start a job's local processes (like msrun/torchrun)
    mscluster scheduler [options]              a standalone scheduler
    mscluster status --addr HOST:PORT          what a running job looks like

Exit codes: 0 success, 1 the job failed, 2 a usage or configuration error, 128+N a signal.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from cluster import _excepthook, _orphan, _runtime, launch, status
from cluster.config import ClusterConfig, from_env
from cluster.errors import ClusterError, ConfigError, SchedulerUnreachableError
from cluster.scheduler import server as scheduler_server

EXIT_USAGE = 2
DEFAULT_MASTER_PORT = 8118


def _scheduler_config(args: argparse.Namespace) -> ClusterConfig:
    env = dict(os.environ)
    env["MS_ROLE"] = "MS_SCHED"
    overrides = {
        "MS_SCHED_HOST": args.host,
        "MS_WORKER_NUM": args.worker_num,
        "MS_SERVER_NUM": args.server_num,
        "MS_NODE_TIMEOUT": args.node_timeout,
        "MS_TOPO_TIMEOUT": args.topo_timeout,
    }
    env.update({k: str(v) for k, v in overrides.items() if v is not None})
    env.setdefault("MS_SCHED_HOST", "127.0.0.1")
    # Port 0 (any free port, logged at start) is allowed here, not in the launch contract.
    port = args.port if args.port is not None else env.get("MS_SCHED_PORT")
    env["MS_SCHED_PORT"] = "1" if str(port) == "0" else str(port or "")
    config = from_env(env)
    return dataclasses.replace(config, sched_port=0) if str(port) == "0" else config


def _cmd_scheduler(args: argparse.Namespace) -> int:
    config = _scheduler_config(args)
    _orphan.watch_launcher()
    _runtime.configure_logging("scheduler")
    return scheduler_server.run(config)


def _cmd_run(args: argparse.Namespace) -> int:
    local = args.local_worker_num if args.local_worker_num is not None else args.worker_num
    options = launch.LaunchOptions(
        script=Path(args.script),
        script_args=tuple(args.script_args),
        worker_num=args.worker_num,
        local_worker_num=local,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_rank=args.node_rank,
        log_dir=Path(args.log_dir),
        join=args.join,
        cluster_time_out=args.cluster_time_out,
        node_timeout=args.node_timeout,
        enable_recovery=args.enable_recovery,
        recovery_path=Path(args.recovery_path) if args.recovery_path else None,
        max_restarts=args.max_restarts,
        tls_config=Path(args.tls_config) if args.tls_config else None,
    )
    return launch.run(options)


def _split_addr(addr: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--addr {addr!r} must be HOST:PORT with a port in 1-65535")
    return addr


async def _status(addr: str) -> status.JobView:
    async with grpc.aio.insecure_channel(addr) as channel:
        return await status.fetch(channel, addr)


def _cmd_status(args: argparse.Namespace) -> int:
    addr = _split_addr(args.addr)
    try:
        view = asyncio.run(_status(addr))
    except SchedulerUnreachableError as exc:
        print(f"mscluster: {exc}", file=sys.stderr)
        return 1
    print(view.to_json() if args.json else status.render(view))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mscluster", description="Scheduler/worker networking for distributed training."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run",
        help="start the local processes of a job (like msrun / torchrun)",
        description="Start the scheduler (when --master-addr is this host and --node-rank is 0 "
        "or unset) and this host's workers of SCRIPT; watch them; stop them all together.",
    )
    run.add_argument("--worker-num", type=int, default=8, help="workers in the whole job (8)")
    run.add_argument(
        "--local-worker-num", type=int, help="workers on this host (default: --worker-num)"
    )
    run.add_argument("--master-addr", default="127.0.0.1", help="scheduler host (127.0.0.1)")
    run.add_argument(
        "--master-port", type=int, default=DEFAULT_MASTER_PORT, help="scheduler port (8118)"
    )
    run.add_argument(
        "--node-rank",
        type=int,
        default=-1,
        help="this host's index; its workers get node ids node_rank*local_worker_num+i",
    )
    run.add_argument("--log-dir", default="logs", help="where scheduler.log, worker_<i>.log go")
    run.add_argument(
        "--join", action="store_true", help="also stream the workers' output, prefixed by rank"
    )
    run.add_argument(
        "--cluster-time-out",
        type=float,
        help="seconds for all workers to register (MS_TOPO_TIMEOUT)",
    )
    run.add_argument("--node-timeout", type=float, help="heartbeat timeout (MS_NODE_TIMEOUT)")
    run.add_argument("--enable-recovery", action="store_true", help="MS_ENABLE_RECOVERY=1")
    run.add_argument("--recovery-path", help="MS_RECOVERY_PATH")
    run.add_argument(
        "--max-restarts", type=int, default=0, help="restart a failed local worker up to K times"
    )
    run.add_argument("--tls-config", help="ssl.json for mutual TLS (CLUSTER_TLS_CONFIG)")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(func=_cmd_run)

    sched = commands.add_parser(
        "scheduler",
        help="run a standalone scheduler for one job",
        description="Serve one job until every worker finished (exit 0) or it failed (exit 1). "
        "Options default to the MS_* environment variables.",
    )
    sched.add_argument("--host", help="address to listen on (MS_SCHED_HOST; default 127.0.0.1)")
    sched.add_argument("--port", type=int, help="port to listen on, 0 for any (MS_SCHED_PORT)")
    sched.add_argument("--worker-num", type=int, help="number of workers (MS_WORKER_NUM)")
    sched.add_argument("--server-num", type=int, help="number of parameter servers")
    sched.add_argument("--node-timeout", type=float, help="seconds (MS_NODE_TIMEOUT)")
    sched.add_argument("--topo-timeout", type=float, help="seconds (MS_TOPO_TIMEOUT)")
    sched.set_defaults(func=_cmd_scheduler)

    stat = commands.add_parser(
        "status",
        help="show a running job's nodes, ranks and health",
        description="Ask the scheduler at --addr for the job's phase, generation and nodes.",
    )
    stat.add_argument("--addr", required=True, help="the scheduler's HOST:PORT")
    stat.add_argument("--json", action="store_true", help="machine-readable output")
    stat.set_defaults(func=_cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _excepthook.install()
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ClusterError as exc:
        print(f"mscluster: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code


if __name__ == "__main__":
    sys.exit(main())
