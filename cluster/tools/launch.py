"""`mscluster run`: start a job's local processes, watch them, and end them all together.

One launcher per host. It starts the scheduler when the master address is this host's (and the
node rank is 0 or unset), starts the local workers with the full MS_* environment, writes each
process's output to `<log-dir>/scheduler.log` and `<log-dir>/worker_<i>.log`, shows progress,
restarts a failed worker when asked and when the job can still take it back, and stops everything
it started when the job fails or when it is told to stop. No child outlives it.
It lists the pid of each process it started (and its own) in `<log-dir>/pids`, rewritten at every
start and restart: the demo, the tests and the benchmarks find the process to signal there
(`cluster.tools.processes.launched_pid`), never by a name on the whole machine. One launcher
per log directory, too: it holds `<log-dir>/launcher.lock` (`launch_lock`) before it writes
anything there, and another launcher given the same directory meanwhile is refused.

What it starts is decided first (`launch_setup.plan_job`, `launch_plan`): `--dry-run` prints that
plan and stops there. Under a Slurm step of several nodes without a given job secret, the nodes'
launchers share one that node 0 makes (`slurm_io`) before anything starts.

A job whose every worker runs here is closed to outsiders: the launcher makes a job secret
(`<log-dir>/job.secret`, mode 0600) and gives it to every process it starts
(CLUSTER_JOB_SECRET_FILE), unless CLUSTER_JOB_SECRET[_FILE] gives one, which is then used as it
is (that is how the launchers of several hosts share one).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from cluster.protocol.display import safe
from cluster.protocol.environment import tls_options_from_env
from cluster.protocol.errors import ClusterError, ConfigError
from cluster.tools import launch_policy as policy
from cluster.tools import launch_setup as setup
from cluster.tools import processes, slurm_io
from cluster.tools.launch_plan import (
    LaunchOptions,
    Plan,
    Process,
    child_environment,
    render,
    standby_hosts,
    wants_relay,
)
from cluster.tools.launch_reading import (
    POLL_CHANNEL_OPTIONS,
    POLL_STATUS_S,
    Fresh,
    JobReader,
    job_ended,
    job_seen,
    log_end,
    without_rank_at_end,
)
from cluster.tools.secret import JOB_SECRET_FILE, write_job_secret
from cluster.tools.status import JobView
from cluster.transport import channel as scheduler_channel
from cluster.transport import tls

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SIGNAL_BASE = 128
# Children get this long to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
# After the first failure, wait this long for the other exits it causes, so the report names
# the process that died first (the cause) rather than one that stopped because of it.
SETTLE_S = 0.3
# Once the job finished, how long the processes holding no rank get to exit by themselves.
SPARE_EXIT_S = 1.0
# Once every local worker finished, how long the scheduler gets to end the job and exit.
SCHEDULER_EXIT_S = 30.0
LOG_TAIL_LINES = 12
# How long the relay gets to take connections before the workers start without it (they then go
# to the scheduler directly), and how often the launcher looks meanwhile.
RELAY_START_S = 15.0
RELAY_LOOK_S = 0.02
RELAY_SOCKET = "relay.sock"
# A relay that dies while the job runs is started again at most this many times.
RELAY_RESTARTS = 3
# The signals that stop the job: each child stopped, the launcher's files removed, 128 + signal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Child:
    planned: Process
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    exit_code: int | None = None
    pump: asyncio.Task[None] | None = None
    reaper: asyncio.Task[None] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Launcher:
    def __init__(
        self,
        options: LaunchOptions,
        plan: Plan,
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
        # Polling the scheduler speaks TLS when the job does (the launcher is a client too).
        identity: tls.Identity | None = None
        if options.tls_config is not None:
            tls_options = tls_options_from_env(os.environ, options.tls_config.resolve())
            assert tls_options is not None  # a config path was given
            identity = tls.load_identity(tls_options, server=False)
        self.reader = JobReader(self.addresses, identity, options.job_secret_file)
        self.scheduler: Child | None = None
        self.relay: Child | None = None
        self._relay_said = False
        self.workers: list[Child] = []
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
        self._last_line = ""

    # -- processes -----------------------------------------------------------------------------

    async def _spawn(self, child: Child, args: list[str], env: dict[str, str]) -> None:
        mode = "ab" if child.restarts else "wb"
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
        child.exit_code = None
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

    async def _pump(self, child: Child, mode: str) -> None:
        """--join: copy a worker's output to its log and, prefixed, to the terminal."""
        assert child.process is not None
        assert child.process.stdout is not None
        with child.planned.log.open(mode) as log:
            async for raw in child.process.stdout:
                log.write(raw)
                log.flush()
                rank = self._rank_of(child)
                # `_print` never raises: a terminal that went away stops the echo, not the log.
                prefix = f"[rank {rank}]" if rank is not None else f"[{child.planned.name}]"
                self._print(f"{prefix} {raw.decode(errors='replace').rstrip()}", raw=True)

    async def _reap(self, child: Child) -> None:
        assert child.process is not None
        code = await child.process.wait()
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

    async def _stop_all(self) -> None:
        """SIGTERM every running child's process group (SIGINT the scheduler's: the job ends,
        where SIGTERM would hand it to a standby); SIGKILL what is left after the grace."""
        everyone = [*self.workers, self.scheduler, self.relay]
        children = [c for c in everyone if c is not None and c.running]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for child in children:
                if child.running and child.process is not None:
                    first = signal.SIGINT if child is self.scheduler else signal.SIGTERM
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.process.pid, first if sig == signal.SIGTERM else sig)
            waits = [c.exited.wait() for c in children]
            try:
                await asyncio.wait_for(asyncio.gather(*waits), STOP_GRACE_S)
                return
            except asyncio.TimeoutError:
                continue

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

    async def _poll_status(self) -> None:
        """The job's status every POLL_STATUS_S (`JobReader.poll`), for the progress line."""
        async with scheduler_channel.open_channel(
            self.address, self.reader.identity, POLL_CHANNEL_OPTIONS
        ) as channel:
            while True:
                asked = self._clock()
                with contextlib.suppress(ClusterError):
                    self.view = await self.reader.poll(channel)
                    self._view_asked = asked
                self._progress()
                await asyncio.sleep(POLL_STATUS_S)

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
            setup.say(self.out, f"\r\x1b[K{line} | {elapsed:.0f} s")
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
        setup.say(self.out, start + (line if raw else safe(line)) + "\n")

    async def _seen(self, *, ask: bool) -> policy.Seen:
        """What the launcher has seen, for `policy.decide`; with `ask`, a fresh answer from the
        scheduler too (a worker has failed: may the job take it back?)."""
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
        ended = sched is not None and sched.exit_code == 0 and self._ended()
        if ended and self._at_end is None:
            self._at_end = without_rank_at_end(self._event_log())
        return policy.Seen(
            workers=tuple(
                policy.WorkerSeen(
                    w.planned.index or 0, w.exit_code, w.restarts, self._spare(w, view)
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
        )

    def _ended(self) -> bool:
        """Whether the job's end was seen (`job_ended`: the last answer, the event log)."""
        return job_ended(self.view, self._event_log())

    def _event_log(self) -> Path | None:
        """The event log of this launcher's scheduler (None: none, or not this launcher's)."""
        planned = self.plan.scheduler
        event_log = None if planned is None else planned.env.get("CLUSTER_EVENT_LOG")
        return None if event_log is None else Path(event_log)

    # -- the run -------------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            self._stopping.set()
            self._wake.set()

    def _stopped(self) -> int:
        """The job was told to stop: said, and its exit code (128 + the signal)."""
        assert self._stop_signal is not None
        name = signal.Signals(self._stop_signal).name
        self._print(f"mscluster: {name} received; stopping every process of the job")
        return EXIT_SIGNAL_BASE + self._stop_signal

    async def _wait_or_stop(self, event: asyncio.Event, timeout_s: float) -> None:
        """Until `event` is set, a stop signal arrives, or `timeout_s` has passed."""
        waits = [asyncio.ensure_future(e.wait()) for e in (event, self._stopping)]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def run(self) -> int:
        o = self.options
        o.log_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self._on_signal, signum)
        poller: asyncio.Task[None] | None = None
        try:
            if self.plan.scheduler is not None:
                self.scheduler = Child(self.plan.scheduler)
                await self._start(self.scheduler)
            if self.plan.relay is not None:
                self.relay = Child(self.plan.relay)
                await self._start(self.relay)
                await self._relay_started()
                if self._stop_signal is not None:
                    return self._stopped()
            self.workers = [Child(planned) for planned in self.plan.workers]
            for child in self.workers:
                await self._start(child)
            where = "with the scheduler" if self.scheduler else "for the scheduler"
            spares = f" and {o.spares} spares" if o.spares else ""
            self._print(
                f"mscluster: started {o.local_worker_num} of {o.worker_num} workers{spares} "
                f"{where} at {self.address}; logs in {o.log_dir}/"
            )
            poller = asyncio.create_task(self._poll_status())
            return await self._watch()
        finally:
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            await self._stop_all()
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    async def _relay_started(self) -> None:
        """Wait, up to RELAY_START_S, until the relay takes connections, so that the workers
        find it; one that does not is said, and the workers go to the scheduler directly."""
        relay, path = self.relay, self.options.relay_socket
        assert relay is not None
        assert path is not None
        deadline = self._clock() + RELAY_START_S
        while relay.running and self._clock() < deadline:
            if _accepts(path) or self._stop_signal is not None:
                return
            await self._wait_or_stop(relay.exited, RELAY_LOOK_S)
        self._relay_said = True
        self._print(
            f"mscluster: the relay did not start (see {relay.planned.log}): the workers go to "
            "the scheduler directly"
        )

    async def _relay_gone(self) -> None:
        """A relay that ended while the job runs is started again, up to RELAY_RESTARTS times,
        said in one line: the scheduler took its workers for failed (with recovery they rejoin),
        they go to it directly meanwhile, and through the relay again when they next connect.
        Past the restarts, said once, they stay direct."""
        relay = self.relay
        if relay is None or relay.exit_code is None or self._relay_said:
            return
        how = policy.describe_exit(relay.exit_code)
        if relay.restarts < RELAY_RESTARTS:
            relay.restarts += 1
            self._print(
                f"mscluster: the relay {how}; restarting it (relay restart {relay.restarts} of "
                f"{RELAY_RESTARTS}): this host's workers go to the scheduler directly meanwhile "
                "and come back through it when they next connect"
            )
            await self._start(relay)
            return
        self._relay_said = True
        self._print(f"mscluster: the relay {how}: this host's workers go to the scheduler directly")

    async def _watch(self) -> int:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._relay_gone()
            failed = any(w.exit_code not in (None, 0) for w in self.workers)
            decision = policy.decide(await self._seen(ask=failed))
            if decision.action is policy.Action.STOP:
                return self._stopped()
            if decision.action is policy.Action.RESTART:
                child = self.workers[decision.worker or 0]
                child.restarts += 1
                self._print(
                    f"mscluster: {self._who(child)} "
                    f"{policy.describe_exit(child.exit_code or 0)}; restarting it "
                    f"(restart {child.restarts} of {self.options.max_restarts})"
                )
                await self._start(child)
                self._wake.set()  # another failed worker may be waiting for its turn
            elif decision.action is policy.Action.RESTART_SCHEDULER:
                await self._restart_scheduler()
            elif decision.action is policy.Action.FAIL:
                return await self._fail(decision.worker, decision.reason)
            elif decision.action is policy.Action.FINISH:
                return await self._finish()

    async def _restart_scheduler(self) -> None:
        """Start the scheduler that died (or left the job to resume) again, on the same address
        and state: it resumes the job from what it saved, and the workers, which go on
        training, reconnect to it."""
        sched = self.scheduler
        assert sched is not None
        sched.restarts += 1
        how = policy.describe_scheduler_exit(sched.exit_code or 0)
        self._print(
            f"mscluster: the scheduler {how}; starting it "
            f"again (scheduler restart {sched.restarts} of {self.options.max_restarts}): it "
            "resumes the job from its saved state, and the workers train on meanwhile"
        )
        await self._start(sched)
        self._wake.set()  # a worker that failed meanwhile is decided on next

    async def _settle(self) -> None:
        """Let the exits that a first failure causes arrive, to tell cause from effect."""
        deadline = self._clock() + SETTLE_S
        while self._clock() < deadline:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(deadline - self._clock(), 0))

    async def _fail(self, first: int | None, why_not_restarted: str) -> int:
        """`first`: the failed worker's index, or None for the scheduler."""
        await self._settle()
        seen = await self._seen(ask=False)
        # A worker still running may be dying of an error it printed (see policy.cause).
        ends = {
            w.index: log_end(self.workers[w.index].planned.log)
            for w in seen.workers
            if w.failed or w.exit_code is None
        }
        errors = {i: policy.error_line(lines) for i, lines in ends.items()}
        index = policy.cause(seen.workers, first, errors, seen.scheduler_exit)
        cause = self.scheduler if index is None else self.workers[index]
        assert cause is not None
        what = "the scheduler" if index is None else self._who(cause)
        end = ends[index] if index in ends else log_end(cause.planned.log)
        # The cause in the process's own words (an NCCL error, ...): the scheduler only saw its
        # connection break.
        error = policy.error_line(end)
        said = f": {error}" if error else ""
        if cause.running:  # its exit blocks on what failed (an NCCL communicator)
            how = "failed and had not exited (stopped now)"
        elif index is None:
            how = policy.describe_scheduler_exit(cause.exit_code or 0)
        else:
            how = policy.describe_exit(cause.exit_code or 0)
        self._print(f"mscluster: {what} {how}{said}")
        if index is None and why_not_restarted and self.options.enable_recovery:
            self._print(f"mscluster: not restarting it: {why_not_restarted}")
        if self.options.max_restarts and index is not None:
            if index != first:
                why_not_restarted = (
                    policy.why_not_restart(seen.workers[index], seen) or "the job is ending"
                )
            self._print(f"mscluster: not restarting it: {why_not_restarted}")
        tail = end[-LOG_TAIL_LINES:]
        if tail:
            self._print(f"mscluster: last lines of {cause.planned.log}:")
            for line in tail:
                self._print(f"    {line}")
        running = [c for c in [*self.workers, self.scheduler] if c is not None and c.running]
        if running:
            self._print(f"mscluster: stopping the {len(running)} other running processes")
        self._print("mscluster: job failed")
        return EXIT_FAILED

    async def _let_spares_go(self) -> None:
        """The processes holding no rank hear of the end from the scheduler and exit 0; one that
        could not (restarted while the job ended, it found no scheduler) is stopped after
        SPARE_EXIT_S: the job's exit code is its ranked workers'."""
        left = [w for w in self.workers if w.running]
        if not left:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.exited.wait() for w in left)), SPARE_EXIT_S)
        stopped = [w for w in left if w.running]
        if stopped:
            names = ", ".join(self._who(w) for w in stopped)
            self._print(f"mscluster: the job is over; stopping {names}, which holds no rank")

    async def _finish(self) -> int:
        sched = self.scheduler
        if sched is not None:
            await self._wait_or_stop(sched.exited, SCHEDULER_EXIT_S)
            if self._stop_signal is not None:
                return self._stopped()
            if not sched.exited.is_set():
                self._print(
                    "mscluster: every local worker finished, but the scheduler did not exit"
                )
                return EXIT_FAILED
            if sched.exit_code != 0:
                return await self._fail(None, "")
        await self._let_spares_go()
        restarts = sum(w.restarts for w in self.workers)
        sched_restarts = 0 if sched is None else sched.restarts
        took = self._clock() - self._started
        ranked = [w for w in self.workers if not self._spare(w, self.view)]
        exited = sum(1 for w in ranked if w.exit_code == 0)
        spares = len(self.workers) - len(ranked)
        after = [
            f"{restarts} restart{'' if restarts == 1 else 's'}" if restarts else "",
            f"{sched_restarts} scheduler restart{'' if sched_restarts == 1 else 's'}"
            if sched_restarts
            else "",
        ]
        after = [a for a in after if a]
        held = f" ({spares} spare{'' if spares == 1 else 's'} beside them)" if spares else ""
        self._print(
            f"mscluster: job finished: {exited} local worker{'' if exited == 1 else 's'} exited 0"
            f"{held} in {took:.1f} s" + (f", after {' and '.join(after)}" if after else "")
        )
        return EXIT_OK


def run(options: LaunchOptions, out: IO[str] = sys.stderr, *, dry_run: bool = False) -> int:
    """Validate, launch, and return the exit code (2 for a usage error). With `dry_run`, print
    what would start to stdout instead, and start nothing. A relay's socket goes in a directory
    of this user's only, made here and removed at the end. A stop signal that comes before the
    launcher watches its children (a Slurm step's secret still awaited) ends it the same way:
    its files removed, one line, 128 + the signal."""
    setup.validate(options)
    previous = {signum: signal.signal(signum, _interrupt) for signum in STOP_SIGNALS}
    try:
        return _run(options, out, dry_run=dry_run)
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
        setup.say(out, f"mscluster: {signal.Signals(signum).name} received; stopped\n")
        return EXIT_SIGNAL_BASE + signum
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signum)


def _run(options: LaunchOptions, out: IO[str], *, dry_run: bool) -> int:
    if not wants_relay(options):
        return _launch(options, out, dry_run=dry_run)
    if dry_run:
        unmade = Path(tempfile.gettempdir()) / "mscluster-relay-XXXXXXXX" / RELAY_SOCKET
        return _launch(dataclasses.replace(options, relay_socket=unmade), out, dry_run=True)
    directory = Path(tempfile.mkdtemp(prefix="mscluster-relay-"))  # mode 0700
    try:
        socket_path = directory / RELAY_SOCKET
        return _launch(dataclasses.replace(options, relay_socket=socket_path), out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _launch(options: LaunchOptions, out: IO[str], *, dry_run: bool = False) -> int:
    allocation = options.allocation
    # The Slurm step whose nodes share a secret that node 0 makes (None: no such sharing).
    sharing = allocation if slurm_io.shares_secret(allocation, os.environ) else None
    if sharing is not None:
        secret_file = slurm_io.local_secret_file(options.log_dir)
        options = dataclasses.replace(options, job_secret_file=secret_file)
    plan = setup.plan_job(options)
    made_here = setup.closes_the_job(options, plan, out)
    if made_here:
        options = dataclasses.replace(options, job_secret_file=options.log_dir / JOB_SECRET_FILE)
        plan = setup.plan_job(options)
    if dry_run:
        setup.check_paths(options, plan)
        setup.say(sys.stdout, render(plan, options, os.environ) + "\n")
        return EXIT_OK
    if plan.scheduler is not None:
        setup.check_port_free(plan.ip, options.master_port)
    lock = setup.make_paths(options, plan, out)  # --log-dir is this launcher's from here
    try:
        if sharing is not None:
            slurm_io.share_secret(sharing, options.log_dir)
        if made_here:
            _write_secret(options.log_dir, keep=options.enable_recovery)
        return asyncio.run(Launcher(options, plan, out).run())
    finally:
        lock.release()
        if sharing is not None:
            slurm_io.remove_shared_secret(sharing)


def _write_secret(log_dir: Path, *, keep: bool) -> None:
    try:
        write_job_secret(log_dir, keep=keep)
    except OSError as exc:
        raise ConfigError(
            f"--log-dir: cannot write the job secret in {str(log_dir)!r} ({exc.strerror or exc})"
        ) from None


def _accepts(path: Path) -> bool:
    """Whether something takes connections on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _pid_name(planned: Process) -> str:
    """A process's name in `<log-dir>/pids`: its log's (`scheduler`, `worker_2`, `spare_0`)."""
    return planned.log.stem
