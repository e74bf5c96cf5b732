"""NetworkLab's subnet choice: labs of processes that run at once never share a subnet (nor,
so, interface and namespace names), and a reservation whose process died is taken again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.protocol.errors import ClusterError
from cluster.tools.netlab import NETS, reclaim_dead, release_net, reserve_net


def nothing_in_use() -> set[int]:
    return set()


def test_two_labs_of_one_process_get_two_subnets(tmp_path: Path) -> None:
    first = reserve_net(tmp_path, nothing_in_use)
    second = reserve_net(tmp_path, nothing_in_use)
    assert first != second
    release_net(first, tmp_path)
    assert reserve_net(tmp_path, nothing_in_use) == first  # released: free again


def test_a_subnet_an_address_of_this_host_uses_is_skipped(tmp_path: Path) -> None:
    assert reserve_net(tmp_path, lambda: {NETS[0], NETS[1]}) == NETS[2]


def test_the_reservation_of_a_dead_process_is_taken_again(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (tmp_path / str(NETS[0])).write_text(f"{dead}\n")
    (tmp_path / str(NETS[1])).write_text("torn")
    (tmp_path / str(NETS[2])).write_text(f"{os.getppid()}\n")  # alive: kept
    assert reserve_net(tmp_path, nothing_in_use) == NETS[0]
    assert reserve_net(tmp_path, nothing_in_use) == NETS[1]
    assert reserve_net(tmp_path, nothing_in_use) == NETS[3]


def test_labs_reserved_by_processes_running_at_once_are_all_different(tmp_path: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from cluster.tools.netlab import reserve_net;"
        "print(reserve_net(Path(sys.argv[1]), set), flush=True); sys.stdin.read()"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    try:
        got = [int(proc.stdout.readline()) for proc in procs if proc.stdout is not None]
    finally:
        for proc in procs:
            proc.communicate("", timeout=30)
    assert len(set(got)) == 6


def test_every_subnet_taken_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"every network lab subnet .* is in use"):
        reserve_net(tmp_path, lambda: set(NETS))


def test_a_dead_labs_leftovers_are_removed_before_its_subnet_is_taken(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    (tmp_path / str(NETS[0])).write_text(f"{dead}\n")  # left namespaces behind
    (tmp_path / str(NETS[1])).write_text(f"{dead}\n")  # left nothing
    (tmp_path / str(NETS[2])).write_text(f"{os.getppid()}\n")  # alive: never touched
    removed: list[int] = []
    assert reclaim_dead(tmp_path, {NETS[0], NETS[2]}, removed.append) == [NETS[0]]
    assert removed == [NETS[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(NETS[2])]
