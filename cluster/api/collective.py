"""Control-plane collectives and the job's key-value store, over the scheduler.

For coordination (who has which checkpoint, a shared seed, a rendezvous address), not for
tensors: values travel through the scheduler and are limited to 64 MiB per call. Every rank
must call the same collectives in the same order, as with any collective library; a mismatch
is reported (`CollectiveMismatchError`), not deadlocked on.

Collectives are one at a time per process: the scheduler matches each rank's calls by their
order in the rank's process, which calls made by two threads at once do not have, so a
collective called while another thread's is in flight is refused (`_one_at_a_time`).

What is unpickled: only what `allgather_object` and `broadcast_object` deliver, which the
scheduler takes only from the job's members (every call proves its node's credential), as
torch.distributed's object collectives trust their group. `allreduce`, `allgather_bytes` and
`broadcast_bytes` never unpickle: an array travels as a small JSON header (a numeric dtype, the
shape) and its raw bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cluster.api import runtime
from cluster.api.worker_metrics import collective as timed
from cluster.protocol.display import safe
from cluster.protocol.errors import CapacityError, ClusterError, CollectiveError
from cluster.transport.edge import MESSAGE_LIMITS

if TYPE_CHECKING:
    from cluster.worker.session import WorkerSession

DEFAULT_WAIT_S = 300.0
# The longest kv_store().wait: its call's gRPC deadline (the wait, plus a margin) must be a time
# gRPC can hold; from about 1e10 s on it is already past, and the call fails at once.
MAX_WAIT_S = 1e9


# Held while a collective of this process is in flight (`_one_at_a_time`).
_in_flight = threading.Lock()


@contextlib.contextmanager
def _one_at_a_time(what: str) -> Iterator[WorkerSession]:
    """The session, for the one collective `what` of this process in flight; a CollectiveError,
    before anything is sent, while another thread's is. Every rank matches its calls with its
    peers' by their order, which two threads' calls at once do not have: they would be paired
    across ranks by timing, each thread given another's data."""
    session = runtime.session()
    session.check_process()  # a forked child: that error, not this one
    if not _in_flight.acquire(blocking=False):
        raise CollectiveError(
            f"{what} was called while another thread of this process is in a collective: "
            "collectives are one at a time per process (every rank must make them in the same "
            "order, which threads calling at once do not have); nothing was sent: make them "
            "from one thread, or hold a lock of your own around them"
        )
    try:
        yield session
    finally:
        _in_flight.release()


def barrier() -> None:
    """Return once every worker has called barrier()."""
    with _one_at_a_time("barrier") as session, timed("barrier"):
        session.call(session.agent.exchange("barrier", b"", generation=session.generation_pin))


def allgather_object(obj: Any) -> list[Any]:
    """Every worker's `obj` (picklable), in rank order, on every worker."""
    import pickle  # noqa: PLC0415 - 1.5 ms at import; only the object collectives need it

    mine = pickle.dumps(obj)
    values = _allgather("allgather_object", mine, "this rank's object pickles to")
    return [pickle.loads(v) for v in values]  # noqa: S301 - peers of the same job


def allgather_bytes(data: bytes | bytearray | memoryview) -> list[bytes]:
    """Every worker's `data`, in rank order, on every worker, never unpickled."""
    mine = _as_bytes("allgather_bytes", data)
    return [bytes(v) for v in _allgather("allgather_bytes", mine, "this rank's data is")]


def _allgather(what: str, mine: bytes, made: str) -> list[bytes]:
    with _one_at_a_time(what) as session:
        _check_fits(what, "allgather", mine, made)
        with timed("allgather"):
            return session.call(
                session.agent.exchange("allgather", mine, generation=session.generation_pin)
            )


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """The `obj` of rank `root`, on every worker (other ranks' `obj` is ignored)."""
    root_here = _is_this_rank("broadcast_object", root)
    import pickle  # noqa: PLC0415 - see allgather_object

    mine = pickle.dumps(obj) if root_here else b""
    made = f"rank {root}'s object pickles to"
    with _one_at_a_time("broadcast_object") as session:
        _check_fits("broadcast_object", "broadcast", mine, made, root)
        with timed("broadcast"):
            (value,) = session.call(
                session.agent.exchange(
                    "broadcast", mine, root=root, generation=session.generation_pin
                )
            )
    return pickle.loads(value)  # noqa: S301 - peers of the same job


def broadcast_bytes(data: bytes | bytearray | memoryview, root: int = 0) -> bytes:
    """Rank `root`'s `data` on every worker, never unpickled (other ranks' `data` is ignored)."""
    root_here = _is_this_rank("broadcast_bytes", root)
    mine = _as_bytes("broadcast_bytes", data) if root_here else b""
    with _one_at_a_time("broadcast_bytes") as session:
        _check_fits("broadcast_bytes", "broadcast", mine, f"rank {root}'s data is", root)
        (value,) = session.call(
            session.agent.exchange("broadcast", mine, root=root, generation=session.generation_pin)
        )
    return bytes(value)


def _is_this_rank(what: str, root: object) -> bool:
    """Whether `root`, a broadcast's root, is this rank; a CollectiveError, before this rank
    takes part in the broadcast, when it is not a rank of the job: the rank's next collective
    is the one its peers are in."""
    topology = runtime.session().topology
    size = 0 if topology is None else topology.size
    if isinstance(root, bool) or not isinstance(root, int):
        raise _wrong_type(
            what,
            "root",
            root,
            f"an int, a rank of the job (0-{size - 1}); nothing was sent, and this rank took no "
            "part in the collective",
        )
    if not 0 <= root < size:
        raise CollectiveError(
            f"{what}: root={root} is not a rank of the job: use 0-{size - 1}; nothing was "
            "sent, and this rank took no part in the collective"
        )
    return topology is not None and topology.rank == root


def _as_bytes(what: str, data: object) -> bytes:
    """`data` as the bytes a collective sends; a CollectiveError, before this rank takes part in
    the collective, when it is not bytes-like: the rank's next collective is the one its peers
    are in."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise _wrong_type(
        what,
        "data",
        data,
        "bytes, a bytearray or a memoryview (a str: its .encode()); nothing was sent, and this "
        "rank took no part in the collective",
    )


def _check_fits(what: str, op: str, payload: bytes, made: str, root: int = 0) -> None:
    """Refuse a payload that no collective carries with a CapacityError, once this rank has
    withdrawn from the collective `op` its peers are in (`_withdraw`): nothing of the payload
    is sent, and every rank's call of that collective fails at once, naming this rank and the
    size."""
    size = len(payload)
    if size <= MAX_COLLECTIVE_BYTES:
        return
    _withdraw(
        op,
        f"its {what} payload of {size} bytes ({size / 2**20:.1f} MiB) is over the "
        f"{MAX_COLLECTIVE_BYTES} bytes a control-plane collective carries (64 MiB less room "
        "for framing)",
        root,
    )
    raise CapacityError(
        f"{what}: {made} {size} bytes, more than the {MAX_COLLECTIVE_BYTES} a control-plane "
        "collective carries (64 MiB less room for framing); it was not sent, this collective "
        "failed for every rank (the others were told why), and the next one goes on: send less "
        "(a file's path, a kv_store() key), or use a data-plane library (torch.distributed) "
        "for data this large"
    )


def _withdraw(op: str, reason: str, root: int = 0) -> None:
    """Take part in this rank's next collective, `op`, without a contribution, for `reason`
    (in words, for its peers): the scheduler fails that collective at once for every rank, so
    that none waits out its timeout, and every rank's next collective is the same one."""
    session = runtime.session()
    withdrawal = session.agent.exchange(
        op, b"", root=root, generation=session.generation_pin, withdrawn=reason
    )
    try:
        session.call(withdrawal)
    except CollectiveError:
        return  # the collective failed for every rank, as it must: the caller raises its own


# The longest value and key the store takes, in bytes (the scheduler's `machine.kv.MAX_VALUE_BYTES`
# and `MAX_KEY_BYTES`, not imported: it would bring the scheduler's package into every worker).
MAX_KV_VALUE_BYTES = 4 * 1024 * 1024
MAX_KV_KEY_BYTES = 1024
# The largest KvWait request the scheduler reads (`cluster.transport.edge`): what one wait's keys
# may take, encoded (`_wait_request_bytes`).
MAX_KV_WAIT_BYTES = MESSAGE_LIMITS["KvWait"]
# What one control-plane collective may carry in all (a gRPC message), less room for framing.
MAX_COLLECTIVE_BYTES = 64 * 1024 * 1024 - 64 * 1024
_REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
_NUMERIC_KINDS = "biufc"  # numpy dtype kinds allreduce takes: bool, int, uint, float, complex


def allreduce(array: Any, op: str = "sum") -> Any:
    """The element-wise `op` ("sum", "mean", "max", "min", "prod") of every worker's numpy
    array, on every worker, the same bits everywhere.

    The arrays are gathered through the scheduler and reduced in rank order on each worker, so
    the result does not depend on timing (float addition is not associative). For small arrays
    (gradients of small models, metrics): the array's size times the number of workers must stay
    under 64 MiB.

    The result has the array's shape; a numpy scalar or a Python number gives a numpy scalar.
    Its dtype is numpy's (`reduced_dtypes`), not the input's, where the input's would lose the
    answer: sum and prod of bool and signed integers are taken in int64, of unsigned integers in
    uint64 (as `np.sum`); mean of bool and integers in float64, of float16 in float32 and given
    as float16 (as `np.mean`); max and min keep the dtype. torch.distributed.all_reduce works in
    the tensor's own dtype instead (an int8 sum wraps past 127).
    """
    import numpy as np  # noqa: PLC0415 - numpy only for those who use it

    if op not in _REDUCE_OPS:
        raise ClusterError(f"allreduce op={op!r} is not one of {', '.join(_REDUCE_OPS)}")
    mine = np.asarray(array)  # a 0-d array for a scalar: the shape is kept
    if mine.dtype.kind not in _NUMERIC_KINDS or mine.dtype.hasobject:
        raise ClusterError(
            f"allreduce needs a numeric numpy array (bool, integer, float or complex), not one "
            f"of {mine.dtype}"
        )
    import json  # noqa: PLC0415 - 1.5 ms at import; only allreduce's header needs it

    with _one_at_a_time("allreduce") as session:
        size = session.topology.size if session.topology is not None else 1
        _check_reduce_fits(mine.nbytes, size)
        header = json.dumps({"dtype": mine.dtype.str, "shape": list(mine.shape)}).encode()
        payload = len(header).to_bytes(4, "little") + header + mine.tobytes()
        pin = session.generation_pin
        with timed("allreduce"):
            values = session.call(session.agent.exchange("allgather", payload, generation=pin))
    result = reduced([_peer_array(value, mine) for value in values], op)
    return result if isinstance(array, np.ndarray) or result.ndim else result[()]


def _peer_array(value: bytes, mine: Any) -> Any:
    """A peer's allreduce contribution as an array like `mine`; ClusterError if it is not."""
    import numpy as np  # noqa: PLC0415 - see allreduce

    length = int.from_bytes(value[:4], "little")
    dtype, shape = _array_header(value[4 : 4 + length])
    if (dtype, shape) != (mine.dtype.str, mine.shape):
        raise ClusterError(
            f"allreduce got an array of {dtype} {shape} from a peer, but this worker's is "
            f"{mine.dtype.str} {mine.shape}: every worker must pass the same dtype and shape"
        )
    if len(value) != 4 + length + mine.nbytes:
        raise ClusterError(
            f"allreduce got {len(value) - 4 - length} bytes of array data from a peer for "
            f"{mine.dtype.str} {mine.shape} ({mine.nbytes} bytes)"
        )
    return np.frombuffer(value, dtype=mine.dtype, offset=4 + length).reshape(shape)


def reduced(arrays: list[Any], op: str) -> Any:
    """The element-wise `op` of `arrays` (one per rank, all of one dtype and shape), taken in
    rank order, in the dtype `reduced_dtypes` names; an array of their shape (0-d for 0-d)."""
    import numpy as np  # noqa: PLC0415 - see allreduce

    work, given = reduced_dtypes(arrays[0].dtype, op)
    reduce = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}.get(
        op, np.multiply
    )
    result = arrays[0].astype(work)  # a copy, which the others are reduced into
    for other in arrays[1:]:
        reduce(result, other, out=result)
    if op == "mean":
        np.divide(result, len(arrays), out=result)
    return result.astype(given, copy=False)


def reduced_dtypes(dtype: Any, op: str) -> tuple[Any, Any]:
    """(the dtype `op` is taken in, the dtype of its result) for arrays of `dtype`: numpy's
    `np.sum`, `np.prod` and `np.mean` rule, so that a sum of bools counts, an int8 sum does not
    wrap at 127 and an integer mean has its fraction."""
    import numpy as np  # noqa: PLC0415 - see allreduce

    kind = dtype.kind
    if op in ("max", "min"):
        return dtype, dtype
    if op == "mean":
        if kind in "biu":
            return np.dtype(np.float64), np.dtype(np.float64)
        return (np.dtype(np.float32) if dtype == np.float16 else dtype), dtype
    widened = {"b": np.int64, "i": np.int64, "u": np.uint64}.get(kind)
    work = dtype if widened is None else np.dtype(widened)
    return work, work


def _check_reduce_fits(nbytes: int, size: int) -> None:
    """Refuse an allreduce whose gathered arrays no collective carries with a ClusterError,
    once this rank has withdrawn from it (`_withdraw`), as `_check_fits` does."""
    if nbytes * size <= MAX_COLLECTIVE_BYTES:
        return
    _withdraw(
        "allgather",
        f"its allreduce array of {nbytes} bytes, from each of {size} workers, is over the "
        f"{MAX_COLLECTIVE_BYTES} bytes a control-plane collective carries",
    )
    raise ClusterError(
        f"allreduce of {nbytes} bytes from each of {size} workers exceeds the "
        f"{MAX_COLLECTIVE_BYTES // 2**20} MiB a control-plane collective carries (it was not "
        "sent, and this allreduce failed for every rank): reduce in chunks, or use a "
        "data-plane library (torch.distributed) for tensors this large"
    )


def _array_header(raw: bytes) -> tuple[str, tuple[int, ...]]:
    """(dtype string, shape) of a peer's allreduce header; ClusterError if it is not one."""
    import json  # noqa: PLC0415 - see allreduce

    try:
        header = json.loads(raw)
        dtype, shape = str(header["dtype"]), tuple(int(n) for n in header["shape"])
    except (ValueError, KeyError, TypeError):
        raise ClusterError("allreduce got an array header it cannot read from a peer") from None
    return dtype, shape


class KeyValueStore:
    """The job's key-value store, shared by every node: set, get, wait, add.

    Keys are str of 1 to MAX_KV_KEY_BYTES (1024) bytes in UTF-8. Values are bytes (str is
    encoded as UTF-8). Counters made by `add` are stored as decimal text, as in torch's
    TCPStore. An argument of the wrong type, or a key or str value that breaks these rules (a
    lone surrogate has no UTF-8), is refused at once, before anything is sent, with a
    CollectiveError naming it.
    """

    def set(self, key: str, value: bytes | str) -> None:
        _check_key("set", key)
        if isinstance(value, str):
            data = _utf8("set", "value", value)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            data = bytes(value)
        else:
            raise _refused("set", "value", value, "bytes or str (encode other values: str(n))")
        if len(data) > MAX_KV_VALUE_BYTES:
            raise CapacityError(
                f"kv_store().set: the value for key {safe(repr(key), 60)} has {len(data)} bytes, "
                f"more than the {MAX_KV_VALUE_BYTES} (4 MiB) the store takes a value; nothing was "
                "sent: the store is for control data, so store a file's path instead"
            )
        session = runtime.session()
        session.call(session.agent.kv_set(key, data))

    def get(self, key: str) -> bytes:
        """The value of `key`; KeyError when it is not set (use wait to block for it)."""
        _check_key("get", key)
        session = runtime.session()
        values, missing = session.call(session.agent.kv_get([key]))
        if missing:
            raise KeyError(key)
        return values[0]

    def wait(self, keys: str | list[str], timeout_s: float = DEFAULT_WAIT_S) -> list[bytes]:
        """Block until every key is set; their values, in order. CollectiveError on timeout.

        `keys` is a list of keys, as for TCPStore.wait; one str is one key: `wait("ready")`
        waits for the key "ready" and returns its value as the list's one item. `timeout_s`:
        a finite number of seconds from 0 to MAX_WAIT_S (about 31 years). One wait's keys may
        take at most MAX_KV_WAIT_BYTES (256 KiB) as sent, about 20,000 keys of 10 bytes: more
        are refused with a CapacityError (wait for them in batches)."""
        wanted = [keys] if isinstance(keys, str) else keys
        if not isinstance(wanted, (list, tuple)):
            raise _refused("wait", "keys", keys, "a list of str keys (or one str key)")
        _check_wait_fits([_check_key("wait", key) for key in wanted])
        wait_s = wait_seconds("kv_store().wait", timeout_s)
        session = runtime.session()
        return session.call(session.agent.kv_wait(list(wanted), wait_s))

    def add(self, key: str, amount: int = 1) -> int:
        """Add `amount` (an int) to a counter atomically (missing counts as 0); the new value.
        Counters are 64-bit integers."""
        _check_key("add", key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise _refused("add", "amount", amount, "an int (counters are 64-bit integers)")
        if not INT64_MIN <= amount <= INT64_MAX:
            raise CollectiveError(
                f"kv_store().add: amount={amount} is outside [{INT64_MIN}, {INT64_MAX}]: "
                "counters are 64-bit integers"
            )
        session = runtime.session()
        return session.call(session.agent.kv_add(key, amount))


def wait_seconds(call: str, timeout_s: object) -> float:
    """`timeout_s` of `call` as seconds; a CollectiveError naming it unless it is a finite
    number from 0 to MAX_WAIT_S."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise _wrong_type(call, "timeout_s", timeout_s, "a number of seconds")
    if not 0 <= timeout_s <= MAX_WAIT_S:  # also refuses nan and inf
        raise CollectiveError(
            f"{call}: timeout_s={safe(repr(timeout_s), 60)} is outside [0, {MAX_WAIT_S:g}]: it "
            "must be a finite number of seconds (at most about 31 years, what the call's "
            "deadline can hold)"
        )
    return float(timeout_s)


# The range of a counter of the store, and so of what one add may add.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_key(method: str, key: object) -> int:
    """The length of `key` in UTF-8; a CollectiveError unless it is a key the scheduler takes
    (a str of 1 to MAX_KV_KEY_BYTES bytes)."""
    if not isinstance(key, str):
        raise _refused(method, "key", key, "a str")
    size = len(_utf8(method, "key", key))
    if not 1 <= size <= MAX_KV_KEY_BYTES:
        raise CollectiveError(
            f"kv_store().{method}: key {safe(repr(key), 60)} is {size} bytes long in UTF-8; a key "
            f"must be 1-{MAX_KV_KEY_BYTES} bytes long"
        )
    return size


def _utf8(method: str, name: str, text: str) -> bytes:
    """`text` in UTF-8; a CollectiveError naming it when it has none (a lone surrogate)."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise CollectiveError(
            f"kv_store().{method}: {name} {safe(repr(text), 60)} has no UTF-8 form ({exc.reason} "
            f"at index {exc.start}, {text[exc.start]!r}): keys and str values must be valid "
            "text; pass bytes for a value that is not"
        ) from None


def _check_wait_fits(key_sizes: list[int]) -> None:
    """A CapacityError, before anything is sent, for keys of these sizes (in UTF-8) that make a
    wait larger than the scheduler reads (MAX_KV_WAIT_BYTES)."""
    size = _wait_request_bytes(key_sizes)
    if size > MAX_KV_WAIT_BYTES:
        raise CapacityError(
            f"kv_store().wait: its {len(key_sizes):,} keys make a request of {size:,} bytes, more "
            f"than the {MAX_KV_WAIT_BYTES:,} ({MAX_KV_WAIT_BYTES // 1024} KiB) the scheduler "
            "takes for one wait; nothing was sent: wait for the keys in batches, one wait "
            "after another"
        )


def _wait_request_bytes(key_sizes: list[int]) -> int:
    """The size of a KvWait request for keys of these sizes, as protobuf encodes it: a key is its
    tag, its length (a varint) and its bytes; the timeout, a tag and 8 bytes (counted also for
    a timeout of 0, which is left out)."""
    return sum(1 + max(1, (n.bit_length() + 6) // 7) + n for n in key_sizes) + 9


def _refused(method: str, name: str, value: object, must: str) -> CollectiveError:
    """The error of a KeyValueStore call whose argument `name` is of the wrong type."""
    return _wrong_type(f"kv_store().{method}", name, value, must)


def _wrong_type(call: str, name: str, value: object, must: str) -> CollectiveError:
    """The error of a `call` whose argument `name` is of the wrong type."""
    shown = safe(repr(value), 60)
    return CollectiveError(
        f"{call}: {name}={shown} is of type {type(value).__name__}; it must be {must}"
    )


def kv_store() -> KeyValueStore:
    """The job's key-value store (needs `cluster.init()` first)."""
    runtime.session()
    return KeyValueStore()
