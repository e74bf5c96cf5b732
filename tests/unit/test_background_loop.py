"""`BackgroundLoop`: grpc's late completions for a closed loop are dropped, nothing else is."""

from __future__ import annotations

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
