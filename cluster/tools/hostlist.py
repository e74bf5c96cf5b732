"""Slurm's node-list syntax, expanded: `gpu[01-03,7],login` -> gpu01 gpu02 gpu03 gpu7 login.

Pure (no subprocess, no scontrol). The rules, checked against `scontrol show hostnames` of a real
Slurm (tests/unit/test_hostlist.py):

- Items are separated by commas or whitespace outside brackets; empty items are skipped and
  duplicates are kept, in order.
- `[...]` holds comma-separated numbers and `lo-hi` ranges (lo <= hi). Each range is padded with
  zeros to the width of its `lo` as written: `[08-10]` -> 08 09 10, `[1-02]` -> 1 2.
- Several brackets in one item expand as a product, the first bracket outermost:
  `rack[1-2]-n[1-2]` -> rack1-n1 rack1-n2 rack2-n1 rack2-n2.
- Text after the last bracket (`n[1-2]-ib`) is kept as a suffix. Slurm 22.05 refuses such a list
  and never writes one; accepting it costs nothing and reads it the way it is meant.

Anything else (an unclosed or nested bracket, an empty or reversed range, letters in a range) is
a ConfigError that names the list and the fault.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from cluster.protocol.errors import ConfigError

# A node list longer than this is refused rather than expanded into memory.
MAX_HOSTS = 1_000_000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


# One bracket term: numbers low..high, each written with at least `width` digits.
_Span = tuple[int, int, int]
# An item of the list: literal text, or the spans of one bracket.
_Part = str | list[_Span]


def expand(nodelist: str, what: str = "node list", limit: int = MAX_HOSTS) -> list[str]:
    """Every host of `nodelist`, in Slurm's order; `what` names it in errors."""
    return list(iter_hosts(nodelist, what, limit))


def first(nodelist: str, what: str = "node list") -> str:
    """The first host of `nodelist` (without expanding the rest); ConfigError when empty."""
    for host in iter_hosts(nodelist, what, limit=None):
        return host
    raise ConfigError(f"{what} {nodelist!r} names no host")


def iter_hosts(
    nodelist: str, what: str = "node list", limit: int | None = MAX_HOSTS
) -> Iterator[str]:
    """The hosts of `nodelist` one by one. The whole list is checked (its syntax, and that it
    names at most `limit` hosts) before the first host comes."""
    items = [_parse_item(item, nodelist, what) for item in _split(nodelist, what)]
    total = sum(_count(parts) for parts in items)
    if limit is not None and total > limit:
        raise ConfigError(f"{what} {nodelist!r} names {total} hosts, more than {limit}")
    for parts in items:
        yield from _hosts(parts, "")


def _count(parts: list[_Part]) -> int:
    total = 1
    for part in parts:
        if not isinstance(part, str):
            total *= sum(high - low + 1 for low, high, _ in part)
    return total


def _hosts(parts: list[_Part], prefix: str) -> Iterator[str]:
    """The product of `parts`, the first bracket outermost."""
    if not parts:
        yield prefix
        return
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        yield from _hosts(rest, prefix + head)
        return
    for low, high, width in head:
        for number in range(low, high + 1):
            yield from _hosts(rest, f"{prefix}{number:0{width}d}")


def _split(nodelist: str, what: str) -> list[str]:
    """The items of the list: split at commas and whitespace outside brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in nodelist:
        if char == "[":
            if depth:
                raise ConfigError(f"{what} {nodelist!r} has a bracket inside a bracket")
            depth = 1
        elif char == "]":
            if not depth:
                raise ConfigError(f"{what} {nodelist!r} closes a bracket it never opened")
            depth = 0
        elif depth == 0 and (char == "," or char.isspace()):
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise ConfigError(f"{what} {nodelist!r} has a bracket that is never closed")
    items.append("".join(current))
    return [item for item in items if item]


def _parse_item(item: str, nodelist: str, what: str) -> list[_Part]:
    """`a[1-2]b[3]` -> ["a", [(1, 2, 1)], "b", [(3, 3, 1)]]."""
    parts: list[_Part] = []
    for index, piece in enumerate(re.split(r"[\[\]]", item)):
        if index % 2 == 0:
            if piece:
                parts.append(piece)
        else:
            parts.append(_spans(piece, nodelist, what))
    return parts


def _spans(inner: str, nodelist: str, what: str) -> list[_Span]:
    """`01-03,7` -> [(1, 3, 2), (7, 7, 1)]."""
    spans: list[_Span] = []
    for term in inner.split(","):
        match = _RANGE.match(term)
        if match is None:
            raise ConfigError(
                f"{what} {nodelist!r}: [{inner}] must hold numbers and lo-hi ranges separated "
                f"by commas, not {term!r}"
            )
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if low > high:
            raise ConfigError(f"{what} {nodelist!r}: the range {term!r} runs backwards")
        spans.append((low, high, len(low_text)))
    return spans
