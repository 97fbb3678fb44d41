"""Rank 0's messages to the tensor-parallel workers through shared memory.

One writer (rank 0), one reader per worker, a ring of `slots` buffers in one shared-memory
segment. A message (pickled) goes into the next slot, or, larger than a slot, into as many
as it needs in turn. The writer publishes a slot by writing its sequence number after the
payload; each reader spins on that number, copies the payload out and counts the slot read;
the writer reuses a slot only once every reader has read it. The ranks are on one host, so a
message costs a pickle and a copy: a step's inputs reach the workers in microseconds, where a
gloo broadcast took ~0.9 ms of rank 0's time per step (8B model, batch 64, 1k contexts, two
H200s), a fifth of the step.

A reader waiting for the next message spins (yielding its core) while messages come
often, and sleeps between looks once none came for a while, so an idle server's workers do
not hold a core each.

Layout: `slots` control lines of 64 bytes [sequence number, payload bytes (negative: the
message goes on in the next slot)], one 64-byte line per reader [messages read], then the
slots' payloads.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np

LINE = 64  # bytes: each counter on a cache line of its own
WORDS = LINE // 8
SPIN_S = 0.5  # a reader spins this long after its last message, then sleeps between looks
NAP_S = 50e-6  # ... this long at first
LONG_NAP_S = 1e-3  # ... and this long once idle for `IDLE_S`
IDLE_S = 5.0

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release): the payload is visible before
    the sequence number that publishes it, on CPUs that reorder stores too."""
    with _fence_lock:
        pass


class ChannelClosed(RuntimeError):
    """The writer gave up: a reader stopped reading (`alive` said so, or `timeout` passed)."""


class ShmChannel:
    """Rank 0 makes it (`create`), passes `name` to the workers, and each attaches (`attach`)
    with its reader index (rank - 1)."""

    def __init__(self, shm: shared_memory.SharedMemory, readers: int, slots: int,
                 slot_bytes: int, reader: int | None) -> None:
        self.shm, self.readers, self.slots, self.slot_bytes = shm, readers, slots, slot_bytes
        self.reader = reader  # None: the writer
        words = (slots + readers) * WORDS
        buf = shm.buf
        assert buf is not None, "mapped"
        ctrl = np.ndarray((words,), dtype=np.int64, buffer=buf)
        self._seq = ctrl[0: slots * WORDS: WORDS]  # per slot: its message's number + 1
        self._len = ctrl[1: slots * WORDS: WORDS]  # per slot: payload bytes, < 0: continued
        self._read = ctrl[slots * WORDS:: WORDS]  # per reader: slots read
        self._data = buf[words * 8:]
        self._count = 0  # slots written (writer) or read (this reader)

    @classmethod
    def create(cls, readers: int, slots: int = 4, slot_bytes: int = 4 << 20) -> ShmChannel:
        size = (slots + readers) * LINE + slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)  # zero-filled
        return cls(shm, readers, slots, slot_bytes, None)

    @classmethod
    def attach(cls, name: str, readers: int, reader: int, slots: int = 4,
               slot_bytes: int = 4 << 20) -> ShmChannel:
        return cls(shared_memory.SharedMemory(name=name), readers, slots, slot_bytes, reader)

    @property
    def name(self) -> str:
        return self.shm.name

    # -- the writer -------------------------------------------------------------------------

    def send(self, message: Any, alive: Callable[[], bool] = lambda: True,
             timeout: float = 120.0) -> None:
        """Queue `message` for every reader. Waits only while the ring is full: then raises
        ChannelClosed once `alive()` is false or `timeout` seconds passed."""
        assert self.reader is None, "readers do not send"
        data = memoryview(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        for offset in range(0, len(data), self.slot_bytes):  # a pickle is never empty
            part = data[offset: offset + self.slot_bytes]
            n = self._count
            slot = n % self.slots
            if n >= self.slots:
                self._wait_free(n - self.slots + 1, alive, timeout)
            start = slot * self.slot_bytes
            self._data[start: start + len(part)] = part
            more = offset + len(part) < len(data)
            self._len[slot] = -len(part) if more else len(part)
            _fence()
            self._seq[slot] = n + 1
            self._count = n + 1

    def _wait_free(self, read: int, alive: Callable[[], bool], timeout: float) -> None:
        """Until every reader has read `read` slots."""
        deadline = None
        while int(self._read.min()) < read:
            if deadline is None:
                deadline = time.monotonic() + timeout
            elif not alive() or time.monotonic() > deadline:
                raise ChannelClosed("a tensor-parallel worker stopped reading rank 0's messages")
            os.sched_yield()

    # -- a reader ---------------------------------------------------------------------------

    def recv(self) -> Any:
        """The next message (waits for it)."""
        assert self.reader is not None, "the writer does not read"
        parts: list[bytes] = []
        while True:
            n = self._count
            slot = n % self.slots
            self._wait_published(slot, n + 1)
            _fence()
            length = int(self._len[slot])
            start = slot * self.slot_bytes
            parts.append(bytes(self._data[start: start + abs(length)]))
            _fence()
            self._count = n + 1
            self._read[self.reader] = n + 1
            if length >= 0:
                return pickle.loads(b"".join(parts) if len(parts) > 1 else parts[0])

    def _wait_published(self, slot: int, seq: int) -> None:
        if self._seq[slot] == seq:
            return
        since = time.monotonic()
        while self._seq[slot] != seq:
            idle = time.monotonic() - since
            if idle < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(NAP_S if idle < IDLE_S else LONG_NAP_S)

    def close(self) -> None:
        """Detach (the writer also removes the segment). Idempotent."""
        if self._seq is None:
            return
        self._seq = self._len = self._read = None  # type: ignore[assignment]
        self._data.release()
        self.shm.close()
        if self.reader is None:
            self.shm.unlink()
