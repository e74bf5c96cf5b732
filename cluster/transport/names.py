"""Host names' addresses for a process that must not wait on a resolver (`Names`): the relay,
comparing a worker's schedulers with its own (`cluster.protocol.endpoints`).

Each name is looked up once, on a daemon thread of its own: a resolver that hangs holds that
thread, and nothing else (not the event loop, not an executor's threads the process waits for
when it ends). Whoever asks waits at most LOOKUP_S for it; an answer that comes later is still
kept for the next to ask. A name that resolved keeps its addresses for the process's life (at
most MAX_NAMES of them); one that did not is looked up again when next asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterable

from cluster.protocol.endpoints import Resolved, ip_form
from cluster.protocol.parse import lookup_name

# How long one who asks waits for a name's lookup: a resolver's own timeout is 5 s a try.
LOOKUP_S = 5.0
# Names whose addresses are kept, at most; past them an answer serves its askers only.
MAX_NAMES = 1024
# Lookups under way at once, at most (each a thread, which a hung resolver holds): a name asked
# for past them is taken as not resolved, until one ends.
MAX_LOOKUPS = 16
# A name's lookup: its IP addresses (`ip_form` of each), or OSError.
Lookup = Callable[[str], frozenset[str]]


def addresses_of(name: str) -> frozenset[str]:
    """The IP addresses `name` resolves to (a stream socket's), in `ip_form`; OSError
    (socket.gaierror) when it resolves to none."""
    infos = socket.getaddrinfo(lookup_name(name), None, type=socket.SOCK_STREAM)
    return frozenset(ip_form(str(info[4][0])) or str(info[4][0]) for info in infos)


class Names:
    """Names' addresses, each name looked up once off the loop (`lookup`: `addresses_of`)."""

    def __init__(self, lookup: Lookup = addresses_of, timeout_s: float | None = None) -> None:
        self._lookup = lookup
        self._timeout_s = LOOKUP_S if timeout_s is None else timeout_s
        self._known: dict[str, frozenset[str]] = {}
        self._pending: dict[str, asyncio.Future[frozenset[str]]] = {}

    @property
    def known(self) -> Resolved:
        """The names resolved so far, and their addresses."""
        return self._known

    def start(self, names: Iterable[str]) -> None:
        """Look `names` up now, not waiting (what `resolve` will ask for, asked early)."""
        for name in names:
            self._looked_up(name)

    async def resolve(self, names: Iterable[str]) -> tuple[Resolved, dict[str, str]]:
        """(addresses of the names that resolved, why each of the others did not), waiting at
        most the timeout for them all."""
        wanted = {name: self._looked_up(name) for name in set(names)}
        pending = [f for f in wanted.values() if isinstance(f, asyncio.Future)]
        if pending:
            await asyncio.wait(pending, timeout=self._timeout_s)
        resolved: dict[str, frozenset[str]] = {}
        failed: dict[str, str] = {}
        for name, found in wanted.items():
            if isinstance(found, str):
                failed[name] = found
            elif isinstance(found, frozenset):
                resolved[name] = found
            elif not found.done():
                failed[name] = f"no answer within {self._timeout_s:g} s"
            elif (exc := found.exception()) is not None:
                failed[name] = _why(exc)
            else:
                resolved[name] = found.result()
        return resolved, failed

    def _looked_up(self, name: str) -> frozenset[str] | asyncio.Future[frozenset[str]] | str:
        """`name`'s addresses when known, its lookup when under way (started now if need be),
        or why it is not looked up."""
        if name in self._known:
            return self._known[name]
        pending = self._pending.get(name)
        if pending is not None:
            return pending
        if len(self._pending) >= MAX_LOOKUPS:
            return f"{MAX_LOOKUPS} other names are being looked up: call again"
        loop = asyncio.get_running_loop()
        future: asyncio.Future[frozenset[str]] = loop.create_future()
        self._pending[name] = future
        future.add_done_callback(lambda done: self._ended(name, done))
        thread = threading.Thread(
            target=self._run, args=(loop, future, name), name="relay-lookup", daemon=True
        )
        thread.start()
        return future

    def _run(
        self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[frozenset[str]], name: str
    ) -> None:
        try:
            found: frozenset[str] | OSError = self._lookup(name)
        except OSError as exc:
            found = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody asks
            loop.call_soon_threadsafe(_settle, future, found)

    def _ended(self, name: str, done: asyncio.Future[frozenset[str]]) -> None:
        self._pending.pop(name, None)
        if done.exception() is None and len(self._known) < MAX_NAMES:
            self._known[name] = done.result()


def _settle(future: asyncio.Future[frozenset[str]], found: frozenset[str] | OSError) -> None:
    if future.done():
        return
    if isinstance(found, OSError):
        future.set_exception(found)
    else:
        future.set_result(found)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
