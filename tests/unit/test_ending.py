"""cluster.worker.ending: a background thread ends the process by raising the job's error in the
main thread (finally blocks and atexit run, one line, exit 1); os._exit only as the last resort,
when the main thread does not end the process within the grace. Real processes, real signals."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from cluster.worker import ending

GRACE_S = 1.0
BOUND_S = 30.0

PRELUDE = f"""
import atexit, os, signal, sys, threading
from cluster.api import excepthook
from cluster.protocol.errors import JobFailedError
from cluster.worker.ending import SIGNAL, Ending

excepthook.install()
atexit.register(lambda: print("atexit ran", flush=True))
end = Ending(lambda line: sys.stderr.write(f"cluster: {{line}}\\n"), grace_s={GRACE_S})
error = JobFailedError("rank 1 (node 1) failed: its process ended")
"""


def run(body: str) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=False,
    )
    return result


def test_a_main_thread_in_python_gets_the_error_and_ends_as_a_program_ends() -> None:
    result = run(
        """
        threading.Timer(0.2, end.end, args=(error,)).start()
        try:
            while True:
                sum(range(1000))  # pure Python: the handler runs between bytecodes
        finally:
            print("finally ran", flush=True)
        """
    )
    assert result.returncode == ending.EXIT_CODE, result.stderr
    assert result.stdout.splitlines() == ["finally ran", "atexit ran"]
    assert result.stderr.splitlines() == [
        "cluster: JobFailedError: rank 1 (node 1) failed: its process ended"
    ]


def test_a_main_thread_stuck_in_a_c_call_still_ends_within_the_grace() -> None:
    # A read that the kernel restarts after the signal (SA_RESTART): Python's handler never
    # runs, as in a gloo collective waiting for the dead peer.
    result = run(
        """
        signal.siginterrupt(SIGNAL, False)
        read_end, _ = os.pipe()
        threading.Timer(0.2, end.end, args=(error,)).start()
        try:
            os.read(read_end, 1)
        finally:
            print("finally ran", flush=True)
        """
    )
    assert result.returncode == ending.EXIT_CODE, result.stderr
    assert result.stdout == ""  # the last resort: nothing of the program ran after
    assert result.stderr.splitlines() == ["cluster: rank 1 (node 1) failed: its process ended"]


def test_a_program_that_swallows_the_error_is_ended_by_the_last_resort() -> None:
    result = run(
        """
        threading.Timer(0.2, end.end, args=(error,)).start()
        while True:
            try:
                while True:
                    sum(range(1000))
            except JobFailedError:
                print("caught, carrying on", flush=True)
        """
    )
    assert result.returncode == ending.EXIT_CODE
    assert result.stdout.splitlines() == ["caught, carrying on"]  # raised once, not again
    assert result.stderr.splitlines() == ["cluster: rank 1 (node 1) failed: its process ended"]


def test_a_program_with_its_own_handler_keeps_it_and_gets_the_exit_at_once() -> None:
    result = run(
        """
        signal.signal(SIGNAL, lambda *_: print("the program's handler", flush=True))
        own = Ending(lambda line: sys.stderr.write(f"cluster: {line}\\n"))
        assert not own.interrupts
        threading.Thread(target=own.end, args=(error,)).start()
        threading.Event().wait(20)
        """
    )
    assert result.returncode == ending.EXIT_CODE
    assert "the program's handler" not in result.stdout
    assert result.stderr.splitlines() == ["cluster: rank 1 (node 1) failed: its process ended"]


def test_an_error_already_raised_by_a_waiting_call_gets_only_the_last_resort() -> None:
    result = run(
        """
        end.end(error, raised=True)  # a waiting cluster call raised it in the main thread
        try:
            threading.Event().wait(20)
        except JobFailedError:
            print("raised again", flush=True)
        """
    )
    assert result.returncode == ending.EXIT_CODE
    assert "raised again" not in result.stdout
    assert result.stderr.splitlines() == ["cluster: rank 1 (node 1) failed: its process ended"]


def test_a_main_thread_dying_of_its_own_error_prints_its_line_whole() -> None:
    """A waiting call raised its own error as the job failed and nothing caught it; the job's
    end comes while `sys.excepthook` prints it (a loaded CI run): the hook's line is printed
    whole, with no "Error in sys.excepthook" and no traceback, and the process exits 1."""
    result = run(
        """
        said = excepthook._hook

        def hook(kind, value, traceback):
            ending_thread = threading.Thread(target=end.end, args=(error,))
            ending_thread.start()
            ending_thread.join()  # the signal is handled in here, in the main thread
            said(kind, value, traceback)

        sys.excepthook = hook
        raise JobFailedError("barrier failed: rank 1 (node 1) died")
        """
    )
    assert result.returncode == ending.EXIT_CODE
    assert result.stdout.splitlines() == ["atexit ran"]
    assert result.stderr.splitlines() == [
        "cluster: JobFailedError: barrier failed: rank 1 (node 1) died"
    ]


def test_a_program_that_takes_the_signal_after_init_gets_the_exit_at_once() -> None:
    # The program installs its own handler after the library took the signal: the library
    # does not run it (sending the signal) and ends the process at once instead.
    result = run(
        """
        assert end.interrupts
        signal.signal(SIGNAL, lambda *_: print("the program's handler", flush=True))
        threading.Thread(target=end.end, args=(error,)).start()
        threading.Event().wait(20)
        """
    )
    assert result.returncode == ending.EXIT_CODE
    assert "the program's handler" not in result.stdout
    assert result.stderr.splitlines() == ["cluster: rank 1 (node 1) failed: its process ended"]


def test_while_finalizing_the_end_sends_no_signal_and_keeps_the_last_resort() -> None:
    # The finalize raises the error itself: nothing is raised in it (a closer would log it and
    # go on, an atexit callback would print a traceback and exit 0), and the last resort still
    # bounds the process.
    result = run(
        """
        end.quiet()
        ender = threading.Thread(target=end.end, args=(error,))
        ender.start()
        ender.join()
        try:
            sum(range(1000))
            print("not interrupted", flush=True)
            threading.Event().wait(20)
        except JobFailedError:
            print("raised", flush=True)
        """
    )
    assert result.returncode == ending.EXIT_CODE
    assert result.stdout.splitlines() == ["not interrupted"]
    assert result.stderr.splitlines() == ["cluster: rank 1 (node 1) failed: its process ended"]


def test_release_gives_the_signal_back_its_default_action() -> None:
    # A closed session leaves nothing behind: a SIGUSR2 after it does what it does in a process
    # without cluster (a batch system's warning signal ends it, by default).
    result = run(
        """
        print(signal.getsignal(SIGNAL) == end._raise, flush=True)
        end.release()
        print(signal.getsignal(SIGNAL) is signal.SIG_DFL, end.interrupts, flush=True)
        os.kill(os.getpid(), SIGNAL)
        threading.Event().wait(20)
        """
    )
    assert result.stdout.splitlines() == ["True", "True False"]
    assert result.returncode == -ending.SIGNAL


def test_release_leaves_a_handler_the_program_took_since() -> None:
    result = run(
        """
        signal.signal(SIGNAL, lambda signum, frame: print("own handler", flush=True))
        end.release()
        os.kill(os.getpid(), SIGNAL)
        print("still here", flush=True)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["own handler", "still here", "atexit ran"]
