"""The adapter registry every replica shares (`--redis-url`), with the adapters' files.

Keys (named in gateway/redis_store.py), no TTL:
    ADAPTERS + tenant                     hash name -> JSON: the adapter object as uploaded,
                                          plus `version`
    adapter_files(tenant, name, version)  hash file name -> bytes

The registry is the truth: an upload is registered (and its files written) in one Lua script
that refuses a name the tenant already has, or an adapter past the tenant's quota (count, and
bytes of files: `stored_bytes` of its entries), so that concurrent uploads through several
replicas cannot exceed it together; a delete removes one version. Each replica's `--adapter-dir`
is its local cache of validated copies. Adapters are small (LoRA deltas, a few
MB to a few hundred), so Redis holds them whole; `--max-adapter-bytes` bounds each.

"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import NotRequired, TypedDict

from gateway.redis_store import ADAPTERS, Redis, adapter_files
from lora.quota import AdapterQuota, QuotaExceeded

# KEYS: registry, files. ARGV: name, meta JSON, max adapters, max bytes, then file name / bytes
# pairs. Returns {1} (registered), {0} (name taken) or {-1, count, bytes used, bytes of this
# upload} (over quota).
_PUBLISH = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {0} end
local entries = redis.call('HVALS', KEYS[1])
local used = 0
for _, meta in ipairs(entries) do used = used + (cjson.decode(meta)['stored_bytes'] or 0) end
local size = cjson.decode(ARGV[2])['stored_bytes'] or 0
if #entries + 1 > tonumber(ARGV[3]) or used + size > tonumber(ARGV[4]) then
  return {-1, #entries, used, size}
end
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {1}
"""

# KEYS: registry, files. ARGV: name, version. Deletes only that version.
_DELETE = """
local meta = redis.call('HGET', KEYS[1], ARGV[1])
if not meta or cjson.decode(meta)['version'] ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""


class AdapterEntry(TypedDict):
    """A registry entry (JSON): the adapter object as uploaded (gateway/adapters/routes.py's
    `adapter_object`, less `tier` and `pinned`) plus its `version`. The fields read here and
    in gateway/adapters/shared.py are named; the others pass through."""

    id: str
    created: int
    stored_bytes: NotRequired[int]
    version: str


def new_version() -> str:
    """A fresh version for an upload (given to the local registry, then published)."""
    return uuid.uuid4().hex


class SharedAdapterStore:
    def __init__(self, redis: Redis):
        """`redis`: a bytes client (`redis_store.Clients.files`): adapter files are binary."""
        self.redis = redis
        self._publish = self.redis.register_script(_PUBLISH)
        self._delete = self.redis.register_script(_DELETE)

    async def get(self, tenant: str, name: str) -> AdapterEntry | None:
        """The adapter's registry entry (with `version`), or None."""
        raw = await self.redis.hget(ADAPTERS + tenant, name)
        return None if raw is None else json.loads(raw)

    async def list(self, tenant: str) -> list[AdapterEntry]:
        raw = await self.redis.hgetall(ADAPTERS + tenant)
        entries: list[AdapterEntry] = [json.loads(v) for v in raw.values()]
        return sorted(entries, key=lambda m: (m["created"], m["id"]))

    async def usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's adapters: how many, and the bytes of their stored files."""
        entries = await self.list(tenant)
        return len(entries), sum(m.get("stored_bytes", 0) for m in entries)

    async def publish(self, tenant: str, name: str, meta: dict[str, object],
                      files: dict[str, bytes], quota: AdapterQuota, version: str) -> bool:
        """Register `name` as `version` (`new_version()`) with its files (`meta["stored_bytes"]`
        their size); False when the name is taken. Raises `QuotaExceeded`, registering
        nothing."""
        args: list[str | int | bytes] = [name, json.dumps({**meta, "version": version}),
                                         quota.max_adapters, quota.max_bytes]
        for filename, data in files.items():
            args += [filename, data]
        status, *usage = await self._publish(
            keys=[ADAPTERS + tenant, adapter_files(tenant, name, version)], args=args)
        if status == -1:
            count, used, size = usage
            raise QuotaExceeded(quota.problem(count, used, size) or "adapter quota exceeded")
        return status == 1

    async def download(self, tenant: str, name: str, version: str, dest: Path) -> None:
        """Write that version's files into the folder `dest`."""
        files = await self.redis.hgetall(adapter_files(tenant, name, version))
        if not files:
            raise FileNotFoundError(f"adapter {name!r} has no files in the shared store")
        for filename, data in files.items():
            (dest / Path(filename.decode()).name).write_bytes(data)

    async def delete(self, tenant: str, name: str, version: str) -> bool:
        keys = [ADAPTERS + tenant, adapter_files(tenant, name, version)]
        return bool(await self._delete(keys=keys, args=[name, version]))
