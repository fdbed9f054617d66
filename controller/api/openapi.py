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


_DETAIL = {"application/json": {"schema": {
    "type": "object", "properties": {"detail": {}}, "required": ["detail"]}}}


def _answer(description: str) -> dict[str, Any]:
    return {"description": description, "content": _DETAIL}


def declare_error_answers(document: dict[str, Any]) -> None:
    """Add to each operation of document the error answers the server gives (in place).

    The routes check tokens, names and bodies themselves (see the package's
    rule), so FastAPI cannot see those answers: every ``/api`` operation may be
    401 (no or unknown token) or 403 (a node token outside its node, or on an
    admin endpoint); one with a path parameter 404; one with a body 413 (over
    1 MiB) and 422; every one 503 when the database is unavailable. A client
    generated from the document then expects what the server sends.
    """
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            answers = operation["responses"]
            if path.startswith("/api/"):
                answers.setdefault("401", _answer("missing or unknown bearer token"))
                answers.setdefault("403", _answer(
                    "a node token outside its node, or on an endpoint that needs the admin"))
            if "{" in path:
                answers.setdefault("404", _answer("no such node, schedule or task"))
            if "requestBody" in operation:
                answers.setdefault("413", _answer("the body is over 1 MiB"))
            if "requestBody" in operation or "{" in path or operation.get("parameters"):
                answers.setdefault("422", _answer("a bad body, name or parameter, named"))
            answers.setdefault("503", _answer("the database is unavailable; try again"))


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make app's OpenAPI document carry models' schemas (validation mode) as components.

    Each operation also declares its error answers (:func:`declare_error_answers`).
    """

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
        declare_error_answers(document)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
