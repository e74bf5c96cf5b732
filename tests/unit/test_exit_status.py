"""What a worker tells the scheduler it ends of, besides an uncaught exception: the status its
main thread asked `sys.exit()` for, once `cluster.init()` watches it. Real interpreters: the
watch wraps the process's own `sys.exit`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
    assert excepthook.exit_line(True) == "exited with status 1"


@pytest.mark.parametrize("code", [256, -1, 2**70, 300])
def test_the_status_told_is_the_status_the_process_exits_with(code: int) -> None:
    """The status is the low byte of what `sys.exit()` is given (255 past a C long long)."""
    exited = subprocess.run([sys.executable, "-c", f"raise SystemExit({code})"], check=False)
    told = excepthook.exit_line(code)
    assert told == (f"exited with status {exited.returncode}" if exited.returncode else None)


def test_an_uncaught_exception_before_the_watch_is_not_what_the_job_dies_of() -> None:
    """An uncaught exception shown by an interactive prompt of `code.interact()` (its hook sets
    what the process died of) before `cluster.init()` watches: not this job's crash."""
    script = textwrap.dedent(
        """
        import code, io, sys
        from cluster.api import excepthook
        excepthook.install()
        sys.stdin = io.StringIO("undefined_name\\n")
        sys.ps1 = sys.ps2 = ""  # no prompts among the lines printed
        code.interact(banner="", exitmsg="")
        print(excepthook.crash() is not None)
        excepthook.watch_exits()
        print(excepthook.crash())
        """
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert ran.stdout.splitlines() == ["True", "None"], ran.stderr


def test_an_interactive_interpreter_dies_of_no_exception_its_prompt_showed() -> None:
    """`python -i`: the prompt shows an uncaught exception and goes on; the process exits with
    the prompt's status, 0 here, and tells no crash."""
    typed = [
        "from cluster.api import excepthook",
        "excepthook.install()",
        "excepthook.watch_exits()",
        "atexit.register(lambda: print('crash:', excepthook.crash()))",
        "undefined_name",
    ]
    ran = subprocess.run(
        [sys.executable, "-i", "-c", "import atexit"],
        input="\n".join(typed) + "\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert "crash: None" in ran.stdout, (ran.stdout, ran.stderr)
    assert "NameError" in ran.stderr


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
