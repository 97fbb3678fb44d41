"""OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, for every failure;
Anthropic's, `{"type": "error", "error": {"type", "message"}}`, on the Messages API's routes.

Handlers cover our own `APIError`, pydantic / FastAPI validation (400, never FastAPI's 422
body), Starlette's HTTP errors (unknown route, wrong method: each names the route and what
to use instead) and anything unexpected (500).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.ipc.core_client import EngineUnavailable
from gateway.access.quota import QuotaExceeded
from gateway.redis_store import StoreUnavailable

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"
MAX_JSON_DEPTH = 200  # pydantic's JSON parser refuses deeper nesting
MAX_PROBLEMS = 10  # validation problems listed in one message; the rest are counted
MAX_PROBLEM_CHARS = 200  # one problem's message, clipped
MAX_MESSAGE_CHARS = 4096  # any error message, clipped: a client's input is never echoed whole
MAX_PARAM_CHARS = 256  # and its `param` (a path may hold the client's object keys)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param = None if param is None else clip(param, MAX_PARAM_CHARS)
        self.code, self.headers = code, headers

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, request: Request | None = None) -> JSONResponse:
        """The error's response, in Anthropic's shape on its routes (`request`'s path)."""
        if request is not None and request.url.path.startswith(ANTHROPIC_ROUTES):
            status, body = anthropic_error(self)
            return JSONResponse(body, status_code=status, headers=self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_ROUTES = "/v1/messages"
# status -> Anthropic's error type; 529: the server is overloaded (a full queue, an engine
# loading, failed or restarting, a store down), where OpenAI's shape answers 429 or 503.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
OVERLOADED = 529


def anthropic_error(e: APIError) -> tuple[int, dict[str, object]]:
    """(status, body) of `e` in Anthropic's shape, which has no `param`: the message names
    it first when it does not already ("messages[1].content[0]: ...")."""
    status = OVERLOADED if e.status == 503 or e.code == "queue_full" else e.status
    kind = ANTHROPIC_TYPES.get(status, INVALID if status < 500 else "api_error")
    message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


# -- the statuses the gateway answers ---------------------------------------------------


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> APIError:
    return APIError(403, message, code="permission_denied")


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{clip(model)}' does not exist.", param="model", code="model_not_found"
    )


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")


def rate_limited(message: str, retry_after: float, code: str) -> APIError:
    seconds = max(1, int(retry_after + 0.999))
    return APIError(429, message, "rate_limit_error", code=code,
                    headers={"Retry-After": str(seconds)})


def not_ready() -> APIError:
    return APIError(503, "The model is still loading; retry shortly.", "server_error",
                    code="model_not_ready", headers={"Retry-After": "1"})


def engine_failed(message: str) -> APIError:
    """The engine core died (its requests fail with this) or is being restarted."""
    return APIError(503, message, "server_error", code="engine_failed",
                    headers={"Retry-After": "1"})


def generation_failed(error: str | None, code: str | None) -> APIError:
    """A generation the engine ended with an error: 503 when the engine itself failed (retry
    once it is back), else 500."""
    if code == "engine_failed":
        return engine_failed(error or "the engine failed")
    return APIError(500, f"generation failed: {error or 'engine error'}", "server_error",
                    code="engine_error")


def store_unavailable(e: StoreUnavailable) -> APIError:
    """A store that is down, full (Redis `maxmemory`) or refusing writes: retry later."""
    return APIError(503, f"The store is unavailable, nothing was saved: {e}", "server_error",
                    code="store_unavailable", headers={"Retry-After": "1"})


def storage_quota_exceeded(e: QuotaExceeded) -> APIError:
    return APIError(403, str(e), param=e.quota, code="storage_quota_exceeded")


def from_validation(errors: Sequence[ErrorDetails], drop_prefix: str | None = None) -> APIError:
    """pydantic's errors as one 400: the first `MAX_PROBLEMS` problems and a count of the
    rest, each naming its parameter, so the body stays small whatever the input. A union's
    members (`content: str | list[...]`) each report the same value: a parameter whose
    descendants have problems is left out for them (the member the client meant), and one
    parameter is reported once. `param` is the first problem's."""
    first: dict[tuple[int | str, ...], ErrorDetails] = {}  # parameter -> its first error
    for err in errors:
        if err["type"] == "json_invalid":
            return invalid_json(str(err.get("msg", "")))
        loc = err["loc"]
        if drop_prefix and loc and loc[0] == drop_prefix:
            loc = loc[1:]
        key = tuple(p for p in loc if isinstance(p, int) or not _is_tag(p))
        if key not in first:
            first[key] = err
    parents = {k[:i] for k in first for i in range(1, len(k))}
    leaves = [k for k in first if k not in parents]  # never empty: the longest key is a leaf
    shown = [(_param_path(k), first[k]) for k in leaves[:MAX_PROBLEMS]]
    param = shown[0][0] or None
    if len(leaves) == 1:
        return bad_request(_problem(*shown[0]) + ".", param=param)
    more = f"; and {len(leaves) - MAX_PROBLEMS} more" if len(leaves) > MAX_PROBLEMS else ""
    listed = "; ".join(_problem(p, e) for p, e in shown)
    return bad_request(f"The request has {len(leaves)} invalid values: {listed}{more}.",
                       param=param)


def from_pydantic(e: ValidationError) -> APIError:
    """`from_validation` of a model's errors, read without their inputs and links (a body of
    10^5 bad values has as many errors: this halves the cost of reading them)."""
    return from_validation(e.errors(include_url=False, include_context=False,
                                    include_input=False))


# Bodies are validated from their parsed JSON (gateway/body.py), whose type errors pydantic
# words in Python's terms: they are said in JSON's, as validating the bytes would.
JSON_TYPE_ERRORS = {"list_type": "Input should be a valid array",
                    "dict_type": "Input should be an object",
                    "model_type": "Input should be an object",
                    "model_attributes_type": "Input should be an object"}


def _problem(param: str, err: ErrorDetails) -> str:
    """One pydantic error as a sentence (no final period), its message clipped."""
    msg = JSON_TYPE_ERRORS.get(err.get("type", ""), err.get("msg", "invalid value"))
    msg = clip(str(msg).removeprefix("Value error, "), MAX_PROBLEM_CHARS)
    if err.get("type") == "missing":
        return f"Missing required parameter: '{param}'"
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: '{param}'"
    if param:
        return f"Invalid value for '{param}': {msg}"
    return f"Invalid request body: {msg}"


def invalid_json(detail: str) -> APIError:
    """A body the JSON parser refused, saying why (`detail`: pydantic's "Invalid JSON: ...")."""
    detail = detail.removeprefix("Invalid JSON: ")
    where = detail[detail.find(" at line "):] if " at line " in detail else ""
    if detail.startswith("recursion limit exceeded"):
        return bad_request(f"The request body nests JSON arrays and objects more than "
                           f"{MAX_JSON_DEPTH} levels deep{where}.", code="json_too_deep")
    if "surrogate" in detail:
        return bad_request(
            f"The request body is not valid JSON: a string holds an unpaired UTF-16 surrogate "
            f"escape (\\ud800-\\udfff without its other half), which is not text{where}.",
            code="invalid_json")
    return bad_request(f"The request body is not valid JSON: {detail or 'cannot parse it'}.",
                       code="invalid_json")


def clip(value: str, limit: int = 64) -> str:
    """`value` for an error message: a client's 1 MB string is not echoed back whole."""
    return value if len(value) <= limit else value[:limit] + "…"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_tag(part: str) -> bool:
    """Whether a location part is pydantic's tag of a union member ('str',
    'list[ContentPart]', 'function-after[...]') rather than a field or key."""
    return part in _TYPE_TAGS or "[" in part or "-" in part


def _param_path(loc: Sequence[int | str]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; object keys clipped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += f".{clip(part)}" if out else clip(part)
    return out


def route_error(request: Request, status: int, headers: Mapping[str, str]) -> APIError:
    """404 for a path no route serves, 405 for a method its route does not take; both name
    the route and what to use instead, so that no client reads them as an unknown model."""
    method, path = request.method, request.url.path
    if status == 405:
        allowed = headers.get("Allow", "another method")  # Starlette sets it
        return APIError(405, f"{method} is not allowed on {path}; use {allowed}.",
                        code="method_not_allowed", headers=headers)
    paths = request.app.openapi()["paths"]  # built once, then cached by the app
    hint = ""
    if "/v1" + path in paths:
        hint = f" Did you mean /v1{path}? The OpenAI base URL of this server ends in /v1."
    served = ", ".join(f"{'/'.join(m.upper() for m in ops)} {p}"
                       for p, ops in sorted(paths.items()) if p.startswith("/v1/"))
    return APIError(404, f"Unknown route {method} {path}.{hint} This server serves {served}.",
                    code="unknown_route")


# -- handlers -------------------------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request)

    @app.exception_handler(StoreUnavailable)
    async def _store(request: Request, exc: StoreUnavailable) -> JSONResponse:
        return store_unavailable(exc).response(request)

    @app.exception_handler(EngineUnavailable)
    async def _engine(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return engine_failed(f"The engine is unavailable: {exc}").response(request)

    @app.exception_handler(QuotaExceeded)
    async def _quota(request: Request, exc: QuotaExceeded) -> JSONResponse:
        return storage_quota_exceeded(exc).response(request)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc.errors(), drop_prefix="body").response(request)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_pydantic(exc).response(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):  # raised by routing: no route, or not this method
            return route_error(request, exc.status_code, exc.headers or {}).response(request)
        type_ = INVALID if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type_,
                        headers=exc.headers).response(request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return APIError(500, "The server had an error while processing your request.",
                        "server_error", code="internal_error").response(request)
