"""Whether an error that ended a training step (or a restore) is a peer's failure.

A `TrainingLoop` rolls back when a peer failed, and raises anything else. Beside the
`PeerFailedError` of a cluster collective (a peer failed, said by the scheduler), an error is
either:

- an error of the data plane: a torch.distributed collective (gloo, NCCL) whose peer died or
  hung. The data plane often knows first: a SIGKILLed peer closes its sockets at once, and the
  scheduler's word follows a moment later (a hung peer's, after MS_NODE_TIMEOUT). So the
  scheduler is given `runtime.failure_wait_s()` to confirm a failed peer, and the wait is said
  in one line;
- a fetch of a peer's state (`NoPeerStateError`) that got it from none of them: the peer that
  held it may have died or hung as it served (a hung one is given up on after 10 s of
  silence, well before the scheduler names it), so the scheduler is given the same wait;
- anything else (ZeroDivisionError, a KeyError, a shape that does not match): the program's
  own error, raised at once, unless the scheduler already knows that a peer of the generation
  failed (the step may have failed of it). Waiting for a failure that is not coming would hold
  the process, and with it the data-plane group its peers are blocked on, for MS_NODE_TIMEOUT.

An error is of the data plane when it, or one it was raised from or during (`__cause__`,
`__context__`), is torch.distributed's `DistError` (DistBackendError, DistNetworkError, ...),
or a RuntimeError or OSError that torch.distributed (or DDP, torch.nn.parallel) raised itself
(the innermost frame of its traceback is theirs: gloo's "Connection closed by peer" and
"Timed out waiting ... for recv" come as a plain RuntimeError out of `all_reduce`), or whose
message names gloo, NCCL, c10d or a ProcessGroup (DDP's allreduce fails inside the autograd
engine, whose frames are not torch.distributed's). torch is never imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from types import TracebackType

from cluster.api import excepthook, runtime
from cluster.protocol.errors import NoPeerStateError

# The modules whose frames raise a collective's error: torch.distributed's, and DDP's.
_DATA_PLANE_MODULES = ("torch.distributed", "torch.nn.parallel")
_DATA_PLANE_WORDS = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)
_CHAIN_MAX = 8  # an error raised while handling another, and so on: a bounded walk


def a_peer_failed(generation: int, error: BaseException, say: Callable[[str], None]) -> bool:
    """Whether `error`, raised by work of `generation`, is a peer's failure (see the module):
    the scheduler says at once that a peer of it failed (or the job moved past it), or `error`
    is of the data plane and the scheduler says so within `runtime.failure_wait_s()`."""
    if runtime.peer_failed(generation, 0.0):
        return True
    if isinstance(error, NoPeerStateError):
        what = "no peer gave its state"
    elif is_data_plane_error(error):
        what = "an error of the data plane"
    else:
        return False
    wait_s = runtime.failure_wait_s()
    say(
        f"{excepthook.error_line(error)}: {what}; waiting up to {wait_s:g} s "
        "(MS_NODE_TIMEOUT + 2 s) for the scheduler to say whether a peer failed"
    )
    return runtime.peer_failed(generation, wait_s)


def is_data_plane_error(error: BaseException) -> bool:
    """Whether `error` (or one in its chain) came from a collective of gloo or NCCL."""
    for link in _chain(error):
        if _is_dist_error(link):
            return True
        if isinstance(link, (RuntimeError, OSError)) and (
            _raised_by_data_plane(link.__traceback__) or _DATA_PLANE_WORDS.search(str(link))
        ):
            return True
    return False


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen and len(seen) < _CHAIN_MAX:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def _is_dist_error(error: BaseException) -> bool:
    """torch.distributed.DistError or a subclass, found by name: torch is not imported here."""
    return any(
        kind.__name__ == "DistError" and kind.__module__.startswith("torch.distributed")
        for kind in type(error).__mro__
    )


def _raised_by_data_plane(traceback: TracebackType | None) -> bool:
    """Whether the innermost frame of `traceback` is torch.distributed's or DDP's: the error
    was raised by a collective, not by the program's code that a collective's caller ran (a
    model's forward under DDP)."""
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    module = traceback.tb_frame.f_globals.get("__name__", "")
    return isinstance(module, str) and module.startswith(_DATA_PLANE_MODULES)
