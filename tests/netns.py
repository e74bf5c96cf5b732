"""Two test hosts on one machine: network namespaces joined by a veth pair, always removed.

Needs root and iproute2; `hosts_or_skip` skips the test, saying why, when either is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

SUBNET = "10.231.{}.{}"


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


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    why = why_not_available()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    net = os.getpid() % 250 + 1
    a = Host(f"cl-a-{tag}", SUBNET.format(net, 1), f"cla{tag}")
    b = Host(f"cl-b-{tag}", SUBNET.format(net, 2), f"clb{tag}")
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("link", "add", a.link, "type", "veth", "peer", "name", b.link)
        for host in (a, b):
            _ip("link", "set", host.link, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.ip}/24", "dev", host.link)
            _ip("-n", host.namespace, "link", "set", host.link, "up")
        yield a, b
    finally:
        for host in (a, b):
            # Deleting a namespace deletes its end of the veth pair, and so the pair.
            subprocess.run(
                ["ip", "netns", "delete", host.namespace],
                capture_output=True,
                timeout=30,
                check=False,
            )
