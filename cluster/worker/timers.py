"""The agent's timers on the event loop: one timer per stream or call, not a task per message.

`Silence` cancels an event stream on which nothing arrived for too long, `AnswerLimit` a
registration that did not reach the scheduler or was not answered in time, and `Heartbeats`
writes this node's heartbeats on their own stream. Each only does I/O; what a cancelled call
means is for the worker core to decide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from cluster.v1 import scheduler_pb2 as pb

# While a registration waits for its answer, how often `waiting` is called.
REPORT_EVERY_S = 5.0

Call = grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.Event]
Beats = grpc.aio.StreamUnaryCall[pb.HeartbeatRequest, pb.HeartbeatResponse]


class Silence:
    """Cancels `call` when nothing has arrived on it for `limit_s`; one timer per stream,
    re-armed only when it runs out (not a task and a timer per message)."""

    def __init__(self, call: Call, limit_s: float) -> None:
        self._call = call
        self.limit_s = limit_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self.fired = False
        self._timer = self._loop.call_at(self._last + limit_s, self._check)

    def heard(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        due = self._last + self.limit_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.fired = True
        self._call.cancel()

    def stop(self) -> None:
        self._timer.cancel()


class AnswerLimit:
    """Cancels a registration `call` that has not reached the scheduler within `attempt_s`, or
    that has and is still unanswered after `answer_s`; calls `waiting(seconds)` every
    REPORT_EVERY_S while it waits for the answer."""

    def __init__(
        self,
        call: Call,
        channel: grpc.aio.Channel,
        attempt_s: float,
        answer_s: float,
        waiting: Callable[[float], None],
    ) -> None:
        self._call = call
        self._channel = channel
        self._waiting = waiting
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._answer_by = self._started + max(answer_s, 0.0)
        self.expired = False
        self._timer = self._loop.call_later(max(min(attempt_s, answer_s), 0.0), self._check)

    def _check(self) -> None:
        connected = self._channel.get_state() is grpc.ChannelConnectivity.READY
        now = self._loop.time()
        if connected and now < self._answer_by:
            if now - self._started >= REPORT_EVERY_S:
                self._waiting(now - self._started)
            self._timer = self._loop.call_at(
                min(self._answer_by, now + REPORT_EVERY_S), self._check
            )
            return
        self.expired = True
        self._call.cancel()

    def stop(self) -> None:
        self._timer.cancel()


class Heartbeats:
    """Writes `beat` every `interval_s` on a Heartbeat stream, opened by `open_stream` at the
    first beat and again after it broke: a timer, and a task only while a beat is on its way
    (not a task per stream that sleeps)."""

    def __init__(
        self, open_stream: Callable[[], Beats], beat: pb.HeartbeatRequest, interval_s: float
    ) -> None:
        self._open_stream = open_stream
        self._beat = beat
        self._interval_s = interval_s
        self._loop = asyncio.get_running_loop()
        self._stream: Beats | None = None
        self._sending: asyncio.Task[None] | None = None
        self._timer = self._loop.call_later(interval_s, self._due)

    def _due(self) -> None:
        if self._sending is None or self._sending.done():
            self._sending = self._loop.create_task(self._send())
        self._timer = self._loop.call_later(self._interval_s, self._due)

    async def _send(self) -> None:
        if self._stream is None or self._stream.done():
            self._stream = self._open_stream()
        # A beat that fails is not this node's concern: the event stream tells whether the
        # scheduler is there, and the next beat opens a new stream.
        try:
            await self._stream.write(self._beat)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._stream.cancel()
            self._stream = None

    def stop(self) -> None:
        self._timer.cancel()
        if self._sending is not None:
            self._sending.cancel()
        if self._stream is not None:
            self._stream.cancel()
