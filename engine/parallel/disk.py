"""The disk KV tier with tensor parallelism (engine/kv/disk.py): every rank keeps its own KV
heads' share of each page as files of its own, under the keys rank 0 chose.

Rank 0 decides what is written and read; its `DiskKV` tells the workers through `DiskPeers`,
in order with the steps, so each worker snapshots the same device pages (`KVWrite`) and reads
into the same host pages (`KVRead`) as rank 0 at the same point of the work. A worker answers
each read with how many pages checked out on its side, through a pipe of its own (the
messages only go from rank 0 to the workers); rank 0 takes the fewest of all ranks.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from engine.kv.disk import DiskKV, HostPages
from engine.parallel.collectives import TPGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVWrite:
    """Snapshot these device pages now and write them as `keys`' files."""

    keys: list[str]
    device_pages: list[int]
    owner: str


@dataclass(frozen=True)
class KVRead:
    """Read `keys`' files into these host pages; answer `(read, good pages)`."""

    read: int
    keys: list[str]
    host_pages: list[int]


class DiskPeers:
    """Rank 0's view of the workers' disk tiers (`engine.kv.disk.Peers`). `answers`: one
    pipe end per worker, on which it sends `(read, good pages)` for each `KVRead`."""

    def __init__(self, tp: TPGroup, answers: list[Connection]) -> None:
        self.tp = tp
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._reads: dict[int, _Read] = {}
        threading.Thread(target=self._collect, args=(list(answers),), name="kv-disk-peers",
                         daemon=True).start()

    def write(self, keys: list[str], device_pages: list[int], owner: str) -> None:
        self.tp.send(KVWrite(keys, device_pages, owner))

    def read(self, keys: list[str], host_pages: list[int]) -> Future:
        read = next(self._ids)
        pending = _Read(self.tp.size - 1, len(keys))
        with self._lock:
            self._reads[read] = pending
        self.tp.send(KVRead(read, keys, host_pages))
        return pending.future

    def _collect(self, answers: list[Connection]) -> None:
        """Take the workers' answers until every pipe closes (the workers exited). A read a
        dead worker never answered stays pending: the engine stops on the dead rank anyway."""
        while answers:
            for conn in wait(answers):
                assert isinstance(conn, Connection)
                try:
                    read, good = conn.recv()
                except (EOFError, OSError):
                    answers.remove(conn)
                    continue
                with self._lock:
                    pending = self._reads[read]
                    if pending.answer(good):
                        del self._reads[read]


class _Read:
    """A read the workers have not all answered yet."""

    def __init__(self, workers: int, good: int) -> None:
        self.future: Future = Future()
        self.left, self.good = workers, good

    def answer(self, good: int) -> bool:
        """One worker's answer; True once all are in (the future then holds the fewest)."""
        self.good, self.left = min(self.good, good), self.left - 1
        if self.left:
            return False
        self.future.set_result(self.good)
        return True


class WorkerDisk:
    """A worker's disk tier: runs rank 0's `KVWrite`s and `KVRead`s on this rank's share
    (`disk`, under `host`, this rank's host pool) and answers each read on `answers`."""

    def __init__(self, disk: DiskKV, host: HostPages, answers: Connection) -> None:
        self.disk, self.host, self.answers = disk, host, answers
        self._sending = threading.Lock()  # a read's answer comes from the reader thread

    def run(self, msg: KVWrite | KVRead) -> None:
        if isinstance(msg, KVWrite):
            self.disk.write_from(self.host, msg.keys, msg.device_pages, msg.owner)
            return
        future = self.disk.read_into(self.host, msg.keys, msg.host_pages)
        future.add_done_callback(lambda f: self._answer(msg.read, f))

    def _answer(self, read: int, future: Future) -> None:
        try:
            good = future.result()
        except Exception:  # noqa: BLE001 - a failed read: no page of it is used
            log.exception("reading KV pages from disk failed")
            good = 0
        try:
            with self._sending:
                self.answers.send((read, good))
        except OSError:  # rank 0 is gone: this worker is about to stop too
            pass

    def close(self) -> None:
        """Wait for the writes queued so far (rank 0 stops the workers, then reads nothing
        more from them)."""
        self.disk.flush()

