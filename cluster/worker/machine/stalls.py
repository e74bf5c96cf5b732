"""This process's own stalls, a part of the worker core: when it did not run, so that neither
the scheduler nor the network is blamed for it.

A worker that is stopped (SIGSTOP, a debugger), starved of CPU, or whose main thread holds
Python's GIL in a long call does not run its event loop: it hears nothing meanwhile and sends
no heartbeat. The agent's stall watch (`cluster.worker.timers.StallWatch`) tells the core of each
stall it sees (`steps.Stalled`), and the core keeps them here:

- `within`: how much of a span this process spent stalled. The scheduler's silence on the
  stream does not count it (what the scheduler sent meanwhile waits in this process's socket),
  so a stream is never given up for a silence that was this process's own.
- `named`: a stall long enough for the scheduler to have failed this node (it fails a node it
  does not hear for its silence limit), ended a moment ago, as the loss of the stream that
  follows it says it: this process was stopped or starved, not the scheduler silent.
"""

from __future__ import annotations

from collections import deque

# A loss of the stream this soon after a long stall ended is told as the stall's (the
# scheduler's word that it failed the node waits in the socket, read as soon as the node runs).
NAMED_WITHIN_S = 5.0
# The stalls kept (the newest): more than one silence limit's worth of them, each of at least
# the stall watch's threshold (`cluster.worker.timers.OWN_STALL_S`).
KEPT = 256

CAUSES = "SIGSTOP, a debugger, too little CPU, or a long call holding Python's GIL"


class Stalls:
    """The spans (start, end) of this process's recent stalls, oldest first."""

    def __init__(self) -> None:
        self._spans: deque[tuple[float, float]] = deque(maxlen=KEPT)

    def add(self, seconds: float, now: float) -> None:
        """This process did not run for the `seconds` up to `now`."""
        self._spans.append((now - seconds, now))

    def within(self, since: float, now: float) -> float:
        """How many of the seconds from `since` to `now` this process spent stalled."""
        return sum(max(min(end, now) - max(start, since), 0.0) for start, end in self._spans)

    def named(self, now: float, limit_s: float, heartbeat_interval_s: float) -> str:
        """The last stall, as a sentence, when it ended within NAMED_WITHIN_S of `now` and was
        long enough for the scheduler to fail this node: with the time since its last
        heartbeat before it, the scheduler heard nothing for `limit_s`. "" otherwise."""
        if not self._spans:
            return ""
        start, end = self._spans[-1]
        seconds = end - start
        if now - end > NAMED_WITHIN_S or seconds + heartbeat_interval_s < limit_s:
            return ""
        return (
            f"this process was stopped or starved for {seconds:.1f} s ({CAUSES}), and the "
            f"scheduler fails a node it does not hear for {limit_s:g} s (MS_NODE_TIMEOUT)"
        )
