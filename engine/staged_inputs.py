"""The static inputs of a set of CUDA graphs, sent up in one copy per step.

The device buffers the graphs were captured on are views into one allocation, mirrored by one
pinned host buffer. A step writes its values into the host views (numpy arrays: they take
Python ints about 3x faster than `torch.tensor`), then `send` copies the host buffer up to a
given row of one field, without waiting. The host buffer is rewritten only once the previous
copy out of it has run (an event), so staging never races a copy still queued on the stream.
"""

from __future__ import annotations

import math

import numpy as np
import torch

ALIGN = 256  # bytes: each field starts aligned (Triton specializes on 16-byte pointers)


class StagedInputs:
    def __init__(
        self, fields: list[tuple[str, torch.dtype, tuple[int, ...], int]], device: torch.device
    ):
        """fields: (name, dtype, shape, initial value), in memory order, so that
        `send(name, rows)` also sends every field before `name`."""
        self.offsets: dict[str, int] = {}
        self.row_bytes: dict[str, int] = {}
        size = 0
        for name, dtype, shape, _ in fields:
            self.offsets[name] = size
            self.row_bytes[name] = dtype.itemsize * math.prod(shape[1:])
            size += -(-dtype.itemsize * math.prod(shape) // ALIGN) * ALIGN
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.empty(size, dtype=torch.uint8, device=device)
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, dtype, shape, fill in fields:
            start = self.offsets[name]
            end = start + dtype.itemsize * math.prod(shape)
            host = self._host[start:end].view(dtype).view(shape)
            host.fill_(fill)
            self.host[name] = host.numpy()
            self.dev[name] = self._dev[start:end].view(dtype).view(shape)
        self._dev.copy_(self._host)
        self._copied = torch.cuda.Event()  # recorded after each copy out of the host buffer

    def stage(self) -> dict[str, np.ndarray]:
        """The host views, to fill with this step's values (once the last copy has run)."""
        self._copied.synchronize()
        return self.host

    def send(self, name: str, rows: int) -> None:
        """Copy up, without waiting, the fields before `name` and the first `rows` of `name`."""
        end = self.offsets[name] + rows * self.row_bytes[name]
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        self._copied.record()
