"""Who this process is to the scheduler: node id, incarnation, and the address peers reach it at."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from dataclasses import field

from cluster.protocol import auth
from cluster.protocol.display import quoted
from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import check_host, lookup_name
from cluster.protocol.value import frozen

ADVERTISE = "CLUSTER_ADVERTISE_HOST"
# MindSpore's name for the address a worker networks on, read when CLUSTER_ADVERTISE_HOST is
# unset (or empty).
WORKER_IP = "MS_WORKER_IP"


@frozen
class NodeIdentity:
    node_id: str
    # Random per process: a restarted process with the same node id is a new incarnation.
    incarnation: int
    host: str
    port: int
    # Random per process too, and secret: it proves to the scheduler that a call comes from this
    # process (see cluster.protocol.auth). Only in memory: it is never written anywhere.
    credential: bytes = field(default_factory=auth.new_credential, repr=False)


def new_incarnation() -> int:
    return int.from_bytes(os.urandom(8), "big") >> 1 or 1  # 63 random bits


def generated_node_id() -> str:
    """A node id for a process started without MS_NODE_ID: unique, and sorted by host."""
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


def local_address_towards(host: str, port: int) -> str:
    """The local IP address this host uses to reach host:port (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(lookup_name(host), port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ConfigError(
            f"MS_SCHED_HOST={host!r} does not resolve ({exc.strerror}): use the scheduler's IP "
            "address or a host name this machine can resolve"
        ) from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)
        except OSError as exc:
            raise ConfigError(
                f"no route from this host to MS_SCHED_HOST={host!r} ({exc.strerror})"
            ) from None
        return str(probe.getsockname()[0])


def free_port(host: str) -> int:
    """A port that is free on host now: advertised to peers for the data plane. OSError
    (socket.gaierror when host does not resolve) when host is no address of this machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def advertise_setting(env: Mapping[str, str]) -> tuple[str, str]:
    """(variable, value) of the address this worker is told to advertise in `env`:
    CLUSTER_ADVERTISE_HOST, else MS_WORKER_IP; the value is "" when neither is set."""
    for name in (ADVERTISE, WORKER_IP):
        value = env.get(name, "").strip()
        if value:
            return name, value
    return ADVERTISE, ""


def advertised_host(value: str, name: str) -> str:
    """Variable `name`'s `value` as this process listens on it: a host name or IP address (an
    IPv6 address given in [ ] without them); else a ConfigError."""
    host = check_host(name, value)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare or "[" in bare or "]" in bare:
        raise ConfigError(
            f"{name} {quoted(value, 64)} is not a host name or IP address: [ ] go only "
            "around a whole IPv6 address"
        )
    return bare


def unusable(advertised: str, host: str, exc: OSError, name: str) -> ConfigError:
    """The ConfigError for a host this process cannot listen on: `exc` from `free_port`;
    `advertised` the value of variable `name` ("": none was given)."""
    if isinstance(exc, socket.gaierror):
        why = f"does not resolve ({exc.strerror})"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "is not an address of this host"
    else:
        why = f"cannot be listened on ({exc.strerror})"
    if not advertised:
        return ConfigError(
            f"the local address {quoted(host, 64)} that routes to the scheduler {why}: set "
            f"{ADVERTISE} to an address of this host that peers reach"
        )
    return ConfigError(
        f"{name} {quoted(advertised, 64)} {why}: this worker listens on the address it "
        "advertises, so give an address (or host name) of this host that peers reach, or unset "
        "it to use the local address that routes to the scheduler"
    )


def make_identity(node_id: str | None, sched_host: str, sched_port: int) -> NodeIdentity:
    """This process's identity; a ConfigError when CLUSTER_ADVERTISE_HOST (else MS_WORKER_IP,
    else the address found in their place) is not one this process can listen on."""
    name, advertised = advertise_setting(os.environ)
    host = (
        advertised_host(advertised, name)
        if advertised
        else local_address_towards(sched_host, sched_port)
    )
    try:
        port = free_port(host)
    except OSError as exc:
        raise unusable(advertised, host, exc, name) from None
    return NodeIdentity(
        node_id=node_id or generated_node_id(),
        incarnation=new_incarnation(),
        host=host,
        port=port,
    )
