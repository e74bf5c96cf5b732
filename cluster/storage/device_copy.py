"""Copies between CUDA tensors and a snapshot's host buffer, on a copy stream.

`copy_state` copies an encoded state's arrays into a snapshot's buffer: each CUDA tensor with
`non_blocking=True` on a copy stream of its device (one per device, kept), which first waits for
the work queued on the device's current stream (the step that computed the tensors), then the
host arrays while those copies run; it returns once every copy is complete, because the training
step after `save` may change the tensors in place. Into a pinned buffer the copies run at the
bus's speed; into a pageable one they are correct, at the driver's staging speed.

Why not return before the copies end (overlap them with the next step): an in-place update of a
parameter (`optimizer.step()`, `p.add_`) would have to wait for an event recorded after the
copy, and torch has no hook that makes an in-place write to a tensor wait on an event; the
caching allocator's `record_stream` protects memory from reuse, not a tensor from being written.
A caller that syncs on its own could overlap; `save` cannot promise it for any caller.

`to_device` makes a tensor on a device from bytes of the buffer (a snapshot put back from
memory): one host-to-device copy, no intermediate host tensor.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from cluster.storage.checkpoint_tree import Encoded, copy_into

# A copy stream per CUDA device, made at first use and kept.
_streams: dict[Any, Any] = {}


def cuda_device(source: Any) -> Any:
    """The CUDA device of a tensor source, or None (a host array, bytes, a CPU tensor)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(source, torch.Tensor) or source.device.type != "cuda":
        return None
    return source.device


def copy_state(encoded: Encoded, data: np.ndarray[Any, Any], host: Any = None) -> list[Any]:
    """Copy every array of `encoded` to its place in `data`; the device of each entry's source
    (None for host ones). `host`: the torch tensor whose memory `data` is (pinned), if any."""
    devices = [cuda_device(source) for source in encoded.sources]
    torch = sys.modules["torch"] if any(devices) else None
    used: dict[Any, Any] = {}
    for entry, source, device in zip(encoded.entries, encoded.sources, devices, strict=True):
        if device is None or entry["nbytes"] == 0:
            continue
        assert torch is not None
        stream = used.get(device)
        if stream is None:
            stream = used[device] = _stream(torch, device)
            stream.wait_stream(torch.cuda.current_stream(device))
        base = host if host is not None else torch.from_numpy(data)
        place = _place(base, entry, source.dtype, source.shape)
        with torch.cuda.stream(stream):
            place.copy_(source.resolve_conj().resolve_neg(), non_blocking=True)
    for entry, source, device in zip(encoded.entries, encoded.sources, devices, strict=True):
        if device is None:
            copy_into(source, entry, data)  # while the device copies run
    for stream in used.values():
        stream.synchronize()
    return devices


def to_device(entry: dict[str, Any], raw: memoryview, device: Any) -> Any:
    """A tensor of `entry` on `device`, from its bytes `raw` (in the host buffer)."""
    torch = sys.modules["torch"]
    dtype = getattr(torch, entry["dtype"])
    shape = tuple(entry["shape"])
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if entry["nbytes"]:
        source = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        tensor.copy_(source)
    return tensor


def _place(base: Any, entry: dict[str, Any], dtype: Any, shape: Any) -> Any:
    offset, nbytes = entry["offset"], entry["nbytes"]
    return base[offset : offset + nbytes].view(dtype).reshape(shape)


def _stream(torch: Any, device: Any) -> Any:
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    return stream
