"""The arguments of `mscluster run` (which `mscluster chaos` takes after `--` too), the options
by which a reader proves the job secret (`status`, `events`), and the parsing that answers a
mistyped option with the closest known one, and each of msrun's options that `run` has no
counterpart for in one line (refused, or ignored with a note).
"""

from __future__ import annotations

import argparse
import sys
from argparse import SUPPRESS
from collections.abc import Sequence
from typing import Any

# The values of msrun's --join (ast.literal_eval'd there, True or False: 1 and 0 too), with the
# lower-case words people write; what each means.
JOIN_VALUES = {"True": True, "true": True, "1": True, "False": False, "false": False, "0": False}


# msrun's options that mscluster run has no counterpart for (MindSpore's
# parallel/cluster/run.py), each with what becomes of it: ignored with a note where the job runs
# the same without it, else refused. Both in one line, with no "did you mean".
MSRUN_IGNORED = {
    "--bind_core": "no worker is bound to CPU cores here (a script may bind itself: "
    "os.sched_setaffinity)",
    "--worker_log_name": "the workers' logs are worker_<i>.log in --log-dir",
    "--tail_worker_log": "with --join every local worker's output is streamed, prefixed by "
    "rank, and each one's log is worker_<i>.log in --log-dir",
}
_SIMULATION = (
    "it starts a real job, never MindSpore's dry-run simulation (simulate with msrun; "
    "`mscluster run --dry-run` shows what a run would start)"
)
MSRUN_REFUSED = {
    "--sim_level": _SIMULATION,
    "--sim_rank_id": _SIMULATION,
    "--rank_table_file": "ranks here follow no rank table (a worker's numeric node id is its "
    "rank: --node-rank gives this host's workers node_rank*local_worker_num+i); drop the option",
}
_NOTES = "msrun_notes"  # the namespace's notes of the msrun options that were ignored


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    _add_placement_arguments(run)
    _add_join_arguments(run)
    _add_job_arguments(run)
    for option, why in {**MSRUN_IGNORED, **MSRUN_REFUSED}.items():
        run.add_argument(
            option, action=_MsrunOnly, why=why, ignored=option in MSRUN_IGNORED, help=SUPPRESS
        )
    run.add_argument("script", help="the training script")
    rest = run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    rest.required = False  # none is fine; argparse (3.11) would name it among the missing


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
        help="where scheduler.log, worker_<rank>.log go (logs; Slurm: logs/<job>.<step>[/node<R>])",
    )


def _add_join_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--join",
        action="store_true",
        help="also stream the workers' output, prefixed by rank (msrun's --join True; "
        "--join False: logs only; the launcher always waits for the job)",
    )
    # msrun's --join takes a value. Whole words, matched before argparse splits at "=", so that
    # a bare --join still leaves the next word to be the script; `--join True` is joined into
    # `--join=True` by `parse` (`_join_value_apart`).
    for word, on in JOIN_VALUES.items():
        run.add_argument(
            f"--join={word}",
            dest="join",
            action="store_true" if on else "store_false",
            default=False,
            help=SUPPRESS,
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


class _MsrunOnly(argparse.Action):
    """One of msrun's options that mscluster run does not have, with its value: refused in
    one line (exit 2), or, `ignored`, noted for `parse` to say in one line."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, why: str, ignored: bool, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, default=SUPPRESS, **kwargs)
        self.why, self.ignored = why, ignored

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        option = self.option_strings[0]
        if not self.ignored:
            parser.exit(
                2,
                f"{parser.prog}: error: msrun's {option} is not supported by mscluster "
                f"run: {self.why}\n",
            )
        notes = getattr(namespace, _NOTES, [])
        notes.append(f"{parser.prog}: note: msrun's {option} is ignored: {self.why}")
        setattr(namespace, _NOTES, notes)


def add_reader_options(reader: argparse.ArgumentParser, *, events: bool = False) -> None:
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


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is answered with the closest known one, and msrun's
    `--join True` (its value a word of its own) is `--join=True`."""
    words = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(words)
    joined = _join_value_apart(words, args)
    if joined is not None:
        args, unknown = parser.parse_known_args(joined)
    if unknown:
        known = _known_options(parser, getattr(args, "command", None))
        hints = []
        import difflib  # noqa: PLC0415 - only for a mistyped option

        for word in unknown:
            close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.75)
            hints.append(f"{word} (did you mean {close[0]}?)" if close else word)
        parser.error(f"unrecognized arguments: {' '.join(hints)}")
    for note in vars(args).pop(_NOTES, []):
        print(note, file=sys.stderr)
    return args


def _join_value_apart(words: list[str], args: argparse.Namespace) -> list[str] | None:
    """`words` with msrun's `--join VALUE` as `--join=VALUE` when argparse took that VALUE for
    the script (and the script for the script's first argument); None when it did not."""
    script = getattr(args, "script", None)
    if script not in JOIN_VALUES:
        return None
    at = len(words) - len(args.script_args) - 1  # the script's arguments are the last words
    if at < 1 or words[at] != script or words[at - 1] != "--join":
        return None
    return [*words[: at - 1], f"--join={script}", *words[at + 1 :]]


def _known_options(parser: argparse.ArgumentParser, command: str | None) -> list[str]:
    """The option strings of `parser` and of its subcommand `command`."""
    known: list[str] = []
    for action in parser._actions:
        if not isinstance(action, _MsrunOnly):  # none is meant in place of another
            known += action.option_strings
        if isinstance(action.choices, dict) and command in action.choices:
            known += _known_options(action.choices[command], None)
    return known
