"""Ending the process from a background thread, the way a library should.

The agent's thread learns that the job is over for this process (a peer failed with recovery
off, the job failed, the launcher is gone) while the main thread runs the user's program. The
process must not linger, but it should end as a program ends: the job's `ClusterError` is raised
in the main thread (a signal sent to that thread, whose handler raises it), so that its `finally`
blocks and atexit handlers run and the process prints one line (`cluster.api.excepthook`) and
exits 1.

`os._exit` stays, as the bounded last resort: Python runs a signal handler only between
bytecodes of the main thread, so a main thread stuck in a C call that restarts after signals (a
gloo or NCCL collective waiting for the dead peer, a read with SA_RESTART) never sees the
error. When the process has not ended within the grace, it says the error and exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from cluster.protocol.errors import ClusterError

# The signal that carries "raise the job's error" to the main thread. Taken only while it has
# its default action, and used only while the handler is still this library's: a program with
# its own handler (installed before or after init()) keeps it, and gets the last resort.
SIGNAL = signal.SIGUSR2
GRACE_S = 5.0
EXIT_CODE = 1


class Ending:
    """Ends this process with one `ClusterError`, once, from any thread.

    Made in the main thread (where a signal handler can be installed); `end()` from any other.
    """

    def __init__(self, say: Callable[[str], None], *, grace_s: float = GRACE_S) -> None:
        self._say = say
        self._grace_s = grace_s
        self._error: ClusterError | None = None
        self._exiting = False  # the process ends already, of its own error (`exiting`)
        self._quiet = False  # the finalize raises the job's error itself (`quiet`)
        self._owed = False  # left to the main thread's waiting call (`owed`)
        # sys.last_value as the job began: another one is an exception it died of (`_dying`).
        self._uncaught_before = getattr(sys, "last_value", None)
        self._lock = threading.Lock()
        self._main = threading.main_thread()
        self.interrupts = self._install()

    def _install(self) -> bool:
        """Whether the main thread can be interrupted: this is it, and the signal is free."""
        if threading.current_thread() is not self._main:
            return False
        if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, self._raise):
            return False
        signal.signal(SIGNAL, self._raise)
        return True

    def _owns_signal(self) -> bool:
        """Whether the signal still runs `_raise`: the program may have taken it since."""
        return self.interrupts and signal.getsignal(SIGNAL) == self._raise

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        """The handler, in the main thread: the job's error, raised where the program is."""
        error = self._error
        if error is not None and not self._exiting and not self._dying():
            raise error

    def _dying(self) -> bool:
        """The main thread is dying of an uncaught exception of its own (one a waiting call
        raised as the job failed): raised in its `sys.excepthook`, the job's error would only
        break the hook's line into a traceback. CPython sets `sys.last_value` before it calls
        the hook, whichever hook it is (`excepthook.crash` reads it so too). The process exits
        1 of that exception, which its finalize at exit tells the scheduler. (At an interactive
        prompt, after an error there, the job's end is left to the last resort.)"""
        return getattr(sys, "last_value", None) is not self._uncaught_before

    def end(self, error: ClusterError, *, raised: bool = False) -> None:
        """End the process with `error`. `raised`: a call of the main thread waits, and raises
        it there (or, when its answer came first, as it ends: `owed`); only the last resort is
        left, should the program carry on regardless."""
        with self._lock:
            if self._error is not None or self._exiting:
                return  # already ending
            self._error = error
            quiet = self._quiet
            self._owed = raised and not quiet
        if not (raised or quiet):
            if not self._owns_signal() or self._main.ident is None:
                self.last_resort(error)
                return
            signal.pthread_kill(self._main.ident, SIGNAL)
        # The timer holds the line and the voice, not this (nor the session that made it).
        timer = threading.Timer(self._grace_s, _last_resort, args=(self._say, str(error)))
        timer.daemon = True  # the process ending as it should ends the timer too
        timer.start()

    def owed(self) -> ClusterError | None:
        """The error `end(raised=True)` left to the main thread's waiting call, once, for that
        call to raise when it ended otherwise (its answer came as the job ended); None when
        there is none (or the finalize raises it: `quiet`)."""
        with self._lock:
            owed, self._owed = self._owed and not self._quiet, False
            return self._error if owed else None

    def quiet(self) -> None:
        """The worker finalizes (`cluster.finalize()`, or at exit): the job's end sends no
        signal, which would only interrupt a closer (that logs it and goes on) or an atexit
        callback (a traceback, and exit status 0); the finalize raises the error itself at its
        end. The last resort still bounds it."""
        with self._lock:
            self._quiet = True

    def release(self) -> None:
        """The session is closed: give the signal back its default action, when its handler
        is still this one (a program that took it since keeps its own). After this a SIGUSR2
        does what it does in a process without `cluster` (by default: end it), and the closed
        session is no longer held by the signal's handler. Main thread only, as installing."""
        if threading.current_thread() is not self._main or not self._owns_signal():
            return
        signal.signal(SIGNAL, signal.SIG_DFL)
        self.interrupts = False

    def exiting(self) -> None:
        """The process is ending of its own error (its finalize at exit, telling the scheduler
        which): the job's end, which that may bring about, raises nothing more in it."""
        with self._lock:
            self._exiting = True

    def last_resort(self, error: ClusterError) -> None:
        """The main thread did not end the process: say why, and exit now."""
        _last_resort(self._say, str(error))


def _last_resort(say: Callable[[str], None], line: str) -> None:
    say(line)
    sys.stdout.flush()
    os._exit(EXIT_CODE)
