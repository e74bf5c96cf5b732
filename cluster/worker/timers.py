"""The agent's timers on the event loop: one timer per stream or call, not a task per message.

`Silence` cancels an event stream on which nothing arrived for too long, `StallWatch` tells
when this process itself did not run, `AnswerLimit` cancels a registration that did not reach
the scheduler or was not answered in time, `Heartbeats` writes this node's heartbeats on their
own stream, and `Periodic` calls a check now and then. Each only does I/O; what a cancelled
call or a stall means is for the worker core to decide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from cluster.transport.stub import Beat, BeatsCall, WatchCall

# While a registration waits for its answer, how often `waiting` is called.
REPORT_EVERY_S = 5.0

Call = WatchCall
Beats = BeatsCall


# A stall watch's timer that runs this much later than due means this process did not run
# meanwhile (stopped, starved of CPU, or its main thread holding Python's GIL).
OWN_STALL_S = 1.0
# The stall watch's timer is due this often: a stall is measured to within this much.
STALL_TICK_S = 0.25
# A registration whose channel is connecting is looked at again after this long.
CONNECTING_RECHECK_S = 1.0


class StallWatch:
    """Tells `stalled(seconds)` of each time this process did not run for over OWN_STALL_S: its
    timer, due every STALL_TICK_S, ran that late (seen when it runs, or by `check()` first).
    What a stall means is for the worker core to decide (`steps.Stalled`)."""

    def __init__(self, stalled: Callable[[float], None]) -> None:
        self._stalled = stalled
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(STALL_TICK_S, self._due)

    def check(self) -> None:
        """Tell a stall that is over by now, before its timer runs (a decision about to be
        made counts it)."""
        if self._loop.time() - self._timer.when() > OWN_STALL_S:
            self._timer.cancel()
            self._due()

    def _due(self) -> None:
        late = self._loop.time() - self._timer.when()
        self._timer = self._loop.call_later(STALL_TICK_S, self._due)
        if late > OWN_STALL_S:
            self._stalled(late)

    def stop(self) -> None:
        self._timer.cancel()


class Silence:
    """Cancels `call` when nothing has arrived on it for long enough: `left(heard_at)`, asked
    when its timer runs out, is how much longer the stream last heard at `heard_at` may stay
    silent (the worker core decides, this process's own stalls not counted); one timer per
    stream, re-armed only when it runs out (not a task and a timer per message)."""

    def __init__(self, call: Call, limit_s: float, left: Callable[[float], float]) -> None:
        self._call = call
        self.limit_s = limit_s
        self._left = left
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.fired = False
        self._timer = self._loop.call_at(self._last + limit_s, self._check)

    def heard(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        left = self._left(self._last)
        if left > 0:
            self._timer = self._loop.call_later(left, self._check)
            return
        self.fired = True
        self._call.cancel()

    def stop(self) -> None:
        self._timer.cancel()


class AnswerLimit:
    """Cancels a registration `call` that has not reached the scheduler within `attempt_s`
    (unless its connection is on its way, CONNECTING, and `patient()`: the scheduler was found
    up a moment ago), or that has and is still unanswered after `answer_s`, or after `longer()`
    seconds when that is more (asked at each check); calls `waiting(seconds)` every
    REPORT_EVERY_S while it waits for the answer, and once more as it gives the answer up. Once
    connected, the answer is awaited longer than the connection: a scheduler busy with a burst
    of registrations answers late, and giving up on a registration it is about to accept only
    makes it do the work again. (A timer that cancels the call, not a task and a timeout per
    attempt.)"""

    def __init__(
        self,
        call: Call,
        channel: grpc.aio.Channel,
        attempt_s: float,
        answer_s: float,
        waiting: Callable[[float], None],
        *,
        patient: Callable[[], bool] = lambda: False,
        longer: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._call = call
        self._patient, self._longer = patient, longer
        self._channel = channel
        self._waiting = waiting
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._answer_by = self._started + max(answer_s, 0.0)
        self.expired = False
        self._timer = self._loop.call_later(max(min(attempt_s, answer_s), 0.0), self._check)

    def _check(self) -> None:
        state = self._channel.get_state()
        now = self._loop.time()
        answer_by = max(self._answer_by, self._started + self._longer())
        if state is grpc.ChannelConnectivity.READY and now < answer_by:
            if now - self._started >= REPORT_EVERY_S:
                self._waiting(now - self._started)
            self._timer = self._loop.call_at(min(answer_by, now + REPORT_EVERY_S), self._check)
            return
        connecting = state is grpc.ChannelConnectivity.CONNECTING
        if connecting and self._patient() and now < answer_by:
            # A connection on its way to a scheduler this process found up a moment ago: a
            # scheduler that thousands of nodes connect to at once
            # takes seconds to accept each (its accept queue full, the SYN sent again), and
            # gRPC bounds each attempt itself. Abandoning the call only makes another, with a
            # check of its own: a storm of them kept 6,000 of 8,192 nodes out for minutes.
            self._timer = self._loop.call_at(
                min(answer_by, now + CONNECTING_RECHECK_S), self._check
            )
            return
        self.expired = True
        if state is grpc.ChannelConnectivity.READY:
            # Taken and unanswered to its end (a scheduler that cannot save holds its answer):
            # said before the call ends, so that the node's error names it.
            self._waiting(now - self._started)
        self._call.cancel()

    def stop(self) -> None:
        self._timer.cancel()


class Periodic:
    """Calls `tick()` every `interval_s` until stopped: one timer, re-armed."""

    def __init__(self, tick: Callable[[], None], interval_s: float) -> None:
        self._tick, self._interval_s = tick, interval_s
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(interval_s, self._due)

    def _due(self) -> None:
        self._timer = self._loop.call_later(self._interval_s, self._due)
        self._tick()

    def stop(self) -> None:
        self._timer.cancel()


class Heartbeats:
    """Writes `beat` every `interval_s` on a Heartbeat stream, opened by `open_stream` at the
    first beat and again after it broke: a timer, and a task only while a beat is on its way
    (not a task per stream that sleeps). A stream the scheduler ended is shown to `refuses`
    (its error): True stops the beats (the scheduler refused this node for good)."""

    def __init__(
        self,
        open_stream: Callable[[], Beats],
        beat: Beat,
        interval_s: float,
        refuses: Callable[[grpc.aio.AioRpcError], bool] = lambda _: False,
    ) -> None:
        self._open_stream = open_stream
        self._beat = beat
        self._refuses = refuses
        self._loop = asyncio.get_running_loop()
        self._stream: Beats | None = None
        self._sending: asyncio.Task[None] | None = None
        self._ticks = Periodic(self._due, interval_s)

    def _due(self) -> None:
        if self._sending is None or self._sending.done():
            self._sending = self._loop.create_task(self._send())

    async def _send(self) -> None:
        stream = self._stream
        if stream is None or stream.done():
            if stream is not None and await self._refused(stream):
                return
            stream = self._stream = self._open_stream()
        # A beat that fails is not this node's concern, unless the scheduler refused it: the
        # event stream tells whether the scheduler is there, and the next beat opens a new one.
        try:
            await stream.write(self._beat)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            if not (stream.done() and await self._refused(stream)):
                stream.cancel()
                self._stream = None

    async def _refused(self, stream: Beats) -> bool:
        """Whether `stream`, over, was ended by the scheduler in a way `refuses`: no beat
        follows then."""
        if stream.cancelled():
            return False
        try:
            await stream
        except grpc.aio.AioRpcError as exc:
            if self._refuses(exc):
                self._ticks.stop()
                return True
        return False

    def stop(self) -> None:
        self._ticks.stop()
        if self._sending is not None:
            self._sending.cancel()
        if self._stream is not None:
            self._stream.cancel()
