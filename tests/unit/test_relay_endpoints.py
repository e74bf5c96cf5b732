"""cluster.protocol.endpoints: one scheduler, however an address spells it, is one endpoint;
lists share a scheduler when an endpoint, or a port and an address, is in both."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.config import join_address
from cluster.protocol.endpoints import Endpoint, described, endpoint, endpoints, names, shared

NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,8}(\.[a-z][a-z0-9-]{0,8}){0,3}", fullmatch=True)
PORTS = st.integers(1, 65535)


def _cased(name: str, upper: list[bool]) -> str:
    return "".join(c.upper() if up else c for c, up in zip(name, upper + [False] * len(name)))


@given(NAMES, PORTS, st.lists(st.booleans()), st.booleans(), st.integers(0, 3))
def test_a_name_is_one_endpoint_in_any_case_with_or_without_its_dot_and_port_zeros(
    name: str, port: int, upper: list[bool], dot: bool, zeros: int
) -> None:
    spelt = f"{_cased(name, upper)}{'.' if dot else ''}:{'0' * zeros}{port}"
    assert endpoint(spelt) == Endpoint(name, port)


@given(st.ip_addresses(v=6), PORTS)
def test_an_ipv6_address_is_one_endpoint_however_it_is_written(
    ip: ipaddress.IPv6Address, port: int
) -> None:
    forms = {endpoint(f"[{text}]:{port}") for text in (ip.exploded, ip.compressed, str(ip))}
    forms.add(endpoint(f"[{ip.exploded.upper()}]:{port}"))
    mapped = ip.ipv4_mapped
    expected = Endpoint(str(mapped) if mapped is not None else ip.compressed, port)
    assert forms == {expected}


@given(st.ip_addresses(v=4), PORTS)
def test_an_ipv4_address_mapped_into_ipv6_is_the_ipv4_one(
    ip: ipaddress.IPv4Address, port: int
) -> None:
    assert endpoint(f"[::ffff:{ip}]:{port}") == endpoint(f"{ip}:{port}") == Endpoint(str(ip), port)


@given(st.text(max_size=40))
def test_any_text_is_an_endpoint_in_its_one_form_or_none(text: str) -> None:
    found = endpoint(text)
    if found is not None:
        assert 1 <= found.port <= 65535
        assert endpoint(join_address(*found)) == found


def test_what_is_not_host_port_is_no_endpoint() -> None:
    for text in ("", "host", "host:", ":80", "host:0", "host:65536", "host:+80", "a b:80"):
        assert endpoint(text) is None, text
    assert endpoints(["host:80", "nothing", "[::1]:0080"]) == (
        Endpoint("host", 80),
        Endpoint("::1", 80),
    )


LISTS = st.lists(
    st.builds(Endpoint, st.sampled_from(["a", "b", "c", "10.0.0.1", "::1"]), st.integers(1, 3)),
    max_size=4,
)
RESOLVED = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.frozensets(st.sampled_from(["10.0.0.1", "10.0.0.2", "::1"]), max_size=2),
)


@given(LISTS, LISTS, RESOLVED)
def test_sharing_is_symmetric_and_needs_one_port(
    ours: list[Endpoint], theirs: list[Endpoint], resolved: dict[str, frozenset[str]]
) -> None:
    assert shared(ours, theirs, resolved) == shared(theirs, ours, resolved)
    if {e.port for e in ours}.isdisjoint(e.port for e in theirs):
        assert not shared(ours, theirs, resolved)
    if ours:
        assert shared(ours, ours, {})


@given(LISTS, LISTS)
def test_without_addresses_known_lists_share_only_what_is_written_in_both(
    ours: list[Endpoint], theirs: list[Endpoint]
) -> None:
    assert shared(ours, theirs, {}) == (not set(ours).isdisjoint(theirs))


def test_names_of_one_port_share_when_their_addresses_meet() -> None:
    resolved = {"localhost": frozenset({"127.0.0.1", "::1"}), "other": frozenset({"10.0.0.9"})}
    localhost, loopback = Endpoint("localhost", 80), Endpoint("127.0.0.1", 80)
    assert shared([localhost], [loopback], resolved)
    assert shared([localhost], [Endpoint("::1", 80)], resolved)
    assert not shared([localhost], [Endpoint("127.0.0.1", 81)], resolved)
    assert not shared([localhost], [Endpoint("other", 80)], resolved)
    assert not shared([localhost], [loopback], {})  # not known: not the same
    meeting = {"a": frozenset({"10.0.0.9", "10.0.0.7"}), "b": frozenset({"10.0.0.7"})}
    assert shared([Endpoint("a", 80)], [Endpoint("b", 80)], meeting)


def test_the_names_of_the_lists_are_said_with_what_they_resolved_to_in_order() -> None:
    ours = endpoints(["sched:80", "10.0.0.1:80", "standby:80"])
    theirs = endpoints(["Other:80", "sched.:81"])
    assert names(ours, theirs) == ("sched", "standby", "other")
    resolved = {"sched": frozenset({"10.0.0.2", "10.0.0.1"})}
    failed = {"other": "Name or service not known"}
    assert described(names(ours, theirs), resolved, failed) == (
        "sched is 10.0.0.1, 10.0.0.2; other does not resolve (Name or service not known)"
    )
    assert described((), resolved, failed) == ""
