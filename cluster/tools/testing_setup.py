"""What a `LocalJob` settles before it starts anything: its options (`LocalJobOptions`) and
their checks, its schedulers' hosts, a port free on every one of them, and the TLS identity of
its status calls.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.protocol.config import parse_seconds
from cluster.protocol.environment import tls_options_from_env
from cluster.protocol.errors import ClusterError
from cluster.tools.netlab import NetworkLab
from cluster.tools.testing_process import free_port


@dataclass(frozen=True)
class LocalJobOptions:
    """What a `LocalJob` may change beyond its script, size, guard, directory and bound.

    `recovery`: MS_ENABLE_RECOVERY with the recovery path in the job's directory; `env`: extra
    environment for every process; `python`: the interpreter of every process; `network`: put
    each worker in its own network namespace (set up by `start`); `spares`: spare workers
    (CLUSTER_SPARE=1, node ids spare-<i>, logs spare_<i>.log); `state_url`: the schedulers keep
    the job in etcd (CLUSTER_STATE_URL, lease `lease_s`); `standbys`: schedulers beside the
    first (needs `state_url`), scheduler k on 127.0.0.<k+1> (or the lab's k-th scheduler
    address), all on one port, logs scheduler_<k>.log; `port`: theirs (a free one by default);
    `tls_config`: mutual TLS from this ssl.json for every process and for the job's status
    calls (CLUSTER_TLS_CONFIG, with the TLS variables of this environment); `relay`: the
    workers reach the scheduler through one relay (`mscluster relay`, log relay.log, socket in
    a directory of this user's only), as `mscluster run` starts for 2 or more workers."""

    recovery: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable
    network: NetworkLab | None = None
    spares: int = 0
    standbys: int = 0
    state_url: str | None = None
    lease_s: int = 2
    port: int | None = None
    tls_config: Path | None = None
    relay: bool = False


def scheduler_hosts(standbys: int, state_url: str | None, network: NetworkLab | None) -> list[str]:
    """The schedulers' hosts: 127.0.0.1, 127.0.0.2, ... (the lab's addresses with a lab)."""
    if standbys < 0 or (standbys and state_url is None):
        raise ClusterError(
            f"LocalJob standbys={standbys}: standby schedulers need state_url='etcd://...' "
            "(they share the job's state in etcd) and a count >= 0"
        )
    if network is None:
        return [f"127.0.0.{k + 1}" for k in range(standbys + 1)]
    if len(network.scheduler_ips) < standbys + 1:
        raise ClusterError(
            f"LocalJob standbys={standbys} needs NetworkLab(..., schedulers={standbys + 1})"
        )
    return network.scheduler_ips[: standbys + 1]


def check_options(workers: int, node_timeout_s: float, options: LocalJobOptions) -> None:
    """A ClusterError for a job LocalJob cannot run as asked."""
    if workers < 1:
        raise ClusterError(f"LocalJob workers={workers} must be >= 1")
    parse_seconds("LocalJob node_timeout_s", repr(node_timeout_s))  # finite, > 0
    lab = options.network
    if lab is not None and lab.workers < workers + options.spares:
        raise ClusterError(
            f"LocalJob workers={workers} spares={options.spares} needs a namespace for "
            f"each: NetworkLab({workers + options.spares}), not NetworkLab({lab.workers})"
        )
    if lab is not None and options.relay:
        raise ClusterError(
            "LocalJob relay=True with a NetworkLab: each worker is a host of its own there, "
            "and a relay serves the workers of one host"
        )


def tls_identity(config: Path) -> Any:
    """The job's client identity for its status calls (`tls.prepare`: grpc's cipher list
    first); a TLSConfigError naming what is wrong with the config or its files."""
    from cluster.transport import tls  # noqa: PLC0415 - cryptography, only with TLS

    options = tls_options_from_env(os.environ, config.resolve())
    assert options is not None  # a config path was given
    return tls.prepare(options, server=False)


def free_on(hosts: list[str], port: int) -> bool:
    """Whether `port` is free on every loopback host of `hosts` now (a lab's hosts do not
    exist yet)."""
    return all(_bindable(host, port) for host in hosts if host.startswith("127."))


def free_port_on(hosts: list[str]) -> int:
    """A port free on every loopback host of `hosts` now."""
    for _ in range(100):
        port = free_port()
        if free_on(hosts, port):
            return port
    raise ClusterError(f"no port is free on every one of {', '.join(hosts)}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
