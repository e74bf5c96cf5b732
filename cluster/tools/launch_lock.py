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

The lock is the file its path names (`holder_lock.try_lock` given the path: a file removed or
replaced between its open and its lock is opened anew). One removed or replaced while held (by
hand, or with the directory's other files) keeps no other launcher out by itself, so the
launcher also holds an exclusive `flock` on the directory itself, taken first, before the lock
file is opened or made (`holder_lock.lock_directory`): a directory is not removed or replaced
behind a running job as a file in it is, so a newcomer is refused there, before it has made or
written anything, however the lock file has fared. The refusal names the holder as its lock
file does once it names a live process again (the holder locks it anew within a check; waited
for up to CHECK_S + `holder_lock.SETTLE_S`), or says that it names no one. Where the directory
cannot be locked, the lock file alone keeps others out.

The launcher checks every CHECK_S while its job runs (`watch`) that the path still names its
file. Where it does not, it says so in one line and locks the file there now, at once: then
the file names it to newcomers again; where another process holds that file (a launcher on a
file system that locks no directory), it says who, and its job goes on (stopping a running job
for a lock file would lose its work): the two runs write over each other's files until one is
stopped. It tries again at each check, and says when it holds the lock again.

A run refused before it began removes the file only while it holds its lock (`release`), and
before it lets the lock go: a launcher that opened the old file and locks it once it is let go
finds that the path no longer names it and locks the file there now. Removed after the lock
was let go, the file could be one that another launcher had just locked.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from cluster.protocol.errors import ConfigError
from cluster.storage import atomic, holder_lock

LOCK_FILE = "launcher.lock"
# How often a launcher whose job runs checks that the path still names the file it locked.
CHECK_S = 1.0
# What a file system without locks answers `flock` with.
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


class LogDirLock:
    """The lock of log directory `directory` for this launcher: `take`, `watch` while the job
    runs, then `release`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self._hold = holder_lock.Hold(self.path)
        self._directory_fd: int | None = None  # the directory's own lock, where it can be had

    def take(self, port: int) -> str:
        """Lock the directory, or a ConfigError when another launcher holds it (nothing
        written, nothing made); the holder's pid, host and `port` written into the file.
        Returns '' or, where the file system has no locks, the line to say: the run goes on
        without one."""
        self._hold.tell(port=port)
        self._lock_directory()
        try:
            return self._take_file()
        except BaseException:
            self._release_directory()
            raise

    def _lock_directory(self) -> None:
        """The directory's own lock (`holder_lock.lock_directory`), taken before its lock file
        is opened (or made): a ConfigError naming the launcher that holds it, as its lock file
        names it (once it does, within a check: that file may have been removed or replaced
        behind it). Where the directory cannot be locked, the lock file alone keeps others
        out (its own errors said as `take` says them)."""
        try:
            fd = holder_lock.lock_directory(self.directory)
        except OSError:
            return
        if fd is None:
            holder = holder_lock.live_holder(self.path, CHECK_S + holder_lock.SETTLE_S)
            gone = f"which holds the directory; its {LOCK_FILE} was removed or replaced since"
            who = self._who(holder) if holder else f"{gone} and names no one"
            # The directory's lock is had only where the kernel locks directories (no shared
            # file system's): its holder is on this host, whatever an old file may say.
            raise ConfigError(self._refusal(who))
        self._directory_fd = fd

    def _release_directory(self) -> None:
        fd, self._directory_fd = self._directory_fd, None
        if fd is not None:
            os.close(fd)  # the lock goes with it

    def _take_file(self) -> str:
        """`take`'s lock of the file, the directory's held (or not to be had)."""
        fd = self._open()
        try:
            holder = self._hold.lock(fd)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise ConfigError(
                    f"--log-dir: cannot lock {str(self.path)!r} ({exc.strerror or exc}): give "
                    "this job another --log-dir"
                ) from None
            return (
                f"mscluster: --log-dir {str(self.directory)!r} cannot be locked (its file "
                f"system refuses a lock on {LOCK_FILE}: {exc.strerror}): nothing keeps another "
                "mscluster run out of it; give every job its own --log-dir"
            )
        if holder is not None:
            raise ConfigError(self._refusal(self._who(holder), holder))
        return ""

    async def watch(self, say: Callable[[str], None]) -> None:
        """While the job runs (until cancelled): `keep` every CHECK_S, its lines said."""
        while True:
            await asyncio.sleep(CHECK_S)
            line = await asyncio.to_thread(self.keep)
            if line:
                say(line)

    def keep(self) -> str:
        """'' while the path names the file this launcher locked (or it never held one: a file
        system without locks). Where the file was removed or replaced, the lock is let go and
        the file there now locked at once (`holder_lock.Hold.keep`); the line to say: locked
        anew, or not (held by another launcher: said once; each later `keep` tries again, and
        says when it holds it)."""
        found = self._hold.keep()
        if found is None or not found.news:
            return ""
        lost = f"mscluster: {str(self.path)!r} was removed or replaced while this run held it"
        if found.holder is not None:
            return (
                f"{lost}, and another mscluster run ({self._who(found.holder)}) has locked the "
                "file there since: this job goes on, but the two runs replace each other's job "
                f"secret, pids and logs in --log-dir {str(self.directory)!r}; stop one of them"
            )
        if found.error is not None:
            return (
                f"{lost}, and cannot be locked anew ({found.cause}): this job goes on, but "
                f"nothing keeps another mscluster run out of --log-dir {str(self.directory)!r}"
            )
        if found.repeated:
            return f"mscluster: this run holds {str(self.path)!r} again"
        return f"{lost}, so it kept no other launcher out: locked the file there anew"

    def release(self, *, remove: bool = False) -> None:
        """Let the lock go. The file stays; with `remove`, given only where this run made the
        directory and is refused before it began, the file is removed too (the directory next),
        while this run still holds it, and only then: removed after its lock was let go, or by
        a run that never held it, it may be the file another launcher has just locked."""
        fd = self._hold.fd
        if fd is not None:
            if remove and holder_lock.still_holds(fd, self.path):
                with contextlib.suppress(OSError):
                    self.path.unlink()
            self._hold.release()
        self._release_directory()

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

    def _refusal(self, who: str, holder: dict[str, object] | None = None) -> str:
        """Why this run is refused the directory: held by `who` (`holder`: what it wrote). A
        holder on another host shares the directory through a shared file system, most often
        as another host of the same job: each host's part of a job needs a directory of its
        own."""
        directory = str(self.directory)
        if holder is not None and holder_lock.elsewhere(holder):
            return (
                f"--log-dir {directory!r} is in use by the mscluster run of another host "
                f"({who}): the directory is shared by the hosts, and each host's part of a job "
                "writes its own job secret, pids and logs: give each host a --log-dir of its "
                f"own (e.g. --log-dir {directory}/node<rank>; without --log-dir, a job that "
                "spans hosts keeps each host's part in logs/node<rank>/)"
            )
        return (
            f"--log-dir {directory!r} is in use by another mscluster run ({who}), "
            "whose job secret, pids and logs this run would replace: give this job another "
            "--log-dir, or stop that job first"
        )

    @staticmethod
    def _who(holder: dict[str, object]) -> str:
        """The launcher that holds the lock, as the file says."""
        if holder.get("pid") is None:
            return "whose pid and host are not written yet"
        return f"{holder_lock.described(holder)}, --master-port {holder.get('port')}"
