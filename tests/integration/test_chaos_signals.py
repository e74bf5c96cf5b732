"""`mscluster chaos` killed from outside leaves no network behind, and a later run reclaims
what a dead one left.

A chaos run with partitions puts each worker in a network namespace and its scheduler on an
address of `lo`. SIGTERM (or SIGINT) from outside ends the run through its teardown; a run
killed with SIGKILL cannot, so the next lab that reserves a subnet deletes the namespaces, links
and addresses of every subnet whose owner's process is gone. Needs root and iproute2 (CI runs
as root); skipped, saying why, elsewhere.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from cluster.testing import wait_until
from cluster.tools.netlab import RESERVATIONS, NetworkLab, release_net, reserve_net
from tests.procs import PYTHON, ROOT, private_copy

pytestmark = pytest.mark.slow

START_S = 120.0
STOP_S = 60.0


@pytest.fixture(autouse=True)
def _netns() -> None:
    why = NetworkLab.why_not_available()
    if why:
        pytest.skip(why)


def ip(*args: str) -> str:
    """What `ip ARGS` printed (its failure is no error: it is asked, or cleans up)."""
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=30, check=False
    ).stdout


def leftovers(net: int) -> list[str]:
    """What of subnet `net`'s lab is on this host: namespaces, links, addresses on lo."""
    found = []
    for args in (["netns", "list"], ["-o", "link"], ["-o", "addr", "show", "dev", "lo"]):
        out = ip(*args)
        found += [
            line
            for line in out.splitlines()
            if f"cluster-{net}-w" in line or f"cl{net}h" in line or f"10.{net}.250." in line
        ]
    return found


def net_of(pid: int) -> int | None:
    """The subnet the lab of process `pid` reserved, once it has."""
    for path in RESERVATIONS.glob("[0-9]*"):
        try:
            if path.read_text().split()[:1] == [str(pid)]:
                return int(path.name)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_chaos_stopped_by_a_signal_tears_its_network_down(tmp_path: Path, sig: int) -> None:
    script = private_copy(tmp_path, ROOT / "examples" / "train_mlp.py")
    chaos = subprocess.Popen(
        [
            PYTHON, "-m", "cluster", "chaos", "--seed", "1", "--every", "60",
            "--faults", "partition", "--duration", "120", "--",
            "--worker-num", "2", "--local-worker-num", "2", "--log-dir", str(tmp_path / "logs"),
            str(script), "--steps", "100000", "--step-delay", "0.05", "--out", str(tmp_path / "o"),
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: net_of(chaos.pid) is not None, START_S, "the lab's reservation")
        net = net_of(chaos.pid)
        assert net is not None
        wait_until(lambda: len(leftovers(net)) >= 3, START_S, "its namespaces and address")
        chaos.send_signal(sig)
        _, said = chaos.communicate(timeout=STOP_S)
    finally:
        if chaos.poll() is None:
            chaos.kill()
        # Drained and closed whatever happened: a pipe left open is a ResourceWarning when the
        # Popen is collected, in whichever test runs then.
        chaos.communicate(timeout=STOP_S)
    assert chaos.returncode == 128 + sig, said
    assert leftovers(net) == [], said
    assert net_of(chaos.pid) is None  # its reservation released


def test_a_later_lab_reclaims_what_a_dead_owner_left() -> None:
    net = reserve_net()
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    made = [
        ["ip", "netns", "add", f"cluster-{net}-w0"],
        ["ip", "link", "add", f"cl{net}h0", "type", "veth", "peer", "name", f"cl{net}p0"],
        ["ip", "addr", "add", f"10.{net}.250.1/32", "dev", "lo"],
    ]
    taken: int | None = None
    try:
        for args in made:
            subprocess.run(args, check=True, capture_output=True, timeout=30)
        (RESERVATIONS / str(net)).write_text(f"{dead}\n")  # as a SIGKILLed lab leaves it
        assert len(leftovers(net)) >= 3
        taken = reserve_net()
        assert leftovers(net) == []
        assert taken == net or taken < net  # free again: the lowest free subnet is taken
    finally:
        if taken is not None:
            release_net(taken)
        ip("netns", "delete", f"cluster-{net}-w0")
        ip("link", "del", f"cl{net}h0")
        ip("addr", "del", f"10.{net}.250.1/32", "dev", "lo")
