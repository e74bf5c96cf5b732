"""The synchronous face of a worker: a `WorkerAgent` on a background event loop.

The user's training loop runs in the main thread and is never asked to be async. The agent lives
on a daemon thread's loop, so heartbeats go on while the main thread computes. When the job
fails (recovery off), the process must not linger: a call that is waiting raises the failure in
the main thread, and otherwise the failure is raised in the main thread wherever it is
(`ending.Ending`); a main thread that does not end the process within a grace (it caught the
error and carried on, or it is stuck in a C call) gets the last resort, an exit at once with a
message naming what died.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from contextvars import Context
from typing import TYPE_CHECKING, Any, TypeVar

from cluster.protocol.config import ClusterConfig
from cluster.protocol.display import safe
from cluster.protocol.errors import ClusterError
from cluster.protocol.topology import Topology
from cluster.transport.channel import SchedulerProbe
from cluster.worker import ending, orphan
from cluster.worker.agent import WorkerAgent
from cluster.worker.identity import NodeIdentity

if TYPE_CHECKING:
    from cluster.worker import node_file

T = TypeVar("T")
# How long a process that dies of an error gives the scheduler to hear which (one call).
FAILURE_REPORT_S = 2.0
FORKED = (
    "cluster calls are only for the process that called cluster.init(); pass values to "
    "children instead"
)
# A call of this session once it was finalized, and one that finalize cut short.
# What a RuntimeError says when an executor takes no more work: shut by the interpreter's exit
# (concurrent.futures' submit), one made first at that exit (its module's import registers a
# hook with threading, closed by then), or shut by its loop (asyncio's default executor).
_SHUT_EXECUTOR = (
    "cannot schedule new futures after",
    "can't register atexit after shutdown",
    "Executor shutdown has been called",
)
FINALIZED = "this worker was finalized (cluster.finalize(), or at exit): no cluster call follows"
CUT = "the job was finalized while this call waited"


class _Loop(asyncio.SelectorEventLoop):
    """An event loop that lets grpc hand it a completion after it has closed.

    grpc.aio polls on one loop (the first to use grpc in the process) and passes each event
    of an object of another loop to that loop with `call_soon_threadsafe`. A worker has two
    loops (its agent's and its state server's); once one has closed, such an event (a
    connection of its stopped server torn down, a call still on the way) raised "Event loop is
    closed" in the other, a traceback at the end of a job that had ended well, and it cut
    short grpc's handling of the events queued behind it. Nothing can run the callback any
    more: it is dropped. Anything else handed to a closed loop still raises.
    """

    def call_soon_threadsafe(  # type: ignore[override]  # same signature, typeshed's TypeVarTuple
        self, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> asyncio.Handle:
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if not (self.is_closed() and _is_grpc_completion(callback)):
                raise
            handle = asyncio.Handle(callback, args, self, context)
            handle.cancel()
            return handle

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        """The loop's report of an error a callback raised, except grpc's poller reading its
        wake-up socket after grpc closed it at the process's teardown (`OSError` EBADF, once,
        after the job has ended): nothing is left for it to hand over, and the traceback would
        read as a failure of a job that ended well."""
        if _closed_grpc_poller(context.get("exception")):
            return
        super().default_exception_handler(context)


def _is_grpc_completion(callback: Callable[..., object]) -> bool:
    return (
        getattr(callback, "__module__", None) == "grpc._cython.cygrpc"
        and getattr(callback, "__name__", None) == "_handle_callback_wrapper"
    )


def _closed_grpc_poller(error: object) -> bool:
    """`error` is grpc's poller reading a closed wake-up socket: EBADF from
    `PollerCompletionQueue._handle_events` (grpc/_cython/_cygrpc/aio/completion_queue.pyx.pxi)."""
    if not isinstance(error, OSError) or error.errno != errno.EBADF:
        return False
    last = error.__traceback__
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    if last is None:
        return False
    code = last.tb_frame.f_code
    return code.co_filename.endswith("completion_queue.pyx.pxi") and code.co_name.endswith(
        "_handle_events"
    )


class BackgroundLoop:
    """An asyncio loop on a daemon thread, with a blocking `run` for the main thread."""

    def __init__(self, name: str) -> None:
        self.loop = _Loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        # What `run` waits for now: `stop` ends each with CancelledError.
        self._waiting: set[concurrent.futures.Future[Any]] = set()
        self._waiting_lock = threading.Lock()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Stopped: let what is left (grpc's own call tasks among it) end cleanly, so nothing is
        # destroyed while pending.
        leftover = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            self.loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """`coro`'s result; concurrent.futures.CancelledError when `stop` ended it first, and
        RuntimeError when the loop was closed before (`closed`: then `coro` never runs)."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:
            coro.close()  # never run: no "never awaited" warning
            raise
        with self._waiting_lock:
            self._waiting.add(future)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise
        finally:
            with self._waiting_lock:
                self._waiting.discard(future)

    @property
    def closed(self) -> bool:
        """Whether this loop takes no more work: stopped, or its thread ended."""
        return self.loop.is_closed() or not self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return  # still ending what it ran: it settles their futures itself
        # The loop cancelled what it ran; a call handed to it as it stopped was never run.
        with self._waiting_lock:
            left = [future for future in self._waiting if not future.done()]
        for future in left:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(concurrent.futures.CancelledError())


def _say(prefix: str, message: str) -> None:
    # One write with its newline: print() writes the newline apart, and another thread's
    # output (the program's own lines on stdout, to the same log) can land in between.
    sys.stderr.write(f"{prefix}: {safe(message)}\n")  # a reason may quote the wire
    sys.stderr.flush()


def _named(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _Voice:
    """How a session speaks: its lines name the node, then its rank. Its `Ending` holds this,
    not the session, as the last resort and the launcher watch may outlive the session."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def say(self, message: str) -> None:
        _say(self.prefix, message)


class WorkerSession:
    def __init__(self, config: ClusterConfig, identity: NodeIdentity) -> None:
        self.config = config
        self.identity = identity
        self._pid = os.getpid()
        self._voice = _Voice(f"cluster[{identity.node_id}]")
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._recovery_dir = None if config.recovery is None else config.recovery.path
        self._record_unsaved = False  # the last save of this node's file failed
        # Held from before the node's file is read until the session closes.
        self._node_lock = self._lock_record()
        try:
            self._record = self._load_record()
            previous_job = (
                self._record.cluster_id
                if self._record is not None and not self._record.finished
                else ""
            )
            if self._node_lock is not None:
                self._node_lock.tell(previous_job)
            # What this session's checks of the scheduler found (`SchedulerProbe`): its agent's.
            self._probe = SchedulerProbe()
            # Made here, in the main thread, where the signal that interrupts it can be set up.
            self._ending = ending.Ending(self._voice.say)
        except BaseException:
            self._unlock_record()
            raise
        self._background = BackgroundLoop(f"cluster-agent-{identity.node_id}")
        try:
            self.agent: WorkerAgent = self._background.run(self._make_agent(previous_job))
        except BaseException:  # (TLS that cannot be loaded, say): the caller gets it
            self._let_go()
            raise
        self._started = False
        self._closed = False
        # Set by a TrainingLoop around each step: the generation its collectives belong to.
        self.generation_pin: int | None = None
        orphan.watch_launcher(self._ending.end)

    async def _make_agent(self, cluster_id: str) -> WorkerAgent:
        return WorkerAgent(
            self.config,
            self.identity,
            say=self.say,
            on_fatal=self._on_fatal,
            cluster_id=cluster_id,
            probe=self._probe,
        )

    @property
    def topology(self) -> Topology | None:
        """The job as it is now (a new generation after a rejoin); None before start() returns."""
        return self.agent.topology if self._started else None

    def say(self, message: str) -> None:
        self._voice.say(message)

    def start(self) -> Topology:
        topology = self.call(self.agent.start())
        self._started = True
        self._voice.prefix = f"cluster[rank {topology.rank}]"
        if self._node_lock is not None:
            self._node_lock.tell(self.agent.cluster_id)
        self._save_record(topology, finished=False)
        return topology

    def _lock_record(self) -> node_file.NodeLock | None:
        """This node's hold on its file: ConfigError when another live process has it."""
        if self._recovery_dir is None:
            return None
        from cluster.worker import node_file  # noqa: PLC0415 - see _load_record

        lock = node_file.NodeLock(self._recovery_dir, self.identity.node_id)
        unlocked = lock.take()
        if unlocked:
            self.say(unlocked)
        return lock

    def _unlock_record(self) -> None:
        if self._node_lock is not None:
            self._node_lock.release()

    def _load_record(self) -> node_file.NodeRecord | None:
        if self._recovery_dir is None:
            return None
        from cluster.worker import node_file  # noqa: PLC0415 - recovery only: files, json, hashes

        return node_file.load(self._recovery_dir, self.identity.node_id)

    def _save_record(self, topology: Topology, *, finished: bool) -> None:
        if self._recovery_dir is None:
            return
        from cluster.worker import node_file  # noqa: PLC0415 - see _load_record

        record = node_file.NodeRecord(
            cluster_id=self.agent.cluster_id,
            node_id=self.identity.node_id,
            rank=topology.rank,
            generation=topology.generation,
            finished=finished,
        )
        try:
            # The record only while the path names this node's lock file (`NodeLock.keep`).
            said = "" if self._node_lock is None else self._node_lock.keep()
            if said:
                self.say(said)
            node_file.save(self._recovery_dir, record)
        except ClusterError as exc:
            if not self._record_unsaved:  # once: the next failure says nothing new
                self.say(f"{exc}; a restart of this process would not know its job")
            self._record_unsaved = True
        else:
            self._record_unsaved = False

    @property
    def forked(self) -> bool:
        """Whether this is the copy a forked child has (a DataLoader's worker, multiprocessing's
        fork, os.fork): the agent's thread and connection stayed in the parent."""
        return os.getpid() != self._pid

    def check_process(self) -> None:
        """Raise, in a forked child, what it must do instead of a cluster call (which would
        wait forever for the agent's thread)."""
        if self.forked:
            raise ClusterError(FORKED)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run an agent coroutine to its end (from any thread). `_pending` counts the main
        thread's calls only: another thread's call (the checkpoint writer's report, a user
        thread's kv_wait) raises the job's failure in that thread, not in the main one."""
        if self.forked or self._closed:
            coro.close()  # never run: no "never awaited" warning
            self.check_process()
            raise ClusterError(FINALIZED)
        if threading.current_thread() is not threading.main_thread():
            return self._run(coro, timeout_s)
        with self._pending_lock:
            self._pending += 1
        try:
            result = self._run(coro, timeout_s)
        except BaseException as exc:
            self._waited(exc)
            raise
        self._waited(None)
        return result

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        try:
            return self._background.run(coro, timeout_s)
        except concurrent.futures.CancelledError:
            if not self._closed:
                raise
            raise ClusterError(CUT) from None

    def _waited(self, raised: BaseException | None) -> None:
        """A call of the main thread has ended (`raised`: with that). The job's error that
        `_on_fatal` left to it, as it was waiting then, is raised here unless the call raised
        it: its answer may have come as the job ended (an answer wins the race)."""
        with self._pending_lock:
            self._pending -= 1
            owed = self._ending.owed()
        if owed is not None and owed is not raised:
            raise owed from raised

    def _on_fatal(self, error: ClusterError) -> None:
        """The job is over for this process (runs on the agent's thread)."""
        # A waiting call of the main thread raises `error` there itself (`_waited`: held, so
        # that the call cannot end unseen in between); otherwise the main thread is interrupted
        # wherever it is. Either way the process ends within the grace.
        with self._pending_lock:
            self._ending.end(error, raised=self._pending > 0)

    def _report_failure(self, failure: str) -> None:
        """One call, best effort: the process goes on exiting whatever comes of it, and its
        connection breaking says the same. The job failing because of it (no recovery) must
        not raise its error in this exiting process (`Ending.exiting`)."""
        self._ending.exiting()
        with contextlib.suppress(concurrent.futures.TimeoutError, ClusterError):
            try:
                self._background.run(
                    self.agent.send_finish(FAILURE_REPORT_S, failure),
                    timeout_s=FAILURE_REPORT_S + 1,
                )
            except RuntimeError as exc:
                if not self._exiting(exc):
                    self.say(
                        f"could not tell the scheduler what this process dies of ({_named(exc)}):"
                        " it sees this node's connection close instead"
                    )

    def quiet(self) -> None:
        """The worker finalizes (what it opened is being closed): the job's failure, heard
        from now on, is raised by `finalize` at its end instead of by a signal wherever the
        main thread is (a closer would only log it and go on)."""
        self._ending.quiet()

    def finalize(self, *, finished: bool = True, failure: str | None = None) -> None:
        """Tell the scheduler this node finished (`finished`), or the error its process dies
        of (`failure`, best effort: at most FAILURE_REPORT_S), then close. A node that
        finished while its job failed (heard before or during the finalize) raises that
        failure."""
        if self._closed:
            return
        self._closed = True
        self.quiet()
        self._finalize(finished=finished, failure=failure)
        fatal = self.agent.fatal
        if finished and fatal is not None:
            raise fatal

    def _finalize(self, *, finished: bool, failure: str | None) -> None:
        try:
            if not finished and failure and self.agent.fatal is None:
                self._report_failure(failure)
            if finished and self.agent.fatal is None:
                heard = self._background.run(
                    self.agent.finish(), timeout_s=self.agent.finish_bound_s + ending.GRACE_S
                )
                topology = self.topology
                if heard and topology is not None:
                    self._save_record(topology, finished=True)
            self._background.run(self.agent.close(), timeout_s=5.0)
        except concurrent.futures.TimeoutError:
            pass  # past its bound: the scheduler sees the stream close
        except RuntimeError as exc:
            if self._exiting(exc):
                pass  # the scheduler sees the stream close, as when a process ends
            elif finished and not self.agent.core.finish_heard:
                self.say(
                    f"could not tell the scheduler that this node finished ({_named(exc)}): it "
                    "sees this node's connection close instead of a Finish"
                )
            else:
                self.say(
                    f"could not close this node's connection to the scheduler ({_named(exc)}): "
                    "it closes as this process exits"
                )
        finally:
            self._let_go()

    def _exiting(self, error: RuntimeError) -> bool:
        """Whether `error` says that this process is past telling anyone: this session's loop
        closed, or an executor shut by the interpreter's exit. Any other RuntimeError (a bug, a
        failed call that surfaced as one) is said, in one line."""
        return self._background.closed or any(s in str(error) for s in _SHUT_EXECUTOR)

    def _let_go(self) -> None:
        """Give back what this session holds in the process: its agent's thread, its node's
        lock, the signal's handler, the launcher watch's pointer to its ending."""
        self._background.stop()
        self._unlock_record()
        self._ending.release()
        orphan.unwatch(self._ending.end)  # the process's watch holds nothing of this
