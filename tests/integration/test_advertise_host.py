"""CLUSTER_ADVERTISE_HOST is an address this worker listens on: one it cannot listen on (a name
that does not resolve, an address of another host, stray brackets) is one ConfigError line
naming it, and an IPv6 address in [ ] is the address without them."""

from __future__ import annotations

import socket

import pytest

from cluster.protocol.errors import ConfigError
from cluster.testing import free_port
from cluster.worker.identity import make_identity
from tests.procs import example_error_line, job_env

NOT_HERE = "192.0.2.7"  # TEST-NET-1 (RFC 5737): no host's own address


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("no-such-host.invalid", "'no-such-host.invalid' does not resolve ("),
        (NOT_HERE, f"'{NOT_HERE}' is not an address of this host: this worker listens on"),
        ("[]", "'[]' is not a host name or IP address: [ ] go only around a whole IPv6"),
        ("[::1", "'[::1' is not a host name or IP address: [ ] go only around a whole IPv6"),
        ("a[b]", "'a[b]' is not a host name or IP address: [ ] go only around a whole IPv6"),
    ],
)
def test_an_address_this_worker_cannot_listen_on_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    monkeypatch.setenv("CLUSTER_ADVERTISE_HOST", value)
    with pytest.raises(ConfigError) as refused:
        make_identity("0", "127.0.0.1", 1)
    line = str(refused.value)
    assert line.startswith("CLUSTER_ADVERTISE_HOST "), line
    assert said in line
    assert "\n" not in line


@pytest.mark.skipif(not has_ipv6_loopback(), reason="this host has no IPv6 loopback")
@pytest.mark.parametrize("value", ["[::1]", "::1"])
def test_an_ipv6_address_in_brackets_is_the_address(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CLUSTER_ADVERTISE_HOST", value)
    identity = make_identity("0", "127.0.0.1", 1)
    assert identity.host == "::1"
    assert 0 < identity.port < 65536


def test_a_worker_advertising_another_hosts_address_says_so_in_one_line() -> None:
    env = job_env(2, free_port(), MS_ROLE="MS_WORKER", CLUSTER_ADVERTISE_HOST=NOT_HERE)
    line = example_error_line(env)
    assert line.startswith(
        f"cluster: ConfigError: CLUSTER_ADVERTISE_HOST '{NOT_HERE}' is not an address of this host"
    ), line
