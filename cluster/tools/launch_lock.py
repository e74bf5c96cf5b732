"""One `mscluster run` per log directory: `<log-dir>/launcher.lock`, held with `flock`.

Two launchers in one log directory would each write the job secret, `pids`, the event log and
the process logs over the other's: the running job's restarted workers would then prove the new
secret and be refused. So a launcher holds an exclusive `flock` on `<log-dir>/launcher.lock`
from before it writes anything there until it ends (`launch_setup.make_paths`). The kernel
drops the lock of a process that ends, however it ends (SIGKILL included), so a launcher that
died never keeps the next one out. The holder writes its pid, host and --master-port into the
file; a launcher that finds the lock held is refused at once (a ConfigError: one line, exit 2)
naming the directory, the holder and what to do, and has changed nothing there.

The lock is advisory: the readers of the directory (`mscluster status` and `events` reading
job.secret and events.jsonl, a tool reading `pids`) never take it and never wait for it. The
file stays when its holder ends: removing it would let a newcomer lock a new file while another
locks the old one. The descriptor is not inherited (O_CLOEXEC): no child of the launcher keeps
the lock after it. The file is opened without following a link (`atomic`) and written only when
it is this user's own regular file with one name. Where the file system has no locks (ENOLCK:
NFS without its lock daemon; Lustre mounted without flock) the launcher goes on without one,
saying so (`take` returns the line).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from cluster.protocol.errors import ConfigError
from cluster.storage import atomic, holder_lock

LOCK_FILE = "launcher.lock"


class LogDirLock:
    """The lock of log directory `directory` for this launcher: `take`, then `release`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def take(self, port: int) -> str:
        """Lock the directory, or a ConfigError when another launcher holds it (nothing
        written); the holder's pid, host and `port` written into the file. Returns '' or,
        where the file system has no locks, the line to say: the run goes on without one."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holder_lock.read_holder(fd)
            os.close(fd)
            raise ConfigError(self._refusal(holder)) from None
        except OSError as exc:  # ENOLCK, ENOSYS, EOPNOTSUPP: no locks on this file system
            os.close(fd)
            return (
                f"mscluster: --log-dir {str(self.directory)!r} cannot be locked (its file "
                f"system refuses a lock on {LOCK_FILE}: {exc.strerror}): nothing keeps another "
                "mscluster run out of it; give every job its own --log-dir"
            )
        self._fd = fd
        holder_lock.write_holder(fd, port=port)
        return ""

    def release(self, *, remove: bool = False) -> None:
        """Let the lock go. The file stays; with `remove`, given only where this run made the
        directory and is refused before it began, the file is removed too (the directory next)."""
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with it
            self._fd = None

    def _open(self) -> int:
        try:
            fd, unfit = atomic.open_own(self.path)
        except OSError as exc:
            raise ConfigError(
                f"--log-dir: cannot write {str(self.path)!r} ({exc.strerror or exc})"
            ) from None
        if fd is not None:
            return fd
        if unfit == "a symbolic link":
            raise ConfigError(
                f"--log-dir: {str(self.path)!r} is a symbolic link: it was not made by "
                "mscluster run, and is never followed; remove it"
            )
        raise ConfigError(
            f"--log-dir: {str(self.path)!r} is {unfit}: it was not made by mscluster run "
            "of this user, and writing it would change a file elsewhere; remove it"
        )

    def _refusal(self, holder: dict[str, object]) -> str:
        if holder.get("pid") is None:
            who = "whose pid and host are not written yet"
        else:
            who = f"{holder_lock.described(holder)}, --master-port {holder.get('port')}"
        return (
            f"--log-dir {str(self.directory)!r} is in use by another mscluster run ({who}), "
            "whose job secret, pids and logs this run would replace: give this job another "
            "--log-dir, or stop that job first"
        )
