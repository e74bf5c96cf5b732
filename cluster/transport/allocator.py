"""The scheduler's C allocator, set so that a large message it refused leaves no memory behind.

gRPC reads a whole request before the method's size cap (`edge.capped`) can refuse it: an
outsider's 8 MiB registration passes through gRPC's slices and a Python bytes object. glibc's
defaults then keep much of it: its mmap threshold rises to the largest block freed (so the next
large buffers come from the heap, and stay there), and each of gRPC's threads gets an arena of
its own. Measured (`benchmarks/outsider.py`, 16 such messages): the scheduler kept 30-70 MB with
the defaults, 8-18 MB with two arenas and a fixed 1 MiB threshold. Only the scheduler does this:
a worker's allocator is its training framework's business.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("cluster.transport")

# mallopt(3) parameters (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 1 << 20  # blocks of 1 MiB and more are mapped, and unmapped when freed
ARENA_MAX = 2


def return_large_buffers() -> bool:
    """Tune glibc's malloc as above, before the server's threads start; False where the C
    library is not glibc (nothing is changed there)."""
    try:
        # The C library the process runs on, already loaded: ctypes.util.find_library would run
        # ldconfig in a subprocess to name it, at each scheduler's start.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # musl and others: no mallopt
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_ARENA_MAX, ARENA_MAX))
    if not done:
        log.debug("mallopt refused the scheduler's settings; the allocator keeps its defaults")
    return done
