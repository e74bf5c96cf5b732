"""Checks every layer needs on text from outside: a plain decimal number, a host, "host:port".

Here, below `config` and `state_url` (which both use them), so that there is one of each.
"""

from __future__ import annotations

import re

from cluster.protocol.display import quoted
from cluster.protocol.errors import ConfigError

# A host name (RFC 1035: at most 253 characters) or an IP literal (IPv6 maybe in brackets,
# with a %zone): what a socket and a person can both take as it is.
MAX_HOST_CHARS = 253
# A bad value is quoted in its message cut to this many characters (`display.quoted`).
VALUE_CHARS = 64
_HOST_RE = re.compile(r"[A-Za-z0-9._:%\[\]-]+")


def is_decimal(text: str) -> bool:
    """`text` is ASCII digits, so int(text) is a plain decimal number: '²'.isdigit() is true,
    but int('²') fails; and ' 7' or '+7' are not what the sender meant by a number."""
    return text.isascii() and text.isdigit()


def plain_float(text: str) -> float | None:
    """`text` as float() reads it when it is ASCII without '_' ('1e3', '0.5', 'nan'); None
    otherwise, though float() also takes fullwidth digits and '1_0'."""
    if not text.isascii() or "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def shown(value: str) -> str:
    """`value` quoted for a message, cut to VALUE_CHARS characters and escaped (`quoted`)."""
    return quoted(value, VALUE_CHARS)


def lookup_name(host: str) -> str | bytes:
    """`host` as socket.getaddrinfo takes it: an ASCII one as bytes, which it passes on as they
    are; a str goes through the idna codec, imported on first use (encodings.idna and stringprep,
    about 1 ms of each process's start)."""
    return host.encode("ascii") if host.isascii() else host


def check_host(name: str, host: str) -> str:
    """`host` when it is a host name or an IP address of at most MAX_HOST_CHARS; else a
    ConfigError naming `name` and quoting a short, escaped prefix of it."""
    if not host or len(host) > MAX_HOST_CHARS or not _HOST_RE.fullmatch(host):
        raise ConfigError(
            f"{name} {shown(host)} is not a host name or IP address: use at most "
            f"{MAX_HOST_CHARS} letters, digits and . - _ : % (an IPv6 address maybe in [ ])"
        )
    return host


def split_address(name: str, address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an IPv6 host in brackets loses them); a ConfigError
    naming `name` when it is not HOST:PORT with a host (`check_host`) and a port in 1-65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not is_decimal(port) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{name} {quoted(address, 300)} must be HOST:PORT with a port in 1-65535")
    return check_host(name, host.strip("[]")), int(port)
