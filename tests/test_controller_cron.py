"""Cron tasks at the controller's edges: refused over HTTP when they never match, saved in DST.

The API runs as in ``test_controller_api``: one uvicorn server per module, in a
thread, on a free port, over a temporary SQLite file migrated with the real
migrations.

DST instants used: America/New_York falls back 2026-11-01 02:00 EDT -> 01:00 EST
(06:00 UTC), so 01:00-01:59 happens twice (05:00-05:59 and 06:00-06:59 UTC).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlmodel import Session

from controller import store
from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.models import TaskIn
from controller.server import serve_in_thread

ADMIN_TOKEN = "admin-secret-token-cron-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NY = "America/New_York"


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('cron') / 'controller.db'}"
    migrate(url)
    return url


@pytest.fixture(scope="module")
def base_url(db_url: str) -> Iterator[str]:
    engine = make_engine(db_url)
    try:
        with serve_in_thread(create_app(engine, Tokens(admin=[ADMIN_TOKEN], nodes={}))) as url:
            yield url
    finally:
        engine.dispose()


@pytest.fixture()
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def _only_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert len(detail) == 1, detail
    error: dict[str, Any] = detail[0]
    return error


@pytest.mark.parametrize("expr", ["0 0 30 2 *", "0 0 31 4,6 *"])
def test_a_cron_that_never_matches_is_422_and_keeps_the_last_good_task(
    client: httpx.Client, expr: str
) -> None:
    name = f"t-never-{expr.replace(' ', '_').replace('*', 'x')}"
    good = {"cron": "0 6 * * *", "event": "report"}
    assert client.put(f"/api/tasks/{name}", json=good, headers=ADMIN).status_code == 200
    bad = client.put(f"/api/tasks/{name}", json={**good, "cron": expr}, headers=ADMIN)
    error = _only_error(bad)
    assert error["field"] == "cron"
    assert f"cron expression '{expr}' never matches" in error["msg"]
    assert client.get(f"/api/tasks/{name}", headers=ADMIN).json()["cron"] == "0 6 * * *"


def test_a_new_task_with_a_never_matching_cron_is_not_created(client: httpx.Client) -> None:
    body = {"cron": "0 0 30 2 *", "event": "report"}
    _only_error(client.put("/api/tasks/t-never-new", json=body, headers=ADMIN))
    assert client.get("/api/tasks/t-never-new", headers=ADMIN).status_code == 404


def _nov(day: int, hour: int, minute: int, second: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, second, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "now", "expected"),
    [
        # In the first copy of 01:xx: the next quarter, 01:00 EST.
        ("*/15 1 * * *", _nov(1, 5, 50), _nov(1, 6, 0)),
        # In the second copy: its next five minutes, EST.
        ("*/5 1 * * *", _nov(1, 6, 7), _nov(1, 6, 10)),
        ("* 1 * * *", _nov(1, 5, 59, 30), _nov(1, 6, 0)),
        # A fixed time already fired in the first copy: tomorrow's.
        ("30 1 * * *", _nov(1, 6, 10), _nov(2, 6, 30)),
    ],
)
def test_saving_a_cron_task_in_the_repeated_hour_gives_its_next_run(
    db_url: str, expr: str, now: datetime, expected: datetime
) -> None:
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            task = TaskIn(name=f"t-fall-{expr}", cron=expr, timezone=NY, event="x")
            assert store.save_task(session, task, now=now).next_run_at == expected
    finally:
        engine.dispose()
