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

This module builds the parser (`build_parser`: each subcommand's options and the command it
runs) and runs it (`main`). What each command does is `cli_commands`'; the arguments of `run`
(`chaos` takes them too), the readers' secret options and the parsing that answers a mistyped
option are `cli_args`'.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
from argparse import SUPPRESS
from collections.abc import Sequence
from typing import Any

import cluster
from cluster.api import excepthook
from cluster.protocol.display import safe
from cluster.protocol.errors import ClusterError, ReadRefusedError
from cluster.tools import cli_commands as commands
from cluster.tools import placement
from cluster.tools.cli_args import add_reader_options, add_run_arguments, parse
from cluster.tools.cli_commands import EXIT_INTERRUPTED, default_scheduler_addr

__all__ = [
    "DISTRIBUTION",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "VERSION_HELP",
    "build_parser",
    "default_scheduler_addr",
    "main",
]

EXIT_USAGE = 2
# A command whose stdout's reader went: the status a shell gives a tool SIGPIPE ended.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
# The distribution that installs this command (pyproject.toml's name; the import name is cluster).
DISTRIBUTION = "mscluster-grpc"
VERSION_HELP = "show the program's version number and exit"  # argparse's own words


def _add_run_options(run: argparse.ArgumentParser) -> None:
    """`mscluster run`: the launcher's options, then the script and its arguments."""
    add_run_arguments(run)
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would start on this host (processes, node ids, ranks, environment "
        "without secrets, logs) and exit",
    )
    run.set_defaults(func=commands.cmd_run)


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
    sched.add_argument(
        "--metrics-host",
        help="the address /metrics listens on, plain HTTP and open to whoever reaches it: a "
        "private one (CLUSTER_METRICS_HOST; default: --host)",
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
    sched.set_defaults(func=commands.cmd_scheduler)


def _add_relay_options(relay: argparse.ArgumentParser) -> None:
    """`mscluster relay`: one host's relay for its workers."""
    relay.add_argument("--socket", required=True, help="the local socket to serve (unix:PATH)")
    relay.add_argument(
        "--scheduler", help="HOST:PORT (default: MS_SCHED_HOST and MS_SCHED_PORT, the first)"
    )
    relay.set_defaults(func=commands.cmd_relay)


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
    add_reader_options(stat)
    stat.set_defaults(func=commands.cmd_status)


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
    add_reader_options(ev, events=True)
    ev.set_defaults(func=commands.cmd_events)


def _add_certs_options(cert: argparse.ArgumentParser) -> None:
    """`mscluster certs`: test certificates and ssl.json."""
    cert.add_argument("--out", required=True, help="directory to write to")
    cert.add_argument(
        "--host",
        action="append",
        help="another name or address of the scheduler for its certificate (repeatable; an "
        "IPv6 address maybe in [ ]); 127.0.0.1, ::1 and localhost are always in",
    )
    cert.add_argument("--force", action="store_true", help="overwrite existing files")
    cert.set_defaults(func=commands.cmd_certs)


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
    chaos.set_defaults(func=commands.cmd_chaos)


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


# `mscluster certs --help`: what it writes, and where the docs say the rest (a wheel has no
# certs/README.md: the site has it as its Certificates page).
CERTS_DESCRIPTION = (
    "Write DIR/ca.pem, server.p12, client.p12, client-revoked.p12, crl.pem, the p12 passwords "
    "(server.pass, client.pass) and DIR/ssl.json, a complete TLS config for `mscluster run "
    "--tls-config DIR/ssl.json`. Not for production keys: see the docs' TLS how-to "
    "(docs/howto/tls.md) and its Certificates page, for your own CA's."
)


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
        description=CERTS_DESCRIPTION,
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


def main(argv: Sequence[str] | None = None) -> int:
    excepthook.install()
    args = parse(build_parser(), argv)
    try:
        code: int = args.func(args)
    except ReadRefusedError as exc:  # one line that says which secret to give
        print(f"mscluster: {safe(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except ClusterError as exc:
        print(f"mscluster: {type(exc).__name__}: {safe(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the last net: a file or socket the command could not use
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            return EXIT_BROKEN_PIPE  # stdout's reader went (`| head`): quiet, as Unix tools
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"mscluster: {safe(where)}{safe(exc.strerror or exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C that no command took: its exit, without a traceback
        return EXIT_INTERRUPTED
    return code


def _stdout_gone() -> bool:
    """Whether stdout's reader went (its pipe polls as an error); if so, stdout is pointed at
    /dev/null, so that its flush at exit does not meet the broken pipe again."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(flags & select.POLLERR for _, flags in poller.poll(0)):
            return False
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError):  # ValueError: a stdout of no descriptor (a test's)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
