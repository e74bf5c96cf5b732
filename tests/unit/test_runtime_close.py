"""What a worker runs when it closes: `on_finalize` calls before it tells the scheduler it
finished; after an uncaught exception, the scheduler told first, then the `on_crash` calls only
(a closer could block on what failed: an NCCL communicator)."""

from __future__ import annotations

import pytest

from cluster.api import runtime


class Session:
    """Stands for the worker's session: records when it was finalized and how."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def finalize(self, *, finished: bool) -> None:
        self.calls.append(f"scheduler told finished={finished}")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []
    monkeypatch.setattr(runtime, "_session", Session(made))
    monkeypatch.setattr(runtime, "_closers", [])
    monkeypatch.setattr(runtime, "_aborters", [])
    runtime.on_finalize(lambda: made.append("closed"))
    runtime.on_crash(lambda: made.append("aborted"))
    return made


def test_a_finished_worker_closes_then_tells_the_scheduler(calls: list[str]) -> None:
    runtime._close(finished=True)
    assert calls == ["closed", "scheduler told finished=True"]
    runtime._close(finished=True)  # twice: nothing more
    assert calls == ["closed", "scheduler told finished=True"]


def test_a_crashed_worker_tells_the_scheduler_then_aborts(calls: list[str]) -> None:
    runtime._close(finished=False)
    assert calls == ["scheduler told finished=False", "aborted"]


def test_an_abort_that_fails_is_logged_not_raised(
    calls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("ncclCommAbort failed")

    runtime.on_crash(broken)
    runtime._close(finished=False)
    assert calls == ["scheduler told finished=False", "aborted"]
    assert "ncclCommAbort failed" in caplog.text
