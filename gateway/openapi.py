"""The OpenAPI document (`/openapi.json`) describes the bodies the routes read themselves.

The JSON routes and the adapter upload read their raw body (size cap first, then strict
pydantic validation: gateway/body.py), so FastAPI cannot see their schemas; this adds them. A
body whose model requires no field may be omitted. Errors are OpenAI's JSON with status 400,
never FastAPI's 422, and the document says so. Clients and API fuzzers (tests/test_api_fuzz.py)
then exercise the real validators.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, object] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}},
    }},
}

UPLOAD_SCHEMA: dict[str, object] = {
    "type": "object",
    "required": ["name", "files"],
    "properties": {
        "name": {"type": "string", "description": "the adapter's name"},
        "files": {"type": "array", "items": {"type": "string", "format": "binary"},
                  "description": "adapter_config.json and adapter_model.safetensors"},
    },
}


def document_bodies(app: FastAPI, json_bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` describe `json_bodies` (POST path -> body model), the adapter
    upload form and the OpenAI error responses."""
    default = app.openapi

    def openapi() -> dict[str, Any]:  # Any: FastAPI's type for the document we edit
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = default()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["Error"] = ERROR_SCHEMA
        for path, model in json_bodies.items():
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            doc["paths"][path]["post"]["requestBody"] = _body(
                "application/json", {"$ref": REF.format(model=model.__name__)},
                required=bool(schema.get("required")))
        doc["paths"]["/v1/adapters"]["post"]["requestBody"] = _body(
            "multipart/form-data", UPLOAD_SCHEMA)
        for operations in doc["paths"].values():
            for op in operations.values():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None or "requestBody" in op:
                    responses["400"] = _error("Invalid request")
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _body(media_type: str, schema: dict[str, object], required: bool = True) -> dict[str, object]:
    return {"required": required, "content": {media_type: {"schema": schema}}}


def _error(description: str) -> dict[str, object]:
    return {"description": f"{description} (OpenAI's error JSON)",
            "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
