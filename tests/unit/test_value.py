"""`@frozen` (cluster.protocol.value): a frozen dataclass with shared methods does what
`@dataclass(frozen=True)` does, so the classes a worker builds at import can use it."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from cluster.protocol.value import frozen


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
