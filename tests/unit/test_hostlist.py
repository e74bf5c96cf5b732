"""Slurm node lists: our expansion is Slurm's (`scontrol show hostnames`), and bad lists are
named errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.protocol.errors import ConfigError
from cluster.tools import hostlist
from tests.servers.slurm import scontrol_hostnames

# Ten lists that a hand-written parser gets wrong one way or another.
TRICKY = [
    "node[1-3]",  # a range
    "gpu[08-11]",  # zero padding across a digit boundary
    "n[098-101]",  # padding kept past 099
    "n[1-02]",  # the width is the low end's: n1 n2
    "n[01-2,3-05]",  # each range of a bracket pads on its own
    "rack[1-2]-node[01-02]",  # several brackets: a product, the first outermost
    "a[1-2][3-4]",  # adjacent brackets
    "n[1-2,5]-ib[0-1],login01",  # a comma list inside a bracket, then another item
    "gpu[1-2],cpu[10-11],login,x[0]",  # several prefixes, a plain name, a one-number bracket
    "node[1-2],,node3 node2",  # empty items, a blank as separator, a duplicate kept
]


@pytest.mark.parametrize("nodelist", TRICKY)
def test_expansion_is_scontrols(nodelist: str, scontrol_env: dict[str, str]) -> None:
    assert hostlist.expand(nodelist) == scontrol_hostnames(nodelist, scontrol_env)


def test_the_tricky_lists_expand_as_written_down() -> None:
    # The same lists without scontrol, so that a machine without Slurm still checks the rules.
    assert hostlist.expand("gpu[08-11]") == ["gpu08", "gpu09", "gpu10", "gpu11"]
    assert hostlist.expand("n[1-02]") == ["n1", "n2"]
    assert hostlist.expand("n[01-2,3-05]") == ["n01", "n02", "n3", "n4", "n5"]
    assert hostlist.expand("rack[1-2]-node[01-02]") == [
        *("rack1-node01", "rack1-node02"),
        *("rack2-node01", "rack2-node02"),
    ]
    assert hostlist.expand("node[1-2],,node3 node2") == ["node1", "node2", "node3", "node2"]


def test_a_suffix_after_the_last_bracket_is_kept() -> None:
    # Slurm 22.05 refuses `n[1-2]-ib`; read it the way it is meant rather than fail a launch.
    assert hostlist.expand("n[1-2]-ib") == ["n1-ib", "n2-ib"]


@pytest.mark.parametrize(
    ("nodelist", "fault"),
    [
        ("n[3-1]", "runs backwards"),
        ("n[1-3", "never closed"),
        ("a]b", "never opened"),
        ("n[1[2]]", "inside a bracket"),
        ("n[]", "must hold numbers"),
        ("n[a-b]", "must hold numbers"),
        ("n[1,,2]", "must hold numbers"),
        ("n[-2]", "must hold numbers"),
    ],
)
def test_a_bad_list_is_a_config_error_naming_it(nodelist: str, fault: str) -> None:
    with pytest.raises(ConfigError, match=fault) as caught:
        hostlist.expand(nodelist, what="SLURM_JOB_NODELIST")
    assert f"SLURM_JOB_NODELIST {nodelist!r}" in str(caught.value)


def test_a_huge_list_is_refused_before_it_is_expanded() -> None:
    with pytest.raises(ConfigError, match="names 100000000 hosts, more than 1000000"):
        hostlist.expand("n[0-99999999]")
    # The first host needs no expansion of the rest.
    assert hostlist.first("n[0-99999999]") == "n0"


def test_an_empty_list_has_no_first_host() -> None:
    assert hostlist.expand(" , ") == []
    with pytest.raises(ConfigError, match="names no host"):
        hostlist.first("")


@given(
    prefix=st.from_regex(r"[a-z][a-z-]{0,5}", fullmatch=True),
    low=st.integers(0, 500),
    length=st.integers(0, 20),
    width=st.integers(1, 4),
)
def test_a_range_has_one_host_per_number_padded_to_the_low_end(
    prefix: str, low: int, length: int, width: int
) -> None:
    low_text = f"{low:0{width}d}"
    hosts = hostlist.expand(f"{prefix}[{low_text}-{low + length}]")
    assert hosts == [f"{prefix}{n:0{width}d}" for n in range(low, low + length + 1)]
