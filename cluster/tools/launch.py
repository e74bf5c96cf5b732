"""`mscluster run`: start a job's local processes, watch them, and end them all together.

One launcher per host. It starts the scheduler when the master address is this host's (and the
node rank is 0 or unset), starts the local workers with its MS_* environment (less what it sets
itself per process), writes each process's output to `<log-dir>/scheduler.log` and
`<log-dir>/worker_<rank>.log` (`worker_<i>.log` for a worker ranked at registration), shows
progress, restarts a failed worker when asked and when the job can still take it back, and stops
everything it started when the job fails or when it is told to stop. No child outlives it: one
that is SIGKILLed has its children end all the same, a stopped one too (its guard: `guard`).
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

This module holds the supervision: `Launcher`, the run from start to end and the decision on
each exit, and `run`, which settles the options (a relay's socket, a Slurm step's shared secret,
this job's own) before anything starts. The children themselves (each start, its output, its
exit, the pids file, the lines said) and what the launcher has seen of them are
`launch_children`'s.
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
from pathlib import Path
from typing import IO

from cluster.protocol.errors import ClusterError, ConfigError
from cluster.tools import launch_policy as policy
from cluster.tools import launch_setup as setup
from cluster.tools import slurm_io
from cluster.tools.launch_children import Child, Children
from cluster.tools.launch_lock import LogDirLock
from cluster.tools.launch_plan import LaunchOptions, render, wants_relay
from cluster.tools.launch_reading import (
    POLL_CHANNEL_OPTIONS,
    POLL_STATUS_S,
    joined_nodes,
    log_end,
)
from cluster.tools.secret import JOB_SECRET_FILE, write_job_secret
from cluster.transport import channel as scheduler_channel

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SIGNAL_BASE = 128
# Children get this long to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0
# After the first failure, wait this long for the other exits it causes, so the report names
# the process that died first (the cause) rather than one that stopped because of it.
SETTLE_S = 0.3
# How long a failed worker's report waits for the scheduler to say whether it had joined the
# job (`policy.awaits_joined`: ours, just started, does not answer yet).
JOINED_REPORT_S = 5.0
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
# SIGHUP is one unless the launcher was started with it ignored (`nohup`): see `stop_signals`.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Launcher(Children):
    """One host's part of a job from start to end: it starts the children, decides on each exit
    (`launch_policy.decide`: restart, fail, finish, stop) and stops them all at the end."""

    # -- processes -----------------------------------------------------------------------------

    async def _stop_all(self) -> None:
        """Stop every process group this launcher started, its leader running or not (a
        worker that exited leaves the helpers it started in its group): SIGTERM (a running
        scheduler SIGINT: the job ends, where SIGTERM would hand it to a standby), then SIGKILL
        to what is left after STOP_GRACE_S. Then what is left to say reaches the terminal
        (bounded: `_said`)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self._signal_groups(sig, signal.SIGINT if sig == signal.SIGTERM else sig)
            if await self._groups_gone(STOP_GRACE_S):
                break
        await self._said()

    # -- watching ------------------------------------------------------------------------------

    async def _poll_status(self) -> None:
        """The job's status every POLL_STATUS_S (`JobReader.poll`), for the progress line.
        While whether a worker that exited 0 is in the job is not known (its exit came before
        the scheduler answered, or before it forgot the worker while the job forms), each poll
        wakes the decision on it, answered or not, and so does the poll whose answer settles
        it."""
        async with scheduler_channel.open_channel(
            self.address, self.reader.identity, POLL_CHANNEL_OPTIONS
        ) as channel:
            while True:
                asked = self._clock()
                in_doubt = self._unseen_exit()  # this answer may settle it: decided on then
                with contextlib.suppress(ClusterError):
                    self.view = await self.reader.poll(channel)
                    self._view_asked = asked
                    self._note_members(self.view)
                    self._note_answer(self.view, asked)
                if in_doubt or self._unseen_exit():
                    self._wake.set()  # decided on again (`_asks`, `policy.joining_unknown`)
                self._progress()
                await asyncio.sleep(POLL_STATUS_S)

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

    async def run(self, lock: LogDirLock | None = None) -> int:
        """The job from start to end; its exit code. `lock`: the log directory's, which it
        checks while the job runs (`LogDirLock.watch`: a lock file removed or replaced)."""
        o = self.options
        o.log_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        stops = stop_signals()
        for signum in stops:
            loop.add_signal_handler(signum, self._on_signal, signum)
        poller: asyncio.Task[None] | None = None
        watcher = None if lock is None else asyncio.create_task(lock.watch(self._print))
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
            for task in (poller, watcher):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self._stop_all()
            await self._close_guard()
            for signum in stops:
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
            seen = await self._seen(ask=self._asks())
            self._note_finished(seen)
            decision = policy.decide(seen)
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
            elif decision.action is policy.Action.ASK:
                await self._ask_again(self.workers[decision.worker or 0])
            elif decision.action is policy.Action.FAIL:
                return await self._fail(decision.worker, decision.reason)
            elif decision.action is policy.Action.UNJOINED:
                return await self._unjoined()
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

    def _note_finished(self, seen: policy.Seen) -> None:
        """Each worker that failed after it finished its part of the job (the scheduler counts
        its node finished: a crash in its teardown), said once: it is not started again, and
        the job goes on without it; the exit code at the end says it (`_finish`)."""
        for worker in seen.workers:
            child = self.workers[worker.index]
            said = (worker.index, child.restarts)
            if worker.failed_after_finishing and said not in self._noted:
                self._noted.add(said)
                self._print(
                    f"mscluster: {self._who(child)} {policy.describe_exit(child.exit_code or 0)} "
                    "after it finished its part of the job: not restarted"
                )

    async def _ask_again(self, child: Child) -> None:
        """`child` failed while the scheduler of this launcher has not exited and does not
        answer yet (`policy.awaits_scheduler`: started again a moment ago, it does not listen
        yet): said once for this exit, then decided again after POLL_STATUS_S, or sooner when
        another process exits or a signal comes."""
        said = (child.planned.index or 0, child.restarts)
        if said not in self._awaiting:
            self._awaiting.add(said)
            self._print(
                f"mscluster: {self._who(child)} {policy.describe_exit(child.exit_code or 0)}; "
                "the scheduler has not exited but does not answer yet: deciding on it once it "
                f"does (within {self.scheduler_wait_s:g} s)"
            )
        await self._wait_or_stop(self._wake, POLL_STATUS_S)
        self._wake.set()

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
        else:  # one that had not joined the job says so: the job never formed with it
            how = policy.describe_exit(cause.exit_code or 0) + await self._not_joined(index)
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
        return self._job_failed()

    async def _not_joined(self, index: int) -> str:
        """What the report of worker `index`, which failed, adds when it had not joined the job
        (`policy.not_joined_note`). While a scheduler of ours runs and no answer says yet
        (`policy.awaits_joined`), the polls' answers are waited for, JOINED_REPORT_S at most."""
        deadline = self._clock() + JOINED_REPORT_S
        while True:
            seen = await self._seen(ask=False)
            worker = seen.workers[index]
            if not policy.awaits_joined(worker, seen) or self._clock() >= deadline:
                break
            await self._wait_or_stop(asyncio.Event(), POLL_STATUS_S)
            if self._stop_signal is not None:
                break
        return policy.not_joined_note(self._with_registered(worker))

    def _with_registered(self, worker: policy.WorkerSeen) -> policy.WorkerSeen:
        """`worker` with `registered` also from our scheduler's event log, once the scheduler
        answered (it wrote this job's start: the log's last job is this one): a worker that
        registered and left between two polls was never listed."""
        event_log = self._event_log()
        if worker.registered or self._latest is None or event_log is None:
            return worker
        node_id = self.workers[worker.index].planned.node_id
        return dataclasses.replace(worker, registered=node_id in joined_nodes(event_log))

    def _job_failed(self) -> int:
        """Say what is stopped with the job, and that it failed."""
        running = [c for c in [*self.workers, self.scheduler] if c is not None and c.running]
        if len(running) == 1:
            self._print("mscluster: stopping the other running process")
        elif running:
            self._print(f"mscluster: stopping the {len(running)} other running processes")
        self._print("mscluster: job failed")
        return EXIT_FAILED

    async def _unjoined(self) -> int:
        """Workers exited 0 without joining the job (`policy.unjoined`): it cannot form, and
        its scheduler would wait for them until MS_TOPO_TIMEOUT. Once the exits that come
        together have arrived, they are named in one line with what to do (one for those that
        never registered, one for those that left before the job formed), and the job ends."""
        await self._settle()
        seen = await self._seen(ask=True)
        left = policy.unjoined(seen.workers) or [
            w for w in seen.workers if w.exit_code == 0 and w.joined is not True and not w.spare
        ]
        left = [self._with_registered(w) for w in left]
        for registered in (False, True):  # those that never registered, then those that left
            exits = [
                (self._who(child), child.exit_code or 0, str(child.planned.log))
                for child in (self.workers[w.index] for w in left if w.registered is registered)
            ]
            if exits:
                self._print(f"mscluster: {policy.unjoined_line(exits, left=registered)}")
        return self._job_failed()

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
        # The others exited after they finished their part (`_note_finished`): not 0.
        crashed = [w for w in ranked if w.exit_code != 0]
        if crashed:
            said = "; ".join(
                f"{self._who(w)} {policy.describe_exit(w.exit_code or 0)}" for w in crashed
            )
            self._print(f"mscluster: exiting 1: {said} after it finished its part of the job")
            return EXIT_FAILED
        return EXIT_OK


def run(options: LaunchOptions, out: IO[str] = sys.stderr, *, dry_run: bool = False) -> int:
    """Validate, launch, and return the exit code (2 for a usage error). With `dry_run`, print
    what would start to stdout instead, and start nothing. A relay's socket goes in a directory
    of this user's only, made here and removed at the end. A stop signal that comes before the
    launcher watches its children (a Slurm step's secret still awaited) ends it the same way:
    its files removed, one line, 128 + the signal. SIGHUP ignored at the start (`nohup`) stays
    ignored throughout (`stop_signals`)."""
    setup.validate(options)
    previous = {signum: signal.signal(signum, _interrupt) for signum in stop_signals()}
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


def stop_signals() -> tuple[signal.Signals, ...]:
    """The STOP_SIGNALS this launcher acts on: all of them, but SIGHUP only where it is not
    ignored now. `nohup mscluster run ... &` starts it with SIGHUP ignored, so that the job
    outlives the terminal; it is left so (and `run` decides this before it handles any)."""
    hup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    return tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and hup_ignored))


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
    identity = setup.launcher_identity(options)  # a dry run checks it as a real run loads it
    made_here = setup.closes_the_job(options, plan, out)
    if made_here:
        options = dataclasses.replace(options, job_secret_file=options.log_dir / JOB_SECRET_FILE)
        plan = setup.plan_job(options)
    if dry_run:
        setup.check_paths(options, plan)
        setup.say(sys.stdout, render(plan, options, os.environ) + "\n")
        return EXIT_OK
    setup.check_ports_free(options, plan)
    keep = options.enable_recovery  # the secret a run of this job made before is kept

    def write_secret() -> None:
        if sharing is not None:
            slurm_io.share_secret(sharing, options.log_dir, keep=keep)
        if made_here:
            _write_secret(options.log_dir, keep=keep)

    # --log-dir is this launcher's from here, its job secret in it.
    lock = setup.make_paths(options, plan, out, write_secret)
    try:
        return asyncio.run(Launcher(options, plan, identity, out).run(lock))
    finally:
        lock.release()
        if sharing is not None:
            slurm_io.remove_shared_secret(sharing)


def _write_secret(log_dir: Path, *, keep: bool) -> None:
    try:
        write_job_secret(log_dir, keep=keep)
    except ConfigError as exc:
        raise ConfigError(f"--log-dir: {exc}") from None


def _accepts(path: Path) -> bool:
    """Whether something takes connections on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True
