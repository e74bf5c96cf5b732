"""`BackgroundLoop`: grpc's late completions for a closed loop are dropped, and its poller's
read of its closed socket at teardown is not reported; nothing else is either."""

from __future__ import annotations

import errno
import logging

import pytest
from grpc._cython import cygrpc  # type: ignore[attr-defined]  # no stubs for the C core

from cluster.worker.session import BackgroundLoop


async def _answer() -> int:
    return 42


def test_a_grpc_completion_for_a_closed_loop_is_dropped() -> None:
    background = BackgroundLoop("test-closed")
    assert background.run(_answer(), timeout_s=10.0) == 42
    background.stop()
    assert background.loop.is_closed()
    # What grpc's poller does with an event of an object of this loop (a connection of a
    # stopped server torn down): it used to raise "Event loop is closed" in the other loop.
    handle = background.loop.call_soon_threadsafe(cygrpc._handle_callback_wrapper, None, 1)
    assert handle.cancelled()


def test_anything_else_for_a_closed_loop_still_raises() -> None:
    background = BackgroundLoop("test-closed")
    background.stop()
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        background.loop.call_soon_threadsafe(print, "never")


def test_an_open_loop_runs_what_it_is_handed() -> None:
    background = BackgroundLoop("test-open")
    try:
        ran: list[int] = []
        background.loop.call_soon_threadsafe(ran.append, 1)
        assert background.run(_answer(), timeout_s=10.0) == 42
        assert ran == [1]
    finally:
        background.stop()


def _raised_in(filename: str, name: str, error: OSError) -> OSError:
    """`error` as raised by a function of code `name` in `filename` (what a Cython frame of
    grpc's carries: the .pyx.pxi file and the method's qualified name)."""

    def raising() -> None:
        raise error

    raising.__code__ = raising.__code__.replace(co_filename=filename, co_name=name)
    try:
        raising()
    except OSError as raised:
        return raised
    raise AssertionError("not raised")


POLLER = "src/python/grpcio/grpc/_cython/_cygrpc/aio/completion_queue.pyx.pxi"
HANDLE_EVENTS = "grpc._cython.cygrpc.PollerCompletionQueue._handle_events"


def test_grpcs_poller_reading_its_closed_socket_is_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker's process ends: grpc's poller reads its wake-up socket after grpc closed it
    (EBADF), once, after the job ended well (a CI run's worker log ended with its traceback).
    The loop reports nothing for it, and reports anything else a callback raises."""
    background = BackgroundLoop("test-report")
    try:
        closed = _raised_in(POLLER, HANDLE_EVENTS, OSError(errno.EBADF, "Bad file descriptor"))
        other_errno = _raised_in(POLLER, HANDLE_EVENTS, OSError(errno.EIO, "I/O error"))
        elsewhere = _raised_in("mine.py", "_handle_events", OSError(errno.EBADF, "Bad fd"))
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for error in (closed, other_errno, elsewhere):
                context = {"message": "Exception in callback None()", "exception": error}
                background.loop.call_soon_threadsafe(
                    background.loop.call_exception_handler, context
                )
            assert background.run(_answer(), timeout_s=10.0) == 42
        reported = [record.exc_info[1] for record in caplog.records if record.exc_info]
        assert reported == [other_errno, elsewhere]
    finally:
        background.stop()


def test_a_stopped_loop_is_closed_and_runs_nothing_more() -> None:
    background = BackgroundLoop("test-stopped")
    assert not background.closed
    background.stop()
    assert background.closed
    coro = _answer()
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        background.run(coro, timeout_s=10.0)
    assert coro.cr_frame is None  # closed, never run: no "never awaited" warning
