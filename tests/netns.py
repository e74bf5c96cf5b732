"""Test hosts on one machine: network namespaces on one network, always removed.

`hosts(n)` makes n namespaces, each with a veth link whose other end is on a bridge in a
namespace of its own (the switch): every host reaches every other by its address, nothing is
added to the machine's own namespace, and deleting the namespaces deletes every link. Needs root
and iproute2; without them the test is skipped saying why, except under
CLUSTER_REQUIRE_SERVERS=1 (CI, as root), where it fails (`tests.servers.require`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.servers import require

SUBNET = "10.231.{}.{}"
BRIDGE = "br0"


@dataclass(frozen=True)
class Host:
    namespace: str
    ip: str
    link: str

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def why_not_available() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def _delete(namespaces: list[str]) -> None:
    for namespace in namespaces:
        # Deleting a namespace deletes its links, and so the other end of each veth pair.
        subprocess.run(
            ["ip", "netns", "delete", namespace], capture_output=True, timeout=30, check=False
        )


def _plug(host: Host, switch: str, port: str) -> None:
    """`host`'s link, up with its address, its other end `port` on the switch's bridge."""
    _ip("netns", "add", host.namespace)
    _ip("-n", host.namespace, "link", "set", "lo", "up")
    _ip(
        *("link", "add", host.link, "netns", host.namespace, "type", "veth"),
        *("peer", "name", port, "netns", switch),
    )
    _ip("-n", host.namespace, "addr", "add", f"{host.ip}/24", "dev", host.link)
    _ip("-n", host.namespace, "link", "set", host.link, "up")
    _ip("-n", switch, "link", "set", port, "master", BRIDGE, "up")


@contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """`n` hosts (namespaces) on one /24 network, addresses .1 to .n; removed at the end."""
    require(why_not_available())
    tag = f"{os.getpid() % 100000}"
    net = os.getpid() % 250 + 1
    switch = f"cl-{tag}-sw"
    made = [Host(f"cl-{tag}-{i}", SUBNET.format(net, i + 1), f"clh{i}") for i in range(n)]
    namespaces = [switch, *(host.namespace for host in made)]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", switch, "link", "set", BRIDGE, "up")
        for i, host in enumerate(made):
            _plug(host, switch, f"port{i}")
        yield made
    finally:
        _delete(namespaces)


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    with hosts(2) as (a, b):
        yield a, b
