"""Two checks every layer needs on text from outside: a plain decimal number, and "host:port".

Here, below `config` and `state_url` (which both use them), so that there is one of each.
"""

from __future__ import annotations

from cluster.protocol.errors import ConfigError


def is_decimal(text: str) -> bool:
    """`text` is ASCII digits, so int(text) is a plain decimal number: '²'.isdigit() is true,
    but int('²') fails; and ' 7' or '+7' are not what the sender meant by a number."""
    return text.isascii() and text.isdigit()


def split_address(name: str, address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an IPv6 host in brackets loses them); a ConfigError
    naming `name` when it is not HOST:PORT with a port in 1-65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not is_decimal(port) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{name} {address!r} must be HOST:PORT with a port in 1-65535")
    return host.strip("[]"), int(port)
