"""One config object for `switchboard serve`, built once from a TOML file and flags.

Precedence: flags > TOML > defaults. Everything is validated here, so components take the
fields they need and never re-check them.

The API-keys file (`--api-keys FILE`) is a JSON object mapping each key to its tenant, either
a name or an object with per-tenant limits:

    {"sk-alpha": "alpha",
     "sk-beta": {"tenant": "beta", "max_concurrent_requests": 4, "tokens_per_minute": 20000},
     "sk-ops": {"tenant": "ops", "admin": true}}

`"admin": true` marks a key that may read `/metrics` (see `public_metrics`). `max_adapters` and
`max_adapter_storage_bytes` bound the LoRA adapters a tenant stores (default: the serve flags
`--max-adapters-per-tenant`, `--max-adapter-storage-per-tenant`).

Without it, auth is off and every request belongs to the tenant "default". In the TOML file,
`api_keys` is that file's path (relative to the TOML file), and `[tenants.NAME]` tables or
`[default_limits]` may set limits too.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import EngineConfig, default_cache_dir
from lora.quota import AdapterQuota

# Same name as engine.loader.EMBEDDED_NAME; that module imports torch, this one must not.
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TENANT = "default"


class ConfigError(ValueError):
    """The serve configuration is invalid; the message says which setting and why."""


class TenantLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent_requests: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    # Stored LoRA adapters (None: --max-adapters-per-tenant / --max-adapter-storage-per-tenant).
    max_adapters: int | None = Field(None, ge=0)
    max_adapter_storage_bytes: int | None = Field(None, ge=0)


class ServeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # What to serve and where.
    model: str | None = None  # None: the embedded SmolLM2; else an HF folder or a .gguf file
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"

    # Tenants: api key -> tenant name (None: auth off), and limits per tenant name.
    api_keys: dict[str, str] | None = None
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    default_limits: TenantLimits = TenantLimits()
    admin_keys: frozenset[str] = frozenset()  # keys marked "admin": they may read /metrics
    public_metrics: bool = False  # /metrics without a key even with api_keys

    # Admission control and request limits.
    max_queue: int = Field(256, ge=0, description="sequences that may wait beyond a full batch")
    max_request_bytes: int = Field(4 * 2**20, ge=1024)
    default_max_tokens: int | None = Field(
        4096, ge=1, description="max_tokens when a request leaves it out (capped by the context)")
    drain_timeout: float = Field(30.0, ge=0, description="SIGTERM: seconds to finish requests")

    # Engine.
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    page_size: int = Field(16, ge=1)
    kv_pages: int | None = Field(None, ge=1)
    kv_cache_gb: float = Field(2.0, gt=0)
    max_model_len: int | None = Field(None, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    seed: int = 0
    threads: int | None = Field(None, ge=1)

    # Multi-LoRA: device slots, host cache, slot rank, upload store and upload size limit.
    max_loras: int = Field(4, ge=0)
    max_cpu_loras: int = Field(16, ge=0)
    max_lora_rank: int = Field(16, ge=1, le=512)
    adapter_dir: str | None = None  # None: <cache dir>/adapters
    max_adapter_bytes: int = Field(256 * 2**20, ge=1024)
    max_adapters_per_tenant: int = Field(100, ge=0, description="unless the tenant's own limits "
                                         "say otherwise")
    max_adapter_storage_per_tenant: int = Field(8 * 2**30, ge=0, description="bytes of stored "
                                                "adapter files, unless the tenant's limits say")

    # Prefix cache and sessions.
    prefix_cache: bool = True
    session_kv_pages: int | None = Field(None, ge=0, description="pinned pages per tenant")
    redis_url: str | None = None  # None: sessions, keys, limits, adapters live in this process
    advertise_url: str | None = None  # how routers reach this replica (default: where it binds)

    @model_validator(mode="after")
    def _check_loras(self) -> ServeConfig:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        return self

    @model_validator(mode="after")
    def _check_tenants(self) -> ServeConfig:
        if self.api_keys is not None:
            if not self.api_keys:
                raise ValueError("the API-keys file holds no keys")
            if any(not k.strip() for k in self.api_keys):
                raise ValueError("API keys must be non-empty strings")
            if any(not t.strip() for t in self.api_keys.values()):
                raise ValueError("tenant names must be non-empty strings")
        return self

    @property
    def model_name(self) -> str:
        """The name `/v1/models` lists and requests must use as `model`."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return EMBEDDED_MODEL_NAME
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name

    def limits_for(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default_limits)

    def adapter_quota(self, limits: TenantLimits) -> AdapterQuota:
        """What a tenant with `limits` may store; the server-wide quota where they say nothing."""
        return AdapterQuota(
            self.max_adapters_per_tenant if limits.max_adapters is None else limits.max_adapters,
            self.max_adapter_storage_per_tenant if limits.max_adapter_storage_bytes is None
            else limits.max_adapter_storage_bytes,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            page_size=self.page_size,
            num_pages=self.kv_pages,
            kv_cache_gb=self.kv_cache_gb,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            threads=self.threads,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            max_lora_rank=self.max_lora_rank,
            adapter_dir=Path(self.adapter_dir or default_cache_dir() / "adapters"),
            prefix_cache=self.prefix_cache,
            session_kv_pages=self.session_kv_pages,
        )


def build_config(toml_path: str | Path | None = None, **overrides: Any) -> ServeConfig:
    """Merge TOML (if any) with `overrides` (None values are ignored) and validate once."""
    values: dict[str, Any] = {}
    if toml_path is not None:
        values = _read_toml(Path(toml_path))
        if "api_keys" in values:  # a path relative to the TOML file
            values["api_keys"] = Path(toml_path).parent / str(values["api_keys"])
    values.update({k: v for k, v in overrides.items() if v is not None})
    keys_file = values.pop("api_keys", None)
    if keys_file is not None:
        keys, limits, admins = load_api_keys(Path(keys_file))
        values["api_keys"] = keys
        values["admin_keys"] = admins
        values["tenants"] = {**limits, **values.get("tenants", {})}
    try:
        return ServeConfig(**values)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def load_api_keys(
    path: Path,
) -> tuple[dict[str, str], dict[str, TenantLimits], frozenset[str]]:
    """Read the API-keys JSON file: (key -> tenant, tenant -> limits, admin keys)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the API-keys file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"the API-keys file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the API-keys file {path} must hold a JSON object of key -> tenant")
    keys: dict[str, str] = {}
    limits: dict[str, TenantLimits] = {}
    admins: set[str] = set()
    for key, entry in data.items():
        if isinstance(entry, str):
            keys[key] = entry
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str):
            raise ConfigError(
                f"API key {key[:6]}...: expected a tenant name or an object with 'tenant'"
            )
        entry = dict(entry)
        tenant = keys[key] = entry.pop("tenant")
        admin = entry.pop("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError(f"API key {key[:6]}...: 'admin' must be true or false")
        if admin:
            admins.add(key)
            if not entry:  # an admin key alone sets no limits for its tenant
                continue
        try:
            lim = TenantLimits(**entry)
        except ValidationError as e:
            raise ConfigError(f"tenant {tenant!r}: {_describe(e)}") from None
        if limits.setdefault(tenant, lim) != lim:
            raise ConfigError(f"tenant {tenant!r} has different limits on different keys")
    return keys, limits, frozenset(admins)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"the config file {path} is not valid TOML: {e}") from None


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
