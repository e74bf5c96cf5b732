"""What `mscluster run` does next, decided from what it has seen.

Pure: no processes, no sockets, no clock. The launcher (`cluster.tools.launch`) gathers what it
observed into a `Seen` (its children's exit codes, the scheduler's last answer, a fresh answer
when a worker has just failed) and carries out the `Decision` this module returns. Keeping the
rules here means each of them is a unit test: when a failed worker is started again and why not,
which process caused a failure, when the job is over.
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.protocol.display import ERROR_LINE_CHARS
from cluster.protocol.records import Phase


class Action(enum.Enum):
    WAIT = "wait"  # nothing to do until something else happens
    STOP = "stop"  # a signal asked the launcher to stop the job
    RESTART = "restart"  # start `worker` again
    RESTART_SCHEDULER = "restart-scheduler"  # start this launcher's scheduler again
    ASK = "ask"  # `worker` failed: ask the scheduler again shortly, its answer decides on it
    FAIL = "fail"  # the job has failed: stop everything, report `worker` (None: the scheduler)
    FINISH = "finish"  # every local worker finished: wait for the scheduler, report
    # `worker` (and maybe others: `unjoined`) exited 0 without joining the job: it cannot form
    UNJOINED = "unjoined"


@dataclass(frozen=True)
class WorkerSeen:
    index: int
    exit_code: int | None  # None while it runs
    restarts: int = 0
    # Holds no rank now: a spare, or a worker whose rank a spare took (the scheduler says so;
    # before it answers, how it was started). Its exit never fails the job.
    spare: bool = False
    # When it exited, on the launcher's clock (None while it runs): the first failure is the
    # earliest exit, whatever the workers' order.
    exited_at: float | None = None
    # The scheduler counts its node finished (it called finalize(): its part of the job is
    # done). A failed exit after that (a crash in its teardown) is neither started again (a node
    # id finishes once: a new process would be refused) nor a failure of the job.
    finished: bool = False
    # Whether its node is in the job, by the scheduler's answers: True once one listed it (or
    # counted it finished); False when an answer asked after its exit does not list it (it
    # never registered, or left before the job formed); None: not known (no such answer).
    # `joined_by_answers` decides it.
    joined: bool | None = None
    # An answer listed its node once: it registered. With `joined` False, it left the job
    # before the job formed (the scheduler forgets a node whose connection closes then).
    registered: bool = False

    @property
    def failed(self) -> bool:
        return self.exit_code is not None and self.exit_code != 0

    @property
    def failed_after_finishing(self) -> bool:
        return self.finished and self.failed

    @property
    def done(self) -> bool:
        """Its part of the job is over: it exited 0, or exited after it finished."""
        return self.exit_code == 0 or self.failed_after_finishing


@dataclass(frozen=True)
class JobSeen:
    """What the scheduler said about the job (see `cluster.tools.status.JobView`)."""

    phase: Phase
    recovery: bool
    detail: str = ""


@dataclass(frozen=True)
class Seen:
    workers: tuple[WorkerSeen, ...]
    max_restarts: int = 0
    # This launcher started the scheduler; its exit code (None while it runs).
    own_scheduler: bool = False
    scheduler_exit: int | None = None
    # How often this launcher has started its scheduler again (counted apart from the workers').
    scheduler_restarts: int = 0
    # This launcher started the job with recovery on (--enable-recovery).
    recovery: bool = False
    # The job has standby schedulers (--master-addr h1,h2): one that exits hands the job to
    # another, and `now` is the leader's answer, whichever leads.
    standbys: bool = False
    stop_signal: int | None = None
    # The job's end was seen: in the scheduler's last answer, or in the event log it writes
    # before it exits. A scheduler of ours that exits 0 without it (recovery on, no standby)
    # left the job to resume (SIGTERM), saved: it is started again as one that died.
    ended: bool = False
    # The scheduler's last answer before this decision (None: it never answered).
    last: JobSeen | None = None
    # An answer asked for this decision, when a worker has failed; None: no answer, and then
    # `unreachable` (no scheduler answered: it is gone, unless it is ours and running) or
    # `unread` (one answered and refused to show the job, its words: it is up) says why.
    now: JobSeen | None = None
    unreachable: str = ""
    unread: str = ""
    # While this launcher's scheduler runs: for how long it has not answered, from its last
    # start or its last answer, whichever came later (None: not ours, or not running), and how
    # long it may take (`scheduler_start_s`: the job's wait for its scheduler). Within that, one
    # that none reaches is starting (just started again) or busy, not gone (`awaits_scheduler`).
    scheduler_silent_s: float | None = None
    scheduler_start_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    action: Action
    worker: int | None = None
    # FAIL: why the failed worker was not started again ("" when restarts were not asked for).
    reason: str = ""


def decide(seen: Seen) -> Decision:
    """The next step. A signal wins; then a scheduler of ours that died and may be started
    again; then a failed worker (restart it, ask again while the answer that decides on it is
    still to come from a scheduler of ours that has not exited, or fail the job; a failed
    process holding no rank is restarted when it may be, and otherwise left alone: the job does
    not need it, and so is one that failed after it finished its part); then a worker that
    exited 0 without joining the job (`unjoined`: the job cannot form without it, and its
    scheduler would wait for it until MS_TOPO_TIMEOUT); then the end of the job, once whether
    each worker joined it is known (`joining_unknown`)
    (every ranked worker done: exited 0, or exited after it finished; the spares are told by
    the scheduler, and the launcher stops those that could not hear it); then a failed
    scheduler."""
    if seen.stop_signal is not None:
        return Decision(Action.STOP)
    scheduler_died = seen.own_scheduler and (
        seen.scheduler_exit not in (None, 0) or left_to_resume(seen)
    )
    why_not_scheduler = why_not_restart_scheduler(seen) if scheduler_died else None
    if scheduler_died and why_not_scheduler is None:
        return Decision(Action.RESTART_SCHEDULER)
    exited = _failed_worker(seen) or _unjoined_worker(seen)
    if exited is not None:
        return exited
    ranked = [w for w in seen.workers if not w.spare]
    if ranked and all(w.done for w in ranked) and not joining_unknown(seen):
        return Decision(Action.FINISH)
    if scheduler_died:
        return Decision(Action.FAIL, None, why_not_scheduler or "")
    return Decision(Action.WAIT)


def _failed_worker(seen: Seen) -> Decision | None:
    """The failed worker that exited first: started again, decided once the scheduler answers
    (`awaits_scheduler`), or the job fails with it; None: none failed (one that failed after
    it finished its part is left as it is)."""
    failed = (w for w in seen.workers if w.failed and not w.finished)
    for worker in sorted(failed, key=_exit_order):
        why_not = why_not_restart(worker, seen)
        if why_not is None:
            return Decision(Action.RESTART, worker.index)
        if worker.restarts < seen.max_restarts and awaits_scheduler(seen):
            return Decision(Action.ASK, worker.index, why_not)
        if not worker.spare:
            return Decision(Action.FAIL, worker.index, why_not)
    return None


def _unjoined_worker(seen: Seen) -> Decision | None:
    """The first of the workers that exited 0 without joining the job (`unjoined`), or None."""
    left = unjoined(seen.workers)
    return Decision(Action.UNJOINED, min(left, key=_exit_order).index) if left else None


def joined_by_answers(
    listed: bool, last: Phase | None, after_exit: tuple[Phase, bool] | None
) -> bool | None:
    """`WorkerSeen.joined` of a worker that exited, from the scheduler's answers: `listed`,
    whether one ever listed its node; `last`, the phase of the freshest answer (None: none
    came); `after_exit`, the phase of the freshest answer asked after its exit and whether it
    lists the node (None: none came since).

    An answer asked after the exit that does not list the node says it is not in the job: it
    never registered, or it left while the job formed (the scheduler forgets such a node, so
    that the job can take another process in its place; a spare never takes it, and recovery
    takes nodes back only once the job formed). One that lists it while the job still forms
    says nothing yet: the scheduler has not seen its connection close, and will forget it (a
    worker that exited 0 cannot have finished a job that has not formed). Listed in a job
    that formed: it joined."""
    if after_exit is not None:
        phase, lists = after_exit
        if not lists:
            return False
        return None if phase is Phase.WAITING else True
    if not listed or last in (None, Phase.WAITING):
        return None
    return True


def unjoined(workers: Sequence[WorkerSeen]) -> list[WorkerSeen]:
    """The ranked workers that exited 0 without joining the job (`WorkerSeen.joined` False),
    in their order: a script that never called `cluster.init()`, or called it under another
    environment, or one that registered and ended before the job formed (`registered`). The
    job cannot form without them: nothing takes their place (`joined_by_answers`), and an exit
    0 is not started again (restarts are for failures; the script would end the same way). A
    failed exit is `_failed_worker`'s (its own error says more), and a spare's is no loss to
    the job."""
    found = (w for w in workers if w.exit_code == 0 and w.joined is False and not w.spare)
    return sorted(found, key=lambda w: w.index)


# How long a scheduler of ours that runs may stay silent while whether a worker that exited 0
# joined the job is not known (`joining_unknown`): as long as it gets to exit once the job ended.
JOINING_ANSWER_S = 30.0


def joining_unknown(seen: Seen) -> bool:
    """Whether the end of the job waits for an answer: a ranked worker exited 0 and no answer
    since says whether it joined the job (its exit came before the scheduler listened), while
    the scheduler is this launcher's, runs, and has been silent for less than JOINING_ANSWER_S
    (its answer, or its exit, decides: a job that finished ends as before)."""
    silent = seen.scheduler_silent_s
    return (
        any(w.exit_code == 0 and w.joined is None and not w.spare for w in seen.workers)
        and seen.own_scheduler
        and seen.scheduler_exit is None
        and silent is not None
        and silent < JOINING_ANSWER_S
    )


# What a worker that exited without joining the job most likely did, and what to do about it.
UNJOINED_REMEDY = (
    "the script must call cluster.init() (it ended without calling it, or called it under "
    "another environment than the MS_* variables it was started with)"
)
# The same for a worker that registered and exited before the job formed (`registered`).
LEFT_REMEDY = (
    "the script must wait for cluster.init() to return and call cluster.finalize() before it "
    "ends (it ended while init() waited for the other workers: os._exit(), or init() in a "
    "thread it did not wait for)"
)


def unjoined_line(exits: Sequence[tuple[str, int, str]], *, left: bool = False) -> str:
    """One line for the workers that exited without joining the job (`unjoined`), each of
    `exits` (who, exit code, log): 'worker 1 (node id '1') exited with code 0 without joining
    the job: the script must call cluster.init() (...); see logs/worker_1.log'. `left`: they
    had registered, and left the job before it formed ('... exited with code 0 after it
    registered, leaving the job before it formed: the script must wait for ...'). `mscluster
    run` and `mscluster chaos` both say it."""
    codes = {code for _, code, _ in exits}
    if len(codes) == 1:  # 'worker 0 (...) and worker 1 (...) exited with code 0'
        said = [_and([who for who, _, _ in exits]) + " " + describe_exit(codes.pop())]
    else:
        said = [f"{who} {describe_exit(code)}" for who, code, _ in exits]
    logs = ", ".join(log for _, _, log in exits)
    if left:
        why = f"after {'it' if len(exits) == 1 else 'they'} registered, leaving the job before "
        return f"{_and(said)} {why}it formed: {LEFT_REMEDY}; see {logs}"
    return f"{_and(said)} without joining the job: {UNJOINED_REMEDY}; see {logs}"


def awaits_joined(worker: WorkerSeen, seen: Seen) -> bool:
    """Whether the failure report of `worker` waits for an answer that says whether it had
    joined the job (`not_joined_note`): none says yet, and the scheduler is this launcher's
    and runs (starting, it does not answer yet; forming, it has not yet forgotten a worker
    that left). The launcher bounds the wait (`launch.JOINED_REPORT_S`)."""
    return worker.joined is None and seen.own_scheduler and seen.scheduler_exit is None


def not_joined_note(worker: WorkerSeen) -> str:
    """What a failed worker's report adds when it had not joined the job (`joined` False: an
    answer asked after its exit does not list it): ' before it joined the job', or ' after it
    registered, before the job formed'; '' otherwise (it joined, or it is not known)."""
    if worker.joined is not False:
        return ""
    return (
        " after it registered, before the job formed"
        if worker.registered
        else (" before it joined the job")
    )


def _and(items: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def awaits_scheduler(seen: Seen) -> bool:
    """Whether a failed worker waits for the scheduler's answer: none reached it
    (`unreachable`), but it is this launcher's own, running, silent for less than
    `scheduler_start_s` (started again a moment ago, it does not listen yet), and its answer
    may take the worker back (the job formed with recovery; one still forming takes it without
    an answer, one without recovery does not take it whatever the answer)."""
    last, silent = seen.last, seen.scheduler_silent_s
    return (
        seen.own_scheduler
        and seen.scheduler_exit is None
        and seen.now is None
        and bool(seen.unreachable)
        and not seen.unread
        and silent is not None
        and silent < seen.scheduler_start_s
        and last is not None
        and last.phase is not Phase.WAITING
        and last.recovery
    )


def _exit_order(worker: WorkerSeen) -> tuple[float, int]:
    """Earliest exit first (one without a time last), then by index."""
    at = worker.exited_at
    return (float("inf") if at is None else at, worker.index)


def left_to_resume(seen: Seen) -> bool:
    """Whether this launcher's scheduler exited 0 before the job's end, with recovery on and no
    standby: stopped by SIGTERM alone, it saved the job and left it to a scheduler started
    again on its state (a standby would have taken it over)."""
    return (
        seen.own_scheduler
        and seen.scheduler_exit == 0
        and seen.recovery
        and not seen.standbys
        and not seen.ended
    )


def why_not_restart_scheduler(seen: Seen) -> str | None:
    """None when this launcher's scheduler, which has exited, may be started again; otherwise
    why not, in words for the user.

    Only a scheduler that died (killed by a signal: SIGKILL, the OOM killer, a crash) or left
    the job to resume (`left_to_resume`) is started again, and only with recovery on: it then
    resumes the job from its saved state. One that exited by itself otherwise ended the job
    (0: finished, 1: failed) or could not start (2: its settings); starting it again would
    begin a new job, or fail the same way.
    """
    code = seen.scheduler_exit
    if code is None or (code >= 0 and not left_to_resume(seen)):
        return f"it {describe_exit(code or 0)}, which ends the job"
    if not seen.recovery:
        return "recovery is off, so a scheduler started again would not know the job"
    last = seen.last
    if last is not None and last.phase in (Phase.FAILED, Phase.FINISHED):
        return f"the job was already {last.phase.value}"
    if seen.scheduler_restarts >= seen.max_restarts:
        return f"no restarts left (--max-restarts {seen.max_restarts})"
    return None


def why_not_restart(worker: WorkerSeen, seen: Seen) -> str | None:
    """None when `worker` may be started again; otherwise why not, in words for the user."""
    if worker.restarts >= seen.max_restarts:
        return f"no restarts left (--max-restarts {seen.max_restarts})"
    if seen.own_scheduler and seen.scheduler_exit is not None and not seen.standbys:
        off = "; recovery is off" if seen.last is not None and not seen.last.recovery else ""
        return f"the scheduler has exited{off}"
    if seen.now is None:
        return _why_not_unanswered(seen)
    if seen.now.phase in (Phase.FAILED, Phase.FINISHED):
        off = "" if seen.now.recovery else " and recovery is off"
        return f"the job is {seen.now.phase.value} ({seen.now.detail}){off}"
    if seen.now.phase is not Phase.WAITING and not seen.now.recovery:
        # The scheduler has not seen the worker go yet (its connection outlives it: a child
        # that inherited it): a process started again would be refused all the same.
        return "the job had formed and recovery is off, so it cannot take it back"
    return None


def _why_not_unanswered(seen: Seen) -> str | None:
    """A worker failed and no fresh answer came; the last one decides. A job that has not
    formed can still take the worker. A scheduler that none reaches (`unreachable`) is gone,
    or, ours and running, silent past its bound (`awaits_scheduler` waits within it): a formed
    job cannot. One that is up but refused the read (`unread`) is no gone scheduler:
    its last answer stands for a fresh one, so a formed job with recovery takes the worker
    back, and one over, or formed without recovery, cannot."""
    last = seen.last
    if last is None or last.phase is Phase.WAITING:
        return None
    if not seen.unread:
        off = "" if last.recovery else "; recovery is off, so the job cannot take it back"
        silent = seen.scheduler_silent_s
        gone = (
            "its scheduler is gone"
            if silent is None
            else f"its scheduler, running, has not answered for {silent:.0f} s"
        )
        return f"the job had formed and {gone} ({seen.unreachable}){off}"
    refused = f"its scheduler is up but refused a fresh read: {seen.unread}"
    if last.phase in (Phase.FAILED, Phase.FINISHED):
        return f"the job was {last.phase.value} at its last answer ({last.detail}); {refused}"
    if not last.recovery:
        return f"the job had formed and recovery is off, so it cannot take it back ({refused})"
    return None


def cause(
    workers: Sequence[WorkerSeen],
    first: int | None,
    errors: Mapping[int, str | None] | None = None,
    scheduler_exit: int | None = None,
) -> int | None:
    """Which process to blame once the exits a failure causes have arrived (`first`: the first
    to fail, a worker's index or None for the scheduler; `errors`: each failed worker's own
    error line, `error_line`):

    1. a ranked worker killed by a signal: it is the cause, the others exited because of it.
       Of several, the first to fail, else the earliest to exit whose last line is not the
       job's failure (a peer that NCCL's watchdog aborted, SIGABRT, after another was
       SIGKILLed); a spare, or a worker whose rank a spare took, is no cause of a failure;
    2. the scheduler killed by a signal, when it was first;
    3. a worker that died of an error of its own (an NCCL error, a bug in the script), not of
       the job's failure (`FAILURE_ERRORS`): which exit the launcher sees first is a race, and
       the scheduler or a peer told of the failure may exit before it. Such a worker may still
       be running (`errors` has its line, its exit code is None): after its traceback, its
       exit can block on what failed (an NCCL communicator) while its connection is closed;
    4. when the first to fail died of the job's failure (its line is one of `FAILURE_ERRORS`):
       the earliest-exited failed worker whose exit is no such consequence (`sys.exit(3)` after
       a line of its own, `os._exit`);
    5. otherwise the first to fail.

    A worker that failed after it finished its part (`WorkerSeen.finished`) is never the cause.
    """
    workers = [w for w in workers if not w.finished]
    said = errors or {}
    ranked = sorted((w for w in workers if not w.spare), key=_exit_order)
    killed = _killed(ranked, first, said)
    if killed is not None:
        return killed
    if first is None and scheduler_exit is not None and scheduler_exit < 0:
        return None
    own = [
        w.index
        for w in ranked
        if (w.failed or w.exit_code is None) and _own_error(said.get(w.index))
    ]
    if first in own:
        return first
    if own:
        return own[0]
    if first is None or not _consequence(said.get(first)):
        return first
    not_told = [w.index for w in ranked if w.failed and not _consequence(said.get(w.index))]
    return not_told[0] if not_told else first


# The errors a worker dies of when the job failed around it: not a cause.
FAILURE_ERRORS = ("JobFailedError", "PeerFailedError", "SchedulerUnreachableError")


def _killed(
    ranked: Sequence[WorkerSeen], first: int | None, said: Mapping[int, str | None]
) -> int | None:
    """Rule 1 of `cause`: of the `ranked` workers (earliest exit first) killed by a signal, the
    first to fail, else the earliest whose last line is not the job's failure; None when none
    was killed."""
    killed = [w for w in ranked if w.exit_code is not None and w.exit_code < 0]
    if not killed:
        return None
    if first is not None and first in {w.index for w in killed}:
        return first
    return next((w for w in killed if not _consequence(said.get(w.index))), killed[0]).index


def _own_error(line: str | None) -> bool:
    """`line`: 'cluster: JobFailedError: ...' (cluster's excepthook) or a traceback's last line,
    'cluster.protocol.errors.PeerFailedError: ...', 'RuntimeError: NCCL error ...'."""
    return bool(line) and not _consequence(line)


def _consequence(line: str | None) -> bool:
    """Whether `line` (as `_own_error` takes it) is an error of the job's failure
    (`FAILURE_ERRORS`): the worker died because another process failed."""
    if not line:
        return False
    kind = line.removeprefix("cluster: ").split(":", 1)[0].rsplit(".", 1)[-1]
    return kind in FAILURE_ERRORS


def describe_scheduler_exit(code: int) -> str:
    """`describe_exit` of this launcher's scheduler, which is decided on with exit code 0 only
    when it left the job to resume (`left_to_resume`)."""
    if code == 0:
        return "exited with code 0 before the job's end (it left the job to resume)"
    return describe_exit(code)


def describe_exit(code: int) -> str:
    """'exited with code 3', 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_TRACEBACK = "Traceback (most recent call last):"
# The line cluster's excepthook prints for an uncaught ClusterError (no traceback).
_CLUSTER_ERROR = re.compile(r"^cluster: [A-Za-z_][\w.]*: ")
# torch.distributed's excepthook starts every line of an uncaught error with the rank.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


def error_line(lines: Sequence[str]) -> str | None:
    """The first line of the error a process died of, from the end of its output: the first
    unindented line after the last traceback's header (an exception's message may go on over
    several lines, NCCL's does: the first says what failed), else the last line of an uncaught
    ClusterError; None when there is neither (a signal, os._exit, an error printed otherwise)."""
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in lines]
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index]
        if line.strip() == _TRACEBACK:
            for after in lines[index + 1 :]:
                if after.strip() and not after[0].isspace():
                    return after.strip()[:ERROR_LINE_CHARS]
            return None
        if _CLUSTER_ERROR.match(line):
            return line.strip()[:ERROR_LINE_CHARS]
    return None
