"""A peer table laid out to be read in place (`cluster.transport.table_file`): every table comes
back as it was written, read row by row or whole; a file of another table, or a short one, is
refused before a row is read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.protocol.topology import Topology, find_row
from cluster.transport import table_file
from cluster.v1 import scheduler_pb2 as pb

DIGEST = bytes(range(32))
names = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
roles = st.sampled_from([pb.ROLE_WORKER, pb.ROLE_SERVER])


@st.composite
def tables(draw: st.DrawFn) -> pb.PeerTable:
    n = draw(st.integers(0, 60))
    ints = st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)
    return pb.PeerTable(
        ranks=draw(ints),
        node_ids=draw(st.lists(names, min_size=n, max_size=n)),
        hosts=draw(st.lists(names, min_size=n, max_size=n)),
        ports=draw(ints),
        roles=draw(st.lists(roles, min_size=n, max_size=n)),
        local_ranks=draw(ints),
        local_sizes=draw(ints),
    )


def shared(table: pb.PeerTable, digest: bytes = DIGEST) -> tuple[int, str]:
    fd = table_file.create_shared(table, digest)
    return fd, f"/proc/{os.getpid()}/fd/{fd}"


@settings(max_examples=60, deadline=None)
@given(tables())
def test_every_table_reads_back_as_it_was_written(table: pb.PeerTable) -> None:
    fd, path = shared(table)
    try:
        mapped = table_file.open_shared(path, DIGEST)
    finally:
        os.close(fd)  # the mapping outlives the relay's descriptor
    for column in ("ranks", "node_ids", "hosts", "ports", "roles", "local_ranks", "local_sizes"):
        assert list(getattr(mapped, column)) == list(getattr(table, column)), column
    n = len(table.node_ids)
    for row in {0, n // 2, n - 1} if n else ():
        assert mapped.node_ids[row] == table.node_ids[row]
        assert mapped.hosts[-n + row] == table.hosts[row]
    assert list(mapped.node_ids[1:3]) == list(table.node_ids[1:3])
    with pytest.raises(IndexError):
        mapped.node_ids[n]


def test_a_worker_finds_its_row_and_a_peer_without_reading_the_rest() -> None:
    n = 65_536
    table = pb.PeerTable(
        ranks=range(n),
        node_ids=[f"w{r:05d}" for r in range(n)],
        hosts=[f"host-{r // 8:04d}" for r in range(n)],
        ports=[29500 + r % 8 for r in range(n)],
        roles=[pb.ROLE_WORKER] * n,
        local_ranks=[r % 8 for r in range(n)],
        local_sizes=[8] * n,
    )
    fd, path = shared(table)
    try:
        mapped = table_file.open_shared(path, DIGEST)
    finally:
        os.close(fd)
    row = find_row(mapped, "w40000", "host-5000", range(n))  # by bisection: no guess
    assert row == 40000
    topology = Topology(1, 40000, 0, 8, n, mapped)
    assert topology.peer(12345).host == "host-1543"
    assert topology.peer(12345).port == 29500 + 12345 % 8


def test_a_file_of_another_table_or_a_short_one_is_refused(tmp_path: Path) -> None:
    table = pb.PeerTable(
        ranks=[0, 1],
        node_ids=["a", "b"],
        hosts=["h", "h"],
        ports=[1, 2],
        roles=[pb.ROLE_WORKER] * 2,
        local_ranks=[0, 1],
        local_sizes=[2, 2],
    )
    data = table_file.layout(table, DIGEST)
    whole = tmp_path / "whole"
    whole.write_bytes(data)
    assert list(table_file.open_shared(str(whole), DIGEST).node_ids) == ["a", "b"]
    with pytest.raises(table_file.SharedTableError, match="not the table"):
        table_file.open_shared(str(whole), b"\1" * 32)
    for size in (0, 20, len(data) - 8):
        short = tmp_path / f"short{size}"
        short.write_bytes(data[:size])
        with pytest.raises(table_file.SharedTableError, match="short"):
            table_file.open_shared(str(short), DIGEST)
    with pytest.raises(OSError, match="No such file"):
        table_file.open_shared(str(tmp_path / "none"), DIGEST)


def test_a_shared_table_is_sealed_against_writing() -> None:
    table = pb.PeerTable(ranks=[0], node_ids=["a"], hosts=["h"], ports=[1], roles=[1])
    table.local_ranks.append(0)
    table.local_sizes.append(1)
    fd, path = shared(table)
    try:
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        writable = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(writable, b"x", 0)
        finally:
            os.close(writable)
    finally:
        os.close(fd)


def test_a_column_of_another_length_is_not_laid_out() -> None:
    table = pb.PeerTable(ranks=[0, 1], node_ids=["a", "b"], hosts=["h"])
    with pytest.raises(ValueError, match="column ports is not 2 long"):
        table_file.layout(table, DIGEST)
