"""How long a worker waits, pure: the bounds of its registration attempts, its pauses between
tries, and the pace at which its Finish is sent again. `cluster.worker.machine.core` decides
when to wait; `Pace` says how long, for a node of a job of `nodes`.

The job's nodes wait together (they start together; a scheduler's restart finds every one of
them waiting), so a pause that would make each of them try a few times a second is stretched to
the node's share of what the scheduler's host takes from the whole job, and each pause between
tries is drawn around its pace (`cluster.protocol.backoff`: within JITTER of it; a guard's poll
between half of its ceiling and the ceiling), from draws the node's shell seeds, so that the
nodes' tries do not arrive together. A pause never passes the deadline the core clips it to.
"""

from __future__ import annotations

from cluster.protocol.backoff import (
    LISTEN_FAST_S,
    Draws,
    RetryPolicy,
    Spread,
    guard_pause_s,
    jittered,
    listen_every_s,
    listen_pace,
)

# A registration attempt gives up on reaching the scheduler after this long; with several
# scheduler addresses sooner, so that the next one is tried.
ATTEMPT_TIMEOUT_S = 3.0
FAILOVER_ATTEMPT_S = 1.0
# Between attempts that got no answer: at least this, and at the pace of a wait for the
# scheduler's port past its first second (`Pace.retry_s`).
RETRY_PAUSE_S = 0.1
# A transient refusal (the guard) is retried this long after it says it clears.
GUARD_MARGIN_S = 0.02
# With recovery, a call cut off by the scheduler's death is made again after this pause.
CALL_RETRY_PAUSE_S = 0.05
# A node's Finish is one call that waits up to MS_NODE_TIMEOUT (and FINISH_SLACK_S) for its
# answer: a scheduler busy with a whole job's finishes answers late, and a node that left
# unanswered was taken for a dead one (the job failed at 4,096 nodes). It is not made again on a
# short deadline: gRPC keeps an abandoned call in the scheduler's queue until the scheduler takes
# it up, so at 8,192 nodes each round of 5 s attempts queued 8,192 more dead calls ahead of the
# live ones, and the finishes of 8,183 nodes went unheard for 65 s. When it is made again (the
# core says when), it is after a pause that doubles (FINISH_RETRY), and never past
# FINISH_SLACK_S after MS_NODE_TIMEOUT.
FINISH_SLACK_S = 5.0
FINISH_RETRY = RetryPolicy(first_s=0.1, max_s=2.0)


class Pace:
    """The pauses of node `node_id` of a job of `nodes`, jittered with `draws` (by default
    draws seeded from the node id: nodes of one job differ). `direct`: it connects to the
    scheduler itself (no relay between), so its tries reach the scheduler's host and keep the
    job's pace."""

    def __init__(self, nodes: int, node_id: str | None, draws: Draws | None = None) -> None:
        self.nodes = nodes
        self.draws = draws or Spread(int.from_bytes((node_id or "").encode()[-8:], "big"))
        self.direct = False

    def listening(self, waited_s: float) -> tuple[float, float]:
        """(every_s, for_s) of a wait for the scheduler's port `waited_s` in (`listen_pace`):
        quick for its first second, then for ATTEMPT_TIMEOUT_S at a time; tried every_s
        apart, drawn around the pace."""
        every_s, for_s = listen_pace(waited_s, self.nodes, ATTEMPT_TIMEOUT_S)
        return jittered(every_s, self.draws), for_s

    def retry_s(self) -> float:
        """The pause after an attempt that got no answer, or a probe that found no scheduler:
        RETRY_PAUSE_S; for a node that connects directly, in a large job, its share of the
        tries the job's nodes make in all (`listen_every_s` past the quick first second: 0.82 s
        at 8,192 nodes), as its waits for the port are paced. Direct nodes probing schedulers
        they cannot reach (several scheduler addresses, a leader gone) would otherwise try 10
        times a second each. A node behind a relay asks its relay again when the relay cannot
        reach the scheduler, and probes only when the relay did not answer in time or a
        certificate must pass a CRL first; it keeps RETRY_PAUSE_S for those, so that it is not
        held up to its share's pace (6.5 s at 65,536 nodes) behind its relay."""
        return self.paced(RETRY_PAUSE_S)

    def call_retry_s(self) -> float:
        """The pause before a call cut off by the scheduler's death is made again (with
        recovery): a relay that cannot reach the scheduler and a standby that does not lead
        answer at once."""
        return self.paced(CALL_RETRY_PAUSE_S)

    def paced(self, pause_s: float) -> float:
        """`pause_s`, or for a node that connects directly its share of the job's tries; drawn
        around that."""
        if self.direct:
            pause_s = max(pause_s, listen_every_s(LISTEN_FAST_S, self.nodes))
        return jittered(pause_s, self.draws)

    def guard_s(self, retry_after_s: float) -> float:
        """The pause after a transient refusal (the guard) that clears in `retry_after_s`: a
        little past its end, so that the next attempt is not early by a hair; and no longer
        than a poll of the guard (`guard_pause_s`: at most GUARD_POLL_S in a job of up to 750
        nodes), soon enough to hear that the job ended meanwhile."""
        return min(retry_after_s + GUARD_MARGIN_S, guard_pause_s(self.nodes, self.draws))
