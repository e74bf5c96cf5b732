"""`@frozen`: a frozen dataclass whose methods are shared, not compiled per class.

`@dataclass(frozen=True)` compiles six methods from source for every class (`__init__`,
`__repr__`, `__eq__`, `__hash__`, `__setattr__`, `__delattr__`): about 0.5 ms a class on
Python 3.11, and a worker builds some 60 of them (its core's events and actions, the wire
records, its settings) before it can connect. `@frozen` makes the same dataclass (fields,
defaults, `default_factory`, `field(repr=False)`, `__match_args__`, `dataclasses.fields` and
`replace` as before) and gives it one shared implementation of each method instead, which
reads the class's fields: equal to a frozen dataclass in what it does, a few microseconds
slower per instance, most of the class's cost gone. For the classes a process builds at
import in numbers; `@dataclass` stays right for the rest.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # what it does at run time (mark the decorator) does not matter here

    def dataclass_transform(**_: object) -> Any:
        return lambda decorator: decorator


_C = TypeVar("_C", bound=type)
_NOTHING: Any = dataclasses.MISSING


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen(cls: _C) -> _C:
    """The frozen dataclass of `cls`, with shared methods (see the module)."""
    made: Any = dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    fields = dataclasses.fields(made)
    made.__value_init__ = tuple((f.name, f.default, f.default_factory) for f in fields if f.init)
    made.__value_compared__ = tuple(f.name for f in fields if f.compare)
    made.__value_shown__ = tuple(f.name for f in fields if f.repr)
    for name, method in _METHODS.items():
        if name not in cls.__dict__:
            setattr(made, name, method)
    return cls


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    spec = type(self).__value_init__
    if len(args) > len(spec):
        raise TypeError(
            f"{type(self).__name__}() takes {len(spec)} positional arguments but "
            f"{len(args)} were given"
        )
    for n, (name, default, factory) in enumerate(spec):
        if n < len(args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}() got multiple values for {name!r}")
            given = args[n]
        elif name in kwargs:
            given = kwargs.pop(name)
        elif default is not _NOTHING:
            given = default
        elif factory is not _NOTHING:
            given = factory()
        else:
            raise TypeError(f"{type(self).__name__}() missing required argument: {name!r}")
        object.__setattr__(self, name, given)
    if kwargs:  # what is left named no field
        unknown = ", ".join(repr(k) for k in kwargs)
        raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {unknown}")
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


def _key(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in type(self).__value_compared__)


def _eq(self: Any, other: object) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self: Any) -> int:
    return hash(_key(self))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self).__value_shown__)
    return f"{type(self).__qualname__}({shown})"


def _setattr(self: Any, name: str, _: object) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


_METHODS: dict[str, Any] = {
    "__init__": _init,
    "__eq__": _eq,
    "__hash__": _hash,
    "__repr__": _repr,
    "__setattr__": _setattr,
    "__delattr__": _delattr,
}
