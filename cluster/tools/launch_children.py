"""A launcher's children: the processes it starts, their output, and what it has seen of them.

`Children` holds what one launcher knows: its options and plan, the scheduler, relay and
workers it started (a `Child` each), the scheduler's last answer and the job's end as its event
log tells it. It starts a child (its output to its log, or with --join through `_pump` to the
terminal too), reaps its exit, rewrites `<log-dir>/pids`, says the progress line and every other
line for the person at the terminal (through `launch_echo.Terminal`, which never blocks), signals
the process groups it started at the end, tells its guard (`guard`) of each group as it starts
it (they end with the launcher even SIGKILLed, stopped ones too), and gathers what it has seen
for `launch_policy.decide` (`_seen`). What to do about an exit, and the run from start to end, are
`launch.Launcher`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from cluster.protocol.display import safe
from cluster.protocol.environment import from_env
from cluster.protocol.records import NodeState
from cluster.tools import guard as job_guard
from cluster.tools import launch_policy as policy
from cluster.tools import launch_setup as setup
from cluster.tools import processes
from cluster.tools.launch_echo import EchoLines, Terminal
from cluster.tools.launch_plan import LaunchOptions, Plan, Process, child_environment, standby_hosts
from cluster.tools.launch_reading import Fresh, JobReader, job_ended, job_seen, without_rank_at_end
from cluster.tools.status import JobView
from cluster.transport import tls

# A node's state in the scheduler's answer once it called finalize().
FINISHED = NodeState.FINISHED.value
# While the job's processes stop, how often the launcher looks whether any is left.
STOP_LOOK_S = 0.05
# --join: how much of a worker's output is read at once.
PUMP_CHUNK_BYTES = 64 * 1024
# At the end, how long the terminal is given to take what is left to say.
TERMINAL_DRAIN_S = 2.0


@dataclass
class Child:
    planned: Process
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    exit_code: int | None = None
    started_at: float = float("-inf")  # when it was last started (the launcher's clock)
    exited_at: float | None = None  # when it was reaped (the launcher's clock)
    pump: asyncio.Task[None] | None = None
    reaper: asyncio.Task[None] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Children:
    """What one launcher started and has seen of it: the plumbing under `launch.Launcher`."""

    def __init__(
        self,
        options: LaunchOptions,
        plan: Plan,
        identity: tls.Identity | None,
        out: IO[str] = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.plan = plan
        self._clock = clock
        self.out = out
        self.address = plan.address
        # Every scheduler of the job, the first first (--master-addr h1,h2: standbys follow).
        port = options.master_port
        self.addresses = [
            plan.address,
            *(setup.at(h, port) for h in standby_hosts(options.master_addr)),
        ]
        # Polling the scheduler speaks TLS when the job does, with `identity`, the launcher's
        # own as a client (`launch_setup.launcher_identity`, loaded before anything is made).
        self.reader = JobReader(self.addresses, identity, options.job_secret_file)
        self.scheduler: Child | None = None
        # How long the job waits for its scheduler (`scheduler_wait_s`); a scheduler of ours
        # that runs and does not answer is starting or busy within it, and gone past it.
        self.scheduler_wait_s = 0.0 if plan.scheduler is None else scheduler_wait_s(plan.scheduler)
        # The failed workers said to wait for the scheduler's answer, and those said to have
        # failed after they finished their part: (index, restarts) of each, said once.
        self._awaiting: set[tuple[int, int]] = set()
        self._noted: set[tuple[int, int]] = set()
        # The node ids the scheduler counted finished (their part of the job done): a node id
        # finishes once, so an answer that said so holds for the rest of the job.
        self.finished_nodes: set[str] = set()
        # The node ids the scheduler's answers listed; its freshest answer, when asked (`_joined`).
        self.members_seen: set[str] = set()
        self._latest: tuple[float, JobView] | None = None
        self.relay: Child | None = None
        self._relay_said = False
        self.workers: list[Child] = []
        # Every process started, each incarnation (restarts too), in a group of its own: its
        # helpers stay in that group after it exits, and are stopped with it at the end.
        self.groups: list[asyncio.subprocess.Process] = []
        # Told of each of `groups` as it starts: it ends them once this launcher is gone, even
        # SIGKILLed, a stopped one at once (`guard`). Started with the first child.
        self.guard: subprocess.Popen[bytes] | None = None
        self.view: JobView | None = None
        # Once the job ended: whether each node held no rank at its end, by its event log.
        self._at_end: dict[str, bool] | None = None
        # When the poll that got `view` was asked, and when a child last exited (clock times):
        # an answer asked before an exit is not shown beside the processes as they are now.
        self._view_asked = float("-inf")
        self._exited_at = float("-inf")
        self._stop_signal: int | None = None
        self._stopping = asyncio.Event()  # set with `_stop_signal`
        self._wake = asyncio.Event()
        self._started = clock()
        self._tty = out.isatty()
        # Every line for the person at the terminal goes through it: it never blocks the loop.
        self.terminal = Terminal(out)
        self._last_line = ""

    # -- processes -----------------------------------------------------------------------------

    async def _spawn(self, child: Child, args: list[str], env: dict[str, str]) -> None:
        mode = "ab" if child.restarts else "wb"
        if self.guard is None:
            self.guard = job_guard.start()
        if self.options.join and child.planned.index is not None:
            child.process = await asyncio.create_subprocess_exec(
                *args,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,  # our own process group: we stop it, not the terminal
            )
            child.pump = asyncio.create_task(self._pump(child, mode))
        else:
            with child.planned.log.open(mode) as log:
                child.process = await asyncio.create_subprocess_exec(
                    *args,
                    env=env,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
        self.groups.append(child.process)
        job_guard.note(self.guard, child.process.pid)
        child.started_at = self._clock()
        child.exit_code = None
        child.exited_at = None
        child.exited.clear()
        child.reaper = asyncio.create_task(self._reap(child))
        self._write_pids()

    def _write_pids(self) -> None:
        """`<log-dir>/pids`: the pid of every process this launcher started (the newest
        incarnation of each), so that a tool signals this job's processes and no other's."""
        started = [c for c in [self.scheduler, self.relay, *self.workers] if c is not None]
        pids = {_pid_name(c.planned): c.process.pid for c in started if c.process is not None}
        with contextlib.suppress(OSError):  # a courtesy to tools: never fails the job
            processes.write_pids(self.options.log_dir, pids)

    def _signal_groups(self, signum: int, scheduler_signum: int) -> None:
        """`signum` to every process group this launcher started (`groups`), its leader running
        or not; `scheduler_signum` to the group of the scheduler while it runs."""
        sched = None if self.scheduler is None else self.scheduler.process
        for process in self.groups:
            running = process.returncode is None
            sent = scheduler_signum if process is sched and running else signum
            processes.signal_group(process.pid, sent, leader_reaped=not running)

    async def _close_guard(self) -> None:
        """Once every group was stopped: the guard ends what may be left, and exits."""
        if self.guard is not None:
            await asyncio.to_thread(job_guard.close, self.guard)
            self.guard = None

    async def _groups_gone(self, timeout_s: float) -> bool:
        """Whether, within `timeout_s`, no process of `groups` is left: every child reaped (its
        exit seen) and no helper of one running."""
        children = [c for c in [*self.workers, self.scheduler, self.relay] if c is not None]

        def left() -> bool:
            if any(c.process is not None and not c.exited.is_set() for c in children):
                return True
            ours = [
                p.pid
                for p in self.groups
                if processes.group_is_ours(p.pid, leader_reaped=p.returncode is not None)
            ]
            return bool(processes.groups_running(ours))

        deadline = asyncio.get_running_loop().time() + timeout_s
        while left():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(STOP_LOOK_S)
        return True

    async def _pump(self, child: Child, mode: str) -> None:
        """--join: copy a worker's output to its log as it comes, in chunks (whatever the length
        of its lines), and echo its lines to the terminal, prefixed (`_echo`). A log that
        cannot be written (a full disk) is said once and the output still drained: a worker
        never blocks on a pipe that nobody reads."""
        assert child.process is not None
        assert child.process.stdout is not None
        stream = child.process.stdout
        lines = EchoLines()
        log = self._open_log(child, mode)
        try:
            while chunk := await stream.read(PUMP_CHUNK_BYTES):
                if log is not None and not self._logged(child, log, chunk):
                    log = None
                self._echo(child, lines.feed(chunk))
            self._echo(child, lines.end())
        finally:
            if log is not None:
                with contextlib.suppress(OSError):
                    log.close()

    def _open_log(self, child: Child, mode: str) -> io.FileIO | None:
        try:
            return io.FileIO(child.planned.log, mode)
        except OSError as exc:
            self._log_failed(child, exc)
            return None

    def _logged(self, child: Child, log: io.FileIO, chunk: bytes) -> bool:
        """Whether all of `chunk` went to the log; the first write that fails is said, and the
        log closed."""
        view = memoryview(chunk)
        try:
            while view:
                view = view[log.write(view) or 0 :]
        except OSError as exc:
            self._log_failed(child, exc)
            with contextlib.suppress(OSError):
                log.close()
            return False
        return True

    def _log_failed(self, child: Child, exc: OSError) -> None:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._print(
            f"mscluster: cannot write {child.planned.log} ({exc.strerror or exc}, {code}): the "
            f"rest of {child.planned.name}'s output is shown here only"
        )

    def _echo(self, child: Child, lines: list[tuple[bytes, int]]) -> None:
        """Each of a worker's `lines` (with the bytes cut from it: `EchoLines`) to the terminal,
        after its rank (`_print`: never blocks, never raises)."""
        for line, cut in lines:
            rank = self._rank_of(child)
            prefix = f"[rank {rank}]" if rank is not None else f"[{child.planned.name}]"
            more = f" [... {cut} more bytes of this line in {child.planned.log}]" if cut else ""
            self._print(f"{prefix} {line.decode(errors='replace').rstrip()}{more}", raw=True)

    async def _reap(self, child: Child) -> None:
        assert child.process is not None
        code = await child.process.wait()
        child.exited_at = self._clock()  # before the output's end: the order of the exits
        if child.pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(child.pump, 2.0)
        child.exit_code = code
        self._exited_at = self._clock()
        child.exited.set()
        self._wake.set()

    async def _start(self, child: Child) -> None:
        planned = child.planned
        await self._spawn(child, list(planned.args), child_environment(os.environ, planned))

    # -- watching ------------------------------------------------------------------------------

    def _rank_of(self, child: Child) -> int | None:
        node_id = child.planned.node_id
        if node_id is not None and self._at_end is not None and self._at_end.get(node_id):
            return None  # the job ended with its rank a spare's
        if node_id is not None and self.view is not None:
            rank = self.view.rank_of(node_id)
            if rank is not None:
                return rank
        return child.planned.rank

    def _spare(self, child: Child, view: JobView | None) -> bool:
        """Whether `child` holds no rank now (the scheduler's word, its event log's once the
        job ended; else how it started)."""
        node_id = child.planned.node_id
        known = None if view is None or node_id is None else view.is_spare(node_id)
        if node_id is not None and self._at_end is not None:
            known = self._at_end.get(node_id, known)
        return child.planned.spare if known is None else known

    def _who(self, child: Child) -> str:
        rank = self._rank_of(child)
        where = f"rank {rank}, " if rank is not None else ""
        planned = child.planned
        name = planned.name if planned.spare else f"worker {planned.index}"
        return f"{name} ({where}node id {planned.node_id!r})"

    def _progress(self) -> None:
        """The progress line, from an answer asked after the last exit of a child (none until
        one comes: the job as it was beside the workers as they are is no state it was in)."""
        if self.view is not None and self._view_asked < self._exited_at:
            return
        running = sum(1 for w in self.workers if w.running)
        job = (
            f"{self.view.registered}/{self.view.expected} registered ({self.view.phase.value})"
            if self.view is not None
            else "scheduler not answering yet"
        )
        if self.options.spares or (self.view is not None and self.view.spares):
            job += f" | spares {0 if self.view is None else self.view.spares}"
        line = (
            f"mscluster: {job} | local workers running {running}/{len(self.workers)} | "
            f"restarts {self._restarts()}"
        )
        if self._tty and not self.options.join:
            elapsed = self._clock() - self._started
            self.terminal.write(f"\r\x1b[K{line} | {elapsed:.0f} s")
            self._last_line = line
        elif line != self._last_line:
            self._last_line = line
            self._print(line)

    def _restarts(self) -> str:
        """'3' (the workers'), '3, scheduler 1' once the scheduler has been started again."""
        workers = sum(w.restarts for w in self.workers)
        sched = 0 if self.scheduler is None else self.scheduler.restarts
        return f"{workers}, scheduler {sched}" if sched else str(workers)

    def _print(self, line: str, *, raw: bool = False) -> None:
        """One line for the person at the terminal, escaped (`safe`: a reason from the
        scheduler, a log's tail); `raw`: a --join worker's own output, colours and all."""
        start = "\r\x1b[K" if self._tty and not self.options.join else ""
        self.terminal.write(start + (line if raw else safe(line)) + "\n")

    async def _said(self) -> None:
        """Once the job's processes are gone: what is left to say reaches the terminal, within
        TERMINAL_DRAIN_S (a reader that pauses longer loses it; the logs hold the output)."""
        await asyncio.to_thread(self.terminal.drain, TERMINAL_DRAIN_S)

    async def _seen(self, *, ask: bool) -> policy.Seen:
        """What the launcher has seen, for `policy.decide`; with `ask`, a fresh answer from the
        scheduler too (a worker has failed: may the job take it back?)."""
        asked = self._clock()
        fresh = await self.reader.fresh() if ask else Fresh()
        if fresh.unread:
            last = "none" if self.view is None else self.view.phase.value
            self._print(
                f"mscluster: the scheduler is up but refused to show the job ({fresh.unread}); "
                f"deciding from its last answer ({last})"
            )
        now = fresh.view
        sched = self.scheduler
        view = now or self.view
        if view is not None:
            self.finished_nodes |= {n.node_id for n in view.nodes if n.state == FINISHED}
        for answer in (self.view, now):
            self._note_members(answer)
        if now is not None:
            self._note_answer(now, asked)
        ended = sched is not None and sched.exit_code == 0 and self._ended()
        if ended and self._at_end is None:
            self._at_end = without_rank_at_end(self._event_log())
        return policy.Seen(
            workers=tuple(
                policy.WorkerSeen(
                    w.planned.index or 0,
                    w.exit_code,
                    w.restarts,
                    self._spare(w, view),
                    None if w.exit_code is None else w.exited_at,
                    w.planned.node_id in self.finished_nodes,
                    self._joined(w),
                    w.planned.node_id in self.members_seen,
                )
                for w in self.workers
            ),
            max_restarts=self.options.max_restarts,
            own_scheduler=sched is not None,
            scheduler_exit=None if sched is None else sched.exit_code,
            scheduler_restarts=0 if sched is None else sched.restarts,
            recovery=self.options.enable_recovery,
            standbys=len(self.addresses) > 1,
            stop_signal=self._stop_signal,
            ended=ended,
            last=job_seen(self.view),
            now=job_seen(now),
            unreachable=fresh.unreachable,
            unread=fresh.unread,
            scheduler_silent_s=self._silent(),
            scheduler_start_s=self.scheduler_wait_s,
        )

    def _asks(self) -> bool:
        """Whether a decision needs a fresh answer: a worker failed (may the job take it
        back? one the scheduler counted finished needs none: a node id finishes once), or a
        ranked one exited 0 that no answer listed yet (did it join the job?) while a scheduler
        may answer (not ours, or ours running)."""
        failed = any(
            w.exit_code not in (None, 0) and w.planned.node_id not in self.finished_nodes
            for w in self.workers
        )
        return failed or self._unseen_exit()

    def _unseen_exit(self) -> bool:
        """Whether a ranked worker exited 0 and whether it is in the job is not known yet
        (`_joined`: no answer listed it, or one listed it while the job formed and none asked
        after its exit says whether the scheduler forgot it) while a scheduler may answer (not
        ours, or ours running)."""
        unseen = any(
            w.exit_code == 0 and not w.planned.spare and self._joined(w) is None
            for w in self.workers
        )
        sched = self.scheduler
        return unseen and (sched is None or sched.running)

    def _note_members(self, view: JobView | None) -> None:
        """The node ids `view` (an answer) lists, kept in `members_seen`."""
        if view is not None:
            self.members_seen |= {n.node_id for n in view.nodes}

    def _note_answer(self, view: JobView, asked: float) -> None:
        """`view`, asked at `asked`, is the freshest answer unless a later-asked one came."""
        if self._latest is None or asked >= self._latest[0]:
            self._latest = (asked, view)

    def _joined(self, child: Child) -> bool | None:
        """Whether `child`'s node is in the job (`policy.WorkerSeen.joined`), decided by
        `policy.joined_by_answers` once it exited (from the freshest answer, and whether that
        was asked after its exit); while it runs, True once an answer listed it."""
        node_id = child.planned.node_id
        listed = node_id in self.members_seen
        if child.exit_code is None or child.exited_at is None:
            return True if listed else None
        latest = self._latest
        last = None if latest is None else latest[1].phase
        after = None
        if latest is not None and latest[0] >= child.exited_at:
            after = (latest[1].phase, node_id in {n.node_id for n in latest[1].nodes})
        return policy.joined_by_answers(listed, last, after)

    def _silent(self) -> float | None:
        """While this launcher's scheduler runs: for how long it has not answered, from its
        last start or the last answer to a poll, whichever came later (None: none runs)."""
        sched = self.scheduler
        if sched is None or sched.process is None or sched.exit_code is not None:
            return None
        return self._clock() - max(sched.started_at, self._view_asked)

    def _ended(self) -> bool:
        """Whether the job's end was seen (`job_ended`: the last answer, the event log)."""
        return job_ended(self.view, self._event_log())

    def _event_log(self) -> Path | None:
        """The event log of this launcher's scheduler (None: none, or not this launcher's)."""
        planned = self.plan.scheduler
        event_log = None if planned is None else planned.env.get("CLUSTER_EVENT_LOG")
        return None if event_log is None else Path(event_log)


def scheduler_wait_s(planned: Process) -> float:
    """How long the job waits for its scheduler, `planned`, by its settings: it forms the job
    within MS_TOPO_TIMEOUT after a first start, while its workers wait for it (the launcher has
    no wait of its own then), and the workers of a formed job, recovery on, take it back
    within the longer of MS_NODE_TIMEOUT and MS_TOPO_TIMEOUT after it died."""
    config = from_env(child_environment(os.environ, planned))
    return max(config.node_timeout_s, config.topo_timeout_s)


def _pid_name(planned: Process) -> str:
    """A process's name in `<log-dir>/pids`: its log's (`scheduler`, `worker_2`, `spare_0`,
    `spare_1-0`: `launch_plan.worker_log_name`, `launch_plan.spare_log_name`)."""
    return planned.log.stem
