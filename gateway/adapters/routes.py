"""`/v1/adapters`: each tenant uploads, lists, inspects and deletes its own LoRA adapters.

Upload is a multipart form: field `name` and the PEFT folder's files as repeated `files` parts
(`curl -F name=support-bot -F files=@adapter_config.json -F files=@adapter_model.safetensors`).
The body is streamed under `--max-adapter-bytes` (413 beyond), its parts written as they arrive
into a staging folder inside the store (gateway/adapters/form.py), checked against the
tenant's quota (adapters and bytes stored; 403 beyond), and the folder validated by the
engine's adapter manager off the event loop; only a valid adapter is moved into the store and
registered. A bad one answers 400 naming every
problem and leaves nothing behind; the tenant's other adapters are untouched. A tenant's
uploads run one at a time, so that concurrent ones cannot pass its quota together. The served
model's name is reserved: as `model` it names the base model.

The engine's manager is used as an `engine.protocols.AdapterRegistry` (thread-safe `add`,
`remove`, `get`, `list`); this module imports no torch. With `--redis-url`, the registry
shared by all replicas (gateway/adapters/shared.py) answers instead, and a request naming an
adapter this replica lacks fetches it first (`ensure_adapter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.protocols import AdapterExists, AdapterInfo, AdapterRegistry
from gateway.access.auth import Authenticate
from gateway.adapters.form import StagedForm
from gateway.adapters.shared import SharedAdapters, exists, invalid, over_quota, staging_dir
from gateway.adapters.store import new_version
from gateway.errors import APIError, bad_request, clip, model_not_found, too_large
from gateway.runtime import Runtime
from lora.quota import AdapterQuota, QuotaExceeded

log = logging.getLogger(__name__)



def adapter_routes(rt: Runtime, authenticate: Authenticate) -> APIRouter:
    router = APIRouter()
    base = rt.config.model_name
    # One upload per tenant at a time on this replica: its quota check and its writes are one
    # step (across replicas the shared registry checks again, atomically).
    uploading: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    @router.post("/v1/adapters")
    async def upload(request: Request, tenant: str = Depends(authenticate)) -> dict[str, object]:
        manager = require_manager(rt)
        staging = staging_dir(manager)
        try:
            name, sizes = await _read_form(request, rt.config.max_adapter_bytes, staging)
            return await _register(manager, tenant, name, staging, sum(sizes.values()))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def _register(manager: AdapterRegistry, tenant: str, name: str, staging: Path,
                        size: int) -> dict[str, object]:
        shared = rt.shared_adapters
        lock = shared.lock(tenant, name) if shared else contextlib.nullcontext()
        try:
            if name == base:  # `model` would name the base model, never the adapter
                raise bad_request(f"adapter name {name!r} is the served model's name; choose "
                                  "another", "name")
            quota = rt.config.adapter_quota(rt.auth.limits_for(tenant))  # shared with --redis-url
            async with uploading[tenant], lock:
                if shared:
                    await shared.claim(tenant, name)
                    count, used = await shared.usage(tenant)
                elif manager.get(tenant, name) is not None:
                    raise exists(name)
                else:
                    stored = manager.list(tenant)
                    count, used = len(stored), sum(a.stored_bytes for a in stored)
                quota.check(count, used, size)
                version = new_version() if shared else ""
                info, blobs = await _store(manager, tenant, name, staging, version)
                obj = adapter_object(info, base)
                # Another replica's upload may have taken the name or the quota meanwhile.
                if shared and not await _publish(shared, manager, tenant, name, obj, blobs, quota,
                                                 version):
                    raise exists(name)
            return obj
        except QuotaExceeded as e:
            raise over_quota(e) from None

    @router.get("/v1/adapters")
    async def list_adapters(tenant: str = Depends(authenticate)) -> dict[str, object]:
        manager = require_manager(rt)
        if rt.shared_adapters:
            return {"object": "list", "data": await rt.shared_adapters.list(tenant)}
        return {"object": "list", "data": [adapter_object(i, base) for i in manager.list(tenant)]}

    @router.get("/v1/adapters/{name}")
    async def get_adapter(name: str, tenant: str = Depends(authenticate)) -> dict[str, object]:
        manager = require_manager(rt)
        if rt.shared_adapters:
            obj = await rt.shared_adapters.get(tenant, name)
        else:
            info = manager.get(tenant, name)
            obj = None if info is None else adapter_object(info, base)
        if obj is None:
            raise _unknown(name)
        return obj

    @router.delete("/v1/adapters/{name}")
    async def delete_adapter(name: str, tenant: str = Depends(authenticate)) -> dict[str, object]:
        manager = require_manager(rt)
        if rt.shared_adapters:
            deleted = await rt.shared_adapters.delete(tenant, name)
        else:
            deleted = await asyncio.to_thread(manager.remove, tenant, name)
        if not deleted:
            raise _unknown(name)
        return {"id": name, "object": "adapter", "deleted": True}

    register_metrics(rt.metrics.registry, lambda: rt.engine.adapters)
    return router


async def _store(
    manager: AdapterRegistry, tenant: str, name: str, staging: Path, version: str,
) -> tuple[AdapterInfo, dict[str, bytes]]:
    """Register the staging folder (validated, off the event loop; moved into the store).
    Returns the adapter's info and, with a shared registry's `version`, the files' bytes (to
    publish). A refused adapter leaves nothing behind (the caller removes the folder)."""
    try:
        blobs = await asyncio.to_thread(_files, staging) if version else {}
        info = await asyncio.to_thread(functools.partial(manager.add, tenant, name, staging,
                                                         move=True, version=version))
    except AdapterExists:  # a concurrent upload of the same name won
        raise exists(name) from None
    except ValueError as e:  # AdapterError: everything wrong with the folder
        raise invalid(name, e) from None
    return info, blobs


def require_manager(rt: Runtime) -> AdapterRegistry:
    rt.require_ready()
    manager = rt.engine.adapters
    if manager is None:
        raise APIError(501, "this server does not serve LoRA adapters", code="adapters_disabled")
    return manager


async def _publish(shared: SharedAdapters, manager: AdapterRegistry, tenant: str, name: str,
                   obj: dict[str, object], blobs: dict[str, bytes], quota: AdapterQuota,
                   version: str) -> bool:
    """Register a validated upload in the shared registry; on a refusal or a failure, drop the
    local copy (nothing half-registered)."""
    try:
        published = await shared.publish(tenant, name, obj, blobs, quota, version)
    except BaseException:
        await asyncio.to_thread(manager.remove, tenant, name)
        raise
    if not published:
        await asyncio.to_thread(manager.remove, tenant, name)
    return published


async def ensure_adapter(rt: Runtime, tenant: str, model: str) -> None:
    """Before `model` is resolved: with a shared registry, fetch the tenant's adapter it names
    if this replica lacks it (or drop one deleted elsewhere). No-op for the base model."""
    served = rt.config.model_name
    if rt.shared_adapters is None or model == served or not rt.ready or rt.engine.adapters is None:
        return
    await rt.shared_adapters.ensure(tenant, model.removeprefix(served + ":"))


async def model_cards(rt: Runtime, tenant: str) -> list[dict[str, object]]:
    """`/v1/models` entries for the tenant's adapters (none before the engine is loaded)."""
    manager = rt.engine.adapters if rt.ready else None
    if manager is None:
        return []
    base = rt.config.model_name
    if rt.shared_adapters:
        try:
            return [{"id": a["id"], "object": "model", "created": a["created"],
                     "owned_by": a["owned_by"], "parent": base, "root": base}
                    for a in await rt.shared_adapters.list(tenant)]
        except APIError as e:
            if e.status != 503:
                raise
            log.warning("adapter registry unreachable; /v1/models lists this replica's adapters")
    return [model_card(info, base) for info in manager.list(tenant)]


def adapter_model_card(rt: Runtime, tenant: str, name: str) -> dict[str, object]:
    """`/v1/models/{model}` for the tenant's adapter `name`, resolved just before (a 404
    if it was deleted meanwhile)."""
    manager = rt.engine.adapters
    info = None if manager is None else manager.get(tenant, name)
    if info is None:
        raise model_not_found(name)
    return model_card(info, rt.config.model_name)


def model_card(info: AdapterInfo, base: str) -> dict[str, object]:
    return {"id": info.name, "object": "model", "created": info.created,
            "owned_by": info.tenant, "parent": base, "root": base}


def adapter_object(info: AdapterInfo, base: str) -> dict[str, object]:
    return {
        "id": info.name, "object": "adapter", "created": info.created, "owned_by": info.tenant,
        "parent": base, "rank": info.rank, "target_modules": list(info.target_modules),
        "bytes": info.num_bytes, "stored_bytes": info.stored_bytes, "pinned": info.pinned,
        "tier": info.tier,
    }


async def _read_form(request: Request, limit: int, staging: Path) -> tuple[str, dict[str, int]]:
    """The form's `name`, and its `files` parts written into `staging` ({file name: bytes}),
    the body capped at `limit`."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("upload an adapter as multipart/form-data: field 'name' and the "
                          "folder's files as repeated 'files' parts")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    form = StagedForm(staging)
    await form.read(request.stream(), content_type, limit)
    if not form.name:
        raise bad_request("missing form field 'name' (the adapter's name)", "name")
    if not form.sizes:
        raise bad_request("no 'files' parts: upload adapter_config.json and "
                          "adapter_model.safetensors as repeated 'files' parts", "files")
    return form.name, form.sizes


def _files(folder: Path) -> dict[str, bytes]:
    """A folder's files, by name (read in a thread: an adapter's weights are hundreds of MB)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _unknown(name: str) -> APIError:
    return APIError(404, f"The adapter '{clip(name)}' does not exist.", code="adapter_not_found")


class _AdapterCollector:
    """Prometheus view of the manager's counters, read at scrape time."""

    def __init__(self, manager: Callable[[], AdapterRegistry | None]) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily(
            "switchboard_adapter_loads", "LoRA adapter loads into a tier (host: read from "
            "disk; device: copied into a slot)", labels=["tier"])
        evictions = CounterMetricFamily(
            "switchboard_adapter_evictions", "LoRA adapters evicted from a tier (LRU)",
            labels=["tier"])
        resident = GaugeMetricFamily(
            "switchboard_adapters_resident", "LoRA adapters held in a tier now", labels=["tier"])
        manager = self.manager()
        if manager is not None:
            for tier in ("host", "device"):
                loads.add_metric([tier], manager.stats.loads[tier])
                evictions.add_metric([tier], manager.stats.evictions[tier])
            for tier, n in manager.num_resident.items():
                resident.add_metric([tier], n)
        yield from (loads, evictions, resident)


def register_metrics(registry: CollectorRegistry,
                     manager: Callable[[], AdapterRegistry | None]) -> None:
    registry.register(_AdapterCollector(manager))
