"""Whether two lists of scheduler addresses (HOST:PORT) name a scheduler in common, however
each was written: what a relay asks of a worker's list against its own (`cluster.transport.hop`).

One scheduler has many spellings: `localhost:80`, `LOCALHOST.:0080`, `127.0.0.1:80`, and on
most hosts `[::1]:80`. An address is first brought to one form (`endpoint`): the host without
its brackets, a name in lower case without its trailing dot, an IP address in its shortest
form (an IPv4 address mapped into IPv6 as the IPv4 one), the port an integer. Two addresses
that are then equal are the same scheduler. Two with one port whose hosts differ, a name among
them, are the same when their hosts' addresses meet: what the names (`names`) resolved to
(`Resolved`) is the caller's to find, who can wait on a resolver; the decision (`shared`) and
its words (`described`) are here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, TypeAlias

from cluster.protocol.errors import ConfigError
from cluster.protocol.parse import split_address

# A host name -> the IP addresses it resolved to (`ip_form` of each); a name absent, or with
# none, has no address known.
Resolved: TypeAlias = Mapping[str, frozenset[str]]


class Endpoint(NamedTuple):
    """A scheduler's address in one form: `host` a lower-case name without a trailing dot, or
    an IP address as `ip_form` writes it; `port` in 1-65535."""

    host: str
    port: int


def ip_form(host: str) -> str | None:
    """`host` (brackets removed) in the one form of its IP address (an IPv4 one mapped into
    IPv6 as IPv4; IPv6 compressed, in lower case, its %zone kept); None when it is no IP
    address."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def host_form(host: str) -> str:
    """`host` in one form: an IP address as `ip_form` writes it, a name in lower case without
    its trailing dot (`name.` is the fully qualified `name`)."""
    ip = ip_form(host)
    if ip is not None:
        return ip
    lowered = host.lower()
    return lowered[:-1] if lowered.endswith(".") and len(lowered) > 1 else lowered


def endpoint(address: str) -> Endpoint | None:
    """`address` (HOST:PORT, an IPv6 host in brackets) in one form; None when it is not one
    (`parse.split_address`)."""
    try:
        host, port = split_address("address", address)
    except ConfigError:
        return None
    return Endpoint(host_form(host), port)


def endpoints(addresses: Iterable[str]) -> tuple[Endpoint, ...]:
    """The addresses that are HOST:PORT, each in one form (those that are not are left out)."""
    return tuple(e for e in map(endpoint, addresses) if e is not None)


def is_name(host: str) -> bool:
    """`host` (an `Endpoint`'s) is a name, which a resolver turns into addresses."""
    return ip_form(host) is None


def _ips(host: str, resolved: Resolved) -> frozenset[str]:
    return resolved.get(host, frozenset()) if is_name(host) else frozenset({host})


def shared(ours: Sequence[Endpoint], theirs: Sequence[Endpoint], resolved: Resolved) -> bool:
    """Whether the lists name one scheduler: two endpoints equal, or of one port with hosts
    whose addresses (an IP address its own; a name's as `resolved`) meet."""
    if not set(ours).isdisjoint(theirs):
        return True
    return any(
        a.port == b.port and not _ips(a.host, resolved).isdisjoint(_ips(b.host, resolved))
        for a in ours
        for b in theirs
    )


def names(*lists: Sequence[Endpoint]) -> tuple[str, ...]:
    """The hosts of the lists that are names, each once, in order: what a resolver is asked
    before `shared` can say that lists not equal as written share no scheduler, and
    `described` how each resolved."""
    hosts = (e.host for endpoints in lists for e in endpoints)
    return tuple(dict.fromkeys(h for h in hosts if is_name(h)))


def described(names: Iterable[str], resolved: Resolved, failed: Mapping[str, str]) -> str:
    """What `names` resolved to, for a message: "localhost is 127.0.0.1, ::1; other does not
    resolve (Name or service not known)" (in their order, each once; a name neither resolved
    nor failed is left out); "" when there is nothing to say."""
    said = []
    for name in dict.fromkeys(names):
        if resolved.get(name):
            said.append(f"{name} is {', '.join(sorted(resolved[name]))}")
        elif name in failed:
            said.append(f"{name} does not resolve ({failed[name]})")
    return "; ".join(said)
