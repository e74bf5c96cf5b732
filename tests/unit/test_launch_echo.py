"""cluster.tools.launch_echo: a worker's output cut into terminal lines, and a terminal that
never blocks the launcher."""

from __future__ import annotations

import os
import threading
import time

from cluster.tools.launch_echo import EchoLines, Terminal


def test_lines_are_what_a_terminal_shows_cut_at_the_cap() -> None:
    lines = EchoLines(cap=10)
    assert lines.feed(b"abc\r\ndef\rghi\n") == [(b"abc", 0), (b"ghi", 0)]
    # A progress bar: only its last state, however many updates and chunks it took.
    assert lines.feed(b"\rbar 1\rbar 2") == []
    assert lines.feed(b"\r") == []
    assert lines.feed(b"bar 3\r") == []
    assert lines.feed(b"\n") == [(b"bar 3", 0)]
    # A long line: its first `cap` bytes, and how many more it had.
    assert lines.feed(b"x" * 25) == []
    assert lines.feed(b"yy\nz") == [(b"x" * 10, 17)]
    assert lines.end() == [(b"z", 0)]
    assert lines.end() == []


def test_a_terminal_that_does_not_read_never_blocks_and_is_told_what_it_missed() -> None:
    read_end, write_end = os.pipe()
    out = os.fdopen(write_end, "w")
    try:
        terminal = Terminal(out, limit=64 * 1024)
        started = time.monotonic()
        for i in range(10_000):  # 1 MB, far more than the pipe and the queue hold
            terminal.write(f"line {i} " + "z" * 90 + "\n")
        assert time.monotonic() - started < 5.0
        assert not terminal.drain(0.2)  # nobody reads yet
        received = bytearray()
        reader = threading.Thread(target=_read_all, args=(read_end, received), daemon=True)
        reader.start()
        assert terminal.drain(10.0)
        terminal.write("the end\n")
        assert terminal.drain(10.0)
    finally:
        out.close()
    reader.join(10.0)
    text = received.decode()
    assert text.startswith("line 0 ")
    assert "of output not shown: the terminal did not keep up" in text
    assert text.endswith("the end\n")


def _read_all(fd: int, into: bytearray) -> None:
    try:
        while chunk := os.read(fd, 65536):
            into += chunk
    finally:
        os.close(fd)
