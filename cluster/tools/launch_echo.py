"""What `mscluster run` shows at its terminal: its own lines and, with --join, its workers' output.

`Terminal` writes from a thread of its own, so that a reader that pauses (`| less` not
scrolled, a stalled ssh session, `2>&1 | sleep 60`) never blocks the launcher's event loop: the
workers' pipes are drained, the logs written and a signal heard all the same. What does not fit
in its bounded queue meanwhile is dropped, counted, and said in one line once the terminal
takes output again (the logs hold all of it). `EchoLines` cuts a worker's output into the lines
echoed there: a line as a terminal would show it (after its last carriage return: a tqdm bar's
last state), cut at ECHO_LINE_BYTES.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import select
import threading
from typing import IO

from cluster.tools import launch_setup as setup

# What the terminal may be behind by before output is dropped (bytes).
QUEUE_BYTES = 1 << 20
# The most of one line of a worker's output echoed (the log holds it whole).
ECHO_LINE_BYTES = 4096
# How long a terminal that does not keep up is waited for at a write that would block.
WRITABLE_WAIT_S = 1.0


class Terminal:
    """The launcher's terminal (`out`), written without ever blocking the caller: by a thread
    when `out` is a file descriptor, at once otherwise (a StringIO)."""

    def __init__(self, out: IO[str], limit: int = QUEUE_BYTES) -> None:
        self._out = out
        self._limit = limit
        self._encoding = getattr(out, "encoding", None) or "utf-8"
        self._fd = _fileno(out)
        if self._fd is not None:
            setup.say(out, "")  # what `out` holds yet goes first
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._dropped = 0
        self._writing = False
        self._broken = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def write(self, text: str) -> None:
        """Queue `text` for the terminal; dropped (and counted) when the queue is full. Never
        blocks, never raises."""
        if self._fd is None:
            setup.say(self._out, text)
            return
        data = text.encode(self._encoding, errors="replace")
        with self._changed:
            if self._broken:
                return
            if self._queued + len(data) > self._limit:
                self._dropped += 1
                return
            self._queue.append(data)
            self._queued += len(data)
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mscluster-terminal", daemon=True
                )
                self._thread.start()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the terminal to take what is queued; whether it did."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._writing, timeout_s)

    def _run(self) -> None:
        assert self._fd is not None
        while True:
            with self._changed:
                self._writing = False
                self._changed.notify_all()
                self._changed.wait_for(lambda: bool(self._queue) or bool(self._dropped))
                data = b"".join(self._queue) + self._dropped_note()
                self._queue.clear()
                self._queued = 0
                self._writing = True
            try:
                _write_all(self._fd, data)
            except OSError:  # a pipe whose reader went away, a terminal hung up: the job goes on
                with self._changed:
                    self._broken = True
                    self._queue.clear()
                    self._dropped = 0
                    self._writing = False
                    self._changed.notify_all()
                return

    def _dropped_note(self) -> bytes:
        """The line that says what was dropped since the last one, once the queue has emptied
        (the caller holds the lock); b"" when nothing was."""
        if not self._dropped or self._queue:
            return b""
        dropped, self._dropped = self._dropped, 0
        note = (
            f"mscluster: {dropped} line{'' if dropped == 1 else 's'} of output not shown: the "
            "terminal did not keep up (each process's log holds all of its output)\n"
        )
        return note.encode(self._encoding, errors="replace")


def _fileno(out: IO[str]) -> int | None:
    try:
        return out.fileno()
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None


def _write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd`, waiting while it would block (a descriptor another process made
    non-blocking)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            with contextlib.suppress(OSError, ValueError):
                select.select([], [fd], [], WRITABLE_WAIT_S)


class EchoLines:
    """A worker's output, fed in chunks as it comes, cut into the lines the terminal shows:
    each line as a terminal would show it, from its last carriage return on (a progress bar's
    last state; a CRLF ends a line as a LF does), at most `cap` bytes of it."""

    def __init__(self, cap: int = ECHO_LINE_BYTES) -> None:
        self._cap = cap
        self._line = bytearray()
        self._cut = 0  # bytes of the line past `cap`, not kept
        self._return = False  # the last byte fed was a carriage return

    def feed(self, chunk: bytes) -> list[tuple[bytes, int]]:
        """The lines `chunk` ends, each with how many of its bytes were cut."""
        ended = []
        *whole, rest = chunk.split(b"\n")
        for piece in whole:
            self._add(piece)
            ended.append((bytes(self._line), self._cut))
            self._clear()
        self._add(rest)
        return ended

    def end(self) -> list[tuple[bytes, int]]:
        """At the end of the output: the last line, when it has no newline."""
        if not self._line and not self._cut:
            return []
        last = [(bytes(self._line), self._cut)]
        self._clear()
        return last

    def _add(self, piece: bytes) -> None:
        if not piece:
            return
        if self._return:  # a carriage return followed by more: the line starts over
            self._clear()
        returns = piece.endswith(b"\r")  # a CRLF's, or a bar's: the next byte tells
        piece = piece.rstrip(b"\r")
        if b"\r" in piece:
            self._clear()
            piece = piece.rsplit(b"\r", 1)[1]
        room = max(self._cap - len(self._line), 0)
        self._line += piece[:room]
        self._cut += max(len(piece) - room, 0)
        self._return = returns

    def _clear(self) -> None:
        self._line.clear()
        self._cut = 0
        self._return = False
