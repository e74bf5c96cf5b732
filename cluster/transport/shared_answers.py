"""Answers asked once for everyone who wants them: a host's relay answering its workers' requests
for a peer table (`cluster.transport.relay`), a process fetching one for its agents
(`cluster.worker.peer_table`)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SharedAnswers(Generic[K, V]):
    """Answers by key: the first asker's `ask` runs, and whoever asks for the same key meanwhile
    or later gets its answer (the last `kept` keys are kept). An ask that fails (raises, answers
    None, or its asker is cancelled) leaves nothing behind: its asker gets what it got, and those
    that waited on it ask anew, one at a time."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._answers: collections.OrderedDict[K, asyncio.Future[V]] = collections.OrderedDict()

    async def get(self, key: K, ask: Callable[[], Awaitable[V]]) -> V:
        pending = self._answers.get(key)
        while pending is not None:
            await asyncio.wait((pending,))  # raises only if this asker is cancelled
            if not pending.cancelled() and pending.exception() is None:
                answer = pending.result()
                if answer is not None:
                    return answer
            pending = self._answers.get(key)  # that ask failed: the first waiter asks anew
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._answers[key] = future
        while len(self._answers) > self._kept:
            self._answers.popitem(last=False)  # its waiters still get its answer
        try:
            answer = await ask()
        except BaseException as exc:
            self._forget(key, future)
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: nobody need be waiting
            else:
                future.cancel()
            raise
        if answer is None:
            self._forget(key, future)
        future.set_result(answer)
        return answer

    def _forget(self, key: K, future: asyncio.Future[V]) -> None:
        if self._answers.get(key) is future:
            del self._answers[key]
