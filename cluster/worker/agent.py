"""The worker's side of the protocol, asynchronous: the I/O around the pure worker core.

`WorkerAgent` runs on a background event loop (see `cluster.worker.session`). What it decides is
decided by `cluster.worker.machine.core.WorkerCore` (registration retries and deadlines, the
reconnect policy, following a leader, what an event or a lost stream means, when the job is over for
this node, whether a call or a Finish is made again); every reaction goes `core.step(event)` ->
actions -> `_run`, the one interpreter, which carries them out (register, probe, pause, read the
Watch stream with heartbeats, deliver the topology, send the Finish, report a failure through
`on_fatal` exactly once) and steps the core with what came of them, converted from protobuf by
`cluster.worker.convert` (etcd's raft/RawNode split). Its Watch call, each registration attempt
and the accepted stream read with its heartbeats, is a part it owns
(`cluster.worker.watch_stream`). Every call it makes for the user goes through
`cluster.worker.calls`, and races against the job's failure (`cluster.worker.racing`), so no caller
waits on a job that is already over."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from cluster.protocol.backoff import Spread
from cluster.protocol.config import ClusterConfig
from cluster.protocol.environment import read_job_secret
from cluster.protocol.errors import ClusterError
from cluster.protocol.exhaustive import assert_never
from cluster.protocol.put_back import put_back_at_start
from cluster.protocol.topology import Topology
from cluster.transport import edge, failures, membership
from cluster.transport.channel import SchedulerProbe
from cluster.worker import calls, convert, peer_table, scheduler_link
from cluster.worker.generation_end import GenerationEnd
from cluster.worker.identity import NodeIdentity
from cluster.worker.link import Closing, Link
from cluster.worker.machine import steps
from cluster.worker.machine.core import WorkerCore
from cluster.worker.racing import unless_failed
from cluster.worker.watch_stream import WatchStream

if TYPE_CHECKING:
    from cluster.worker.saved_finish import SavedFinish

Outcome = steps.Watch | steps.RetryCall | None  # for the caller: a stream, a call again, or none
# How often a held Finish looks at the scheduler's saved state for it (`saved_finish`): a read
# of one file, only while a Finish is held.
HELD_LOOK_EVERY_S = 1.0


class WorkerAgent:
    # Whole tables fetched by digest: the process's, shared by its agents (one agent's own: set it).
    tables: peer_table.FetchedTables = peer_table.TABLES

    def __init__(
        self,
        config: ClusterConfig,
        identity: NodeIdentity,
        *,
        say: Callable[[str], None],
        on_fatal: Callable[[ClusterError], None],
        expiry_check_period_s: float | None = None,
        cluster_id: str = "",
        probe: SchedulerProbe | None = None,
    ) -> None:
        """`cluster_id`: the job this node belonged to before its process restarted (its saved
        recovery file), so that a scheduler running another job refuses it. `probe`: the checks
        of the scheduler it shares with its owner's other agents (default: its own).
        `expiry_check_period_s`: how often TLS certificates are checked for expiry (None: daily)."""
        self.config = config
        self.identity = identity
        # The agent's clock is the core's: deadlines the core sets are waited for here.
        self._clock = time.monotonic
        # Its pauses are jittered from its incarnation: no two processes of a job draw alike.
        draws = Spread(identity.incarnation)
        self.core = WorkerCore(config, self._clock, cluster_id=cluster_id, draws=draws)
        self._say = say
        self._on_fatal = on_fatal
        self._tls = None if config.tls is None else scheduler_link.prepare_tls(config.tls, say)
        self._probe = SchedulerProbe() if probe is None else probe
        self._expiry_check_period_s = expiry_check_period_s
        self._expiry: asyncio.Task[None] | None = None
        self._job_secret = None if config.job_secret is None else read_job_secret(config.job_secret)
        # Every call after the registration says which node makes it: with its credential, or
        # with a job secret a call proof that never shows it (`membership.CallSigner`).
        self._metadata = membership.call_metadata(
            identity.node_id, identity.incarnation, identity.credential
        )
        self._signer = membership.signer(self._job_secret, identity)
        self._link = Link(config, self._tls, say, self.core.address)  # its route, channel, stub
        self._aside: set[asyncio.Task[Any]] = set()  # old channels closing, late answers said
        self._stream = WatchStream(self)  # its registrations, and the accepted stream read
        self._back = asyncio.Event()  # accepted again, or over: a held Finish goes on
        self._saved_finish: SavedFinish | None = None  # its looks at the scheduler's state
        self.accepted_at: float | None = None  # first accepted (this clock): a benchmark's stage
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Topology] = loop.create_future()
        self._fatal: asyncio.Future[ClusterError] = loop.create_future()
        self._watch_task: asyncio.Task[None] | None = None
        # Set when a new generation arrives / a peer of this one failed (each replaced then).
        self._new_generation = asyncio.Event()
        self._peer_failed = asyncio.Event()
        self._calls = calls.Calls(
            self._link, self._signer, self._signed, self._fatal, self.core, self._run
        )
        self._report_seq = 0  # checkpoint reports are numbered
        self._add_seq = 0  # and key-value adds
        self.resumed_in: int | None = None  # the generation whose rollback this worker put back
        self.generation_end = GenerationEnd(say)  # told off this loop when a generation is over

    # -- what the core knows -------------------------------------------------------------------

    @property
    def cluster_id(self) -> str:
        return self.core.cluster_id

    @property
    def topology(self) -> Topology | None:
        return self.core.topology

    @property
    def fatal(self) -> ClusterError | None:
        return self._fatal.result() if self._fatal.done() else None

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> Topology:
        """Register and wait until the whole topology is ready. A failure to join is raised
        here, not reported through `on_fatal`: the caller is there to hear it."""
        if self._tls is not None:
            from cluster.transport import tls  # noqa: PLC0415 - TLS only

            period_s = self._expiry_check_period_s or tls.EXPIRY_CHECK_PERIOD_S
            self._expiry = asyncio.create_task(tls.recheck_expiry(self._tls, self._say, period_s))
        self._closing(await self._link.check_relay(self.core.address))  # answering at all?
        start = steps.Start(self._verified(), direct=self._link.route.relay is None)
        watch = await self._run(self.core.step(start), report=False)
        if isinstance(watch, steps.Watch):
            self._watch_task = asyncio.create_task(self._stream.watch_forever(watch))
        while not (self._ready.done() or self._fatal.done()):
            # The job's failure settles _ready too; asyncio.wait neither wraps nor cancels it.
            wait_s = max(self.core.ready_by - self._clock(), 0.0)
            await asyncio.wait((self._ready,), timeout=wait_s)
            if not self._ready.done():
                await self._run(self.core.step(steps.DeadlinePassed()), report=False)
                if self.core.over and not self._fatal.done():
                    raise ClusterError(
                        f"this node was closed before the job formed at {self.core.where}"
                    )
        if self._fatal.done():
            raise self._fatal.result()
        return self._ready.result()

    def _verified(self) -> bool:
        """Whether registering may start without probing the scheduler first. With a CRL nothing
        is sent before the scheduler's certificate passed it (grpc cannot check one), here or, a
        moment ago, for another agent of this process; otherwise the probe only runs when an
        attempt fails, to tell "down" from "speaks the other protocol"."""
        return (
            self._tls is None
            or self._tls.revocation is None
            or self._probe.passed_recently(self._link.host, self._link.port, self._tls)
        )

    # -- carrying out the core's actions -------------------------------------------------------

    async def _run(self, actions: list[steps.Action], *, report: bool = True) -> Outcome:
        """Carry out `actions` and those that follow from them, until one is for the caller (an
        accepted stream to read, a call to make again: returned) or the core has nothing more to
        do (None). `report`: a failure goes to `on_fatal` (not while `start` is there to raise
        it)."""
        queue = deque(actions)
        while queue:
            then = await self._do(queue.popleft(), report)
            if not isinstance(then, list):
                return then
            queue.extend(then)
        return None

    async def _do(  # noqa: PLR0911, PLR0912 - a case an action
        self, action: steps.Action, report: bool
    ) -> list[steps.Action] | steps.Watch | steps.RetryCall:
        """One action's I/O: what the core says to do next, or the outcome for the caller."""
        match action:
            case steps.Say(text=text):
                self._say(text)
            case steps.AwaitListening():
                awaited = scheduler_link.await_listening(self.core.address, action)
                return self.core.step(await awaited)
            case steps.Register():
                event = self._link.relayed(await self._stream.register(action))
                return self._stream.registered(self.core.step(event))
            case steps.LeaveRelay(why=why, refused=refused):
                self._closing(self._link.leave_relay(self.core.address, why, refused=refused))
            case steps.CheckScheduler(timeout_s=timeout_s):
                return self.core.step(await self._check_scheduler(timeout_s))
            case steps.Pause(seconds=seconds):
                await asyncio.sleep(seconds)
                return self.core.step(steps.PauseOver())
            case steps.Follow(address=address):
                self._follow(address)
            case steps.Watch():
                self._back.set()
                return action  # the caller reads the stream
            case steps.RetryCall():
                return action  # the caller makes the call again
            case steps.Deliver():
                self._deliver(action)
            case steps.PeerFailed(generation=generation):
                self._peer_failed.set()
                self.generation_end.heard(generation)
            case steps.Fail(error=error):
                self._failed(error, report=report)
            case steps.Released(error=error):
                # Only while start() waits (no topology yet): it raises it; the process exits 0.
                self._failed(error, report=False)
            case steps.Done():
                self._stream.done = True
                self._back.set()
            case steps.SendFinish(timeout_s=timeout_s):
                return self.core.step(await self.send_finish(timeout_s))
            case steps.RetryFinish(after_s=after_s):
                await asyncio.sleep(after_s)
                return self.core.step(steps.FinishRetryDue())
            case steps.HoldFinish(timeout_s=timeout_s):
                self._back.clear()  # (the core held it while registering again: not back yet)
                return self.core.step(await self._hold_finish(timeout_s))
            case steps.AwaitFatal(wait_s=wait_s):
                # The cut-off call's reason is on the event stream, an instant behind: raise
                # that rather than a bare "CANCELLED" (none in time: the caller raises its own).
                with contextlib.suppress(asyncio.TimeoutError):
                    raise await asyncio.wait_for(asyncio.shield(self._fatal), wait_s) from None
            case _:  # mypy checks that no action is left out
                assert_never(action)
        return []

    async def _hold_finish(self, timeout_s: float) -> steps.Event:
        """Wait until this node is back or over, at most `timeout_s`, looking at the scheduler's
        saved state at once and every HELD_LOOK_EVERY_S meanwhile (`saved_finish`): what ends
        the hold."""
        deadline = self._clock() + timeout_s
        while True:
            evidence = await self._finish_saved()
            if evidence:
                return steps.FinishCounted(evidence)
            left = deadline - self._clock()
            if self._back.is_set() or left <= 0:
                return steps.FinishRetryDue()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._back.wait(), min(left, HELD_LOOK_EVERY_S))

    async def _finish_saved(self) -> str:
        """Whether this node's scheduler saved its Finish as counted, where this node can read
        its state (with recovery): the evidence, in words ("" when none). Looked at on this
        loop, one look at a time: a Finish is held most often in the finalize at exit, where
        the executor of `asyncio.to_thread` takes no more work (RuntimeError, and the finalize
        gave up the Finish unheard); a look is one `lstat`, and a read only when the file
        changed, while this node is away anyway (`SavedFinish`)."""
        recovery = self.config.recovery
        if recovery is None or not self.core.cluster_id:
            return ""
        if self._saved_finish is None:
            from cluster.worker.saved_finish import SavedFinish  # noqa: PLC0415 - files, json

            whose = (self.core.cluster_id, self.identity.node_id, self.identity.incarnation)
            self._saved_finish = SavedFinish(recovery.path, *whose)
        return self._saved_finish.look()

    def _deliver(self, action: steps.Deliver) -> None:
        if action.new_generation:
            self.generation_end.heard(action.topology.generation - 1)
            self._new_generation.set()
            self._new_generation = asyncio.Event()
            self._peer_failed = asyncio.Event()
        if not self._ready.done():
            if self.resumed_in is None:  # its first generation: what it has put back so far
                topology = action.topology
                self.resumed_in = put_back_at_start(
                    topology.generation, topology.rollback_step, self.core.rejoined
                )
            self._ready.set_result(action.topology)

    def _follow(self, address: str) -> None:
        """Talk to the scheduler at `address` from now on; the old channel's connection goes."""
        self._set_aside(self._link.follow(address))

    async def _check_scheduler(self, timeout_s: float) -> steps.Checked:
        link = self._link
        reach = await self._probe.check(link.host, link.port, self._tls, timeout_s)
        if not reach.ok:  # the relay gone too? (up, the core decides: `LeaveRelay`)
            self._closing(await link.off_lost_relay(self.core.address))
        return steps.Checked(reach.ok, reach.why)

    def _closing(self, closing: Closing | None) -> None:
        if closing is not None:
            self._set_aside(closing)

    def _set_aside(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `work` beside this agent's tasks (cancelled by `close`)."""
        task = asyncio.create_task(work)
        self._aside.add(task)
        task.add_done_callback(self._aside.discard)
        return task

    def _failed(self, error: ClusterError, *, report: bool) -> None:
        self._back.set()
        if self._fatal.done():
            return
        self._fatal.set_result(error)
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here: start() raises it
        if report:
            self._on_fatal(error)

    # -- signing -------------------------------------------------------------------------------

    def _signed(self, method: str, request: Any = None) -> membership.Metadata:
        """The metadata of a call of this node: a fresh call proof with a job secret."""
        if self._signer is None:
            return self._metadata
        body = b"" if request is None else edge.signed_body(method, request)
        return self._signer.metadata(method, body)

    # -- calls -------------------------------------------------------------------------------

    def _require_topology(self) -> Topology:
        if self.topology is None:
            raise ClusterError("the job has not formed yet: cluster.init() has not returned")
        return self.topology

    async def exchange(
        self,
        op: str,
        value: bytes,
        root: int = 0,
        generation: int | None = None,
        withdrawn: str = "",
    ) -> list[bytes]:
        """One control-plane collective; `op` is "barrier", "allgather" or "broadcast".

        `generation`: the one the caller's work belongs to (a training step that began before
        the job moved on must not take part in the new generation's collectives); default: the
        current one. `withdrawn`: this rank's contribution was refused here, for that reason
        (`value` is empty): it takes the collective's number and fails it for every rank
        (the scheduler's CollectiveError, raised). Another rank's call of another collective
        as this one is a CollectiveMismatchError.
        """
        topology = self._require_topology()
        generation = topology.generation if generation is None else generation
        seq = self.core.next_seq(generation)
        unsent = functools.partial(self.core.collective_unsent, generation, seq)
        try:  # a root the message cannot carry: the number goes back, as for a refused send
            request = convert.exchange_request(
                self.identity.node_id, generation, seq, op, root, value, withdrawn
            )
        except (ValueError, TypeError):
            unsent()
            raise
        answer = await self._calls.request(
            op, "Exchange", request, unsent=unsent, read=convert.exchange_failure
        )
        self.core.collective_answered(generation, seq)
        return list(answer.values)

    async def wait_generation(self, newer_than: int) -> Topology:
        """The topology once its generation is above `newer_than` (the job's failure, if it
        comes first, is raised)."""
        while True:
            topology = self._require_topology()
            if topology.generation > newer_than:
                return topology
            await unless_failed(self._new_generation.wait(), self._fatal)

    async def peer_failed(self, generation: int, wait_s: float) -> bool:
        """Whether a peer of `generation` failed (or the job moved past it), waiting up to
        `wait_s` for the scheduler to say so: an error of a data-plane library (gloo, NCCL)
        often arrives a moment before the scheduler's word."""
        topology = self._require_topology()
        if topology.generation != generation:
            return True
        peer_failed, moved = self._peer_failed, self._new_generation
        waiters = [asyncio.ensure_future(peer_failed.wait()), asyncio.ensure_future(moved.wait())]
        try:
            # FIRST_COMPLETED: either event answers; the default (all) waited out wait_s.
            await unless_failed(
                asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED),
                self._fatal,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        return peer_failed.is_set() or moved.is_set()

    @property
    def report_generation(self) -> int:
        """The generation a checkpoint report says now: the one whose rollback step this worker
        put back (`resumed_in`: from its first generation on, `put_back_at_start`, then each
        put-back it makes, `runtime.resumed_in`), else the one it is in (0: none yet)."""
        return self.resumed_in or (0 if self.topology is None else self.topology.generation)

    async def report_checkpoints(
        self, steps: list[int], resumed: convert.Resumed | None = None, generation: int = 0
    ) -> int:
        """Report the steps held (and, from rank 0, a generation resumed from memory), listed
        when `report_generation` was `generation` (0: now); a step every worker holds (0:
        none), to keep."""
        self._report_seq += 1  # a retry sends the same number: the scheduler takes it once
        held = generation or self.report_generation
        seq = self._report_seq
        request = convert.checkpoints_request(self.identity, steps, held, seq, resumed)
        answer = await self._calls.request("checkpoint report", "ReportCheckpoints", request)
        return int(answer.held_by_all)

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._calls.request("kv set", "KvSet", convert.kv_set_request(key, value))

    async def kv_get(self, keys: list[str]) -> tuple[list[bytes], list[str]]:
        response = await self._calls.request("kv get", "KvGet", convert.kv_get_request(keys))
        return list(response.values), list(response.missing)

    async def kv_wait(self, keys: list[str], timeout_s: float) -> list[bytes]:
        request = convert.kv_wait_request(keys, timeout_s)
        response = await self._calls.request("kv wait", "KvWait", request, timeout=timeout_s + 5.0)
        return list(response.values)

    async def kv_add(self, key: str, amount: int) -> int:
        self._add_seq += 1  # a retry sends the same number: the scheduler counts the add once
        request = convert.kv_add_request(key, amount, self._add_seq)
        response = await self._calls.request("kv add", "KvAdd", request)
        return int(response.value)

    # -- end ---------------------------------------------------------------------------------

    @property
    def finish_bound_s(self) -> float:
        """The longest `finish()` keeps asking."""
        return self.core.finish_bound_s

    async def finish(self) -> bool:
        """Tell the scheduler this node is done (best effort when the job is over anyway);
        True when it heard. A failure heard meanwhile waits for the answer; the Finish is sent
        again only when it never reached the scheduler (see the core)."""
        try:
            await self._run(self.core.step(steps.FinishSent()))
        except BaseException:
            await self._run(self.core.step(steps.FinishAnswered(heard=False, details="cancelled")))
            raise
        return self.core.finish_heard

    async def send_finish(self, timeout_s: float, failure: str = "") -> steps.Event:
        """One Finish call, waiting up to `timeout_s`: what came of it. With `failure` (the
        first line of the error this process dies of), sent once by the session at exit: the
        node is closed first, so that what the scheduler does about it (it removes the node,
        which ends its stream) is neither said ("lost the scheduler ... training goes on") nor
        acted on (registering again) by a process that is ending."""
        if failure:
            self.core.step(steps.Close())
        request = convert.finish_request(self.identity, failure)
        try:
            await self._link.stub.Finish(
                request, timeout=timeout_s, metadata=self._signed("Finish", request)
            )
        except grpc.aio.AioRpcError as exc:
            why = failures.failure_of(exc)
            return steps.FinishFailed(why.code, why.details, stream_up=self._stream.up)
        return steps.FinishAnswered(heard=True)

    async def close(self) -> None:
        await self._run(self.core.step(steps.Close()))
        for task in (self._watch_task, self._expiry, *self._aside):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._link.channel.close(grace=None)
