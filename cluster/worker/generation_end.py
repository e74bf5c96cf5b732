"""Who is told, off the agent's loop, that a generation of the job is over.

The agent hears it first: a peer of the generation failed (`PeerFailed`), or a newer generation
came. The main thread may not hear it for a long time: blocked in a data-plane wait that a
failed peer never completes (an NCCL kernel behind a CUDA sync), it never reaches a cluster call
or the loop's rollback. What registered here (cluster.torch, for an NCCL group) is called at
once, on a thread of its own: not on the agent's loop, which goes on beating, nor on the main
thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Ender = Callable[[int], None]


class GenerationEnd:
    """The enders of one agent, and the newest generation they were told is over."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._enders: list[Ender] = []
        self._told = 0

    def add(self, ender: Ender) -> None:
        """Have `ender(generation)` called once per generation that ends from now on."""
        if ender not in self._enders:
            self._enders.append(ender)

    def heard(self, generation: int) -> None:
        """`generation` (and any older one) is over: tell the enders once, on a thread."""
        if generation <= self._told:
            return
        self._told = generation
        if self._enders:
            threading.Thread(
                target=self._tell,
                args=(list(self._enders), generation),
                name=f"cluster-generation-{generation}-over",
                daemon=True,  # one that blocks (a stuck NCCL abort) must not hold the exit
            ).start()

    def _tell(self, enders: list[Ender], generation: int) -> None:
        for ender in enders:
            try:
                ender(generation)
            except Exception as exc:  # only said: the loop's own release follows
                self._say(f"letting go of generation {generation}'s resources failed: {exc}")
