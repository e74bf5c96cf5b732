"""The process-wide job membership behind `cluster.init()` and friends.

`import cluster` must not import grpc: grpc reads its TLS cipher list (GRPC_SSL_CIPHER_SUITES)
once, when it is imported, and `set_ps_context()` / `init()` set that variable from ssl.json
first. So the worker session and the scheduler server, which import grpc, are imported in
`init()`, and `cluster.tls` (which imports cryptography) only when TLS is on.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.api import excepthook
from cluster.protocol import environment
from cluster.protocol.config import ClusterConfig, ObserveConfig, Role, TLSOptions
from cluster.protocol.display import SafeFormatter, quoted
from cluster.protocol.errors import (
    CheckpointError,
    ClusterError,
    CollectiveError,
    ConfigError,
    NotInitializedError,
    ReleasedError,
    TLSConfigError,
)
from cluster.protocol.topology import Peer, Topology
from cluster.worker import orphan
from cluster.worker.identity import make_identity

if TYPE_CHECKING:
    from cluster.worker.session import WorkerSession

# Ctrl-C during the finalize at exit: the one line, and the status of a process it ended.
INTERRUPTED = (
    "cluster: KeyboardInterrupt: interrupted while this worker finalized at exit; the "
    "scheduler may not have heard that it finished"
)
EXIT_INTERRUPTED = 130
_lock = threading.Lock()
_session: WorkerSession | None = None
_finalized = False  # the last session was finalized (no init() since)
_closing: WorkerSession | None = None  # the session `_close` is finalizing
# TLS as set_ps_context() decided it (None: off); when it was not called, the environment decides.
_ps_context_called = False
_ps_context_tls: TLSOptions | None = None
# What this worker lets go of when its generation is over (see on_generation_over).
_releases: list[Callable[[], None]] = []
# What this worker closes at finalize, before it tells the scheduler (see on_finalize).
_closers: list[Callable[[], None]] = []
# Called instead of _closers when the program died of an uncaught exception (`on_crash`).
_aborters: list[Callable[[], None]] = []
_log = logging.getLogger(__name__)
# The process whose writers and session these are (the one that imported this, or that called
# init()): a child forked from it leaves them alone at its exit.
_pid = os.getpid()
FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
# The backend names MindSpore's init(backend_name) takes: a ported script's, which init() ignores.
MINDSPORE_BACKENDS = ("hccl", "nccl", "mccl")
_fork_support_taken = False  # init() set FORK_SUPPORT (`_take_fork_support`)


def session() -> WorkerSession:
    if _session is None or _session.topology is None:
        if _finalized:
            from cluster.worker.session import FINALIZED  # noqa: PLC0415 - imported by init()

            raise NotInitializedError(FINALIZED)
        raise NotInitializedError(
            "this needs the job to be formed: call cluster.init() first (in every worker)"
        )
    return _session


def topology() -> Topology:
    topo = session().topology
    assert topo is not None
    return topo


def _given_config(config: object) -> ClusterConfig | None:
    """init()'s argument: a ClusterConfig, or None for the environment's. MindSpore's backend
    name (`init("nccl")`, kept by a ported script) is ignored in one line: cluster forms the
    job, and the data plane's backend is the script's. Any other string (a typo, a config
    file's path) or value is a ConfigError naming it."""
    if config is None or isinstance(config, ClusterConfig):
        return config
    if isinstance(config, str):
        if config not in MINDSPORE_BACKENDS:
            raise ConfigError(
                f"cluster.init({quoted(config, 64)}): a string is MindSpore's backend name, one "
                f"of {', '.join(MINDSPORE_BACKENDS)}, which cluster ignores; call cluster.init() "
                "to read the MS_* environment, or give a ClusterConfig"
            )
        sys.stderr.write(
            f"cluster: init({quoted(config, 64)}): MindSpore's backend name is ignored: cluster "
            "forms the job, and the data plane's backend is the script's (cluster.torch's "
            "init_process_group(backend), or the framework's)\n"
        )
        return None
    raise ConfigError(
        f"cluster.init() takes a ClusterConfig (or MindSpore's backend name, which it ignores), "
        f"not {type(config).__name__}: call cluster.init() to read the MS_* environment"
    )


def init(config: ClusterConfig | str | None = None) -> None:
    """Join the job described by the MS_* environment (or `config`; a string is MindSpore's
    backend name, ignored in one line).

    Worker (MS_WORKER, MS_PSERVER): returns once every node has registered and this process has
    its rank and the peer table. Scheduler (MS_SCHED): serves the job until it ends and then
    exits the process, 0 when every worker finished, 1 otherwise.
    """
    global _session, _pid, _finalized
    given = _given_config(config)
    cfg = given if given is not None else environment.from_env()
    if _ps_context_called:
        cfg = dataclasses.replace(cfg, tls=_ps_context_tls)
    if cfg.tls is not None:
        _apply_cipher_suites(cfg.tls)
    if cfg.recovery is not None:
        from cluster.storage import recovery_dir  # noqa: PLC0415 - only with recovery

        recovery_dir.check_recovery_path(cfg.recovery)
    _take_fork_support()
    if cfg.role is Role.SCHEDULER:
        _run_scheduler(cfg)
    from cluster.storage import host_buffers  # noqa: PLC0415 - numpy only at a first buffer
    from cluster.worker.session import WorkerSession  # noqa: PLC0415 - imports grpc; see above

    with _lock:
        if _session is not None:
            raise ClusterError("cluster.init() was already called in this process")
        try:
            identity = make_identity(cfg.node_id, cfg.sched_host, cfg.sched_port)
            current = _session = WorkerSession(cfg, identity)
        except BaseException:
            _give_back()  # as after a start that failed (`_abandon`)
            raise
        _pid, _finalized = os.getpid(), False
        atexit.unregister(_finalize_at_exit)  # one registration, however many jobs
        atexit.register(_finalize_at_exit)
        excepthook.watch_exits()  # the status sys.exit() is asked for is told at exit
        # The job's bound on pinned memory is the config's, which may not be the environment's.
        host_buffers.configure(cfg.pinned_max_bytes)
    try:
        current.start()
    except ReleasedError as released:
        # A spare (or a restarted node waiting out its guard) that the job did not need: the
        # job's exit code is its ranked workers'.
        current.say(str(released))
        current.finalize(finished=False)
        raise SystemExit(0) from None
    except BaseException:
        _abandon(current)
        raise


def _abandon(current: WorkerSession) -> None:
    """A start that failed (the caller gets its error): the session is closed and forgotten,
    so that init() may be called again and nothing of it is raised again at exit."""
    global _session
    with _lock:
        if _session is current:
            _session = None
    try:
        current.finalize(finished=False)
    finally:
        _give_back()


def _take_fork_support() -> None:
    """gRPC's fork handlers crash a child forked after the first call at random (a
    DataLoader's worker: grpc/grpc#32992); a child has no use for them
    (`WorkerSession.forked`). Set before grpc is imported, which reads the variable once; a
    program that chose keeps its choice. `_give_back` unsets what this set."""
    global _fork_support_taken
    if FORK_SUPPORT not in os.environ:
        os.environ[FORK_SUPPORT] = "false"
        _fork_support_taken = True


def _give_back() -> None:
    """The session is closed: give back what init() took for it, so that a process that
    finalized holds what it held before init() (but for grpc's import, and the launcher watch
    of a process that has a launcher: `orphan`), and a next init() takes it anew. The
    finalize at exit, and with it the status sys.exit() is asked for, are this session's;
    GRPC_ENABLE_FORK_SUPPORT was for this process's grpc, which read it at its import (a
    program's later children get the environment they would get without cluster)."""
    global _fork_support_taken
    atexit.unregister(_finalize_at_exit)
    excepthook.unwatch_exits()
    if _fork_support_taken and os.environ.get(FORK_SUPPORT) == "false":
        del os.environ[FORK_SUPPORT]
    _fork_support_taken = False


def _run_scheduler(cfg: ClusterConfig) -> None:
    from cluster.scheduler import server as scheduler_server  # noqa: PLC0415 - imports grpc

    # Started by a launcher or a LocalJob (CLUSTER_LAUNCHER_PID): it ends when that is gone,
    # as `python -m cluster scheduler` does.
    orphan.watch_launcher()
    configure_logging("scheduler", cfg.observe)
    scheduler_server.run_and_exit(cfg)


def _apply_cipher_suites(options: TLSOptions) -> None:
    from cluster.transport import tls  # noqa: PLC0415 - imports cryptography, needed only with TLS

    tls.apply_cipher_suites(tls.load_settings(options.config_path))


def _password(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def set_ps_context(
    enable_ssl: bool = False,
    config_file_path: str | os.PathLike[str] | None = None,
    client_password: str | bytes | None = None,
    server_password: str | bytes | None = None,
) -> None:
    """Turn TLS on (or off) for this process, as MindSpore's set_ps_context does; call it
    before cluster.init() and before anything imports grpc.

    `config_file_path` is the ssl.json (default: CLUSTER_TLS_CONFIG). A password given here
    wins over the CLUSTER_TLS_*_PASSWORD(_FILE) variables; without one, those and then the
    password files named in ssl.json are used. This call wins over the environment, so
    `enable_ssl=False` turns TLS off even when CLUSTER_TLS_CONFIG is set.
    """
    global _ps_context_called, _ps_context_tls
    if _session is not None:
        raise ClusterError("cluster.set_ps_context() must come before cluster.init()")
    if not enable_ssl:
        _ps_context_called, _ps_context_tls = True, None
        return
    path = Path(config_file_path) if config_file_path else None
    options = environment.tls_options_from_env(os.environ, path)
    if options is None:
        raise TLSConfigError(
            "set_ps_context(enable_ssl=True) needs config_file_path (an ssl.json), or "
            "CLUSTER_TLS_CONFIG naming one"
        )
    if client_password is not None:
        options = dataclasses.replace(
            options, client_password=_password(client_password), client_password_file=None
        )
    if server_password is not None:
        options = dataclasses.replace(
            options, server_password=_password(server_password), server_password_file=None
        )
    _apply_cipher_suites(options)  # now, while grpc may not be imported yet
    _ps_context_called, _ps_context_tls = True, options


def configure_logging(who: str, observe: ObserveConfig | None = None) -> None:
    """Log `cluster` messages to stderr, unless the program configured logging itself; with
    `observe.log_file` (CLUSTER_LOG_FILE), stderr and stdout go to that file, rotated."""
    logger = logging.getLogger("cluster")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if observe is not None and observe.log_file is not None:
        from cluster.storage import rotation  # noqa: PLC0415 - only with a log file

        try:
            handler = rotation.OutputFileHandler(observe.log_file, observe.rotation)
        except OSError as exc:
            raise ConfigError(
                f"CLUSTER_LOG_FILE={str(observe.log_file)!r} cannot be written "
                f"({exc.strerror}): point it at a file this process can create"
            ) from None
    handler.setFormatter(SafeFormatter(f"cluster[{who}]: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def finalize() -> None:
    """Wait for the checkpoint writes queued, run the `on_finalize` closers, tell the
    scheduler this worker is done and close the connection. Safe to call twice. A write that
    failed and was not raised yet (the last save's) is raised here, as a CheckpointError,
    after the scheduler was told this worker failed of it; the job's failure, heard before or
    during it, is raised at its end (no closer is interrupted by it)."""
    current = _session
    if current is not None:
        current.check_process()  # a forked child's is its parent's to finalize
    try:
        _close(finished=True)
    finally:
        if _session is None:  # closed (here, or by another thread that is closing it)
            _give_back()


def _finalize_at_exit() -> None:
    # A program that dies of an uncaught exception, or whose sys.exit() asked for a non-zero
    # status, has not finished its part of the job: it tells the scheduler the error or the
    # status instead, so the scheduler fails it in words (and with recovery takes it back).
    current = _session
    if current is not None and current.forked:
        return  # a forked child's exit: the job and the session are its parent's
    crash = excepthook.crash()
    try:
        if crash is not None:
            _close(finished=False, failure=crash)
        else:
            _close(finished=True, failure=excepthook.exit_failure())
    except ClusterError as error:
        _exit_failed(error)
    except KeyboardInterrupt:  # Ctrl-C while it waited (for a scheduler that is away)
        print(INTERRUPTED, file=sys.stderr, flush=True)
        atexit.unregister(_flush_at_exit)
        _exit_with(EXIT_INTERRUPTED)


def _flush_at_exit() -> None:
    # Without a job (or after it was finalized), a program that returns right after its last
    # save still learns that the write failed: the one line, exit 1.
    if os.getpid() != _pid:
        return  # a forked child: the writers (their threads stayed behind) are its parent's
    if excepthook.crash() is not None:
        return  # the process ends of its own error; the write's was logged when it failed
    error = _flush_writes()
    if error is not None:
        _exit_failed(error)


atexit.register(_flush_at_exit)  # before init()'s _finalize_at_exit, so it runs after it


def _flush_writes() -> ClusterError | None:
    """Wait for every background writer (checkpoints); the error of a write that failed and was
    not raised yet, None when there is none (and no writer where none was imported)."""
    if "cluster.storage.background" not in sys.modules:
        return None  # no writer was made: nothing to import at exit
    from cluster.storage import background  # noqa: PLC0415 - only where writers are used

    try:
        background.flush_all()
    except ClusterError as error:
        return error
    except Exception as error:  # a writer's job failed of a bug: still a failure
        return CheckpointError(f"a checkpoint write failed: {excepthook.error_line(error)}")
    return None


def _exit_failed(error: ClusterError) -> None:
    """End a process whose program returned while its job failed as an uncaught error ends it:
    one line, the other atexit handlers (each once, as at any exit), exit 1."""
    excepthook.say(error)
    atexit.unregister(_flush_at_exit)  # the writes were waited for, or need not be
    _exit_with(1)


class _ExitStatus:
    """Exits the process with `status` when it is deleted. Python keeps the exit status it had
    when the program returned (an exception raised in an atexit callback is only printed), and
    an atexit callback cannot run the others and end the process itself without running again
    those that ran before it: held by this module (`_exit_with`), it is deleted when the
    interpreter clears the modules, after every atexit callback ran and stdout and stderr were
    flushed."""

    def __init__(self, status: int) -> None:
        self.status = status
        self._exit = os._exit  # held: the os module may be cleared first

    def __del__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # gone, closed or broken: nothing left to say
                stream.flush()
        self._exit(self.status)


_exit_status: _ExitStatus | None = None


def _exit_with(status: int) -> None:
    """Have the process exit with `status` once the interpreter has finished its exit."""
    global _exit_status
    if _exit_status is None:
        _exit_status = _ExitStatus(status)
    else:  # replaced, the one held would be deleted, and end the process, now
        _exit_status.status = status


def _close(*, finished: bool, failure: str | None = None) -> None:
    """`finished`: the program ended on its own (returned, or sys.exit()); else it crashed.
    `failure`: what the scheduler is told instead of a finish (a crash's error, a non-zero
    exit status)."""
    global _session, _finalized, _closing
    with _lock:
        current = _session
        if current is None or current is _closing:
            return  # finalized, or being finalized by another thread
        _closing = current
    try:
        current.quiet()  # the job's failure, heard from now on, is raised at the end, once
        # While the session is still this process's: a write reports its steps through it.
        # After a crash neither the writes nor a closer are waited for: they may block on what
        # failed (a stuck disk, a hung NCCL call).
        error = _flush_writes() if finished else None
    finally:
        with _lock:
            _session = _closing = None
            _finalized = True
    if finished:
        _run(_closers, "closing what this worker opened for the job")
    if error is not None:  # this worker's part is not done: the scheduler hears why
        current.finalize(finished=False, failure=excepthook.error_line(error))
        raise error
    if finished:  # a non-zero exit status is no finish: the scheduler hears the status
        current.finalize(finished=failure is None, failure=failure)
        return
    # The scheduler learns of a crash first.
    current.finalize(finished=False, failure=failure)
    _run(_aborters, "aborting what this worker opened for the job")


def is_initialized() -> bool:
    return _session is not None and _session.topology is not None


def get_rank() -> int:
    return topology().rank


def get_group_size() -> int:
    return topology().size


def get_local_rank() -> int:
    return topology().local_rank


def get_local_size() -> int:
    return topology().local_size


def get_peers() -> list[Peer]:
    return list(topology().peers)


def get_generation() -> int:
    return topology().generation


def get_node_id() -> str:
    return session().identity.node_id


def is_rejoin() -> bool:
    """True when this process took the place of a failed one in a running job."""
    return session().agent.core.rejoined


def get_rollback_step() -> int:
    """The step training (re)starts from in the current generation: the newest checkpoint step
    every worker holds (0: the beginning)."""
    return topology().rollback_step


def wait_for_generation(newer_than: int, timeout_s: float | None = None) -> int:
    """Block until the job is at a generation above `newer_than` (after a failed worker
    rejoined); the new generation. Raises the job's failure if it comes first.

    `timeout_s`: None waits as long as it takes; otherwise a finite number of seconds from 0
    to MAX_WAIT_S (0: the generation now), past which it raises a CollectiveError."""
    from cluster.api.collective import wait_seconds  # noqa: PLC0415 - it imports this module

    wait_s = None if timeout_s is None else wait_seconds("wait_for_generation", timeout_s)
    current = session()
    now = topology().generation
    if now > newer_than:
        return now
    try:
        return current.call(current.agent.wait_generation(newer_than), wait_s).generation
    except TimeoutError:
        if wait_s is None:  # not the wait's: the agent's coroutine raises none, but if it did
            raise
        raise CollectiveError(
            f"wait_for_generation: no generation above {newer_than} came within {wait_s:g} s: "
            f"the job is at generation {topology().generation} (a new one comes once a failed "
            "worker has rejoined)"
        ) from None


def report_memory_resume(generation: int, step: int, why: str, steps: list[int]) -> None:
    """Rank 0: generation `generation` resumed from `step` in the survivors' memory (not from
    disk), for the scheduler's events and status; with the steps held, as every report."""
    current = session()
    held = newest_reported(steps)
    current.call(current.agent.report_checkpoints(held, (generation, step, why)))


def resumed_in(generation: int) -> None:
    """This worker has put back the rollback step of `generation` (`discard_newer` says so, for a
    TrainingLoop or a rollback by hand): its checkpoint reports say it from now on, and until
    every worker does, the scheduler keeps that step among those everyone must keep."""
    session().agent.resumed_in = generation


def report_generation() -> int:
    """The generation this worker's checkpoint reports say now: the one whose rollback step it
    put back (`resumed_in`), else the one it is in; 0 outside a job."""
    return session().agent.report_generation if is_initialized() else 0


def report_checkpoints(steps: list[int], generation: int = 0) -> int:
    """Tell the scheduler which checkpoint steps this worker holds (CheckpointManager does; the
    newest of them, `newest_reported`); a step every worker holds (0: none), which this worker
    must keep. `generation`: what `report_generation()` said when `steps` were listed (0: what
    it says now). A list taken before this worker put back a newer generation's rollback step
    says the older one, so the scheduler does not take it as put back (`RollbackPlanner`)."""
    current = session()
    held = newest_reported(steps)
    held_by_all = current.call(current.agent.report_checkpoints(held, generation=generation))
    from cluster.api import worker_metrics  # noqa: PLC0415 - prometheus_client, when used

    worker_metrics.reported(held)
    return held_by_all


def newest_reported(steps: list[int]) -> list[int]:
    """The steps a checkpoint report names of those held: the newest MAX_REPORTED_CHECKPOINTS
    (1,024), sorted. The scheduler refuses a report that names more; it rolls the job back to
    the newest step every worker holds, which is among each worker's newest, so an older step
    held (`keep_checkpoint_max` above that) stays on disk but is never a rollback step."""
    # The pure machine's constant (no grpc), imported with the first report.
    from cluster.scheduler.machine.admission import MAX_REPORTED_CHECKPOINTS  # noqa: PLC0415

    return sorted(steps)[-MAX_REPORTED_CHECKPOINTS:]


def peer_failed(generation: int, wait_s: float = 0.0) -> bool:
    """Whether a peer of `generation` has failed (or the job moved past it), waiting up to
    `wait_s` for the scheduler's word."""
    current = session()
    return current.call(current.agent.peer_failed(generation, wait_s))


def failure_wait_s() -> float:
    """How long the scheduler may take to name a failed peer: a hung one is named after
    MS_NODE_TIMEOUT, and the word takes a moment to arrive."""
    return session().config.node_timeout_s + 2.0


def on_generation_over(release: Callable[[], None]) -> None:
    """Have `release()` called each time a `TrainingLoop` learns that its generation is over
    (a peer failed, or the job moved on), before it waits for the next one. cluster.torch
    closes its process group's connections there, so that a peer blocked in a collective on
    this worker fails at once instead of after the group's timeout."""
    if release not in _releases:
        _releases.append(release)


def generation_over() -> None:
    """Call what `on_generation_over` registered; a release that fails is logged, not raised
    (the rollback goes on: the next generation makes what it needs anew)."""
    _run(_releases, "letting go of the old generation's resources")


def on_finalize(close: Callable[[], None]) -> None:
    """Have `close()` called when this worker finalizes (cluster.finalize(), or at exit), before
    it tells the scheduler: cluster.torch destroys its process group there, so that torch has
    nothing left to tear down (or warn about) at exit. Not after the program died of an
    uncaught exception: what failed (an NCCL communicator) could block the exit."""
    if close not in _closers:
        _closers.append(close)


def on_crash(abort: Callable[[], None]) -> None:
    """Have `abort()` called when the program dies of an uncaught exception (in place of the
    `on_finalize` calls, which could block on what failed), after the scheduler was told: it
    must not wait on peers or on the failed work. cluster.torch aborts its NCCL group there."""
    if abort not in _aborters:
        _aborters.append(abort)


def on_generation_end_heard(abort: Callable[[int], None]) -> None:
    """Have `abort(generation)` called as soon as this worker's agent hears that `generation`
    is over (a peer of it failed, or the job moved past it), once per generation, on a thread
    of its own, while the main thread may be blocked (`cluster.worker.generation_end`).
    cluster.torch aborts its NCCL group's communicators there."""
    session().agent.generation_end.add(abort)


def _run(calls: list[Callable[[], None]], what: str) -> None:
    for call in list(calls):
        try:
            call()
        except Exception as exc:  # any failure is only logged: the worker goes on closing
            _log.warning("%s failed: %s", what, exc)
