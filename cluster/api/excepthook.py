"""An uncaught ClusterError is one clear line on stderr, not a traceback.

Errors stay ordinary exceptions (a program may catch them); only when nothing does, this hook
prints `cluster: <ErrorName>: <message>` instead of the traceback. Other exceptions are left to
the hook that was there before.
"""

from __future__ import annotations

import sys
from types import TracebackType

from cluster.protocol.display import ERROR_LINE_CHARS, safe
from cluster.protocol.errors import ClusterError

_previous = sys.excepthook
# Set when the program dies of an uncaught exception: the finalize that runs at exit then must
# not tell the scheduler that this node finished well, and tells it `failure` instead.
crashed = False
failure: str | None = None


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
    global crashed, failure
    crashed = True
    failure = error_line(value)
    if isinstance(value, ClusterError):
        say(value)
        return
    _previous(kind, value, traceback)


def install() -> None:
    if sys.excepthook is not _hook:
        sys.excepthook = _hook
