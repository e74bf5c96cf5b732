"""A checkpoint state as a JSON tree plus raw arrays: nothing is pickled, in either direction.

A state is a mapping of str to numpy arrays, torch tensors (torch is imported only when the state
or the file holds tensors), bytes, and plain values: None, bool, int, float, str, and lists,
tuples and dicts of them. `encode` turns it into a JSON tree in which every JSON object is a
tagged node ({"$": tag, ...}): lists stay lists, the other containers and the arrays are tagged,
so a tuple, an int dict key or an OrderedDict (a torch state dict) comes back as what it was.
Each array becomes an entry (kind, dtype, shape, offset, nbytes) and a source to copy its bytes
from, at a 64-byte-aligned offset of the data area; `decode` builds the state back from the tree
and the arrays read for the entries (`allocate` makes them, after `check_entry`).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from cluster.protocol.errors import CheckpointError, CorruptCheckpointError

ALIGN = 64
KINDS = ("ndarray", "scalar", "tensor", "bytes")
SUPPORTED = (
    "numpy arrays, torch tensors, bytes, None, bool, int, float, str, and lists, tuples and "
    "dicts of them"
)


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def kind_of(value: object) -> str:
    return type(value).__qualname__


@dataclass
class Encoded:
    """A state taken apart: the tree, each array's entry and the object its bytes come from
    (a numpy array, a torch tensor, or bytes), not copied yet."""

    tree: Any = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)
    data_bytes: int = 0


def encode(state: Mapping[str, Any]) -> Encoded:
    """CheckpointError (naming the value's place) for anything a checkpoint cannot hold."""
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"a checkpoint state is a mapping of str keys, not a {kind_of(state)}"
        )
    for key in state:
        if not isinstance(key, str):
            raise CheckpointError(f"a checkpoint state's keys are str: {key!r} is a {kind_of(key)}")
    encoder = _Encoder()
    try:
        encoder.out.tree = encoder.encode(state, "state")
    except RecursionError:
        raise CheckpointError(
            "the checkpoint state is nested too deeply, or contains itself"
        ) from None
    return encoder.out


def _subclass(array: np.ndarray[Any, Any], where: str) -> CheckpointError:
    """An array of a subclass of numpy's ndarray (a masked array, a matrix, a memmap) would be
    saved as its data only and come back as a plain ndarray: its mask, or what else its class
    adds, silently lost."""
    return CheckpointError(
        f"{where} is a {type(array).__module__}.{kind_of(array)}, a subclass of numpy.ndarray: "
        "a checkpoint holds plain arrays only, and would lose what the subclass adds (a masked "
        "array's mask); pass np.asarray(x), or save a masked array's .data and .mask separately"
    )


class _Encoder:
    def __init__(self) -> None:
        self.out = Encoded()
        # A state can only hold tensors when torch was imported: never import it here.
        self._torch: Any = sys.modules.get("torch")

    def encode(self, value: Any, where: str) -> Any:  # noqa: PLR0911 - one return per kind
        if value is None or isinstance(value, (bool, str)):
            return value
        # Before int and float: numpy's float64 is a float, and must come back as float64.
        if isinstance(value, np.generic):
            return {"$": "scalar", "i": self._array(np.asarray(value), where, "scalar")}
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, np.ndarray):
            if type(value) is not np.ndarray:
                raise _subclass(value, where)
            return {"$": "ndarray", "i": self._array(value, where, "ndarray")}
        if self._torch is not None and isinstance(value, self._torch.Tensor):
            return {"$": "tensor", "i": self._tensor(value, where)}
        if isinstance(value, (bytes, bytearray)):
            return {"$": "bytes", "i": self._add("bytes", "|u1", [len(value)], bytes(value))}
        if isinstance(value, list):
            return [self.encode(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, tuple):
            items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return {"$": "tuple", "items": items}
        if isinstance(value, Mapping):
            node: dict[str, Any] = {"$": "odict" if isinstance(value, OrderedDict) else "dict"}
            node["items"] = [
                [self._key(k, where), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()
            ]
            # torch's state_dict() keeps module versions here; load_state_dict reads them.
            metadata = getattr(value, "_metadata", None)
            if isinstance(metadata, Mapping):
                node["metadata"] = self.encode(metadata, f"{where}._metadata")
            return node
        raise CheckpointError(f"{where} is a {kind_of(value)}: a checkpoint holds {SUPPORTED}")

    def _key(self, key: Any, where: str) -> Any:
        if key is None or isinstance(key, (bool, int, float, str)):
            return key
        if isinstance(key, tuple):
            return {"$": "tuple", "items": [self._key(k, where) for k in key]}
        raise CheckpointError(
            f"{where} has the key {key!r}, a {kind_of(key)}: dict keys in a checkpoint are None, "
            "bool, int, float, str or tuples of them"
        )

    def _array(self, array: np.ndarray[Any, Any], where: str, kind: str) -> int:
        dtype = array.dtype
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise CheckpointError(
                f"{where} is an array of dtype {dtype}: a checkpoint holds arrays of numbers, "
                "bools, strings, bytes and dates, not of Python objects or records"
            )
        return self._add(kind, dtype.str, list(array.shape), array, array.nbytes)

    def _tensor(self, tensor: Any, where: str) -> int:
        torch = self._torch
        is_lazy = getattr(getattr(torch.nn, "parameter", None), "is_lazy", None)
        if is_lazy is not None and is_lazy(tensor):
            raise CheckpointError(
                f"{where} is an uninitialized parameter of a lazy module (torch.nn.LazyLinear, "
                "...): it holds no values yet. Run a forward pass (or the module's "
                "initialize_parameters()) before building the TrainingLoop or saving"
            )
        if tensor.layout != torch.strided or tensor.is_quantized:
            kind = "quantized" if tensor.is_quantized else str(tensor.layout)
            raise CheckpointError(
                f"{where} is a {kind} tensor: a checkpoint holds dense tensors; convert it first "
                "(e.g. .to_dense(), .dequantize())"
            )
        dtype = str(tensor.dtype).removeprefix("torch.")
        nbytes = tensor.numel() * tensor.element_size()
        return self._add("tensor", dtype, list(tensor.shape), tensor.detach(), nbytes)

    def _add(self, kind: str, dtype: str, shape: list[int], source: Any, nbytes: int = -1) -> int:
        nbytes = len(source) if nbytes < 0 else nbytes
        offset = aligned(self.out.data_bytes)
        entry = {"kind": kind, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes}
        self.out.entries.append(entry)
        self.out.sources.append(source)
        self.out.data_bytes = offset + nbytes
        return len(self.out.entries) - 1


def copy_into(source: Any, entry: dict[str, Any], data: np.ndarray[Any, Any]) -> None:
    """Copy an array's bytes to its place in `data` (uint8), in one pass whatever its strides:
    no intermediate copy for a transposed array or a tensor with a lazy conj/neg bit."""
    offset, nbytes = entry["offset"], entry["nbytes"]
    if nbytes == 0:
        return
    target = data[offset : offset + nbytes]
    if isinstance(source, bytes):
        target[:] = np.frombuffer(source, np.uint8)
    elif isinstance(source, np.ndarray):
        np.copyto(target.view(source.dtype).reshape(source.shape), source, casting="no")
    else:  # a torch tensor (on any device); raw bytes: numpy has no bfloat16 or float8
        torch = sys.modules["torch"]
        place = torch.from_numpy(target).view(source.dtype).reshape(source.shape)
        place.copy_(source.resolve_conj().resolve_neg())


def check_entry(entry: Any, cursor: int) -> None:
    """Check an entry's layout before anything is allocated for it."""
    if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
        raise CorruptCheckpointError(f"an array entry is malformed: {entry!r:.200}")
    offset, nbytes, shape = entry.get("offset"), entry.get("nbytes"), entry.get("shape")
    if not (is_count(offset) and is_count(nbytes)) or offset < cursor:
        raise CorruptCheckpointError(f"an array entry has a bad offset or size: {entry!r:.200}")
    if not isinstance(shape, list) or not all(is_count(n) for n in shape):
        raise CorruptCheckpointError(f"an array entry has a bad shape: {entry!r:.200}")
    if not isinstance(entry.get("dtype"), str):
        raise CorruptCheckpointError(f"an array entry has a bad dtype: {entry!r:.200}")


def is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def allocate(entry: dict[str, Any]) -> tuple[Any, memoryview]:
    """The value an entry becomes, and the bytes of it the file's data is read into.
    CorruptCheckpointError when numpy or torch cannot make it: a dtype string numpy cannot
    parse (which raises SyntaxError as readily as TypeError), or a shape whose dimensions
    overflow however few bytes it holds (`[0, 10**19]`)."""
    try:
        return _allocate(entry)
    except (TypeError, ValueError, SyntaxError, OverflowError, RuntimeError) as exc:
        why = str(exc).partition("\n")[0]  # torch's messages go on with a C++ stack
        raise CorruptCheckpointError(
            f"an array entry cannot be made ({type(exc).__name__}: {why:.200}): {entry!r:.200}"
        ) from None


def _allocate(entry: dict[str, Any]) -> tuple[Any, memoryview]:
    kind, shape, nbytes = entry["kind"], tuple(entry["shape"]), entry["nbytes"]
    count = math.prod(shape)
    if kind == "bytes":
        if shape != (nbytes,):
            raise CorruptCheckpointError(f"a bytes entry has shape {shape} but {nbytes} bytes")
        raw = bytearray(nbytes)
        return raw, memoryview(raw)
    if kind == "tensor":
        torch = _import_torch()
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"unknown torch dtype {entry['dtype']!r}")
        if count * dtype.itemsize != nbytes:
            raise CorruptCheckpointError(
                f"a {entry['dtype']} tensor of shape {shape} cannot have {nbytes} bytes"
            )
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype), memoryview(b"")
        buffer = np.empty(nbytes, np.uint8)
        return torch.from_numpy(buffer).view(dtype).reshape(shape), buffer.data
    try:
        np_dtype = np.dtype(entry["dtype"])
    except (TypeError, ValueError, SyntaxError):
        raise CorruptCheckpointError(f"unknown numpy dtype {entry['dtype']!r}") from None
    if np_dtype.hasobject or np_dtype.fields is not None or np_dtype.subdtype is not None:
        raise CorruptCheckpointError(
            f"numpy dtype {entry['dtype']!r} is not one a checkpoint holds"
        )
    if count * np_dtype.itemsize != nbytes or (kind == "scalar" and shape != ()):
        raise CorruptCheckpointError(
            f"an array of dtype {np_dtype} and shape {shape} cannot have {nbytes} bytes"
        )
    array = np.empty(shape, np_dtype)
    return array, (array.reshape(-1).view(np.uint8).data if nbytes else memoryview(b""))


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise CheckpointError(
            "this checkpoint holds torch tensors, and torch is not installed: install torch to "
            "load it"
        ) from None


def decode_state(tree: Any, values: list[Any]) -> dict[str, Any]:
    try:
        state = _decode(tree, values)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"its state tree is malformed ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CorruptCheckpointError("its state is not a mapping of str keys")
    return state


def _decode(node: Any, values: list[Any]) -> Any:  # noqa: PLR0911 - one return per tag
    if isinstance(node, list):
        return [_decode(item, values) for item in node]
    if not isinstance(node, dict):
        return node
    tag = node["$"]
    if tag in ("ndarray", "tensor"):
        return values[node["i"]]
    if tag == "scalar":
        return values[node["i"]][()]
    if tag == "bytes":
        return bytes(values[node["i"]])
    if tag == "tuple":
        return tuple(_decode(item, values) for item in node["items"])
    if tag in ("dict", "odict"):
        items = ((_decode(k, values), _decode(v, values)) for k, v in node["items"])
        if tag == "dict":
            return dict(items)
        result: OrderedDict[Any, Any] = OrderedDict(items)
        if "metadata" in node:
            result._metadata = _decode(node["metadata"], values)  # type: ignore[attr-defined]
        return result
    raise ValueError(f"unknown node tag {tag!r}")
