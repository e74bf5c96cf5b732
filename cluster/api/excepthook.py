"""An uncaught ClusterError is one clear line on stderr, not a traceback.

Errors stay ordinary exceptions (a program may catch them); only when nothing does, this hook
prints `cluster: <ErrorName>: <message>` instead of the traceback. Other exceptions are left to
the hook that was there before.

What a worker's process dies of is told to the scheduler at exit (`cluster.api.runtime`):
`crash()` is the uncaught exception, whichever hook printed it, and `exit_failure()` the
non-zero status the main thread asked for with `sys.exit()` (or the `exit()` / `quit()` of
`site`), once `watch_exits()` wraps those at `cluster.init()` (`unwatch_exits()` gives them
back at `cluster.finalize()`). A `SystemExit` raised by the program itself goes through
neither, so it is not seen: Python runs no hook for it and keeps its status to itself until the
process has ended.
"""

from __future__ import annotations

import builtins
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

from cluster.protocol.display import ERROR_LINE_CHARS, safe
from cluster.protocol.errors import ClusterError

_previous = sys.excepthook
# Set when the program dies of an uncaught exception: the finalize that runs at exit then must
# not tell the scheduler that this node finished well, and tells it `failure` instead.
failure: str | None = None
# The status the main thread last asked `sys.exit()` for, as the line the scheduler is told
# (None: 0, or not asked); `_last_seen` is `sys.last_value` as it was when the watch began.
_exit_failure: str | None = None
_last_seen: object = None
_watching = False


def error_line(error: BaseException) -> str:
    """The first line of `error` as a traceback ends with it: `RuntimeError: NCCL error ...`,
    `torch.distributed.DistBackendError: ...` (the module named unless built in)."""
    kind = type(error)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    lines = str(error).splitlines()
    line = f"{name}: {lines[0]}" if lines else name
    return line[:ERROR_LINE_CHARS]


def say(error: ClusterError) -> None:
    """The one line an uncaught `error` is: `cluster: <ErrorName>: <message>`."""
    print(f"cluster: {type(error).__name__}: {safe(error)}", file=sys.stderr, flush=True)


def _hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
    global failure
    failure = error_line(value)
    if isinstance(value, ClusterError):
        say(value)
        return
    _previous(kind, value, traceback)


def crash() -> str | None:
    """The first line of the exception the program died of (`error_line`), whichever hook
    printed it (CPython keeps the uncaught one as `sys.last_value`, whatever the hook); None
    when it did not die of one. An interactive interpreter (`python -i`) dies of none: its
    prompt shows an uncaught exception and goes on, and its status is the prompt's."""
    if sys.flags.interactive:
        return None
    if failure is not None:
        return failure
    last = getattr(sys, "last_value", None)
    if isinstance(last, BaseException) and last is not _last_seen:
        return error_line(last)
    return None


def exit_failure() -> str | None:
    """`exited with status N` (and a message: `sys.exit("loss is NaN")` is status 1) when the
    main thread's last `sys.exit()` asked for a non-zero status; None otherwise. The last call
    decides: a program that catches its own `sys.exit(1)` and carries on still reports it,
    unless it calls `sys.exit(0)` (or `sys.exit()`) afterwards."""
    return _exit_failure


def exit_line(code: object) -> str | None:
    """What `sys.exit(code)` makes of the process, as a line: None for status 0."""
    if isinstance(code, int):  # the status is its low byte: sys.exit(256) exits 0
        status = int(code) % 256 if abs(code) < 2**63 else 255
        return f"exited with status {status}" if status else None
    if code is None:
        return None
    lines = str(code).splitlines()
    said = f": {lines[0]}" if lines else ""
    return f"exited with status 1{said}"[:ERROR_LINE_CHARS]


class _Watched:
    """`sys.exit` (or `exit`, `quit`) that notes, in the main thread, the status asked for."""

    def __init__(self, original: Callable[..., NoReturn]) -> None:
        self.original = original

    def __call__(self, *args: object) -> NoReturn:
        global _exit_failure
        if threading.current_thread() is threading.main_thread():  # elsewhere: a thread ends
            _exit_failure = exit_line(args[0] if args else None)
        self.original(*args)

    def __repr__(self) -> str:
        return repr(self.original)


def watch_exits() -> None:
    """From now on note the status the program asks `sys.exit()` for (see `exit_failure`),
    and count only an uncaught exception of later as a crash (`crash`): a status asked for
    before (in an earlier job of the process) is not this one's."""
    global _watching, _last_seen, _exit_failure, failure
    _last_seen = getattr(sys, "last_value", None)
    _exit_failure, failure = None, None
    if _watching:
        return
    _watching = True
    sys.exit = _Watched(sys.exit)
    for name in ("exit", "quit"):  # site's, where the interpreter has them
        if hasattr(builtins, name):
            setattr(builtins, name, _Watched(getattr(builtins, name)))


def unwatch_exits() -> None:
    """Give `sys.exit` (and `exit`, `quit`) back as they were before `watch_exits`, where each
    is still its wrapper (one the program replaced since stays the program's)."""
    global _watching
    _watching = False
    if isinstance(sys.exit, _Watched):
        sys.exit = sys.exit.original
    for name in ("exit", "quit"):
        watched = getattr(builtins, name, None)
        if isinstance(watched, _Watched):
            setattr(builtins, name, watched.original)


def install() -> None:
    if sys.excepthook is not _hook:
        sys.excepthook = _hook
