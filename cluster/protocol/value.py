"""`@frozen` and `@mutable`: dataclasses whose methods are shared, not compiled per class.

`@dataclass(frozen=True)` compiles six methods from source for every class (`__init__`,
`__repr__`, `__eq__`, `__hash__`, `__setattr__`, `__delattr__`): about 0.5 ms a class on
Python 3.11, and a worker builds some 60 classes (its core's events and actions, the wire
records, its settings), the scheduler some 110, before it can connect. `@frozen` makes the
same dataclass (fields, defaults, `default_factory`, `field(init=False, repr=False,
compare=False)`, `ClassVar`s, `__post_init__`, `__match_args__`, `dataclasses.fields`, `replace`
and `is_dataclass` as before) and gives it one shared implementation of each method instead,
which reads the class's fields: equal to a frozen dataclass in what it does, a few microseconds
slower per instance. `@mutable` is the same for `@dataclass` (no `__setattr__`, no hash).

It reads the class's annotations itself (some 30 us a class) and leaves `dataclasses` (another
70 us a class, most of it the checks of each annotation) to the first caller of
`dataclasses.fields` and friends, which few processes are. What it does not handle (`InitVar`,
`KW_ONLY`, `kw_only`, a base made by `@dataclass`) is a TypeError: use `@dataclass` there.
For the classes a process builds at import in numbers; `@dataclass` stays right for the rest.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # what it does at run time (mark the decorator) does not matter here

    def dataclass_transform(**_: object) -> Any:
        return lambda decorator: decorator


_C = TypeVar("_C", bound=type)
_NOTHING: Any = dataclasses.MISSING
_Field = dataclasses.Field
# (name, annotation, what the class body gave: a default, a Field, or _NOTHING)
_Spec = tuple[str, Any, Any]
# (name, default, default_factory, init, repr, compare)
_Read = tuple[str, Any, Any, bool, bool, bool]


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field))
def frozen(cls: _C) -> _C:
    """The frozen dataclass of `cls`, with shared methods (see the module)."""
    return _make(cls, _METHODS)


@dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def mutable(cls: _C) -> _C:
    """The (mutable) dataclass of `cls`, with shared methods: `__init__`, `__repr__`, `__eq__`
    and no hash, as `@dataclass` makes them."""
    return _make(cls, _MUTABLE_METHODS)


def _make(cls: _C, methods: dict[str, Any]) -> _C:
    specs = _specs(cls)
    fields = [_read(spec) for spec in specs]  # (name, default, factory, init, repr, compare)
    _check_order(fields)
    _settle(cls)
    unless_defined = {"__match_args__": tuple(f[0] for f in fields if f[3]), **methods}
    # A class body's __eq__ alone sets __hash__ to None: dataclasses still gives it a hash.
    own = set(cls.__dict__) - ({"__hash__"} if _hash_implied_none(cls) else set())
    attributes = {k: v for k, v in unless_defined.items() if k not in own}
    attributes.update(
        __value_specs__=specs,
        __value_init__=tuple(f[:3] for f in fields if f[3]),
        # Fields not taken by __init__ that have a default: __init__ sets them all the same.
        __value_preset__=tuple(
            f[:3] for f in fields if not f[3] and (f[1] is not _NOTHING or f[2] is not _NOTHING)
        ),
        __value_shown__=tuple(f[0] for f in fields if f[4]),
        __value_compared__=tuple(f[0] for f in fields if f[5]),
        __dataclass_fields__=_LazyFields(cls, "__dataclass_fields__"),
        __dataclass_params__=_LazyFields(cls, "__dataclass_params__"),
    )
    for name, value in attributes.items():
        setattr(cls, name, value)
    return cls


def _hash_implied_none(cls: type) -> bool:
    return cls.__dict__.get("__hash__", 0) is None and "__eq__" in cls.__dict__


def _specs(cls: type) -> list[_Spec]:
    """The fields of `cls`, its bases' first, as the class bodies wrote them."""
    specs: dict[str, _Spec] = {}
    for base in cls.__mro__[-1:0:-1]:
        if "__dataclass_fields__" in base.__dict__:
            if "__value_specs__" not in base.__dict__:
                raise TypeError(f"{cls.__name__}: a base made by @dataclass; make it @frozen too")
            specs.update((spec[0], spec) for spec in base.__dict__["__value_specs__"])
    for name, annotation in inspect.get_annotations(cls).items():
        if _is_classvar(annotation):
            continue
        given = cls.__dict__.get(name, _NOTHING)
        if _unsupported(annotation) or (isinstance(given, _Field) and given.kw_only is True):
            raise TypeError(
                f"{cls.__name__}.{name}: InitVar and keyword-only fields need @dataclass"
            )
        specs[name] = (name, annotation, given)
    for name, given in cls.__dict__.items():
        if isinstance(given, _Field) and name not in specs:
            raise TypeError(f"{name!r} is a field but has no type annotation")
    return list(specs.values())


def _check_order(fields: list[_Read]) -> None:
    """The errors dataclasses gives for a class's defaults."""
    defaulted = False
    for name, default, factory, init, _, _ in fields:
        if default is not _NOTHING and default.__class__.__hash__ is None:
            raise ValueError(
                f"mutable default {type(default)} for field {name} is not allowed: "
                "use default_factory"
            )
        if not init:
            continue
        if default is _NOTHING and factory is _NOTHING:
            if defaulted:
                raise TypeError(f"non-default argument {name!r} follows default argument")
        else:
            defaulted = True


def _settle(cls: type) -> None:
    """A field's class attribute is its default, as dataclasses leaves it: none without one."""
    for name in inspect.get_annotations(cls):
        given = cls.__dict__.get(name)
        if isinstance(given, _Field):
            if given.default is _NOTHING:
                delattr(cls, name)
            else:
                setattr(cls, name, given.default)


def _is_classvar(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return annotation.startswith(("ClassVar", "typing.ClassVar"))
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar


def _unsupported(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return "InitVar" in annotation or "KW_ONLY" in annotation
    return isinstance(annotation, dataclasses.InitVar) or annotation in (
        dataclasses.InitVar,
        getattr(dataclasses, "KW_ONLY", None),
    )


def _read(spec: _Spec) -> _Read:
    """(name, default, default_factory, init, repr, compare) of a field."""
    name, _, given = spec
    if isinstance(given, _Field):
        return name, given.default, given.default_factory, given.init, given.repr, given.compare
    return name, given, _NOTHING, True, True, True


class _LazyFields:
    """`__dataclass_fields__` (or `__dataclass_params__`) of a `@frozen` class, made by
    dataclasses on first use: from a copy of the class's fields, so that the class itself
    keeps its shared methods."""

    def __init__(self, owner: type, attribute: str) -> None:
        self.owner, self.attribute = owner, attribute

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        _made_by_dataclasses(self.owner)
        return self.owner.__dict__[self.attribute]


def _made_by_dataclasses(cls: type) -> None:
    """Let dataclasses make `cls`'s fields and parameters, on a copy of its fields."""
    specs: list[_Spec] = cls.__dict__["__value_specs__"]
    body: dict[str, Any] = {
        "__annotations__": {name: annotation for name, annotation, _ in specs},
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__ or cls.__name__,  # any: dataclasses would sign a class without
    }
    body.update((name, given) for name, _, given in specs if given is not _NOTHING)
    copy: Any = dataclasses.dataclass(
        type(cls.__name__, (), body), init=False, repr=False, eq=False
    )
    type.__setattr__(cls, "__dataclass_fields__", copy.__dataclass_fields__)
    type.__setattr__(cls, "__dataclass_params__", copy.__dataclass_params__)


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
    for name, default, factory in type(self).__value_preset__:
        object.__setattr__(self, name, factory() if default is _NOTHING else default)
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
_MUTABLE_METHODS: dict[str, Any] = {
    "__init__": _init,
    "__eq__": _eq,
    "__hash__": None,
    "__repr__": _repr,
}
