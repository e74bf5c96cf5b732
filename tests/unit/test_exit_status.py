"""What a worker tells the scheduler it ends of, besides an uncaught exception: the status its
main thread asked `sys.exit()` for, once `cluster.init()` watches it. Real interpreters: the
watch wraps the process's own `sys.exit`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from cluster.api import excepthook
from cluster.protocol.display import ERROR_LINE_CHARS


def test_the_line_of_an_exit_status() -> None:
    assert excepthook.exit_line(None) is None
    assert excepthook.exit_line(0) is None
    assert excepthook.exit_line(False) is None
    assert excepthook.exit_line(2) == "exited with status 2"
    assert excepthook.exit_line("loss is NaN\nat step 7") == "exited with status 1: loss is NaN"
    assert excepthook.exit_line("") == "exited with status 1"
    assert len(excepthook.exit_line("x" * 10_000) or "") == ERROR_LINE_CHARS


def watched(body: str) -> list[str]:
    """The lines `body` prints after `watch_exits()`, in a fresh interpreter."""
    script = "import sys, threading\nfrom cluster.api import excepthook\nexcepthook.watch_exits()\n"
    result = subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_main_threads_last_sys_exit_decides_and_another_threads_does_not_count() -> None:
    lines = watched(
        """
        def attempt(call, *args):
            try:
                call(*args)
            except SystemExit:
                pass
            print(excepthook.exit_failure())

        attempt(sys.exit, 1)
        attempt(sys.exit)
        attempt(exit, "bad input")
        attempt(quit, 0)
        thread = threading.Thread(target=sys.exit, args=(4,))
        thread.start()
        thread.join()
        print(excepthook.exit_failure())
        print(repr(exit) == repr(quit).replace("quit", "exit"))
        """
    )
    assert lines == [
        "exited with status 1",
        "None",
        "exited with status 1: bad input",
        "None",
        "None",
        "True",
    ]
