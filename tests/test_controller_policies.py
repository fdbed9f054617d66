"""The controller and the row's policy fields (issue 12): it validates them with the model.

The controller is being refactored elsewhere and is not changed here: a bad
policy value is already a 422 naming the field (it validates bodies with
``LocalSchedule``), but it stores rows in one column per Go field, so a
stored row loses its policies. That is pinned as a strict expected failure:
when the store keeps them, the test passes and the marker must go.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.testing import serve_in_thread

ADMIN = {"Authorization": "Bearer admin-secret-token-0123456789"}

POLICIES: dict[str, Any] = {
    "timezone": "Asia/Kolkata", "overlap": "buffer-one", "jitter": 600, "catchup_window": 3600,
    "paused": {"note": "disk swap", "until": "2026-12-01T05:00:00Z"},
    "not_before": "2026-01-01T00:00:00Z", "not_after": "2027-01-01T00:00:00Z",
    "blackouts": [{"days": ["sat"], "from": "22:00", "to": "06:00"}],
    "min_interval": 86400, "repo_lock": True,
}


def row(**changes: Any) -> dict[str, Any]:
    return {"id": "s-1", "name": "nightly", "repo_id": "r-9", "action": "backup",
            "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
            "miss_policy": "skip", "enabled": True, **changes}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    url = f"sqlite:///{Path(tmp_path_factory.mktemp('policies')) / 'controller.db'}"
    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=[ADMIN["Authorization"].split()[1]], nodes={})
    try:
        with serve_in_thread(create_app(engine, tokens)) as base, httpx.Client(
            base_url=base, timeout=30
        ) as http:
            yield http
    finally:
        engine.dispose()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("jitter", 7200, "Input should be less than or equal to 3600"),
    ("timezone", "localtime", "timezone 'localtime' is not an IANA zone name"),
    ("overlap", "queue", "Input should be 'skip', 'allow', 'buffer-one' or 'cancel-other'"),
    ("catchup_window", 0, "Input should be greater than or equal to 60"),
    ("min_interval", -5, "Input should be greater than or equal to 0"),
])
def test_a_bad_policy_value_is_a_422_naming_the_field(
    client: httpx.Client, field: str, value: Any, message: str
) -> None:
    answer = client.put("/api/nodes/node-a/schedules/s-1", json=row(**{field: value}),
                        headers=ADMIN)
    assert answer.status_code == 422
    [detail] = answer.json()["detail"]
    assert detail["field"] == field and message in detail["msg"]


def test_a_bad_nested_policy_value_is_a_422_naming_where(client: httpx.Client) -> None:
    bad = row(blackouts=[{"days": ["sat"], "from": "22:00", "to": "22:00"}])
    answer = client.put("/api/nodes/node-a/schedules/s-1", json=bad, headers=ADMIN)
    assert answer.status_code == 422
    assert "from '22:00' equals to '22:00'" in answer.text


@pytest.mark.xfail(strict=True, reason="the controller stores one column per Go field and drops "
                                       "the policy fields (controller/schedules.py _WIRE_FIELDS)")
def test_a_stored_row_keeps_its_policies_through_the_pull(client: httpx.Client) -> None:
    stored = client.put("/api/nodes/node-b/schedules/s-1", json=row(**POLICIES), headers=ADMIN)
    assert stored.status_code == 200
    pulled = client.get("/api/schedules", params={"node": "node-b"}, headers=ADMIN)
    [got] = pulled.json()["schedules"]
    assert {key: got.get(key) for key in POLICIES} == POLICIES
