"""Per-rank training checkpoints: atomic, checksummed, pruned, and reported for recovery.

`CheckpointManager.save(step, state)` writes `<directory>/rank_<r>/<prefix>-<step:08d>.ckpt` the
way `cluster.store` writes its state files (temporary file, fsync, rename, fsync the directory),
so a crash leaves whole checkpoints only, keeps the newest `keep_checkpoint_max`, and tells the
scheduler which steps this rank holds: with recovery on, the job restarts from the newest step
every rank holds.

A state is a mapping of str to numpy arrays, torch tensors (torch is imported only when the state
or the file holds tensors), bytes, and plain values: None, bool, int, float, str, and lists,
tuples and dicts of them. The file is a small JSON header (the tree of values, the dtype and
shape of every array) followed by the raw array bytes and a SHA-256 of everything before it:
nothing is unpickled, and a torn or edited file is refused as a whole.

File layout (version 1), integers little-endian:

    preamble  MAGIC, version u32, flags u32 (0), header length u64, file size u64   (32 bytes)
    header    JSON, UTF-8; zero padding to a multiple of 64
    data      each array's bytes at 64-byte-aligned offsets (zero padding between)
    footer    END_MAGIC, SHA-256 of every byte before the footer                   (40 bytes)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import logging
import math
import os
import queue
import re
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeGuard

import numpy as np

from cluster.protocol.config import parse_bool
from cluster.protocol.errors import CheckpointError, ConfigError

FORMAT = "cluster-checkpoint"
VERSION = 1
MAGIC = b"CLCKPT\r\n"
END_MAGIC = b"CLCKEND\n"
SUFFIX = ".ckpt"

_PREAMBLE = struct.Struct("<8sIIQQ")
_FOOTER_SIZE = len(END_MAGIC) + hashlib.sha256().digest_size
_ALIGN = 64
# Reads are hashed in slices of this size, so hashing one slice overlaps reading the next.
_READ_SLICE = 8 << 20
_PREFIX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SUPPORTED = (
    "numpy arrays, torch tensors, bytes, None, bool, int, float, str, and lists, tuples and "
    "dicts of them"
)

_log = logging.getLogger(__name__)

Report = Callable[[list[int]], None]


@dataclass(frozen=True)
class CheckpointConfig:
    """When to save and how many checkpoints to keep (MindSpore's CheckpointConfig names)."""

    save_checkpoint_steps: int = 1
    keep_checkpoint_max: int = 5

    def __post_init__(self) -> None:
        for name in ("save_checkpoint_steps", "keep_checkpoint_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"CheckpointConfig {name}={value!r} is invalid: it must be an integer >= 1"
                )


class CheckpointManager:
    """Saves, prunes, lists and loads the checkpoints of one rank under `directory/rank_<r>/`.

    One process writes a rank's directory at a time (the rank's worker); `rank` defaults to
    `cluster.get_rank()` after `cluster.init()`, else 0, and `recovery` to whether recovery is
    on. `report` receives the steps held after every save; by default they go to the scheduler
    when the cluster is initialized.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        prefix: str,
        config: CheckpointConfig,
        *,
        rank: int | None = None,
        recovery: bool | None = None,
        report: Report | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
            raise ConfigError(
                f"checkpoint prefix={prefix!r} is invalid: use 1-128 letters, digits and . _ -, "
                "starting with a letter or digit"
            )
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"config={config!r} is not a CheckpointConfig")
        self.rank = _default_rank() if rank is None else rank
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"checkpoint rank={rank!r} is invalid: it must be an integer >= 0")
        self.recovery = _recovery_on() if recovery is None else recovery
        if self.recovery and config.keep_checkpoint_max < 2:
            raise ConfigError(
                f"CheckpointConfig keep_checkpoint_max={config.keep_checkpoint_max} is too small "
                "with recovery on: it must be >= 2, because the newest step every rank holds may "
                "be one older than this rank's newest"
            )
        self.prefix = prefix
        self.config = config
        self.directory = Path(directory) / f"rank_{self.rank}"
        self._report = report if report is not None else _report_to_scheduler
        self._name_re = re.compile(rf"^{re.escape(prefix)}-(\d{{8,}}){re.escape(SUFFIX)}$")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint directory {self.directory} ({exc.strerror}): "
                "give a writable directory"
            ) from None

    def path(self, step: int) -> Path:
        return self.directory / f"{self.prefix}-{_check_step(step):08d}{SUFFIX}"

    def should_save(self, step: int) -> bool:
        """Whether `step` (the number of completed training steps) is a saving step."""
        return _check_step(step) % self.config.save_checkpoint_steps == 0

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step` atomically and durably, prune, report.

        Checkpoints of this rank newer than `step` are removed too: they belong to a run that
        was rolled back to an older step, and the job must not restart from them.
        """
        path = self.path(step)
        if not isinstance(state, Mapping):
            raise CheckpointError(
                f"a checkpoint state is a mapping of str keys, not a {_kind(state)}"
            )
        encoder = _Encoder()
        tree = encoder.encode_state(state)
        header = _header_bytes(step, self.rank, self.prefix, tree, encoder)
        self._remove_temporaries()
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            _write(temporary, header, encoder.buffers, encoder.offsets, encoder.data_bytes)
            os.replace(temporary, path)
            _fsync_directory(self.directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise CheckpointError(
                f"cannot save the checkpoint of step {step} to {path} ({exc.strerror}); the "
                "checkpoints saved before are unchanged"
            ) from None
        self._prune(step)
        self._report(self.steps())
        return path

    def discard_newer(self, step: int) -> None:
        """Remove this rank's checkpoints newer than `step` and report what is left: after a
        rollback to `step` they belong to the abandoned run, and must not be named as a rollback
        step again before this rank's next save replaces them."""
        removed = False
        for newer, path in self._files().items():
            if newer > step:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                removed = True
        if removed:
            self._report(self.steps())

    def steps(self) -> list[int]:
        """The steps of this rank's complete checkpoints, ascending (a cheap check of each file:
        its preamble, size and footer; `load` verifies the checksum)."""
        return sorted(step for step, path in self._files().items() if _looks_complete(path))

    def load(self, step: int) -> dict[str, Any]:
        """The state saved at `step`; CheckpointError when it is missing, torn or corrupt."""
        path = self.path(step)
        if not path.exists():
            raise CheckpointError(
                f"there is no checkpoint of step {step} ({path}): rank {self.rank} holds steps "
                f"{self.steps()}"
            )
        return _read(path, step)

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint that loads, as (step, state); None when there is none.

        A corrupt checkpoint is skipped with a warning naming the file, never loaded.
        """
        for step in sorted(self._files(), reverse=True):
            try:
                return step, self.load(step)
            except CheckpointError as exc:
                _log.warning("skipping a checkpoint: %s", exc)
        return None

    def _files(self) -> dict[int, Path]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        files = {}
        for name in names:
            match = self._name_re.match(name)
            step = int(match.group(1)) if match else 0
            # Only the canonical spelling: 'p-000000001.ckpt' is not the file of step 1.
            if step >= 1 and name == f"{self.prefix}-{step:08d}{SUFFIX}":
                files[step] = self.directory / name
        return files

    def _prune(self, step: int) -> None:
        files = self._files()
        complete = [s for s in sorted(files) if s <= step and _looks_complete(files[s])]
        keep = set(complete[-self.config.keep_checkpoint_max :])
        for old_step, path in files.items():
            if old_step not in keep:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _remove_temporaries(self) -> None:
        """Temporaries left by a save that was killed (one process writes a rank's directory)."""
        # A pattern, not a glob: '.model-*' would match the temporaries of prefix 'model-ema'.
        stale = re.compile(rf"^\.{re.escape(self.prefix)}-\d{{8,}}{re.escape(SUFFIX)}\.\d+\.tmp$")
        for name in os.listdir(self.directory):
            if stale.match(name):
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise CheckpointError(
            f"step={step!r} is invalid: a step is the number of completed training steps, an "
            "integer >= 1"
        )
    return step


def _kind(value: object) -> str:
    return type(value).__qualname__


def _default_rank() -> int:
    from cluster.api import runtime  # noqa: PLC0415 - cluster/__init__ imports this module

    return runtime.get_rank() if runtime.is_initialized() else 0


def _recovery_on() -> bool:
    from cluster.api import runtime  # noqa: PLC0415 - cluster/__init__ imports this module

    if runtime.is_initialized():
        return runtime.session().config.recovery is not None
    return parse_bool("MS_ENABLE_RECOVERY", os.environ.get("MS_ENABLE_RECOVERY", "0"))


def _report_to_scheduler(steps: list[int]) -> None:
    from cluster.api import runtime  # noqa: PLC0415 - cluster/__init__ imports this module

    report: Report | None = getattr(runtime, "report_checkpoints", None)
    if report is not None and runtime.is_initialized():
        report(steps)


# Encoding: the state becomes a JSON tree in which every JSON object is a tagged node
# ({"$": tag, ...}): lists stay lists, the other containers and the arrays are tagged, so a
# tuple, an int dict key or an OrderedDict (a torch state dict) comes back as what it was.


class _Encoder:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.buffers: list[memoryview] = []
        self.offsets: list[int] = []
        self.data_bytes = 0
        # A state can only hold tensors when torch was imported: never import it here.
        self._torch: Any = sys.modules.get("torch")

    def encode_state(self, state: Mapping[str, Any]) -> Any:
        for key in state:
            if not isinstance(key, str):
                raise CheckpointError(
                    f"a checkpoint state's keys are str: {key!r} is a {_kind(key)}"
                )
        try:
            return self._encode(state, "state")
        except RecursionError:
            raise CheckpointError(
                "the checkpoint state is nested too deeply, or contains itself"
            ) from None

    def _encode(self, value: Any, where: str) -> Any:  # noqa: PLR0911 - one return per kind
        if value is None or isinstance(value, (bool, str)):
            return value
        # Before int and float: numpy's float64 is a float, and must come back as float64.
        if isinstance(value, np.generic):
            return {"$": "scalar", "i": self._add_array(np.asarray(value), where, "scalar")}
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, np.ndarray):
            return {"$": "ndarray", "i": self._add_array(value, where, "ndarray")}
        if self._torch is not None and isinstance(value, self._torch.Tensor):
            return {"$": "tensor", "i": self._add_tensor(value, where)}
        if isinstance(value, (bytes, bytearray)):
            return {"$": "bytes", "i": self._add("bytes", "|u1", [len(value)], memoryview(value))}
        if isinstance(value, list):
            return [self._encode(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, tuple):
            return {
                "$": "tuple",
                "items": [self._encode(v, f"{where}[{i}]") for i, v in enumerate(value)],
            }
        if isinstance(value, Mapping):
            node: dict[str, Any] = {"$": "odict" if isinstance(value, OrderedDict) else "dict"}
            node["items"] = [
                [self._key(k, where), self._encode(v, f"{where}[{k!r}]")] for k, v in value.items()
            ]
            # torch's state_dict() keeps module versions here; load_state_dict reads them.
            metadata = getattr(value, "_metadata", None)
            if isinstance(metadata, Mapping):
                node["metadata"] = self._encode(metadata, f"{where}._metadata")
            return node
        raise CheckpointError(f"{where} is a {_kind(value)}: a checkpoint holds {_SUPPORTED}")

    def _key(self, key: Any, where: str) -> Any:
        if key is None or isinstance(key, (bool, int, float, str)):
            return key
        if isinstance(key, tuple):
            return {"$": "tuple", "items": [self._key(k, where) for k in key]}
        raise CheckpointError(
            f"{where} has the key {key!r}, a {_kind(key)}: dict keys in a checkpoint are None, "
            "bool, int, float, str or tuples of them"
        )

    def _add_array(self, array: np.ndarray[Any, Any], where: str, kind: str) -> int:
        dtype = array.dtype
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise CheckpointError(
                f"{where} is an array of dtype {dtype}: a checkpoint holds arrays of numbers, "
                "bools, strings, bytes and dates, not of Python objects or records"
            )
        # A copy only for an array that is not C-contiguous (ascontiguousarray would make a
        # 0-d array 1-d).
        contiguous = array if array.flags.c_contiguous else array.copy(order="C")
        return self._add(kind, dtype.str, list(array.shape), _bytes_of(contiguous))

    def _add_tensor(self, tensor: Any, where: str) -> int:
        torch = self._torch
        if tensor.layout != torch.strided or tensor.is_quantized:
            kind = "quantized" if tensor.is_quantized else str(tensor.layout)
            raise CheckpointError(
                f"{where} is a {kind} tensor: a checkpoint holds dense tensors; convert it first "
                "(e.g. .to_dense(), .dequantize())"
            )
        # Copies only for a tensor on a device, not contiguous, or with a lazy conj/neg bit.
        dense = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous()
        # Raw bytes whatever the dtype: numpy has no bfloat16 or float8.
        raw = dense.reshape(-1).view(torch.uint8).numpy()
        dtype = str(dense.dtype).removeprefix("torch.")
        return self._add("tensor", dtype, list(dense.shape), memoryview(raw))

    def _add(self, kind: str, dtype: str, shape: list[int], data: memoryview) -> int:
        offset = _aligned(self.data_bytes)
        self.entries.append(
            {"kind": kind, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": data.nbytes}
        )
        self.buffers.append(data)
        self.offsets.append(offset)
        self.data_bytes = offset + data.nbytes
        return len(self.entries) - 1


def _bytes_of(array: np.ndarray[Any, Any]) -> memoryview:
    """The bytes of a C-contiguous array, without copying them."""
    if array.nbytes == 0:
        return memoryview(b"")
    return array.reshape(-1).view(np.uint8).data


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _header_bytes(step: int, rank: int, prefix: str, tree: Any, encoder: _Encoder) -> bytes:
    header = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "rank": rank,
        "prefix": prefix,
        "data_bytes": encoder.data_bytes,
        "entries": encoder.entries,
        "state": tree,
    }
    return json.dumps(header, separators=(",", ":")).encode()


class _Digest:
    """SHA-256 of a stream of buffers, computed on a helper thread: hashing overlaps the file
    I/O (hashlib and os.write/readinto release the GIL on large buffers)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._queue: queue.SimpleQueue[memoryview | bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._hash.update(item)

    def feed(self, data: memoryview | bytes) -> None:
        """Hash `data` next; it must not change until `digest()` returns."""
        self._queue.put(data)

    def digest(self) -> bytes:
        self.close()
        return self._hash.digest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def __enter__(self) -> _Digest:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _write(
    path: Path, header: bytes, buffers: list[memoryview], offsets: list[int], data_bytes: int
) -> None:
    data_start = _aligned(_PREAMBLE.size + len(header))
    size = data_start + data_bytes + _FOOTER_SIZE
    preamble = _PREAMBLE.pack(MAGIC, VERSION, 0, len(header), size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with _Digest() as digest:
            position = 0
            for part in _parts(preamble + header, data_start, buffers, offsets, data_bytes):
                digest.feed(part)
                _write_all(fd, part)
                position += part.nbytes
            assert position == data_start + data_bytes
            # Flush the data while the digest is still being computed; the second fsync then
            # only has the footer to write.
            os.fsync(fd)
            _write_all(fd, memoryview(END_MAGIC + digest.digest()))
        os.fsync(fd)
    finally:
        os.close(fd)


def _parts(
    head: bytes, data_start: int, buffers: list[memoryview], offsets: list[int], data_bytes: int
) -> Iterator[memoryview]:
    """The file before its footer, in order: head, padding, each buffer after its padding."""
    yield memoryview(head + bytes(data_start - len(head)))
    cursor = 0
    for buffer, offset in zip(buffers, offsets, strict=True):
        if offset > cursor:
            yield memoryview(bytes(offset - cursor))
        yield buffer
        cursor = offset + buffer.nbytes
    assert cursor == data_bytes


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _looks_complete(path: Path) -> bool:
    """The preamble, size and footer are right: a cheap check that the file was written whole."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < _PREAMBLE.size + _FOOTER_SIZE:
                return False
            magic, version, _flags, _header_length, recorded = _PREAMBLE.unpack(
                file.read(_PREAMBLE.size)
            )
            if magic != MAGIC or version != VERSION or recorded != size:
                return False
            file.seek(size - _FOOTER_SIZE)
            return file.read(len(END_MAGIC)) == END_MAGIC
    except OSError:
        return False


class _Corrupt(Exception):
    """What is wrong with a checkpoint file; `_read` names the file."""


def _read(path: Path, step: int) -> dict[str, Any]:
    try:
        with open(path, "rb", buffering=0) as file:
            return _read_file(file, step)
    except _Corrupt as exc:
        raise CheckpointError(
            f"the checkpoint {path} is torn or corrupt ({exc}): it was not loaded; an older "
            "checkpoint may still be whole (CheckpointManager.latest() skips corrupt ones)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path} ({exc.strerror})") from None


def _read_file(file: io.FileIO, step: int) -> dict[str, Any]:
    size = os.fstat(file.fileno()).st_size
    if size < _PREAMBLE.size + _FOOTER_SIZE:
        raise _Corrupt(f"{size} bytes, shorter than the smallest checkpoint")
    preamble = _read_exactly(file, _PREAMBLE.size)
    magic, version, _flags, header_length, recorded = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise _Corrupt("not a cluster checkpoint: wrong magic bytes")
    if version != VERSION:
        raise _Corrupt(f"format version {version}; this cluster reads version {VERSION}")
    if recorded != size:
        raise _Corrupt(f"{size} bytes, but it was written with {recorded}: truncated")
    if header_length > size - _PREAMBLE.size - _FOOTER_SIZE:
        raise _Corrupt(f"header length {header_length} exceeds the file")
    header_data = _read_exactly(file, header_length)
    header = _parse_header(header_data)
    data_start = _aligned(_PREAMBLE.size + header_length)
    data_bytes = header["data_bytes"]
    if data_start + data_bytes + _FOOTER_SIZE != size:
        raise _Corrupt(f"the header's data size {data_bytes} does not match the file size {size}")
    entries = header["entries"]
    with _Digest() as digest:
        digest.feed(preamble)
        digest.feed(header_data)
        digest.feed(_read_exactly(file, data_start - _PREAMBLE.size - header_length))
        values: list[Any] = []
        cursor = 0
        for entry in entries:
            digest.feed(_read_exactly(file, entry["offset"] - cursor))
            value, raw = _allocate(entry)
            for start in range(0, raw.nbytes, _READ_SLICE):
                piece = raw[start : start + _READ_SLICE]
                _read_into(file, piece)
                digest.feed(piece)
            values.append(value)
            cursor = entry["offset"] + entry["nbytes"]
        digest.feed(_read_exactly(file, data_bytes - cursor))
        footer = _read_exactly(file, _FOOTER_SIZE)
        if footer[: len(END_MAGIC)] != END_MAGIC or footer[len(END_MAGIC) :] != digest.digest():
            raise _Corrupt("its SHA-256 does not match its content")
    if header["step"] != step:
        raise _Corrupt(f"it holds step {header['step']!r}, not {step}")
    try:
        state = _decode(header["state"], values)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise _Corrupt(f"its state tree is malformed ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise _Corrupt("its state is not a mapping of str keys")
    return state


def _parse_header(data: bytes) -> dict[str, Any]:
    try:
        header = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _Corrupt("its header is not valid JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _Corrupt("its header is not a cluster checkpoint header")
    if not _is_count(header.get("data_bytes")) or not isinstance(header.get("entries"), list):
        raise _Corrupt("its header lacks the data layout")
    cursor = 0
    for entry in header["entries"]:
        _check_entry(entry, cursor)
        cursor = entry["offset"] + entry["nbytes"]
    if cursor > header["data_bytes"]:
        raise _Corrupt("an array lies past the end of the data")
    return header


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(entry: Any, cursor: int) -> None:
    """Check an entry's layout before anything is allocated for it."""
    if not isinstance(entry, dict) or entry.get("kind") not in (
        "ndarray",
        "scalar",
        "tensor",
        "bytes",
    ):
        raise _Corrupt(f"an array entry is malformed: {entry!r:.200}")
    offset, nbytes, shape = entry.get("offset"), entry.get("nbytes"), entry.get("shape")
    if not (_is_count(offset) and _is_count(nbytes)) or offset < cursor:
        raise _Corrupt(f"an array entry has a bad offset or size: {entry!r:.200}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise _Corrupt(f"an array entry has a bad shape: {entry!r:.200}")
    if not isinstance(entry.get("dtype"), str):
        raise _Corrupt(f"an array entry has a bad dtype: {entry!r:.200}")


def _allocate(entry: dict[str, Any]) -> tuple[Any, memoryview]:
    """The value an entry becomes, and the bytes of it the file's data is read into."""
    kind, shape, nbytes = entry["kind"], tuple(entry["shape"]), entry["nbytes"]
    count = math.prod(shape)
    if kind == "bytes":
        if shape != (nbytes,):
            raise _Corrupt(f"a bytes entry has shape {shape} but {nbytes} bytes")
        raw = bytearray(nbytes)
        return raw, memoryview(raw)
    if kind == "tensor":
        torch = _import_torch()
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise _Corrupt(f"unknown torch dtype {entry['dtype']!r}")
        if count * dtype.itemsize != nbytes:
            raise _Corrupt(f"a {entry['dtype']} tensor of shape {shape} cannot have {nbytes} bytes")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype), memoryview(b"")
        buffer = np.empty(nbytes, np.uint8)
        return torch.from_numpy(buffer).view(dtype).reshape(shape), buffer.data
    try:
        np_dtype = np.dtype(entry["dtype"])
    except TypeError:
        raise _Corrupt(f"unknown numpy dtype {entry['dtype']!r}") from None
    if np_dtype.hasobject or np_dtype.fields is not None or np_dtype.subdtype is not None:
        raise _Corrupt(f"numpy dtype {entry['dtype']!r} is not one a checkpoint holds")
    if count * np_dtype.itemsize != nbytes or (kind == "scalar" and shape != ()):
        raise _Corrupt(f"an array of dtype {np_dtype} and shape {shape} cannot have {nbytes} bytes")
    array = np.empty(shape, np_dtype)
    return array, _bytes_of(array)


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise CheckpointError(
            "this checkpoint holds torch tensors, and torch is not installed: install torch to "
            "load it"
        ) from None


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


def _read_exactly(file: io.FileIO, count: int) -> bytes:
    data = bytearray(count)
    _read_into(file, memoryview(data))
    return bytes(data)


def _read_into(file: io.FileIO, view: memoryview) -> None:
    while view:
        count = file.readinto(view)
        if not count:
            raise _Corrupt("it ends early: truncated")
        view = view[count:]
