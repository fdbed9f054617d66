"""The OpenAPI document: every request body declared, so clients and fuzzers can be generated.

Rule: the endpoints read their bodies themselves (after authentication, as Go
reads JSON, see :mod:`controller.api.jsonbody`), so FastAPI cannot see them;
each writing route names its body model with ``openapi_extra=json_body(Model)``
and :func:`install_openapi` adds the models' schemas to the document's
components. The document is at ``/openapi.json`` (no token needed: it holds no
data). The interactive ``/docs`` page is off: FastAPI's loads its script and
style sheet from a CDN, which an offline or locked-down network does not reach;
point any OpenAPI viewer or client generator at ``/openapi.json`` instead.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"

_OPTIONAL_IN_BODY = {"LocalSchedule": "id", "TaskIn": "name"}
"""The body field each model may leave out: the path gives it (and must agree)."""


def json_body(model: type[BaseModel], description: str = "") -> dict[str, Any]:
    """Return a route's ``openapi_extra`` declaring a required JSON body of model."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {
                "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
            },
        }
    }


def merge_patch_body(description: str) -> dict[str, Any]:
    """Return a route's ``openapi_extra`` declaring a required JSON merge patch (RFC 7386)."""
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/merge-patch+json": {"schema": {"type": "object"}},
                        "application/json": {"schema": {"type": "object"}}},
        }
    }


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make app's OpenAPI document carry models' schemas (validation mode) as components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(
            title=app.title, version=app.version, description=app.description,
            routes=app.routes,
        )
        _, definitions = models_json_schema(
            [(model, "validation") for model in models], ref_template=_REF
        )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in definitions.get("$defs", {}).items():
            optional = _OPTIONAL_IN_BODY.get(name)
            if optional and optional in schema.get("required", []):
                schema["required"] = [f for f in schema["required"] if f != optional]
            schemas.setdefault(name, schema)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
