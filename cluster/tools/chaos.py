"""Fault injection over a whole training run: what `mscluster chaos` does to the job
(`cluster.tools.chaos_run` is the command around it).

`Chaos` runs a job as a `cluster.testing.LocalJob` (recovery on), injects faults at random
moments (reproducible from the seed), restarts what it killed, waits for the job to recover
before the next fault, and reports each fault: when it was injected, how long the scheduler took
to see it, how long the job took to get back to normal, and how many steps had to be computed
again (from the workers' "rolled back from step F to step S" lines, which `TrainingLoop` prints).

Faults:
    kill       SIGKILL a random worker, start it again at once (it rejoins after the guard)
    stop       SIGSTOP a random worker for 0.3-2x MS_NODE_TIMEOUT, then SIGCONT: a short stop is
               tolerated, a long one is a failure the same process recovers from
    scheduler  SIGKILL the scheduler, start it again at once; with standby schedulers, SIGKILL the
               leader (found through Status), wait for the job to be back on the standby that
               takes over, then start the killed one again (it stands by)
    partition  (root) cut a random worker's network link for 0.3-2x MS_NODE_TIMEOUT, then heal
               it: every worker runs in its own network namespace (`cluster.testing.NetworkLab`)
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cluster.protocol.errors import ClusterError, JobTimeoutError
from cluster.protocol.events import Kind
from cluster.protocol.records import Phase
from cluster.tools import launch_policy as policy
from cluster.tools.chaos_record import StepSampler
from cluster.tools.launch_reading import joined_nodes
from cluster.tools.testing import LocalJob, wait_until

FAULTS = ("kill", "stop", "scheduler", "partition")
ROLLED_BACK = re.compile(r"rolled back from step (\d+) to step (\d+)")
# After a stop or partition, the share of MS_NODE_TIMEOUT beyond it (from the stop) that
# `_settle` watches for a failure before it calls the fault tolerated: a worker's silence
# check that fires then takes effect (a rejoin) within it.
QUIET_MARGIN = 0.25
QUIET_MARGIN_MIN_S = 0.5
# A fault's note when the job failed after it instead of coming back.
FAILED_AFTER = "the job failed after it"
# Once a worker exited without joining the job, how long the others get to exit too (named in
# the same line), as `mscluster run` lets the exits a first one causes arrive.
UNJOINED_SETTLE_S = 0.3
# How long the job gets to end after the last fault.
FINISH_TIMEOUT_S = 600.0


@dataclass
class Fault:
    kind: str
    target: str
    injected_at_s: float  # since the job formed
    detected_after_s: float | None = None  # by the scheduler; None: not a failure (tolerated)
    recovered_after_s: float | None = None  # back to every worker alive and connected
    steps_lost: int | None = None  # steps computed again; None: no rollback seen
    note: str = ""
    took_over: str = ""  # a scheduler fault with standbys: the scheduler that leads after it
    # The job failed after this fault instead of coming back (recovered_after_s is None).
    job_failed: bool = False

    def failed_the_job(self) -> None:
        """The job failed after this fault, before it came back."""
        self.job_failed = True
        self.recovered_after_s = None
        self.note = f"{self.note}; the job failed after it" if self.note else FAILED_AFTER


@dataclass
class ChaosReport:
    seed: int
    faults: list[Fault] = field(default_factory=list)
    exit_code: int | None = None
    duration_s: float = 0.0
    detail: str = ""
    # For the picture (chaos-report.html): the job's size, when it formed (wall clock), the
    # scheduler's events and each rank's newest checkpoint over time ([t, rank, step]), with t
    # in seconds since it formed.
    workers: int = 0
    started_at: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[list[float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["ok"] = self.ok
        return json.dumps(data, indent=2)

    def render(self) -> str:
        lines = [f"chaos report (seed {self.seed}): {len(self.faults)} faults"]
        header = f"{'#':>3}  {'at':>7}  {'fault':<9}  {'target':<9}  {'detected':>9}  "
        header += f"{'recovered':>9}  {'steps lost':>10}  note"
        lines.append(header)
        for n, fault in enumerate(self.faults, 1):
            lines.append(
                f"{n:>3}  {fault.injected_at_s:>6.1f}s  {fault.kind:<9}  {fault.target:<9}  "
                f"{_seconds(fault.detected_after_s):>9}  {_seconds(fault.recovered_after_s):>9}  "
                f"{'-' if fault.steps_lost is None else fault.steps_lost:>10}  {fault.note}"
            )
        resumes = [e for e in self.events if e.get("event") == Kind.MEMORY_RESUME.value]
        if resumes:
            steps = ", ".join(f"generation {e['generation']} at step {e['step']}" for e in resumes)
            lines.append(f"resumed from memory (not from disk): {steps}")
        fatal = next((n for n, f in enumerate(self.faults, 1) if f.job_failed), None)
        after = "" if fatal is None else f" after fault #{fatal}"
        verdict = "finished correctly" if self.ok else f"FAILED{after} ({self.detail})"
        lines.append(f"the job {verdict}, exit code {self.exit_code}, {self.duration_s:.1f} s")
        return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def check_injection(
    faults: Sequence[str], every_s: float, duration_s: float, count: int | None = None
) -> None:
    """A ClusterError naming the option when the faults or their pace cannot be used: a finite
    --every > 0, a finite --duration >= 0, a --count >= 1 (NaN compares false with anything,
    so each bound is written as what must hold)."""
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown or not faults:
        raise ClusterError(
            f"--faults {','.join(faults)}: {', '.join(unknown) or 'none given'}; choose "
            f"from {','.join(FAULTS)}"
        )
    if not (math.isfinite(every_s) and every_s > 0):
        raise ClusterError(f"--every {every_s:g}: --every must be > 0 (finite seconds)")
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ClusterError(f"--duration {duration_s:g}: --duration must be >= 0 (finite seconds)")
    if count is not None and count < 1:
        raise ClusterError(f"--count {count}: --count must be >= 1 (leave it out: no limit)")


class Chaos:
    def __init__(
        self,
        job: LocalJob,
        *,
        faults: Sequence[str] = FAULTS,
        every_s: float = 5.0,
        duration_s: float = 60.0,
        seed: int = 0,
        count: int | None = None,
        out: IO[str] = sys.stderr,
    ) -> None:
        """`count`: stop injecting after this many faults (None: until `duration_s`)."""
        check_injection(faults, every_s, duration_s, count)
        self.job = job
        self.faults = list(faults)
        self.every_s = every_s
        self.duration_s = duration_s
        self.count = count
        self.rng = random.Random(seed)
        self._bag: list[str] = []
        self._after_the_end: set[int] = set()  # workers killed after they had finished
        self.report = ChaosReport(seed=seed, workers=job.worker_num)
        self._out = out

    def run(self) -> ChaosReport:
        started = time.monotonic()
        sampler: StepSampler | None = None
        try:
            self.job.start()
            if self._formed():
                self.report.started_at = time.time()
                sampler = StepSampler(self.job, self.report.started_at).start()
                self._inject_faults(time.monotonic())
                self.report.exit_code = self._wait_for_the_end()
            else:
                self._ended_unformed()
            if self.report.exit_code != 0 and not self.report.detail:
                self.report.detail = self._first_failure()
        except (ClusterError, OSError) as exc:
            self.report.detail = str(exc)
        finally:
            self.report.duration_s = time.monotonic() - started
            if sampler is not None:
                self.report.steps = sampler.stop()
        return self.report

    def _formed(self) -> bool:
        """Wait for the job to form: True once it has, False when it ended first (a worker or
        every scheduler exited; their exit codes then say how it went)."""
        try:
            self.job.wait_formed()
        except JobTimeoutError:
            if self.job.ended(every_worker=True) is None:
                raise  # the bound passed with the job running
            return False
        return True

    def _ended_unformed(self) -> None:
        """The job ended before it formed: failed, naming the workers that exited 0 without
        joining it, when some did; else as its processes ended. A scheduler that exits before
        any worker did (it runs the script too, which may never serve) leaves the workers' exits
        to come: once every process ended 0, they are all known, and looked at again."""
        detail = self._unjoined()
        code = 1 if detail else self._ended_code()
        if code == 0:
            detail = self._unjoined()
            code = 1 if detail else 0
        self.report.detail, self.report.exit_code = detail, code

    def _unjoined(self) -> str:
        """Once the job ended before it formed: the line naming the workers that exited 0
        without joining it (`launch_policy.unjoined`, in `mscluster run`'s words), '' when none
        did or it is not known. The exits that come together (a script that never calls
        `cluster.init()` ends in every worker) are let in for UNJOINED_SETTLE_S first."""
        left = policy.unjoined(self._exits())
        settle_until = time.monotonic() + UNJOINED_SETTLE_S
        while left and time.monotonic() < settle_until and any(self._running()):
            time.sleep(0.05)
            left = policy.unjoined(self._exits())
        if not left:
            return ""
        return policy.unjoined_line(
            [(f"worker {w.index} (node id '{w.index}')", 0, self._log(w.index)) for w in left]
        )

    def _running(self) -> list[bool]:
        return [w.running for w in self.job.workers if w is not None]

    def _exits(self) -> list[policy.WorkerSeen]:
        """Each worker's exit and whether it joined the job (`_listed`)."""
        listed = self._listed()
        return [
            policy.WorkerSeen(
                i,
                None if w.running else w.popen.returncode,
                joined=None if listed is None else str(i) in listed,
            )
            for i, w in enumerate(self.job.workers)
            if w is not None
        ]

    def _listed(self) -> set[str] | None:
        """The node ids that joined the job: those the scheduler's answer lists, or, once every
        scheduler exited, those its event log names (None: it has none). A scheduler that runs
        and does not answer yet (starting, or ending) is waited for, bounded."""
        found: list[set[str] | None] = []
        event_log = self.job.env.get("CLUSTER_EVENT_LOG")

        def known() -> bool:
            view = self.job.status()
            if view is not None:
                found.append({n.node_id for n in view.nodes})
            elif not any(s.running for s in self.job.schedulers if s is not None):
                found.append(joined_nodes(Path(event_log)) if event_log else None)
            return bool(found)

        wait_until(known, self.job.timeout_s, "the scheduler's answer, or its exit")
        return found[0]

    def _log(self, i: int) -> str:
        return str(self.job.workdir / f"worker_{i}.log")

    def _ended_code(self) -> int:
        """The exit code of a job that ended before it formed: the first code other than 0 of
        a process that exited (the others are then killed, as `mscluster run` does), else every
        process's end."""
        gone = self.job.ended(every_worker=True)
        code = None if gone is None else gone.popen.returncode
        return code if code else self._wait_for_the_end()

    def _inject_faults(self, formed: float) -> None:
        """Faults one after the other until the count, the duration or the job's end."""
        while self.count is None or len(self.report.faults) < self.count:
            pause = self.rng.uniform(0.5, 1.5) * self.every_s
            if time.monotonic() + pause - formed > self.duration_s:
                break
            if not self._sleep_while_running(pause):
                break  # the job is ending: no more faults
            if self._winding_down():
                break  # a rank already finished: a fault now would hit a job that ended
            fault = self._inject(self._next_kind(), time.monotonic() - formed)
            self.report.faults.append(fault)
            self._say(self._describe(fault))
            if self._after_the_end:
                break

    # -- faults --------------------------------------------------------------------------------

    def _next_kind(self) -> str:
        """Kinds drawn from a shuffled bag: every kind comes once before any comes again, so
        a short run still sees all of them."""
        if not self._bag:
            self._bag = list(self.faults)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def _inject(self, kind: str, at_s: float) -> Fault:
        if kind == "scheduler":
            return self._scheduler(at_s)
        target = self.rng.randrange(self.job.worker_num)
        rolled = self._rollbacks()
        kill = kind == "kill"
        fault = self._kill(target, at_s) if kill else self._interrupt(kind, target, at_s)
        fault.steps_lost = self._steps_lost(rolled)
        return fault

    def _kill(self, i: int, at_s: float) -> Fault:
        fault = Fault("kill", f"worker {i}", at_s)
        generation = self._generation()
        detected = self._kill_and_watch(i)
        if detected is None:
            # It had finished an instant before: the job is over, nothing to recover.
            self._after_the_end.add(i)
            fault.note = "after it finished: not a fault of the job"
            return fault
        fault.detected_after_s = detected
        self.job.restart_worker(i, wait=False)
        back = self._back_after(generation)
        if back is None:
            fault.failed_the_job()
        else:
            fault.recovered_after_s = detected + back
        return fault

    def _kill_and_watch(self, i: int) -> float | None:
        """SIGKILL worker i; the seconds until the scheduler marks it failed, or None when the
        job turns out to be over (the worker had finished, or the scheduler has ended)."""
        proc = self.job.worker(i)
        proc.signal(signal.SIGKILL)
        sent = time.monotonic()
        proc.popen.wait(self.job.timeout_s)
        seen: list[str] = []

        def settled() -> bool:
            scheduler = self.job.scheduler
            view = self.job.status()
            node = None if view is None else self.job.node(view, i)
            state = "" if node is None else str(node.state)
            if state == "failed":
                seen.append(state)
                return True
            over = view is not None and view.phase in (Phase.FINISHED, Phase.FAILED)
            return state == "finished" or over or (scheduler is not None and not scheduler.running)

        wait_until(settled, self.job.timeout_s, f"worker {i} marked failed")
        return time.monotonic() - sent if seen else None

    def _interrupt(self, kind: str, i: int, at_s: float) -> Fault:
        """A stop (SIGSTOP) or a partition (link down) of worker i for 0.3-2x MS_NODE_TIMEOUT."""
        hold = self.rng.uniform(0.3, 2.0) * self.job.node_timeout_s
        return self._interrupt_for(kind, i, at_s, hold)

    def _interrupt_for(self, kind: str, i: int, at_s: float, hold: float) -> Fault:
        """A stop or a partition of worker i for `hold` seconds, then its end. Whether the
        scheduler took it for a failure is settled after the end (`_settle`): a stop a little
        shorter than MS_NODE_TIMEOUT can be seen just after SIGCONT, or between two looks."""
        what = "stopped" if kind == "stop" else "cut off"
        fault = Fault(kind, f"worker {i}", at_s, note=f"{what} {hold:.1f} s")
        generation = self._generation()
        if kind == "stop":
            self.job.stop_worker(i)
        else:
            self.job.partition(i)
        stopped = time.monotonic()
        detected: float | None = None
        while time.monotonic() - stopped < hold:
            if detected is None and self._failed(i):
                detected = time.monotonic() - stopped
            time.sleep(0.05)
        if kind == "stop":
            self.job.continue_worker(i)
        else:
            self.job.heal(i)
        if detected is None:
            detected = self._settle(i, generation, stopped)
        fault.detected_after_s = detected
        if fault.detected_after_s is None:
            fault.note += f" (tolerated: MS_NODE_TIMEOUT={self.job.node_timeout_s:g} s)"
            fault.recovered_after_s = 0.0
            return fault
        if self._back_after(generation) is None:
            fault.failed_the_job()
        else:
            fault.recovered_after_s = time.monotonic() - stopped
        return fault

    def _settle(self, i: int, generation: int, stopped: float) -> float | None:
        """Once worker i runs (or is reachable) again: the seconds from `stopped` until the
        job took the fault for a failure, or None when it did not (tolerated). A failure is
        the scheduler marking worker i failed, or a newer generation (the worker itself, its
        scheduler silent for as long as it was stopped, may reconnect and rejoin at once), or
        the job failing; the job finishing in the same generation is not. Tolerated is only
        said once worker i was heard after it resumed (the scheduler's silence check then has
        nothing left to find) and, without a failure, MS_NODE_TIMEOUT and a margin have passed
        since `stopped`: the worker's check of its scheduler's silence, due at the latest a
        guard after its last word before the stop, has then run (a check overdue at the
        resume is taken for the worker's own stall)."""
        resumed = time.monotonic()
        timeout = self.job.node_timeout_s
        quiet_until = stopped + timeout + max(QUIET_MARGIN * timeout, QUIET_MARGIN_MIN_S)
        heard: list[bool] = []
        found: list[float | None] = []

        def settled() -> bool:
            asked = time.monotonic()
            view = self.job.status()
            if view is None:  # over once its scheduler exited: 0 when it finished well
                scheduler = self.job.scheduler
                if scheduler is not None and not scheduler.running:
                    found.append(asked - stopped if scheduler.popen.returncode else None)
                return bool(found)
            node = self.job.node(view, i)
            state = "" if node is None else str(node.state)
            if state == "failed" or view.generation > generation or view.phase is Phase.FAILED:
                found.append(asked - stopped)
                return True
            if view.phase is Phase.FINISHED:
                found.append(None)  # finished with it, in the same generation
                return True
            if state == "alive" and node.seconds_since_heartbeat < asked - resumed:
                heard.append(True)  # a heartbeat sent after it resumed
            if heard and asked >= quiet_until:
                found.append(None)
            return bool(found)

        wait_until(settled, self.job.timeout_s, f"worker {i} heard again, or failed")
        return found[0]

    def _scheduler(self, at_s: float) -> Fault:
        if self.job.standby_num:
            return self._failover(at_s)
        fault = Fault("scheduler", "scheduler", at_s, detected_after_s=0.0)
        self.job.kill_scheduler()
        fault.recovered_after_s = self.job.restart_scheduler()
        return fault

    def _failover(self, at_s: float) -> Fault:
        """SIGKILL the leader; `detected`: until another scheduler leads, `recovered`: until
        every worker is back on it. Then the killed one is started again, as a standby."""
        job = self.job
        killed = job.leader()
        gone = job.addresses[killed]
        fault = Fault("scheduler", f"leader {gone}", at_s)
        job.kill_scheduler(killed)
        sent = time.monotonic()
        job.wait_status(lambda view: job.leader_index != killed, f"a leader other than {gone}")
        fault.detected_after_s = time.monotonic() - sent
        new, _ = job.wait_new_leader(killed)
        fault.recovered_after_s = time.monotonic() - sent
        fault.took_over = job.addresses[new]
        job.restart_scheduler(killed, wait=False)
        job.wait_status(
            lambda view: view.leadership is not None and gone in view.leadership.schedulers,
            f"{gone} back as a standby",
        )
        fault.note = f"{fault.took_over} took over, {gone} back as a standby"
        return fault

    # -- observations --------------------------------------------------------------------------

    def _generation(self) -> int:
        """The job's generation now, waited for while its scheduler runs but does not answer
        (busy, or starved on a loaded machine: read as 0, every later answer was taken for a
        newer generation, and the fault for a failure); 0 once no scheduler runs."""
        found: list[int] = []

        def answered() -> bool:
            view = self.job.status()
            if view is not None:
                found.append(int(view.generation))
            elif self.job.scheduler is None or not self.job.scheduler.running:
                found.append(0)
            return bool(found)

        wait_until(answered, self.job.timeout_s, "the scheduler's status")
        return found[0]

    def _failed(self, i: int) -> bool:
        view = self.job.status()
        node = None if view is None else self.job.node(view, i)
        return node is not None and node.state == "failed"

    def _back_after(self, generation: int) -> float | None:
        """Seconds until the job is back: at a newer generation with every worker alive, or
        finished (a fault near the end is recovered from in a generation whose ranks finish at
        once, and then the scheduler ends). None when the job failed instead: its phase is
        FAILED, or its scheduler exited other than 0."""
        started = time.monotonic()
        came_back: list[bool] = []

        def settled() -> bool:
            view = self.job.status()
            if view is None:
                scheduler = self.job.scheduler
                if scheduler is None or scheduler.running:
                    return False
                came_back.append(scheduler.popen.returncode == 0)
            elif view.phase is Phase.FAILED or view.phase is Phase.FINISHED:
                came_back.append(view.phase is Phase.FINISHED)
            elif view.generation > generation and (
                self.job.everyone_back(view) or any(n.state == "finished" for n in view.nodes)
            ):
                came_back.append(True)
            return bool(came_back)

        wait_until(settled, self.job.timeout_s, "the job back in a new generation")
        return time.monotonic() - started if came_back[0] else None

    def _rollbacks(self) -> list[int]:
        """How many rollback lines each worker's log holds so far."""
        return [len(ROLLED_BACK.findall(self.job.log(i))) for i in range(self.job.worker_num)]

    def _steps_lost(self, before: list[int]) -> int | None:
        """The most steps any worker had to compute again after this fault."""
        deadline = time.monotonic() + 5.0
        lost: list[int] = []
        while time.monotonic() < deadline and not lost:
            for i, seen in enumerate(before):
                for furthest, step in ROLLED_BACK.findall(self.job.log(i))[seen:]:
                    lost.append(int(furthest) - int(step))
            if not lost:
                time.sleep(0.05)
        return max(lost) if lost else None

    def _winding_down(self) -> bool:
        """True once the job is ending: a worker exited, a rank called Finish, or the job is
        over. A fault injected then would wait for a recovery that a finished job never makes."""
        if any(w is not None and not w.running for w in self.job.workers):
            return True
        view = self.job.status()
        if view is None:
            return False  # not known (the scheduler restarting): the fault's own waits decide
        if view.phase in (Phase.FINISHED, Phase.FAILED):
            return True
        return any(n.state == "finished" for n in view.nodes)

    def _sleep_while_running(self, seconds: float) -> bool:
        """Wait `seconds`; False as soon as a worker has exited (the job is ending)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if any(w is not None and not w.running for w in self.job.workers):
                return False
            time.sleep(0.05)
        return True

    def _wait_for_the_end(self) -> int:
        """Every process's end; 0 when all exited 0, else the first other code. A worker this
        run killed after it had finished does not count."""
        self.job.wait(FINISH_TIMEOUT_S)
        procs = [*self.job.schedulers] + [
            w for i, w in enumerate(self.job.workers) if i not in self._after_the_end
        ]
        codes = [p.popen.returncode for p in procs if p is not None]
        return next((code for code in codes if code != 0), 0)

    def _first_failure(self) -> str:
        for proc in [*self.job.schedulers, *self.job.workers]:
            if proc is not None and proc.popen.returncode not in (0, None):
                return proc.exit_line()
        return "a process did not exit 0"

    def _describe(self, fault: Fault) -> str:
        return (
            f"mscluster chaos: {fault.kind} {fault.target} at {fault.injected_at_s:.1f} s: "
            f"detected after {_seconds(fault.detected_after_s)}, recovered after "
            f"{_seconds(fault.recovered_after_s)}"
            + (f", {fault.steps_lost} steps lost" if fault.steps_lost is not None else "")
            + (f" ({fault.note})" if fault.note else "")
        )

    def _say(self, line: str) -> None:
        print(line, file=self._out, flush=True)
