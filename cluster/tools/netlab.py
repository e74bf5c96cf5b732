"""Network namespaces for network faults: `NetworkLab` (re-exported by `cluster.testing`).

Worker i runs in namespace `cluster-<net>-w<i>` at 10.<net>.i.2, joined by a veth pair to this
host's 10.<net>.i.1; the schedulers are at 10.<net>.250.1, .2, ... on this host's loopback.
Needs root and iproute2.

Labs of several processes run at once (tests in parallel, two chaos runs): each takes a subnet
10.<net>.0.0/16 no other lab holds. The choice is made under a lock file, skipping every subnet
that a live lab has reserved (a file naming its process) or that an address of this host
already uses (a lab of an older version, or someone else's network), and it is reserved before
the lock is released. A lab's interface and namespace names carry its subnet, so they are unique
too. A reservation is released at teardown; one whose process has died is reclaimed by the
next lab that reserves a subnet: the namespaces, links and loopback addresses of that subnet are
deleted, then it may be taken again. Teardown holds SIGTERM and SIGINT off until it is done,
and `setup` notes each undo before its deed, so a signal at any moment leaks nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from cluster.protocol.errors import ClusterError, NetemUnavailableError

# The subnets 10.<net>.0.0/16 labs may take: one per live lab.
NETS = range(100, 200)
SCHEDULER_OCTET = 250  # 10.<net>.250.<k+1>: scheduler k
MAX_WORKERS = SCHEDULER_OCTET
RESERVATIONS = Path(tempfile.gettempdir()) / "cluster-netlab"


class NetworkLab:
    """Worker i in namespace `namespace(i)` at `worker_ip(i)`; `schedulers` scheduler addresses
    on this host (`scheduler_ips`). The subnet is reserved when the lab is made."""

    def __init__(self, workers: int, *, schedulers: int = 1) -> None:
        if not 1 <= workers <= MAX_WORKERS or not 1 <= schedulers <= 9:
            raise ClusterError(
                f"NetworkLab(workers={workers}, schedulers={schedulers}): workers must be 1-"
                f"{MAX_WORKERS} and schedulers 1-9"
            )
        self.workers = workers
        self._net = reserve_net()
        self._tag = self._net
        self.scheduler_ips = [
            f"10.{self._net}.{SCHEDULER_OCTET}.{k + 1}" for k in range(schedulers)
        ]
        self.scheduler_ip = self.scheduler_ips[0]
        self._made: list[Callable[[], None]] = []

    @property
    def net(self) -> int:
        """The second octet of this lab's subnet (10.<net>.0.0/16)."""
        return self._net

    @staticmethod
    def why_not_available() -> str | None:
        """Why network faults cannot run here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (`ip`, `tc`) is not installed"
        return None

    def namespace(self, i: int) -> str:
        return f"cluster-{self._tag}-w{i}"

    def host_link(self, i: int) -> str:
        return f"cl{self._tag}h{i}"

    def worker_ip(self, i: int) -> str:
        return f"10.{self._net}.{i}.2"

    def command(self, i: int, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(i), *args]

    def setup(self) -> None:
        why = self.why_not_available()
        if why:
            raise ClusterError(f"network faults are not available: {why}")
        try:
            for ip in self.scheduler_ips:
                # Each undo is noted before its deed: a signal between the two leaks nothing.
                self._made.append(functools.partial(_ip, "addr", "del", f"{ip}/32", "dev", "lo"))
                _ip("addr", "add", f"{ip}/32", "dev", "lo")
            for i in range(self.workers):
                self._link(i)
        except BaseException:
            self.teardown()
            raise

    def _link(self, i: int) -> None:
        ns, host, peer = self.namespace(i), self.host_link(i), f"cl{self._tag}p{i}"
        # Deleting the namespace deletes its end of the veth pair, and so the pair.
        self._made.append(lambda: _ip("netns", "delete", ns))
        _ip("netns", "add", ns)
        # Deleted explicitly too: a namespace's links go away only when the kernel gets to it.
        self._made.append(lambda: _run(["ip", "link", "del", host], check=False))
        _ip("link", "add", host, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("addr", "add", f"10.{self._net}.{i}.1/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{self.worker_ip(i)}/24", "dev", peer)
        _ip("-n", ns, "link", "set", peer, "up")
        _ip("-n", ns, "route", "add", "default", "via", f"10.{self._net}.{i}.1")

    def teardown(self) -> None:
        """Undo what `setup` made, SIGTERM and SIGINT held off meanwhile (a second one would
        cut it short and leave namespaces behind); they are taken after it."""
        with _signals_held():
            while self._made:
                with contextlib.suppress(ClusterError, OSError):
                    self._made.pop()()
            release_net(self._net)

    def cut(self, i: int) -> None:
        _ip("link", "set", self.host_link(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.host_link(i), "up")

    def impair(self, i: int, *, delay_ms: float = 0.0, loss_percent: float = 0.0) -> None:
        """Delay and lose the packets this host sends to worker i (tc netem); 0, 0 clears."""
        link = self.host_link(i)
        _run(["tc", "qdisc", "del", "dev", link, "root"], check=False)  # none there is fine
        if delay_ms or loss_percent:
            netem = ["delay", f"{delay_ms:g}ms", "loss", f"{loss_percent:g}%"]
            try:
                _run(["tc", "qdisc", "add", "dev", link, "root", "netem", *netem])
            except ClusterError as exc:
                if "unknown" in str(exc):
                    raise NetemUnavailableError(
                        "tc netem is not available in this kernel (module sch_netem): delay "
                        "and loss cannot be injected here; cutting links still works"
                    ) from None
                raise


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    held = {signal.SIGTERM, signal.SIGINT}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


# -- which subnet ----------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    with (directory / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reserved_by_the_living(path: Path) -> bool:
    try:
        return _alive(int(path.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return False  # unreadable or torn: nobody's


def nets_in_use() -> set[int]:
    """The second octets of every 10.x address on this host's interfaces, and of every
    namespace or link named as a lab's (`ip` missing: none)."""
    found: set[int] = set()
    for args in (["ip", "-o", "addr", "show"], ["ip", "netns", "list"], ["ip", "-o", "link"]):
        try:
            ran = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
            out = ran.stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found.update(int(n) for n in re.findall(r"\b10\.(\d{1,3})\.\d{1,3}\.\d{1,3}", out))
        found.update(int(n) for n in re.findall(r"\bcluster-(\d+)-w\d+", out))
        found.update(int(n) for n in re.findall(r"\bcl(\d+)[hp]\d+", out))
    return found


def reserve_net(
    directory: Path = RESERVATIONS, in_use: Callable[[], set[int]] = nets_in_use
) -> int:
    """A subnet octet that no live lab holds and no interface uses, reserved for this
    process; ClusterError when all of NETS are taken."""
    with _locked(directory):
        taken = in_use()
        if reclaim_dead(directory, taken):
            taken = in_use()  # what else may hold them (someone else's network) still counts
        for net in NETS:
            path = directory / str(net)
            if net in taken or _reserved_by_the_living(path):
                continue
            path.write_text(f"{os.getpid()}\n")
            return net
    raise ClusterError(
        f"every network lab subnet (10.{NETS.start}-{NETS.stop - 1}.0.0/16) is in use by a "
        f"running lab or an address of this host; end some, or remove stale reservations in "
        f"{directory}"
    )


def reclaim_dead(
    directory: Path, present: set[int], remove: Callable[[int], None] | None = None
) -> list[int]:
    """Drop the reservations of labs whose process has died (killed with SIGKILL, or before
    their teardown) and remove what they left on this host (`present`: the subnets in use
    here); the subnets whose leftovers were removed. Call with the lock held."""
    remove = remove or remove_leftovers
    removed = []
    for path in sorted(directory.iterdir()):
        if not path.name.isdigit() or _reserved_by_the_living(path):
            continue
        if int(path.name) in present:
            remove(int(path.name))
            removed.append(int(path.name))
        path.unlink(missing_ok=True)
    return removed


def remove_leftovers(net: int) -> None:
    """Delete the namespaces, links and loopback addresses a lab of subnet `net` makes."""
    namespaces = _output(["ip", "netns", "list"])
    for ns in re.findall(rf"^(cluster-{net}-w\d+)\b", namespaces, re.MULTILINE):
        _run(["ip", "netns", "delete", ns], check=False)
    for link in re.findall(rf"\b(cl{net}[hp]\d+)\b", _output(["ip", "-o", "link"])):
        _run(["ip", "link", "del", link], check=False)
    on_lo = _output(["ip", "-o", "addr", "show", "dev", "lo"])
    for ip in re.findall(rf"\b(10\.{net}\.{SCHEDULER_OCTET}\.\d+)/32", on_lo):
        _run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=False)


def _output(args: list[str]) -> str:
    try:
        ran = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return ran.stdout


def release_net(net: int, directory: Path = RESERVATIONS) -> None:
    with contextlib.suppress(OSError), _locked(directory):
        path = directory / str(net)
        if path.read_text().split()[:1] == [str(os.getpid())]:
            path.unlink()


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(args: list[str], *, check: bool = True) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(args)} failed: {result.stderr.strip()}")
