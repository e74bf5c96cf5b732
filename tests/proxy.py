"""A TCP proxy between nodes and a server they reach, on one asyncio loop of its own.

For tests that lose what the server answered at a moment they pick: `hold_replies()` drops
everything the server sends from then on (what the node sends still goes), `cut()` closes every
connection through it, and the connections made after that are plain again; `down()` closes
them too and closes each new one at once, until `up()` (a link down for a while). With `source`, the
proxy connects to the target from that loopback address (127.0.0.2, ...): the target sees its
clients as another host. With `delay_s`, every chunk is held that long in each direction while
the proxy reads on: a longer link, not a slower one (`benchmarks/outsider.py --legit-rtt`).

One loop carries every connection, so the proxy costs a link no bandwidth that a thread per
direction would (a 63 MiB request took a third longer through one).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

CHUNK = 1 << 20
TIMEOUT_S = 10.0  # the longest the proxy's own steps (connect upstream, cut, close) take
_T = TypeVar("_T")


class Proxy:
    """Listens on a loopback port of its own (`port`) and forwards each connection to
    `target`."""

    def __init__(
        self, target: tuple[str, int], source: str | None = None, delay_s: float = 0.0
    ) -> None:
        self.target = target
        self._source = None if source is None else (source, 0)
        self._delay_s = delay_s
        self._holding = False
        self._down = False
        self._open: list[asyncio.StreamWriter] = []
        listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proxy", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._connected, sock=listener))

    def hold_replies(self) -> None:
        self._holding = True

    def cut(self) -> None:
        """Close every connection through the proxy; the next ones are forwarded whole."""
        self._call(self._cut())

    def down(self) -> None:
        """Cut every connection, and close each new one at once until `up()`."""
        self._down = True
        self.cut()

    def up(self) -> None:
        self._down = False

    def close(self) -> None:
        """Stop listening, close every connection, and stop the loop."""
        if self._loop.is_closed():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(TIMEOUT_S)
        self._loop.close()

    def _call(self, step: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(step, self._loop).result(TIMEOUT_S)

    async def _cut(self) -> None:
        gone, self._open = self._open, []
        self._holding = False
        for writer in gone:
            _abort(writer)

    async def _close(self) -> None:
        self._server.close()
        await self._cut()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            _abort(writer)  # the link is down: the node sees its connection closed
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target, local_addr=self._source), TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError):
            _abort(writer)  # the server is not up: the node sees its connection closed
            return
        self._open += [writer, up_writer]
        await asyncio.gather(
            self._pipe(reader, up_writer, replies=False),
            self._pipe(up_reader, writer, replies=True),
            return_exceptions=True,
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, replies: bool
    ) -> None:
        """Forward what `reader` reads to `writer` until either end closes; then close `writer`
        once what it holds is sent (the other direction's reader ends with its transport)."""
        if self._delay_s <= 0:  # forwarded as read: the sink's pace holds back the source's
            with contextlib.suppress(OSError):
                while chunk := await reader.read(CHUNK):
                    if not (replies and self._holding):
                        writer.write(chunk)
                        await writer.drain()
            writer.close()
            return
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        delivering = asyncio.ensure_future(self._deliver(chunks, writer))
        with contextlib.suppress(OSError):
            while chunk := await reader.read(CHUNK):
                if not (replies and self._holding):
                    chunks.put_nowait((time.monotonic() + self._delay_s, chunk))
        chunks.put_nowait((time.monotonic() + self._delay_s, b""))
        await delivering

    @staticmethod
    async def _deliver(
        chunks: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        """Write each chunk when it is due; an empty one ends the direction."""
        with contextlib.suppress(OSError):
            while True:
                due, chunk = await chunks.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)  # sleep-ok: the link's delay itself
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
        writer.close()  # what is written still goes


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close the connection at once, both ways (its peer sees it closed now, not at the next
    turn of the loop), unsent bytes dropped."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    writer.transport.abort()
