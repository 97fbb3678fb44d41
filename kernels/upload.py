"""Host ints to device tensors: pinned staging, one copy that does not wait.

Every index tensor a step sends to the device goes up this way: the model runner's eager
inputs and the LoRA segment tables (`upload`, a fresh buffer each time), the sampler's
parameters (`upload_arrays`, also fresh), and the static inputs of the CUDA graphs (`Staging`,
one buffer for the graphs' life). The values are packed in one
host buffer (pinned on a GPU), written through numpy (which takes Python ints about 3x faster
than `torch.tensor`), each field starting 16-byte aligned (Triton specializes on aligned
pointers), and sent in one non-blocking copy queued behind the device's work, so the one host
sync of a step stays reading its sampled tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 16  # bytes
Field = tuple[torch.dtype, tuple[int, ...]]  # dtype, shape


def upload(
    parts: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Int lists as tensors of `dtype` on `device`, sent in one copy: a view per list. The host
    buffer is fresh: torch's pinned allocator hands it out again only once the copy has run."""
    device = torch.device(device)
    offsets, size = _layout([len(p) * dtype.itemsize for p in parts])
    host = torch.empty(size // dtype.itemsize, dtype=dtype, pin_memory=device.type == "cuda")
    staged = host.numpy()
    starts = [o // dtype.itemsize for o in offsets]
    for start, part in zip(starts, parts, strict=True):
        staged[start : start + len(part)] = part
    dev = host.to(device, non_blocking=True)  # on a CPU: `host` itself
    return [dev[start : start + len(part)] for start, part in zip(starts, parts, strict=True)]


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32,
          np.dtype(np.bool_): torch.bool}


def upload_arrays(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Numpy arrays (int64, float32 or bool) packed into one fresh host buffer and sent in one
    copy, like `upload`: a device view per array, of its shape."""
    if not arrays:
        return {}
    offsets, size = _layout([a.nbytes for a in arrays.values()])
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staged = host.numpy()
    for o, a in zip(offsets, arrays.values(), strict=True):
        staged[o : o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
    dev = host.to(device, non_blocking=True)
    out = {}
    for o, (name, a) in zip(offsets, arrays.items(), strict=True):
        view = dev[o : o + a.nbytes].view(_TORCH[a.dtype])
        out[name] = view if a.ndim == 1 else view.view(a.shape)
    return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on its way to (pinned) host memory without waiting: read it once an event recorded
    after this call has passed. A CPU tensor is already there: itself."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Staging:
    """Named fields kept in one host buffer and its device mirror, for inputs rewritten every
    step in place (a CUDA graph's static inputs). The host side may be rewritten only once the
    last copy out of it has run (the caller waits on an event)."""

    def __init__(self, fields: dict[str, Field], device: torch.device):
        self.fields = fields
        nbytes = [dtype.itemsize * math.prod(shape) for dtype, shape in fields.values()]
        offsets, size = _layout(nbytes)
        self.offsets = dict(zip(fields, offsets, strict=True))
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._dev = torch.empty(size, dtype=torch.uint8, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for (name, (dtype, shape)), start, n in zip(fields.items(), offsets, nbytes, strict=True):
            host = self._host[start : start + n].view(dtype).view(shape)
            self.host[name] = host.numpy()
            self.dev[name] = self._dev[start : start + n].view(dtype).view(shape)

    def send(self, last: str | None = None, rows: int = 0) -> None:
        """Copy the host buffer up without waiting: all of it, or the fields before `last`
        and the first `rows` rows of `last`."""
        end = self._host.numel()
        if last is not None:
            dtype, shape = self.fields[last]
            end = self.offsets[last] + rows * dtype.itemsize * math.prod(shape[1:])
        self._dev[:end].copy_(self._host[:end], non_blocking=True)


def _layout(nbytes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of blocks of these sizes packed in order, each `ALIGN`ed; the total."""
    offsets, size = [], 0
    for n in nbytes:
        offsets.append(size)
        size += -(-n // ALIGN) * ALIGN
    return offsets, size
