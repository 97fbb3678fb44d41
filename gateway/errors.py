"""OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Handlers cover our own `APIError`, pydantic / FastAPI validation (400, never FastAPI's 422
body), Starlette's HTTP errors (unknown route, wrong method) and anything unexpected (500).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- the statuses the gateway answers ---------------------------------------------------


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist.", param="model", code="model_not_found"
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


def from_validation(errors: Sequence[Any], drop_prefix: str | None = None) -> APIError:
    """One pydantic error as a 400 naming the offending parameter: the deepest one, since
    for a union (`content: str | list[...]`) that is the member the client meant."""
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = list(err.get("loc", ()))
    if drop_prefix and loc and loc[0] == drop_prefix:
        loc = loc[1:]
    param = _param_path(loc)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        message = f"Missing required parameter: '{param}'."
    elif err.get("type") == "json_invalid":
        return bad_request("The request body is not valid JSON.", code="invalid_json")
    elif err.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: '{param}'."
    elif param:
        message = f"Invalid value for '{param}': {msg}."
    else:
        message = f"Invalid request body: {msg}."
    return bad_request(message, param=param or None)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _param_path(loc: list[Any]) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (drops pydantic's union
    member tags such as 'str' or 'list[ContentPart]')."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _TYPE_TAGS and "[" not in str(part) and "-" not in str(part):
            out += f".{part}" if out else str(part)
    return out


# -- handlers -------------------------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc.errors(), drop_prefix="body").response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        type_ = INVALID if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), type_, None, code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        body = error_body("The server had an error while processing your request.",
                          "server_error", None, "internal_error")
        return JSONResponse(body, status_code=500)
