"""What a worker runs when it closes: `on_finalize` calls before it tells the scheduler it
finished; after an uncaught exception, the scheduler told first, then the `on_crash` calls only
(a closer could block on what failed: an NCCL communicator)."""

from __future__ import annotations

import gc

import pytest

from cluster.api import runtime
from cluster.protocol.errors import CheckpointError
from cluster.storage.background import BackgroundWriter


class Session:
    """Stands for the worker's session: records when it was finalized and how."""

    forked = False

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def quiet(self) -> None:
        self.calls.append("quiet")

    def finalize(self, *, finished: bool, failure: str | None = None) -> None:
        said = f" failure={failure}" if failure else ""
        self.calls.append(f"scheduler told finished={finished}{said}")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    made: list[str] = []
    monkeypatch.setattr(runtime, "_session", Session(made))
    monkeypatch.setattr(runtime, "_closers", [])
    monkeypatch.setattr(runtime, "_aborters", [])
    monkeypatch.setattr(runtime, "_finalized", False)  # closing sets it: undone after the test
    runtime.on_finalize(lambda: made.append("closed"))
    runtime.on_crash(lambda: made.append("aborted"))
    return made


def test_a_finished_worker_closes_then_tells_the_scheduler(calls: list[str]) -> None:
    runtime._close(finished=True)
    assert calls == ["quiet", "closed", "scheduler told finished=True"]
    runtime._close(finished=True)  # twice: nothing more
    assert calls == ["quiet", "closed", "scheduler told finished=True"]


def test_a_crashed_worker_tells_the_scheduler_then_aborts(calls: list[str]) -> None:
    runtime._close(finished=False, failure="RuntimeError: NCCL error")
    assert calls == [
        "quiet",
        "scheduler told finished=False failure=RuntimeError: NCCL error",
        "aborted",
    ]


def test_a_worker_that_exits_non_zero_closes_then_tells_the_scheduler_its_status(
    calls: list[str],
) -> None:
    """sys.exit(2) is no crash (what it opened is closed as at a finish, not aborted), and no
    finish either: the scheduler hears the status."""
    runtime._close(finished=True, failure="exited with status 2")
    assert calls == [
        "quiet",
        "closed",
        "scheduler told finished=False failure=exited with status 2",
    ]


def test_an_abort_that_fails_is_logged_not_raised(
    calls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("ncclCommAbort failed")

    runtime.on_crash(broken)
    runtime._close(finished=False)
    assert calls == ["quiet", "scheduler told finished=False", "aborted"]
    assert "ncclCommAbort failed" in caplog.text


def test_the_error_a_process_dies_of_is_its_first_line_named_as_a_traceback_names_it() -> None:
    from cluster.api.excepthook import error_line  # noqa: PLC0415
    from cluster.protocol.display import ERROR_LINE_CHARS  # noqa: PLC0415

    assert error_line(RuntimeError("NCCL error: invalid usage\nLast error: more")) == (
        "RuntimeError: NCCL error: invalid usage"
    )

    class DistBackendError(RuntimeError):
        pass

    assert error_line(DistBackendError("x")).endswith(
        "test_runtime_close.test_the_error_a_process_dies_of_is_its_first_line_named_as_a_"
        "traceback_names_it.<locals>.DistBackendError: x"
    )
    assert error_line(KeyError()) == "KeyError"
    assert len(error_line(ValueError("v" * 10_000))) == ERROR_LINE_CHARS


def test_a_worker_at_exit_leaves_the_collector_alone(calls: list[str]) -> None:
    """Unlike the scheduler's process, a worker's is the training script's: its cyclic garbage
    (a logger's buffered file in a cycle) is still collected, and finalized, at exit."""
    runtime._finalize_at_exit()
    assert calls == ["quiet", "closed", "scheduler told finished=True"]
    assert gc.get_freeze_count() == 0


def test_a_write_that_failed_unraised_fails_the_finalize(calls: list[str]) -> None:
    """A background write (a checkpoint's) that failed after the last save: the finalize waits
    for it, tells the scheduler the worker failed of it, and raises it."""
    writer = BackgroundWriter("test-writer")

    def full_disk() -> None:
        raise CheckpointError("cannot save the checkpoint of step 3 (No space left on device)")

    writer.submit(full_disk)
    with pytest.raises(CheckpointError, match=r"step 3 \(No space left on device\)"):
        runtime._close(finished=True)
    assert calls == [
        "quiet",
        "closed",
        "scheduler told finished=False failure=cluster.protocol.errors.CheckpointError: "
        "cannot save the checkpoint of step 3 (No space left on device)",
    ]
    writer.flush()  # raised once: nothing is left to raise
