"""Host buffers for snapshots: pinned (page-locked) for states that hold CUDA tensors.

A copy from GPU memory into pageable host memory goes through the driver's own staging buffer
at about a third of the speed of a copy into pinned memory (measured on an H100: 56.6 ms for
1 GB pageable, 18.1 ms pinned). So a `Snapshot` of a state with CUDA tensors asks for a pinned
buffer, and copies into it with `non_blocking=True` on a copy stream (`cluster.storage.
snapshot`). Pinning is slow (a page-locking system call over the whole buffer) and pinned
memory is taken from what the OS can page: the buffers are kept and handed out again (a
snapshot keeps its buffer from one save to the next; one it gives back waits here for the next
that fits), and the pinned bytes of the process are bounded: by the job's configuration
(`ClusterConfig.pinned_max_bytes`, which `cluster.init()` passes to `configure`, whether the
config came from the environment or was given to it), else, in a process without `init()`, by
`CLUSTER_PINNED_MAX_BYTES` of its environment.

Where pinning is refused (no CUDA: torch raises; the bound reached; the OS out of lockable
memory), the buffer is pageable instead, and a warning says so once per reason: the save is
slower, not wrong.

numpy is imported at the first buffer, not with this module: `cluster.init()` imports this
module to pass the bound on, and a job without checkpoints does not need numpy.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.protocol import environment
from cluster.protocol.config import DEFAULT_PINNED_MAX_BYTES

PINNED_MAX_ENV = environment.PINNED_MAX_ENV
PINNED_MAX_DEFAULT = DEFAULT_PINNED_MAX_BYTES

if TYPE_CHECKING:
    import numpy as np

_log = logging.getLogger(__name__)


def pinned_max_from_env() -> int:
    """CLUSTER_PINNED_MAX_BYTES of this process's environment (default 4 GiB; 0: never pin),
    read by the parser `from_env` uses, so cluster.init() has refused a bad one before; a
    ConfigError for a bad value where no init() came first."""
    return environment.pinned_max_from_env(os.environ)


# Makes `nbytes` of zeroed page-locked memory: the array and the object that owns it; raises
# RuntimeError or MemoryError where it cannot.
PageLock = Callable[[int], "tuple[np.ndarray[Any, Any], Any]"]


def torch_page_lock(nbytes: int) -> tuple[np.ndarray[Any, Any], Any]:
    """Pinned memory from torch's CUDA host allocator (RuntimeError without CUDA)."""
    # A state holds CUDA tensors only when torch was imported: never import it here.
    torch = sys.modules.get("torch")
    if torch is None:
        raise RuntimeError("torch is not imported")
    tensor = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    return tensor.numpy(), tensor


@dataclass(frozen=True)
class HostBuffer:
    """`array`: the bytes (uint8); `pinned`: whether they are page-locked. `owner` keeps the
    torch tensor whose memory a pinned array is."""

    array: np.ndarray[Any, Any]
    pinned: bool
    owner: Any = None

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


def _pageable(nbytes: int) -> HostBuffer:
    import numpy as np  # noqa: PLC0415 - at the first buffer (see the module)

    return HostBuffer(np.zeros(nbytes, np.uint8), pinned=False)


class HostBuffers:
    """Hands out host buffers, pinned ones up to `max_pinned` bytes in all; see the module."""

    def __init__(self, max_pinned: int, page_lock: PageLock | None = None) -> None:
        self.max_pinned = max_pinned
        self._page_lock = page_lock or torch_page_lock
        self._lock = threading.Lock()
        self._pinned_bytes = 0  # pinned bytes allocated (handed out or free)
        self._free: list[HostBuffer] = []  # pinned buffers given back, for the next that fits
        self._warned: set[str] = set()
        self.allocations = 0  # pinned buffers made (a reuse makes none)

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return self._pinned_bytes

    def acquire(self, nbytes: int, *, pinned: bool) -> HostBuffer:
        """A zeroed buffer of at least `nbytes` (exactly, when it is new); pinned when asked
        and possible, else pageable (see the module)."""
        if not pinned:
            return _pageable(nbytes)
        with self._lock:
            reused = self._take_free(nbytes)
            if reused is not None:
                reused.array[:] = 0
                return reused
            if self._pinned_bytes + nbytes > self.max_pinned:
                self._drop_free()
            if self._pinned_bytes + nbytes > self.max_pinned:
                self._warn(
                    "bound",
                    f"snapshots of CUDA tensors need {nbytes} more bytes of pinned memory than "
                    f"the bound of {self.max_pinned} bytes allows ({self._pinned_bytes} held): "
                    "using pageable memory, about 3x slower to copy into; raise "
                    f"{PINNED_MAX_ENV} (ClusterConfig.pinned_max_bytes) to pin",
                )
                return _pageable(nbytes)
            buffer = self._pin(nbytes)
            if buffer.pinned:
                self._pinned_bytes += nbytes
                self.allocations += 1
            return buffer

    def set_max_pinned(self, max_pinned: int) -> None:
        """Pin at most `max_pinned` bytes from now on; the buffers given back that the new bound
        leaves no room for are freed (those handed out stay counted, and no new one is pinned
        until the count is under the bound again)."""
        with self._lock:
            self.max_pinned = max_pinned
            if self._pinned_bytes > max_pinned:
                self._drop_free()

    def release(self, buffer: HostBuffer) -> None:
        """Give a buffer back: a pinned one is kept for reuse (a pageable one is just let go)."""
        if buffer.pinned:
            with self._lock:
                if not any(free is buffer for free in self._free):
                    self._free.append(buffer)

    def clear(self) -> None:
        """Free the pinned buffers given back (those handed out stay counted)."""
        with self._lock:
            self._drop_free()

    def _take_free(self, nbytes: int) -> HostBuffer | None:
        fits = [b for b in self._free if b.nbytes >= nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda b: b.nbytes)
        self._free.remove(best)
        return best

    def _drop_free(self) -> None:
        for buffer in self._free:
            self._pinned_bytes -= buffer.nbytes
        self._free.clear()

    def _pin(self, nbytes: int) -> HostBuffer:
        try:
            array, owner = self._page_lock(nbytes)
        except (RuntimeError, MemoryError) as exc:
            self._warn(
                "pin",
                f"cannot pin host memory for snapshots of CUDA tensors ({exc}): using pageable "
                "memory, about 3x slower to copy into",
            )
            return _pageable(nbytes)
        return HostBuffer(array, pinned=True, owner=owner)

    def _warn(self, reason: str, message: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            _log.warning("%s", message)


_default: HostBuffers | None = None
_configured: int | None = None  # the job's bound (`configure`); None: none given
_default_lock = threading.Lock()


def configure(max_pinned: int) -> None:
    """The job's bound on pinned bytes (`ClusterConfig.pinned_max_bytes`, from `cluster.init()`):
    the process's buffers obey it from now on, whether they were made before or are made later.
    """
    global _configured
    with _default_lock:
        _configured = max_pinned
        if _default is not None:
            _default.set_max_pinned(max_pinned)


def default_buffers() -> HostBuffers:
    """The process's buffers (pinned memory is the process's to bound), made at first use with
    the job's bound (`configure`), else the environment's (a process without `cluster.init()`).
    """
    global _default
    with _default_lock:
        if _default is None:
            bound = _configured if _configured is not None else pinned_max_from_env()
            _default = HostBuffers(bound)
        return _default
