"""`mscluster chaos`: the command around `cluster.tools.chaos.Chaos`. `ChaosSpec` is one run's
options; `run_chaos` checks them all before anything is written or started, runs the job under
faults (stopped by SIGTERM or SIGINT through its teardown), prints the report and writes it as
JSON and as a page beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cluster.protocol.config import RecoveryConfig, parse_seconds
from cluster.protocol.errors import ClusterError, ConfigError
from cluster.storage.recovery_dir import check_recovery_path
from cluster.tools import report_html
from cluster.tools.chaos import FAULTS, Chaos, ChaosReport, check_injection
from cluster.tools.chaos_record import EVENT_LOG, load_events
from cluster.tools.launch_lock import CHECK_S, LogDirLock
from cluster.tools.launch_plan import RELAY_FROM, LaunchOptions
from cluster.tools.launch_setup import check_lease, say, settle, writable_dir
from cluster.tools.netlab import NetworkLab
from cluster.tools.testing import LocalJob, LocalJobOptions


@dataclass(frozen=True)
class ChaosSpec:
    """One `mscluster chaos` run: the job (`script` with `script_args`, `workers` and `spares`,
    MS_NODE_TIMEOUT `node_timeout_s`, logs in `log_dir`; `standbys` schedulers beside the first,
    on `state_url` (etcd) with a lease of `lease_s`), the faults (of `faults`, one every
    `every_s` on average for `duration_s`, at most `count`, drawn from `seed`) and the JSON
    report (`report_path`, by default LOG_DIR/chaos-report.json). The rest of `mscluster run`'s
    options that chaos honours: `tls_config`, `recovery_path`, `topo_timeout_s`
    (--cluster-time-out), `master_port`, `metrics_port`, and `relay` (a relay for 2 or more
    workers, as `mscluster run` starts, unless --no-relay; never with partition faults, which
    make each worker a host of its own)."""

    script: Path
    script_args: Sequence[str] = ()
    workers: int = 2
    node_timeout_s: float = 3.0
    log_dir: Path = Path("logs")
    faults: Sequence[str] = FAULTS
    every_s: float = 5.0
    duration_s: float = 60.0
    seed: int = 0
    count: int | None = None
    report_path: Path | None = None
    spares: int = 0
    standbys: int = 0
    state_url: str | None = None
    lease_s: int | None = None
    tls_config: Path | None = None
    recovery_path: Path | None = None
    topo_timeout_s: float | None = None
    master_port: int | None = None
    metrics_port: int | None = None
    relay: bool = True


# How long the end of a run waits for the lock check under way (a few file operations).
KEEP_JOIN_S = 10.0

# The options of `mscluster run` that chaos cannot honour, each with why: given after `--`,
# they are refused in one line before anything starts (the others are honoured).
NOT_FOR_CHAOS = (
    (
        "master_addr",
        "--master-addr",
        "chaos runs the whole job on this host, its scheduler on 127.0.0.1 (standbys on "
        "127.0.0.2, ...)",
    ),
    (
        "max_restarts",
        "--max-restarts",
        "chaos starts again, at once, the processes it kills and no others: a restart by the "
        "launcher would hide the failure it recovers from",
    ),
    ("join", "--join", "the workers' output is in LOG_DIR/worker_<i>.log, not on the terminal"),
)


def refuse_run_options(given: Mapping[str, Any]) -> None:
    """A ConfigError naming the first `mscluster run` option of `given` (the parsed run
    options) that chaos cannot honour (`NOT_FOR_CHAOS`), and why."""
    for key, option, why in NOT_FOR_CHAOS:
        if given.get(key) not in (None, False):
            raise ConfigError(f"mscluster chaos does not take {option} after `--`: {why}")


def spec_of(
    chaos: Any,
    run: Any,
    workers: int,
    log_dir: Path,
    *,
    env: Mapping[str, str] = os.environ,
    out: IO[str] = sys.stderr,
) -> ChaosSpec:
    """The run of `mscluster chaos`: its own options (`chaos`, parsed) and `mscluster run`'s
    after `--` (`run`, parsed, with the placement's `workers` and `log_dir`), with msrun's
    variables of `env` (MS_NODE_TIMEOUT, MS_RECOVERY_PATH, ...) as the options' defaults, as
    `mscluster run` takes them (`launch_setup.settle`; an option given wins, said to `out`)."""
    check_lease(run.lease, run.state_url)  # as `mscluster run` refuses it
    given = _settled(run, workers, log_dir, env, out)
    return ChaosSpec(
        Path(run.script),
        run.script_args,
        workers=workers,
        # A short guard by default, so that a run of a minute sees many faults.
        node_timeout_s=given.node_timeout if given.node_timeout is not None else 3.0,
        log_dir=log_dir,
        faults=[f.strip() for f in chaos.faults.split(",") if f.strip()],
        every_s=chaos.every,
        duration_s=chaos.duration,
        seed=chaos.seed,
        count=chaos.count,
        report_path=Path(chaos.report) if chaos.report else None,
        spares=run.spares,
        standbys=chaos.standbys,
        state_url=run.state_url,
        lease_s=run.lease,
        tls_config=Path(run.tls_config) if run.tls_config else None,
        recovery_path=given.recovery_path,
        topo_timeout_s=given.cluster_time_out,
        master_port=run.master_port,
        metrics_port=run.metrics_port,
        relay=run.relay,
    )


def _settled(
    run: Any, workers: int, log_dir: Path, env: Mapping[str, str], out: IO[str]
) -> LaunchOptions:
    """`run`'s options settled with `env` as `mscluster run` settles them; a ConfigError where
    the environment turns recovery off, which every chaos run needs."""
    options = LaunchOptions(
        script=Path(run.script),
        script_args=tuple(run.script_args),
        worker_num=workers,
        local_worker_num=workers,
        master_addr="127.0.0.1",
        master_port=run.master_port or 0,
        log_dir=log_dir,
        cluster_time_out=run.cluster_time_out,
        node_timeout=run.node_timeout,
        enable_recovery=bool(run.enable_recovery or run.state_url),
        recovery_path=Path(run.recovery_path) if run.recovery_path else None,
    )
    settled = settle(options, env, out, max_restarts=None)
    if not settled.enable_recovery and env.get("MS_ENABLE_RECOVERY", "").strip():
        raise ConfigError(
            f"MS_ENABLE_RECOVERY={env['MS_ENABLE_RECOVERY'].strip()} of this environment turns "
            "recovery off, and mscluster chaos runs its job with recovery on (the job must "
            "resume after each process it kills): unset it, or give --enable-recovery after `--`"
        )
    return settled


def run_chaos(
    spec: ChaosSpec, *, out: IO[str] = sys.stderr, make_job: Callable[..., LocalJob] = LocalJob
) -> ChaosReport:
    """The whole command: run, report to `out` and the JSON report. Every option is checked
    before anything is written or started, and the log directory is locked as `mscluster run`
    locks it (`launch_lock`): a run or another chaos run holding it is a refusal."""
    report_path = spec.report_path or spec.log_dir / "chaos-report.json"
    _check_spec(spec, report_path)
    lock = LogDirLock(spec.log_dir)  # one run per log directory, as `mscluster run`
    note = lock.take(spec.master_port or 0)
    if note:
        print(note, file=out, flush=True)
    try:
        with _keeping(lock, out):
            return _run_locked(spec, report_path, out, make_job)
    finally:
        lock.release()


@contextlib.contextmanager
def _keeping(lock: LogDirLock, out: IO[str]) -> Iterator[None]:
    """While the run goes on, `lock` checked every CHECK_S as the launcher checks its own
    (`LogDirLock.keep`: a lock file removed or replaced is locked anew), its lines to `out`."""
    done = threading.Event()

    def check() -> None:
        while not done.wait(CHECK_S):
            line = lock.keep()
            if line:
                say(out, f"{line}\n")

    thread = threading.Thread(target=check, name="log-dir-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(KEEP_JOIN_S)


def _run_locked(
    spec: ChaosSpec, report_path: Path, out: IO[str], make_job: Callable[..., LocalJob]
) -> ChaosReport:
    """`run_chaos` once the log directory is this run's."""
    events_path = spec.log_dir / EVENT_LOG
    options = _job_options(spec, events_path)
    try:  # checks the TLS config and the port, and writes the job's secret
        job = make_job(
            spec.script,
            spec.script_args,
            workers=spec.workers,
            node_timeout_s=spec.node_timeout_s,
            workdir=spec.log_dir,
            timeout_s=max(60.0, 6 * spec.node_timeout_s),
            options=options,
        )
    except BaseException:
        if options.network is not None:
            options.network.teardown()
        raise
    events_path.unlink(missing_ok=True)  # this run's events only
    chaos = Chaos(
        job,
        faults=spec.faults,
        every_s=spec.every_s,
        duration_s=spec.duration_s,
        seed=spec.seed,
        count=spec.count,
        out=out,
    )
    report = _run_stoppable(chaos, job)
    print(report.render(), file=out, flush=True)
    if report.started_at:
        report.events = load_events(events_path, report.started_at)
    _write_report(report, report_path, out)
    return report


def _check_spec(spec: ChaosSpec, report_path: Path) -> None:
    """A ClusterError naming the option that cannot be used; writes nothing but the log
    directory (made, as the run makes it)."""
    if not spec.script.is_file():
        raise ClusterError(f"the script {str(spec.script)!r} does not exist")
    check_injection(spec.faults, spec.every_s, spec.duration_s, spec.count)
    parse_seconds("--node-timeout", f"{spec.node_timeout_s:g}")  # finite, > 0: it bounds waits
    if spec.topo_timeout_s is not None:
        parse_seconds("--cluster-time-out", f"{spec.topo_timeout_s:g}")
    for option, port, lowest in (
        ("--master-port", spec.master_port, 1),
        ("--metrics-port", spec.metrics_port, 0),
    ):
        if port is not None and not lowest <= port <= 65535:
            raise ConfigError(f"{option} {port} must be between {lowest} and 65535")
    writable_dir("--log-dir", spec.log_dir)
    if spec.recovery_path is not None:
        try:
            check_recovery_path(RecoveryConfig(spec.recovery_path))
        except ConfigError as exc:
            raise ConfigError(f"--recovery-path: {exc}") from None
    option = "--log-dir" if spec.report_path is None else f"--report {str(spec.report_path)!r}"
    if spec.report_path is not None:
        writable_dir(option, report_path.parent, make=False)
    for path in (report_path, report_path.with_suffix(".html")):
        if path.is_dir():
            raise ConfigError(
                f"{option}: {str(path)!r} is a directory: the report is a file (give --report "
                "DIR/chaos-report.json, or remove the directory)"
            )


def _run_stoppable(chaos: Chaos, job: LocalJob) -> ChaosReport:
    """`chaos.run()`, ended through `job.close()` by SIGTERM or SIGINT from outside too."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, _stop)
    try:
        return chaos.run()
    finally:
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# How long a run stopped by a signal may take to end: its teardown is bounded (each process
# reaped within 10 s, each channel closed within 5 s, each `ip` command within 30 s).
STOP_BOUND_S = 45.0


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM or SIGINT from outside: end the run through its `finally` (the job's processes
    killed, the network lab torn down), once; a second signal while it ends is ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _exit_within(STOP_BOUND_S, 128 + signum)
    raise SystemExit(128 + signum)


def _exit_within(seconds: float, code: int) -> None:
    """Exit with `code` even if ending takes longer than `seconds` (something blocked in the
    teardown or at the interpreter's exit): first print every thread's stack, which says what
    blocked, so that a stopped run never hangs silently."""

    def expire() -> None:
        sys.stderr.write(
            f"mscluster chaos: still ending {seconds:g} s after the signal; every thread's stack "
            "follows, then it exits\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _network(workers: int, schedulers: int) -> NetworkLab:
    """The namespaces a partition needs, or a ClusterError that says why they cannot be made."""
    why = NetworkLab.why_not_available()
    if why:
        raise ClusterError(f"--faults partition needs network namespaces: {why}")
    return NetworkLab(workers, schedulers=schedulers)


def _job_options(spec: ChaosSpec, events_path: Path) -> LocalJobOptions:
    """The job's options: recovery on, the event log, spares, and schedulers (standbys on the
    state URL); a ClusterError for standbys without one, a partition with spares, or a
    partition without namespaces."""
    if spec.spares and "partition" in spec.faults:
        raise ConfigError(
            f"--faults partition with --spares {spec.spares}: a worker cut off while a spare took "
            "its rank is refused when its link returns, and exits (started again, it would join "
            "as a spare; chaos starts again only the workers it kills): run partition faults "
            "without --spares"
        )
    if spec.standbys and spec.state_url is None:
        raise ClusterError(
            f"--standbys {spec.standbys} needs --state-url etcd://HOST:PORT/PREFIX after `--`: "
            "standby schedulers share the job's state in etcd"
        )
    partition = "partition" in spec.faults
    options = LocalJobOptions(
        env=_job_env(spec, events_path),
        network=_network(spec.workers, spec.standbys + 1) if partition else None,
        spares=spec.spares,
        port=spec.master_port,
        tls_config=spec.tls_config,
        relay=spec.relay and spec.workers + spec.spares >= RELAY_FROM and not partition,
    )
    if spec.state_url is None:
        return options
    options = dataclasses.replace(options, standbys=spec.standbys, state_url=spec.state_url)
    if spec.lease_s is not None:
        options = dataclasses.replace(options, lease_s=spec.lease_s)
    return options


def _job_env(spec: ChaosSpec, events_path: Path) -> dict[str, str]:
    """What the run options set in every process's environment, as `mscluster run` does."""
    env = {"CLUSTER_EVENT_LOG": str(events_path.resolve())}
    if spec.recovery_path is not None:
        env["MS_RECOVERY_PATH"] = str(spec.recovery_path.resolve())
    if spec.topo_timeout_s is not None:
        env["MS_TOPO_TIMEOUT"] = f"{spec.topo_timeout_s:g}"
    if spec.metrics_port is not None:
        env["CLUSTER_METRICS_PORT"] = str(spec.metrics_port)
    return env


def _write_report(report: ChaosReport, path: Path, out: IO[str]) -> None:
    """The report as JSON at `path` and as a page beside it (.html); a write that fails (the
    disk filled during the run, say) is said in one line, after the report's text."""
    page = path.with_suffix(".html")
    try:
        path.write_text(report.to_json() + "\n")
        page.write_text(report_html.render(json.loads(report.to_json())))
    except OSError as exc:
        where = exc.filename or path
        print(
            f"mscluster chaos: cannot write the report to {where} ({exc.strerror or exc}); its "
            "text is above",
            file=out,
            flush=True,
        )
        return
    print(f"mscluster chaos: report written to {path} and {page}", file=out, flush=True)
