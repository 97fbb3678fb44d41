"""One config object for `switchboard serve`, built once from a TOML file and flags.

`ServeConfig` is the engine's settings (declared once, in `engine/config.py`) plus the server's
own, declared here; `gateway/cli.py` generates the flags from these fields, and the TOML keys
are the same names. Precedence: flags > TOML > defaults. Everything is validated here, so
components take the fields they need and never re-check them.

The API-keys file (`--api-keys FILE`) is a JSON object mapping each key to its tenant, either
a name or an object with per-tenant limits:

    {"sk-alpha": "alpha",
     "sk-beta": {"tenant": "beta", "max_concurrent_requests": 4, "tokens_per_minute": 20000},
     "sk-ops": {"tenant": "ops", "admin": true}}

`"admin": true` marks a key that may read `/metrics` (see `public_metrics`). `max_adapters` and
`max_adapter_storage_bytes` bound the LoRA adapters a tenant stores (default: the serve flags
`--max-adapters-per-tenant`, `--max-adapter-storage-per-tenant`); `max_sessions` and
`max_storage_bytes` bound what else it stores: sessions, conversations and stored responses
(default: `--max-sessions-per-tenant`, `--max-storage-per-tenant`; gateway/access/quota.py).

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

from engine.config import EMBEDDED_MODEL_NAME, EngineConfig, setting
from gateway.access.connections import ConnectionLimits
from gateway.access.quota import StorageQuota
from lora.quota import AdapterQuota

DEFAULT_TENANT = "default"
MAX_TTL_S = 366 * 24 * 3600  # the longest TTL a session, response or conversation may have


class ConfigError(ValueError):
    """The serve configuration is invalid; the message says which setting and why."""


class TenantLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent_requests: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    # Stored LoRA adapters (None: --max-adapters-per-tenant / --max-adapter-storage-per-tenant).
    max_adapters: int | None = Field(None, ge=0)
    max_adapter_storage_bytes: int | None = Field(None, ge=0)
    # Sessions, conversations and stored responses (None: the serve flags' quota).
    max_sessions: int | None = Field(None, ge=0)
    max_storage_bytes: int | None = Field(None, ge=0)


class ServeConfig(EngineConfig):
    """The engine's settings (inherited) and the server's. Scalar fields are flags and TOML
    keys; the tenant tables come from the API-keys file and the TOML file only."""

    # Where to serve.
    served_model_name: str | None = setting(
        None, metavar="NAME", help="the `model` clients send (default: from --model)")
    host: str = setting("127.0.0.1", metavar="HOST", help="interface to bind")
    port: int = setting(
        8000, ge=0, le=65535, metavar="PORT", help="port to bind, 0 for any free port")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = setting(
        "warning", help="server log level")

    # Tenants: api key -> tenant name (None: auth off), and limits per tenant name.
    api_keys: dict[str, str] | None = None
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    default_limits: TenantLimits = TenantLimits()
    admin_keys: frozenset[str] = frozenset()  # keys marked "admin": they may read /metrics
    public_metrics: bool = setting(
        False, help="serve /metrics without a key (default with --api-keys: admin keys only)")

    # Admission control and request limits.
    max_queue: int = setting(
        256, ge=0, help="sequences that may wait beyond a full batch before 429s")
    max_request_bytes: int = setting(
        4 * 2**20, ge=1024, metavar="BYTES", help="largest accepted request body")
    default_max_tokens: int | None = setting(
        4096, ge=1, help="max_tokens when a request leaves it out (capped by what is left of "
        "the context)")
    drain_timeout: float = setting(
        30.0, ge=0, metavar="SECONDS", help="on SIGTERM, how long running requests may finish")

    # The engine core (engine/ipc/core_process.py, engine/ipc/core_client.py).
    engine_core: Literal["process", "thread"] = setting(
        "process", help="where the engine core runs: its own process (the HTTP server holds no "
        "model and shares no GIL with the step loop) or a thread of the server's")
    engine_restarts: int = setting(
        3, ge=0, help="a core process that dies is restarted at most N times within 10 "
        "minutes; past that /health answers 503")
    api_servers: int = setting(
        1, ge=1, le=64, help="HTTP server processes sharing the port over one engine core "
        "process, so JSON, SSE and tokenization use more cores (more than one needs "
        "--redis-url: the processes share sessions, stored responses and limits there)")

    # Connections and slow clients (gateway/access/connections.py).
    header_timeout: float = setting(
        ConnectionLimits.header_timeout, gt=0, metavar="SECONDS", help="a connection that has "
        "not sent a request's headers this long after it opened (or after the request's first "
        "byte) is closed with a 408")
    body_timeout: float = setting(
        ConnectionLimits.body_timeout, gt=0, metavar="SECONDS", help="time a request body may "
        "take, plus a second per --body-min-rate bytes received; slower, the connection is "
        "closed")
    body_min_rate: int = setting(
        ConnectionLimits.body_min_rate, ge=1, metavar="BYTES", help="the slowest a long request "
        "body may arrive, in bytes a second (see --body-timeout)")
    max_connections: int = setting(
        ConnectionLimits.max_connections, ge=1, help="open connections at most (lowered at start "
        "to stay below the open-file limit); beyond it a new connection takes the place of the "
        "one that has waited longest for its headers, or gets a 503 when every connection has a "
        "request in flight")
    keep_alive_timeout: float = setting(
        ConnectionLimits.keep_alive_timeout, gt=0, metavar="SECONDS", help="an idle keep-alive "
        "connection is closed after this long without a request (longer than clients keep "
        "theirs, 5 s for httpx and the openai SDK, so that none sends a request on a connection "
        "being closed; at --max-connections idle ones are the first to go)")
    max_stream_buffer_bytes: int = setting(
        2 * 2**20, ge=4096, metavar="BYTES", help="output a request may hold for a client that "
        "does not read it (about the bytes of its SSE events); past it the request is aborted "
        "and its connection closed")

    # LoRA uploads.
    max_adapter_bytes: int = setting(
        256 * 2**20, ge=1024, metavar="BYTES", help="largest accepted adapter upload")
    max_adapters_per_tenant: int = setting(
        100, ge=0, help="adapters a tenant may store (the keys file's max_adapters overrides "
        "it per tenant)")
    max_adapter_storage_per_tenant: int = setting(
        8 * 2**30, ge=0, metavar="BYTES", help="bytes of adapter files a tenant may store "
        "(max_adapter_storage_bytes in the keys file overrides it per tenant)")

    # What tenants store: sessions, conversations, stored responses (gateway/access/quota.py).
    max_sessions_per_tenant: int = setting(
        10_000, ge=0, help="sessions a tenant may keep, forks, conversations and the sessions "
        "of stored responses included (max_sessions in the keys file overrides it)")
    max_storage_per_tenant: int = setting(
        2**30, ge=0, metavar="BYTES", help="bytes of sessions, conversations and stored "
        "responses a tenant may keep (max_storage_bytes in the keys file overrides it)")
    max_history_bytes: int = setting(
        16 * 2**20, ge=1024, metavar="BYTES", help="largest history one session or "
        "conversation may hold")
    session_ttl: int = setting(
        7 * 24 * 3600, ge=1, le=MAX_TTL_S, metavar="SECONDS", help="how long a session "
        "created without ttl_seconds is kept after its last turn")

    # The Responses API (gateway/responses/routes.py).
    response_ttl: int = setting(
        30 * 24 * 3600, ge=1, le=MAX_TTL_S, metavar="SECONDS", help="how long a stored response or "
        "conversation (and the history it continues) is kept")
    max_stored_responses: int = setting(
        1000, ge=1, help="stored responses a tenant may keep (and as many conversations); "
        "the oldest are evicted beyond it")

    # Replicas.
    redis_url: str | None = setting(
        None, metavar="URL", help="shared state for replicas (sessions, keys, limits, "
        "adapters), e.g. redis://host:6379/0 (default: in-process)")
    advertise_url: str | None = setting(
        None, metavar="URL", help="how routers reach this replica, e.g. http://10.0.0.7:8000 "
        "(default: http://HOST:PORT)")

    @model_validator(mode="after")
    def _check_tenants(self) -> ServeConfig:
        if self.api_keys is not None:
            if not self.api_keys:
                raise ValueError("the API-keys file holds no keys")
            if any(not k.strip() for k in self.api_keys):
                raise ValueError("API keys must be non-empty strings")
            if any(not t.strip() for t in self.api_keys.values()):
                raise ValueError("tenant names must be non-empty strings")
        if self.api_servers > 1 and self.engine_core != "process":
            raise ValueError("--api-servers above 1 needs --engine-core process")
        if self.api_servers > 1 and self.redis_url is None:
            raise ValueError("--api-servers above 1 needs --redis-url: the HTTP processes "
                             "share sessions, stored responses and tenant limits there")
        return self

    @property
    def kv_pages(self) -> int | None:
        """`num_pages` by its serve name (`--kv-pages`, TOML `kv_pages`)."""
        return self.num_pages

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

    def storage_quota(self, limits: TenantLimits) -> StorageQuota:
        """What a tenant with `limits` may keep in the session and response stores."""
        return StorageQuota(
            self.max_sessions_per_tenant if limits.max_sessions is None else limits.max_sessions,
            self.max_storage_per_tenant if limits.max_storage_bytes is None
            else limits.max_storage_bytes,
            self.max_history_bytes,
        )

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout, self.body_timeout, self.body_min_rate,
                                self.max_connections, self.keep_alive_timeout)

    def engine_config(self) -> EngineConfig:
        """The engine's part of this config. A server always has an upload store: under the
        cache dir unless `--adapter-dir` says where."""
        settings = self.model_dump(include=set(EngineConfig.model_fields))
        settings["adapter_dir"] = self.adapter_dir or self.cache_dir / "adapters"
        return EngineConfig(**settings)


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
