"""The OpenAPI document declares every request body, and no generated request gets a 5xx.

The fuzzer (tests/api_fuzzer.py) is driven by the document a real controller
serves over loopback, on SQLite and on Postgres; ``SCHED_API_FUZZ_REQUESTS``
raises its count for a longer hunt.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine
from controller.models import TaskIn
from controller.testing import serve_in_thread
from sched_core.model import LocalSchedule
from tests.api_fuzzer import fuzz, operations

ADMIN_TOKEN = "fuzz-admin-token-31337"
NODE_TOKEN = "fuzz-node-token-4711"
REQUESTS = int(os.environ.get("SCHED_API_FUZZ_REQUESTS", "400"))


@pytest.fixture()
def served(database_url: str) -> Iterator[str]:
    engine = make_engine(database_url)
    tokens = Tokens(admin=[ADMIN_TOKEN], nodes={"node-a": [NODE_TOKEN]})
    try:
        with serve_in_thread(create_app(engine, tokens)) as base:
            yield base
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from controller.db import migrate

    url = f"sqlite:///{tmp_path_factory.mktemp('openapi') / 'c.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        with serve_in_thread(create_app(engine, Tokens(admin=[ADMIN_TOKEN]))) as base:
            response = httpx.get(f"{base}/openapi.json", timeout=30)
            docs = [httpx.get(f"{base}{path}", timeout=30).status_code
                    for path in ("/docs", "/redoc", "/docs/oauth2-redirect")]
    finally:
        engine.dispose()
    assert response.status_code == 200
    assert docs == [404, 404, 404]  # /docs is off: FastAPI's page needs a CDN
    data: dict[str, Any] = response.json()
    return data


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "$ref":
                yield item
            else:
                yield from _refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _refs(item)


def test_openapi_declares_the_request_bodies(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    expected = {
        ("put", "/api/nodes/{node}/schedules/{schedule_id}"): "LocalSchedule",
        ("put", "/api/tasks/{name}"): "TaskIn",
    }
    for (method, path), model in expected.items():
        body = document["paths"][path][method]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
    # The schemas are the models' own (validation mode); the path gives id / name.
    schedule = schemas["LocalSchedule"]
    assert set(schedule["properties"]) == set(LocalSchedule.model_fields)
    assert "id" not in schedule["required"] and "action" in schedule["required"]
    assert set(schemas["TaskIn"]["properties"]) == set(TaskIn.model_fields)
    assert "name" not in schemas["TaskIn"].get("required", [])
    assert {"Schedule", "MissPolicy", "TaskStatus"} <= set(schemas)
    for ref in _refs(document):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[-1] in schemas
    # Every operation that reads a body declares it; the others declare none.
    for method, path, operation in operations(document):
        assert ("requestBody" in operation) == (method in ("PUT", "POST", "PATCH")), (
            method, path)


def test_generated_requests_get_no_5xx(
    served: str, document: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with httpx.Client(base_url=served, timeout=60) as client:
        tokens = [ADMIN_TOKEN, ADMIN_TOKEN, ADMIN_TOKEN, NODE_TOKEN, None, "wrong-token"]
        result = fuzz(client, document, requests=REQUESTS, seed=20261130, tokens=tokens)
        health = client.get("/healthz")
    print(result.summary())
    assert result.failures == [], "\n".join(result.failures[:20])
    assert result.requests == REQUESTS
    assert health.status_code == 200
    # The run reached past validation: rows and tasks were stored, not only refused.
    assert result.statuses[200] > REQUESTS // 20 and result.statuses[422] > REQUESTS // 10
    # Nothing a client sent reached a log line raw, and no token did.
    for record in caplog.records:
        text = f"{record.getMessage()} {record.__dict__}"
        assert "\x1b" not in text and ADMIN_TOKEN not in text and NODE_TOKEN not in text
        assert record.levelno < logging.ERROR, text
