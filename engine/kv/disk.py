"""The disk tier: sessions' KV pages kept as files under the host tier, so a restarted replica
resumes its sessions without re-prefill (engine/kv/prefix_cache.py drives it).

A page's file is named by a chain hash: the model's fingerprint, the namespace, then the
tokens of every page up to and including this one (a page's KV depends on all of them). The
file holds a header line (format, fingerprint, key, shape, dtype, the payload's sha256) and the
page's K and V of every layer, `(num_layers, 2, page_size, kv_heads, head_dim)`. A file is
used only when all of these check out; a page that does not (corrupt, truncated, another
model, dtype or layout) is counted in `rejected_pages`, its file deleted and its key dropped
from the index (so the next write-through of that page writes it again), and it ends the read
there: the request computes the rest. Files are written whole under a temporary name, then
renamed; temporary files a crash left behind are deleted at start.

Only sessions are written (their KV, write-through, when a turn ends), from a private host
snapshot, on one writer thread, which then deletes the least recently used files (by
modification time; a read touches its files) while the folder holds more than `max_bytes`, and
a tenant's least recently used files while that tenant's own pages hold more than
`max_bytes_per_owner` (so one tenant's sessions cannot push out everyone else's). Files found
at start belong to no tenant: they count toward `max_bytes` only.
Reads run on a reader thread into host pages the caller owns until they are done. Namespaces
hold a hash of an adapter's files (`lora.manager.content_uid`), so KV under an adapter is
found again after a restart, as the base model's is.

With tensor parallelism every rank keeps its own KV heads' share of each page in a folder of
its own (its fingerprint names the shard), under the same keys: rank 0 decides what is
written and read, and `peers` (engine/parallel/disk.py) has the workers do the same with
their shares. A read is as good as its worst rank: its result is the fewest good pages of any
rank, and rank 0 drops its own file of the first page some rank lacks, so that the next
write-through writes that page again on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from array import array
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.config import ModelConfig, ResolvedConfig

MAGIC = b"switchboard-kv-page 1\n"

log = logging.getLogger(__name__)


def fingerprint(model: dict, dtype: str, page_shape: Sequence[int]) -> str:
    """What a page file must match: the model's config and location, the dtype, the layout."""
    text = json.dumps({"model": model, "dtype": dtype, "page": list(page_shape)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class HostPages(Protocol):
    """What the disk tier needs of the host tier (`engine.kv.host.HostKVPool`): a private
    host copy of device pages with a function that returns once it is complete; a function
    that returns once the copies queued so far are done; one page read from disk written
    into a host page."""

    def snapshot(self, device_pages: list[int]) -> tuple[Any, Callable[[], None]]: ...

    def host_writes_done(self) -> Callable[[], None]: ...

    def store(self, host_page: int, page: Any) -> None: ...


class Peers(Protocol):
    """The other tensor-parallel ranks' disk tiers, seen from rank 0: each does what rank 0's
    does with its own share of the pages (engine/parallel/disk.py)."""

    def write(self, keys: list[str], device_pages: list[int], owner: str) -> None: ...

    def read(self, keys: list[str], host_pages: list[int]) -> Future:
        """-> the fewest good pages any of them read."""
        ...


def disk_tier(cfg: ResolvedConfig, model: ModelConfig, model_dir: Path,
              pool_shape: Sequence[int], rank: int = 0, size: int = 1) -> DiskKV | None:
    """The disk tier the config asks for (None: none), for the host pool of shape
    `(num_layers, 2, num_pages, page_size, kv_heads, head_dim)`; with tensor parallelism,
    rank `rank` of `size`'s share, bounded by its part of the sizes."""
    if cfg.kv_disk_dir is None:
        return None
    layers, two, _, page_size, heads, dim = pool_shape
    shape = (layers, two, page_size, heads, dim)
    ident: dict[str, Any] = {**dataclasses.asdict(model), "path": str(model_dir)}
    if size > 1:
        ident["shard"] = [rank, size]
    cap = int(cfg.kv_disk_gb * 2**30 / size) if cfg.kv_disk_gb else None
    per_tenant = int(cfg.kv_disk_tenant_gb * 2**30 / size)
    # An FP8 cache's pages are read and written as bytes, as the host tier holds them.
    storage = torch.uint8 if cfg.kv_cache_dtype == "fp8" else getattr(torch, cfg.dtype)
    return DiskKV(cfg.kv_disk_dir, fingerprint(ident, cfg.kv_dtype, shape), shape, storage,
                  cap, per_tenant)


class DiskKV:
    """Page files of one fingerprint under `root`."""

    def __init__(self, root: Path, fingerprint: str, page_shape: Sequence[int],
                 dtype: torch.dtype, max_bytes: int | None = None,
                 max_bytes_per_owner: int | None = None):
        self.fingerprint = fingerprint
        self.page_shape = tuple(page_shape)  # (num_layers, 2, page_size, kv_heads, head_dim)
        self.dtype = dtype
        self.dir = Path(root) / fingerprint[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob(".*.tmp"):  # a write a crash cut short: never renamed
            tmp.unlink(missing_ok=True)
        self.index: set[str] = {p.stem for p in self.dir.glob("*.kvpage")}  # keys on disk
        self.max_bytes = max_bytes  # None: no bound
        self.max_bytes_per_owner = max_bytes_per_owner
        self.nbytes = sum(self._size(k) for k in self.index)
        self.owners: dict[str, str] = {}  # key -> the tenant that wrote it (this run)
        self.owner_bytes: dict[str, int] = {}
        self._lock = threading.Lock()  # `index` and `nbytes`: the writer and reader change them
        self.pending: set[str] = set()  # keys being written
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self.pages_written = self.pages_read = self.rejected_pages = self.pages_deleted = 0
        self.peers: Peers | None = None  # rank 0 of a tensor-parallel group: the workers'

    def write_from(self, host: HostPages, keys: list[str], device_pages: list[int],
                   owner: str = "") -> None:
        """Write device pages (each rank its share) as `keys`' files, from a private host
        snapshot taken now."""
        pages, ready = host.snapshot(device_pages)
        self.write(keys, pages, ready, owner)
        if self.peers is not None:
            self.peers.write(keys, device_pages, owner)

    def read_into(self, host: HostPages, keys: list[str], host_pages: list[int]) -> Future:
        """Read `keys`' pages into `host_pages` (each rank its share), which are the caller's
        and untouched until the future is done; -> how many, from the first, are good on
        every rank."""
        mine = self.read(keys, lambda i, page: host.store(host_pages[i], page),
                         before=host.host_writes_done())
        if self.peers is None:
            return mine
        return self._worst(keys, mine, self.peers.read(keys, host_pages))

    def _worst(self, keys: list[str], mine: Future, theirs: Future) -> Future:
        """The fewer good pages of two reads. Where a peer's read stopped before rank 0's,
        rank 0 drops its own file of that page too, so the next write-through writes it on
        every rank."""
        out: Future = Future()
        once = threading.Lock()

        def both(_: Future) -> None:
            with once:
                if not (mine.done() and theirs.done()) or out.done():
                    return
                try:
                    own, good = mine.result(), theirs.result()
                except Exception as e:  # noqa: BLE001 - the request computes the pages
                    out.set_exception(e)
                    return
                if own > good:
                    self._drop(keys[good])
                out.set_result(min(own, good))

        mine.add_done_callback(both)
        theirs.add_done_callback(both)
        return out

    def keys(self, namespace: Hashable, tokens: Sequence[int], page_size: int,
             num_pages: int) -> list[str]:
        """The keys of the first `num_pages` full pages of `tokens` in `namespace`."""
        h = hashlib.sha256(f"{self.fingerprint}\n{namespace!r}\n".encode())
        out = []
        for i in range(num_pages):
            h.update(array("q", tokens[i * page_size : (i + 1) * page_size]).tobytes())
            out.append(h.copy().hexdigest())
        return out

    def num_on_disk(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, have a file."""
        n = 0
        while n < len(keys) and keys[n] in self.index:
            n += 1
        return n

    def missing(self, keys: Sequence[str]) -> list[int]:
        """Indices of `keys` with no file, written or being written."""
        return [i for i, k in enumerate(keys) if k not in self.index and k not in self.pending]

    def write(self, keys: list[str], pages: torch.Tensor, ready: Callable[[], None],
              owner: str = "") -> None:
        """Write `pages` (n, *page_shape), on the host, as `keys`' files, once `ready()` (run on
        the writer thread) returns: the snapshot is complete. `owner`: the tenant, whose
        pages are bounded by `max_bytes_per_owner`."""
        self.pending.update(keys)
        self._writer.submit(self._write, keys, pages, ready, owner)

    def _write(self, keys: list[str], pages: torch.Tensor, ready: Callable[[], None],
               owner: str = "") -> None:
        ready()
        for key, page in zip(keys, pages, strict=True):
            try:
                self._write_page(key, page, owner)
            except OSError as e:  # a full or failing disk: the page stays unwritten
                log.warning("writing KV page file %s failed: %s", key, e)
                (self.dir / f".{key}.tmp").unlink(missing_ok=True)
            finally:
                self.pending.discard(key)
        self._trim_owner(owner)
        self._trim()

    def _write_page(self, key: str, page: torch.Tensor, owner: str = "") -> None:
        payload = page.contiguous().view(torch.uint8).numpy().tobytes()
        header = {"fingerprint": self.fingerprint, "key": key, "shape": self.page_shape,
                  "dtype": str(self.dtype), "sha256": hashlib.sha256(payload).hexdigest()}
        tmp = self.dir / f".{key}.tmp"
        with tmp.open("wb") as f:
            f.write(MAGIC + json.dumps(header).encode() + b"\n" + payload)
        os.replace(tmp, self.dir / f"{key}.kvpage")
        with self._lock:
            if key not in self.index:
                size = self._size(key)
                self.nbytes += size
                self.index.add(key)
                if owner:
                    self.owners[key] = owner
                    self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + size
        self.pages_written += 1

    def _trim_owner(self, owner: str) -> None:
        """Delete `owner`'s least recently used files while its pages hold over its bound."""
        bound = self.max_bytes_per_owner
        if not owner or bound is None or self.owner_bytes.get(owner, 0) <= bound:
            return
        with self._lock:
            mine = [k for k, o in self.owners.items() if o == owner]
        for key in sorted(mine, key=lambda k: _mtime(self.dir / f"{k}.kvpage")):
            if self.owner_bytes.get(owner, 0) <= bound:
                break
            self._drop(key)
            self.pages_deleted += 1

    def _trim(self) -> None:
        """Delete the least recently used files while the folder holds over `max_bytes`."""
        if self.max_bytes is None or self.nbytes <= self.max_bytes:
            return
        files = sorted(self.dir.glob("*.kvpage"), key=_mtime)
        for f in files:
            if self.nbytes <= self.max_bytes:
                break
            self._drop(f.stem)
            self.pages_deleted += 1

    def _drop(self, key: str) -> None:
        """Delete `key`'s file and forget it (the file goes first: a key in the index whose
        file is gone would be rejected by the next read)."""
        size = self._size(key)
        (self.dir / f"{key}.kvpage").unlink(missing_ok=True)
        with self._lock:
            if key in self.index:
                self.index.discard(key)
                self.nbytes -= size
                owner = self.owners.pop(key, "")
                if owner:
                    self.owner_bytes[owner] -= size

    def _size(self, key: str) -> int:
        try:
            return (self.dir / f"{key}.kvpage").stat().st_size
        except OSError:
            return 0

    def read(self, keys: list[str], store: Callable[[int, torch.Tensor], None],
             before: Callable[[], None]) -> Future:
        """Read `keys`' pages in order, passing each good one to `store(i, page)` on the reader
        thread after `before()` returned; the future's result is how many were good (the read
        stops at the first that is missing or does not check out; that one's file is deleted
        and its key dropped, so that the page is written again by the next write-through)."""
        return self._reader.submit(self._read, keys, store, before)

    def _read(self, keys: list[str], store: Callable[[int, torch.Tensor], None],
              before: Callable[[], None]) -> int:
        before()
        for i, key in enumerate(keys):
            page = self._load(key)
            if page is None:
                self.rejected_pages += 1
                self._drop(key)
                return i
            store(i, page)
            self.pages_read += 1
        return len(keys)

    def _load(self, key: str) -> torch.Tensor | None:
        path = self.dir / f"{key}.kvpage"
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used: trimmed last
        except OSError:
            return None
        if not data.startswith(MAGIC):
            return None
        line_end = data.find(b"\n", len(MAGIC))
        try:
            header = json.loads(data[len(MAGIC) : line_end])
        except ValueError:
            return None
        payload = data[line_end + 1 :]
        want = {"fingerprint": self.fingerprint, "key": key, "shape": list(self.page_shape),
                "dtype": str(self.dtype), "sha256": hashlib.sha256(payload).hexdigest()}
        if header != want:
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
            self.dtype).view(self.page_shape)

    def flush(self) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        self._writer.submit(lambda: None).result()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # deleted meanwhile (a rejected page): sorts first, dropped as nothing
        return 0.0
