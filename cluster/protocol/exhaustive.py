"""`assert_never` for a `match` that handles every member of a union: mypy (--strict) reports a
member left out, and the run raises if one arrives anyway. (`typing.assert_never` is Python 3.11
on; the package runs on 3.10.)"""

from __future__ import annotations

from typing import NoReturn


def assert_never(value: NoReturn) -> NoReturn:
    """The last case of an exhaustive `match`: `case _: assert_never(value)`."""
    raise AssertionError(f"not handled: {value!r}")
