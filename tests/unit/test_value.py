"""`@frozen` and `@mutable` (cluster.protocol.value): dataclasses with shared methods do what
`@dataclass(frozen=True)` and `@dataclass` do, so the classes a process builds at import can use
them."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import ClassVar

import pytest

from cluster.protocol.value import frozen, mutable


@frozen
class Point:
    x: int
    y: int = 0
    tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)
    secret: bytes = dataclasses.field(default=b"", repr=False)
    note: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class Reference:
    x: int
    y: int = 0
    tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)
    secret: bytes = dataclasses.field(default=b"", repr=False)
    note: str = dataclasses.field(default="", compare=False)


def test_it_is_made_and_shown_as_a_frozen_dataclass_is() -> None:
    for kind in (Point, Reference):
        made = kind(1, y=2, secret=b"s", note="n")
        assert (made.x, made.y, made.tags, made.secret) == (1, 2, (), b"s")
        assert repr(made).split("(", 1)[1] == "x=1, y=2, tags=(), note='n')"
        assert kind.__match_args__ == ("x", "y", "tags", "secret", "note")


def test_equal_and_hashed_by_the_compared_fields_and_only_within_its_class() -> None:
    assert Point(1, note="a") == Point(1, note="b")
    assert hash(Point(1, note="a")) == hash(Point(1, note="b"))
    assert Point(1) != Point(2)
    assert Point(1) != Reference(1)
    assert {Point(1), Point(1)} == {Point(1)}


def test_it_cannot_be_changed() -> None:
    point = Point(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        point.x = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del point.x  # type: ignore[misc]


def test_wrong_arguments_are_the_errors_a_dataclass_gives() -> None:
    with pytest.raises(TypeError, match="missing required argument: 'x'"):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        Point(1, z=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="multiple values for 'x'"):
        Point(1, x=2)  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 5 positional arguments but 6 were given"):
        Point(1, 2, (), b"", "", 6)  # type: ignore[call-arg]


def test_fields_replace_match_copy_and_pickle_work() -> None:
    point = Point(1, 2, ("a",))
    assert [f.name for f in dataclasses.fields(point)] == ["x", "y", "tags", "secret", "note"]
    assert dataclasses.replace(point, y=5) == Point(1, 5, ("a",))  # type: ignore[type-var]
    match point:
        case Point(1, y):
            assert y == 2
        case _:
            pytest.fail("the class pattern did not match")
    assert copy.deepcopy(point) == point
    assert pickle.loads(pickle.dumps(point)) == point


@mutable
class Counter:
    name: str
    count: int = 0
    kind: ClassVar[str] = "counter"
    seen: list[str] = dataclasses.field(default_factory=list, init=False, repr=False)


@frozen
class Labelled(Point):
    label: str = ""


def test_mutable_is_changed_compared_and_not_hashed_as_a_dataclass_is() -> None:
    counter = Counter("a")
    counter.count += 1
    counter.seen.append("x")
    assert counter.seen == ["x"]
    assert counter != Counter("a", 1)  # `seen` differs
    assert Counter("a", 1) == Counter("a", 1)
    assert repr(counter) == "Counter(name='a', count=1)"
    assert Counter.__hash__ is None
    assert Counter.kind == "counter"
    assert Counter.__match_args__ == ("name", "count")
    assert [f.name for f in dataclasses.fields(Counter)] == ["name", "count", "seen"]
    assert Counter("b").seen == []
    assert Counter("b").seen is not Counter("c").seen


def test_a_subclass_has_its_bases_fields_first() -> None:
    labelled = Labelled(1, 2, label="l")
    assert repr(labelled) == "Labelled(x=1, y=2, tags=(), note='', label='l')"
    assert [f.name for f in dataclasses.fields(labelled)] == [*Point.__match_args__, "label"]
    assert dataclasses.replace(labelled, label="m").label == "m"
    assert labelled != Point(1, 2)


def test_defaults_are_checked_as_dataclasses_checks_them() -> None:
    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):

        @frozen
        class OutOfOrder:
            a: int = 0
            b: int

    with pytest.raises(ValueError, match="mutable default"):

        @frozen
        class Shared:
            items: list[int] = []  # noqa: RUF012 - the error under test


def test_what_it_does_not_handle_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="InitVar and keyword-only fields need @dataclass"):

        @frozen
        class WithInitVar:
            seed: dataclasses.InitVar[int]

    with pytest.raises(TypeError, match="a base made by @dataclass"):

        @frozen
        class FromReference(Reference):
            label: str = ""
