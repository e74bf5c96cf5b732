"""`mscluster`: the command line. Thin: it parses arguments and calls the library.

    mscluster scheduler [--host H] [--port P] [--worker-num N] ...

Options default to the MS_* launch environment, so `MS_ROLE`-style scripts and the command line
describe a job the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from cluster import _excepthook, _runtime
from cluster.config import ClusterConfig, from_env
from cluster.errors import ClusterError
from cluster.scheduler import server as scheduler_server

EXIT_USAGE = 2


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
    _runtime.configure_logging("scheduler")
    return scheduler_server.run(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mscluster", description="Scheduler/worker networking for distributed training."
    )
    commands = parser.add_subparsers(dest="command", required=True)
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
