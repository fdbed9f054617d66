"""The controller and the row's policy fields, over real HTTP on loopback.

A bad policy value is a 422 naming the field (bodies are validated with
``LocalSchedule``); a stored row keeps every policy it was given (the
``policies`` column), and they reach an agent's cache through a real pull
byte for byte; a row without them is stored and served exactly as the Go kit's.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.testing import serve_in_thread
from sched_core.model import LocalSchedule
from sched_core.scheduler import Config, Scheduler

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


def test_a_stored_row_keeps_its_policies_through_the_pull(client: httpx.Client) -> None:
    stored = client.put("/api/nodes/node-b/schedules/s-1", json=row(**POLICIES), headers=ADMIN)
    assert stored.status_code == 200
    pulled = client.get("/api/schedules", params={"node": "node-b"}, headers=ADMIN)
    [got] = pulled.json()["schedules"]
    assert {key: got.get(key) for key in POLICIES} == POLICIES


def test_the_pull_serves_the_row_with_its_policies_byte_for_byte(client: httpx.Client) -> None:
    assert client.put("/api/nodes/bytes/schedules/s-1", json=row(**POLICIES),
                      headers=ADMIN).status_code == 200
    expected = LocalSchedule.model_validate({**row(**POLICIES), "version": 1}).model_dump_json()
    pulled = client.get("/api/schedules", params={"node": "bytes"}, headers=ADMIN)
    assert pulled.content == f'{{"schedules":[{expected}]}}'.encode()
    one = client.get("/api/nodes/bytes/schedules/s-1", headers=ADMIN)
    assert one.content == expected.encode()
    # The policies follow the Go fields, in the model's order.
    assert expected.index('"version":1') < expected.index('"timezone":"Asia/Kolkata"')


def test_a_row_without_policies_is_stored_as_the_go_kit_writes_it(client: httpx.Client) -> None:
    plain = row(params={"threads": 4})
    assert client.put("/api/nodes/plain/schedules/s-1", json=plain,
                      headers=ADMIN).status_code == 200
    pulled = client.get("/api/schedules", params={"node": "plain"}, headers=ADMIN)
    assert pulled.content == (
        b'{"schedules":[{"id":"s-1","name":"nightly","repo_id":"r-9","action":"backup",'
        b'"schedule":{"days":["*"],"hours":["2"],"minute":"30"},"miss_policy":"skip",'
        b'"enabled":true,"params":{"threads":4},"version":1}]}'
    )


def test_putting_a_row_without_a_policy_removes_it(client: httpx.Client) -> None:
    assert client.put("/api/nodes/cleared/schedules/s-1", json=row(**POLICIES),
                      headers=ADMIN).status_code == 200
    without = {key: value for key, value in POLICIES.items() if key not in ("paused", "jitter")}
    second = client.put("/api/nodes/cleared/schedules/s-1", json=row(**without), headers=ADMIN)
    assert second.status_code == 200
    got = client.get("/api/nodes/cleared/schedules/s-1", headers=ADMIN).json()
    assert "paused" not in got and "jitter" not in got
    assert {key: got[key] for key in without} == without and got["version"] == 2


def test_an_agent_pull_caches_the_policies_as_served(
    client: httpx.Client, tmp_path: Path
) -> None:
    assert client.put("/api/nodes/agent-p/schedules/s-1", json=row(**POLICIES),
                      headers=ADMIN).status_code == 200
    cache_path = tmp_path / "cache.json"
    with httpx.Client(headers=ADMIN, timeout=10) as http:
        scheduler = Scheduler(Config(
            pull_url=f"{client.base_url.join('/api/schedules')}?node=agent-p", node_name="agent-p",
            cache_path=cache_path, fire=lambda fire: None, http_client=http))
        result = scheduler.pull(datetime(2026, 12, 3, 7, 0, tzinfo=UTC))
    assert result.added == ["s-1"]
    served = client.get("/api/nodes/agent-p/schedules/s-1", headers=ADMIN).content.decode()
    [cached] = scheduler.schedules()
    assert cached.model_dump_json() == served
    on_disk = cache_path.read_text()
    assert served in on_disk  # the cache file holds the row's bytes as the controller sent them
