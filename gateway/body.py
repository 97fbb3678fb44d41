"""JSON request bodies: read under a size cap, then parsed and validated strictly.

Every JSON route reads its body here rather than through FastAPI's parameter, so all share
one behaviour: 413 beyond the cap, without reading further; 400 for non-JSON, for strings
that are not Unicode (lone surrogates, which nothing downstream could encode) and for schema
violations, in OpenAI's error shape.
"""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request, from_validation, too_large

Body = TypeVar("Body", bound=BaseModel)


async def read_body(
    request: Request, schema: type[Body], limit: int, default: Body | None = None
) -> Body:
    """The body, at most `limit` bytes, parsed and validated strictly as `schema`. An empty
    body is `default`, or a 400 when there is none."""
    raw = await read_capped(request, limit)
    if not raw.strip():
        if default is not None:
            return default
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e.errors()) from None


async def read_capped(request: Request, limit: int) -> bytes:
    """The raw body; a 413 as soon as it is known to exceed `limit` bytes (from
    Content-Length, or while streaming), without reading further."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
