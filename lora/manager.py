"""The adapter manager: per-tenant registry name -> adapter, over three tiers.

    device  `LoraSlots`: up to `max_loras` adapters in the pools the forward reads, each in
            rows of its own rank;
    host    validated adapters in memory, as the device pools lay them out
            (`PackedAdapter`, pinned on a GPU), LRU, up to `max_cpu_loras` of them and
            `max_cpu_bytes` of their tensors (either bound None: none);
    disk    the adapter's folder: the store directory (uploads) or the caller's own path.

A request's adapter, from the engine thread, through a `Lease` (the manager never sees the
engine's request):

    attach(tenant, name)  at add_request: a lease on (tenant, adapter), or UnknownAdapter. Its
                    `uid` names the adapter's weights (the prefix cache keys KV on it).
    admit(lease)    the scheduler's predicate. True once the adapter sits in a device slot;
                    that slot is then pinned and named by `lease.slot` (which the model runner
                    reads through the request) until release(lease). Otherwise it starts
                    reading the folder in a background thread (never on the step loop) and
                    answers False: the request waits and the others go ahead. When the read or
                    the copy into the slot fails, the leases waiting for that adapter fail
                    (`take_failed`), never the step.
    release(lease)  at finish or abort: unpin.

Eviction is LRU among unpinned adapters in both tiers; on the device an adapter needs a free
slot and free rows, so as many idle adapters go as make room. A slot is pinned while an
admitted request uses it; `pin=True` adapters are never evicted (at most `max_loras - 1` of
them, so one slot always rotates). `add` / `remove` / `get` / `list` come from other threads
(the gateway);
one lock guards all state. A device load starts only on the engine thread, inside `admit`,
that is between forwards; on a GPU it copies asynchronously from the pinned layout the loader
thread made (`LoraSlots.pack`), and its requests are admitted once it has landed. The host tier
holds that layout only; under tensor parallelism also the validated adapter, which the workers
cut their shards from.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import re
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote

import torch

from lora.adapter import AdapterError, LoraAdapter, load_adapter
from lora.info import AdapterExists, AdapterInfo, AdapterStats
from lora.shape import BaseShape
from lora.slots import LoraSlots, PackedAdapter

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class UnknownAdapter(KeyError):
    """No adapter of that name for that tenant."""


@dataclass(eq=False)
class _Entry:
    tenant: str
    name: str
    path: Path
    owned: bool  # the folder is in our store: delete it on removal
    rank: int
    target_modules: tuple[str, ...]
    num_bytes: int
    stored_bytes: int
    uid: int  # its files' hash: KV namespaces key on it (`content_uid`)
    pinned: bool = False
    version: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    removed: bool = False
    packed: PackedAdapter | None = None  # host tier, laid out for the device copy
    loading: Future[tuple[LoraAdapter, PackedAdapter]] | None = None  # disk -> host
    slot: int | None = None  # device tier
    active: int = 0  # admitted requests using the slot (pins it)
    waiting: int = 0  # attached requests not admitted yet
    fresh: bool = False  # loaded into its slot, no request admitted since (`_make_room`)
    host_bytes: int = 0  # what its host tier holds (`PackedAdapter.host_bytes`)


@dataclass(eq=False)
class Lease:
    """One request's hold on its adapter, from `attach` to `release`."""

    entry: _Entry
    slot: int = -1  # the device slot while admitted (pinned); -1 before

    @property
    def uid(self) -> int:
        """Which weights it runs (`content_uid`): KV computed under one never serves another,
        even under the same name."""
        return self.entry.uid


class AdapterManager:
    """Implements `engine.protocols.AdapterRegistry` (the gateway's view) structurally."""

    def __init__(
        self,
        base: BaseShape,
        slots: LoraSlots | None,
        max_cpu_loras: int | None,
        store_dir: Path | None = None,
        dtype: torch.dtype | None = None,
        max_cpu_bytes: int | None = None,
    ) -> None:
        """`slots=None` serves the base model only (`--max-loras 0`): adapters are refused."""
        self.base, self.slots, self.store_dir, self.dtype = base, slots, store_dir, dtype
        self.max_loras = slots.num_slots if slots is not None else 0
        self.max_rank = slots.max_rank if slots is not None else 0
        self.max_cpu_loras = (None if max_cpu_loras is None
                              else max(max_cpu_loras, self.max_loras))
        self.max_cpu_bytes = max_cpu_bytes
        self.stats = AdapterStats()
        self._lock = threading.RLock()
        self._registry: dict[tuple[str, str], _Entry] = {}
        self._host: OrderedDict[_Entry, None] = OrderedDict()  # LRU first
        self._owner: list[_Entry | None] = [None] * self.max_loras  # slot -> entry
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.max_loras))
        self._leases: set[Lease] = set()  # attached, not released
        self._failed: list[tuple[Lease, str]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        if store_dir is not None:
            self._scan_store()

    # -- registry (any thread) ----------------------------------------------------------------

    def add(
        self, tenant: str, name: str, path: str | Path, *, move: bool = False, pin: bool = False,
        version: str = "",
    ) -> AdapterInfo:
        """Validate the PEFT folder at `path` and register it as `name` for `tenant`.

        `move=True` moves the folder into the store directory (uploads); otherwise the folder
        stays where it is and is read from there whenever the host cache lost it. `version`
        labels it (the shared registry's version, with `--redis-url`). Validation
        happens before anything is registered, so a bad adapter leaves no trace.
        Raises:
            AdapterError: every problem with the folder or the name.
            AdapterExists: the tenant already has `name`.
        """
        check_name(name)
        if pin and sum(e.pinned for e in self._registry.values()) + 1 >= max(self.max_loras, 1):
            raise AdapterError(name, [f"at most {self.max_loras - 1} adapters may be pinned"])
        if self.get(tenant, name) is not None:
            raise AdapterExists(name)
        adapter, packed = self._read(Path(path), name)
        uid = content_uid(Path(path))  # before the lock: it reads every file
        with self._lock:
            if (tenant, name) in self._registry:
                raise AdapterExists(name)
            folder, owned = Path(path), False
            if move:
                folder, owned = self._store_path(tenant, name), True
                shutil.rmtree(folder, ignore_errors=True)  # leftover of a crash, unregistered
                folder.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(path, folder)
            entry = _entry(tenant, name, folder, owned, adapter, pin, uid)
            entry.version = version
            self._registry[(tenant, name)] = entry
            self._host_put(entry, packed)
            return self._info(entry)

    def remove(self, tenant: str, name: str) -> bool:
        """Unregister; requests already admitted with it finish normally, waiting ones fail.
        Returns False when the tenant has no such adapter."""
        with self._lock:
            entry = self._registry.pop((tenant, name), None)
            if entry is None:
                return False
            entry.removed = True
            self._host.pop(entry, None)
            entry.packed = None
            if entry.owned:
                shutil.rmtree(entry.path, ignore_errors=True)
            for lease in self._leases:
                if lease.entry is entry and lease.slot < 0:
                    self._failed.append((lease, f"adapter {name!r} was deleted"))
            return True

    def get(self, tenant: str, name: str) -> AdapterInfo | None:
        with self._lock:
            entry = self._registry.get((tenant, name))
            return None if entry is None else self._info(entry)

    def list(self, tenant: str) -> list[AdapterInfo]:
        with self._lock:
            entries = [e for (t, _), e in self._registry.items() if t == tenant]
            return [self._info(e) for e in sorted(entries, key=lambda e: (e.created, e.name))]

    def snapshot(self) -> builtins.list[AdapterInfo]:
        """Every tenant's adapters (what an engine-core process sends its gateways)."""
        with self._lock:
            return [self._info(e) for e in self._registry.values()]

    @property
    def num_resident(self) -> dict[str, int]:
        """Adapters held per tier now."""
        return {
            "device": sum(e is not None and not e.removed for e in self._owner),
            "host": len(self._host),
        }

    # -- requests (engine thread) -------------------------------------------------------------

    def attach(self, tenant: str, name: str) -> Lease:
        """A lease on the tenant's adapter `name`. Raises UnknownAdapter."""
        with self._lock:
            entry = self._registry.get((tenant, name))
            if entry is None:
                raise UnknownAdapter(name)
            lease = Lease(entry)
            self._leases.add(lease)
            entry.waiting += 1
            return lease

    def admit(self, lease: Lease) -> bool:
        """True when the lease's request may run now: its adapter is in a device slot (pinned,
        as `lease.slot`, until `release`). False starts what is missing in the background."""
        if lease.slot >= 0:
            return True
        entry = lease.entry
        with self._lock:
            if entry.slot is None and not self._make_resident(entry):
                return False
            assert self.slots is not None and entry.slot is not None
            if not self.slots.ready(entry.slot):
                return False  # its copy to the device is in flight
            entry.active += 1
            entry.waiting -= 1
            entry.fresh = False
            lease.slot = entry.slot  # type: ignore[assignment]
            self._slot_lru.move_to_end(entry.slot)  # type: ignore[arg-type]
            if entry.packed is not None:
                self._host.move_to_end(entry)
            return True

    def placed(self, lease: Lease) -> Literal["none", "copying", "ready"]:
        """Where the lease's adapter stands on the device: in no slot, in one its copy has not
        reached yet (`admit` says no for that, not for want of room), or in one it has
        (`admit` takes no slot for it)."""
        with self._lock:
            slot = lease.entry.slot
            if slot is None or self.slots is None:
                return "none"
            return "ready" if self.slots.ready(slot) else "copying"

    def release(self, lease: Lease) -> None:
        with self._lock:
            if lease not in self._leases:
                return
            self._leases.discard(lease)
            if lease.slot >= 0:
                lease.entry.active -= 1
                lease.slot = -1
            else:
                lease.entry.waiting -= 1

    # Below `def list`, that method shadows the builtin in annotations: `builtins.list`.
    def take_failed(self) -> builtins.list[tuple[Lease, str]]:
        """Leases whose adapter cannot be loaded any more (deleted, or its folder became
        unreadable); the engine fails their requests."""
        if not self._failed:
            return []
        with self._lock:
            failed, self._failed = dict(self._failed), []
            return [(lease, why) for lease, why in failed.items() if lease in self._leases]

    def pending_loads(self) -> builtins.list[Future]:
        """The background reads in flight."""
        with self._lock:
            return [e.loading for e in self._registry.values() if e.loading is not None]

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a background read finishes (at most `timeout` s); return at once when
        none is in flight."""
        pending = self.pending_loads()
        if pending:
            wait_futures(pending, timeout, return_when="FIRST_COMPLETED")

    def wait_for_copies(self) -> None:
        """Block until the adapters' copies to the device in flight have landed."""
        if self.slots is not None:
            with self._lock:
                self.slots.wait()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- tiers (under the lock) ---------------------------------------------------------------

    def _make_resident(self, entry: _Entry) -> bool:
        """Try to put `entry` into a device slot now; start a disk read if it is not in host
        memory. True when it is resident."""
        if entry.packed is None:
            if entry.loading is None:
                entry.loading = self._pool.submit(self._read, entry.path, entry.name)
                return False
            if not entry.loading.done():
                return False
            future, entry.loading = entry.loading, None
            try:
                self._host_put(entry, future.result()[1])
            except Exception as e:  # noqa: BLE001 - any failure fails its requests
                problems = e.problems if isinstance(e, AdapterError) else [str(e)]
                self._fail_waiting(entry, f"can no longer be loaded: {'; '.join(problems)}")
                return False
        assert self.slots is not None and entry.packed is not None
        slot = self._make_room(entry.packed)
        if slot is None:
            return False
        try:
            self.slots.load(slot, entry.packed)
        except Exception as e:  # noqa: BLE001 - one adapter's failure fails its requests only
            self.slots.clear(slot)
            self._host.pop(entry, None)  # its next use reads (and validates) the folder again
            entry.packed = None
            self._fail_waiting(entry, f"could not be loaded into a device slot: {e}")
            return False
        self._owner[slot], entry.slot = entry, slot
        entry.fresh = True
        self._slot_lru.move_to_end(slot)  # a load is a use
        self.stats.loads["device"] += 1
        return self.slots.ready(slot)

    def _fail_waiting(self, entry: _Entry, problem: str) -> None:
        """Fail the requests waiting for `entry` (the engine takes them from `take_failed`)."""
        why = f"adapter {entry.name!r} {problem}"
        log.warning("%s (tenant %r)", why, entry.tenant)
        self._failed += [(lease, why) for lease in self._leases if lease.entry is entry]

    def _make_room(self, adapter: PackedAdapter) -> int | None:
        """An empty slot, with free rows for `adapter` in the pools, evicting the least recently
        used adapters nobody pins until both are there; None when they never will be.

        An adapter loaded for requests that have not been admitted yet is not evicted before
        one of them is: otherwise, with its copy just landed and its requests further down the
        waiting queue, the requests ahead of them took its slot for their own adapters, whose
        requests lost theirs in turn (on an H200, 64 adapters through 16 slots loaded 2,036
        times for 512 requests; `benchmarks/results/lora_slots_h200.md`)."""
        assert self.slots is not None
        order = sorted(self._slot_lru, key=lambda s: not getattr(self._owner[s], "removed", 0))
        idle = (s for s in order  # deleted adapters first, then by least recent use
                if (o := self._owner[s]) is not None and o.active == 0
                and (o.removed or not (o.pinned or (o.fresh and o.waiting > 0)))
                and self.slots.ready(s))
        while True:
            empty = next((s for s, owner in enumerate(self._owner) if owner is None), None)
            if empty is not None and self.slots.fits(adapter):
                return empty
            victim = next(idle, None)
            if victim is None:
                return None
            self._evict(victim)

    def _evict(self, slot: int) -> None:
        old, self._owner[slot] = self._owner[slot], None
        assert old is not None and self.slots is not None
        old.slot = None
        self.slots.clear(slot)
        if not old.removed:
            self.stats.evictions["device"] += 1

    def _host_put(self, entry: _Entry, packed: PackedAdapter) -> None:
        """Cache `entry` in host memory, evicting the least recently used unpinned others
        while the tier holds more than `max_cpu_loras` adapters or `max_cpu_bytes`."""
        entry.packed, entry.host_bytes = packed, packed.host_bytes
        self._host[entry] = None
        self._host.move_to_end(entry)
        self.stats.loads["host"] += 1
        count, held = len(self._host), sum(e.host_bytes for e in self._host)
        victims = (e for e in list(self._host) if not e.pinned and e is not entry)
        while ((self.max_cpu_loras is not None and count > self.max_cpu_loras)
               or (self.max_cpu_bytes is not None and held > self.max_cpu_bytes)):
            victim = next(victims, None)
            if victim is None:
                break
            del self._host[victim]
            count, held = count - 1, held - victim.host_bytes
            victim.packed = None
            self.stats.evictions["host"] += 1

    # -- helpers ------------------------------------------------------------------------------

    def _read(self, path: Path, name: str) -> tuple[LoraAdapter, PackedAdapter]:
        """disk -> host: read and validate, and lay it out for the device copy (runs in the
        loader thread or the caller's). The host tier keeps the layout; the validated adapter
        gives the registry its facts."""
        if self.slots is None:
            raise AdapterError(name, ["LoRA is disabled on this server (--max-loras 0)"])
        adapter = load_adapter(path, self.base, max_rank=self.max_rank, name=name,
                               dtype=self.dtype)
        return adapter, self.slots.pack(adapter)

    def _store_path(self, tenant: str, name: str) -> Path:
        if self.store_dir is None:
            raise AdapterError(name, ["this engine has no adapter store directory"])
        return self.store_dir / quote(tenant, safe="").replace(".", "%2E") / name

    def _scan_store(self) -> None:
        """Register the adapters uploaded before a restart (validated again, lazily cached)."""
        assert self.store_dir is not None
        for folder in sorted(self.store_dir.glob("*/*/adapter_config.json")):
            folder = folder.parent
            if folder.parent.name.startswith("."):
                continue  # .staging: an upload interrupted before validation
            tenant = unquote(folder.parent.name)
            try:
                adapter, packed = self._read(folder, folder.name)
            except Exception as e:  # noqa: BLE001 - written by another version, or damaged
                log.warning("stored adapter %s is not served: %s", folder, e)
                continue
            entry = _entry(tenant, folder.name, folder, True, adapter, False,
                           content_uid(folder))
            self._registry[(tenant, folder.name)] = entry
            self._host_put(entry, packed)

    def _info(self, e: _Entry) -> AdapterInfo:
        tier = "device" if e.slot is not None else "host" if e.packed is not None else "disk"
        return AdapterInfo(e.name, e.tenant, e.rank, e.target_modules, e.num_bytes,
                           e.stored_bytes, e.created, e.pinned, tier, e.version)


def check_name(name: str) -> None:
    """An AdapterError unless `name` is 1-64 characters of letters, digits, '.', '_', '-'."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = str(name) if len(str(name)) <= 64 else str(name)[:64] + "…"  # never 1 MB
        raise AdapterError(
            shown,
            [f"adapter name {shown!r} must be 1-64 characters of letters, digits, '.', '_' "
             "or '-', starting with a letter or digit"],
        )


def _entry(
    tenant: str, name: str, path: Path, owned: bool, adapter: LoraAdapter, pinned: bool,
    uid: int,
) -> _Entry:
    stored = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return _Entry(
        tenant, name, path, owned, adapter.rank, tuple(sorted(adapter.target_modules)),
        adapter.num_bytes, stored, uid, pinned,
    )


def content_uid(folder: Path) -> int:
    """An adapter's identity in KV namespaces: a hash of its folder's files (names and bytes),
    never 0 (the base model). KV computed under an adapter is found again after a restart
    (the disk tier) or when the same files are registered again, and never under other
    weights of the same name."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        with f.open("rb") as fh:
            h.update(f.name.encode() + b"\0" + hashlib.file_digest(fh, "sha256").digest())
    return int.from_bytes(h.digest()[:8], "big") or 1
