"""The fleet API over real HTTP on loopback, on SQLite and on Postgres.

Reports, recorded pulls, fleet and node status, upcoming windows with DST
notes, PATCH (pause with a note, resume), ``_propagation`` in a write's
answer, and the ``sched.schedules.updated`` event on a real Prefect server.
The app's clock is a parameter: each test sets the instant it reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.events import EVENT_SCHEDULES_UPDATED, NO_PREFECT_API, PrefectEvents
from controller.fleet import FleetSettings
from tests.factories import Clock
from tests.fixtures_prefect import agent_events

ADMIN_TOKEN = "admin-secret-token-0123456789"
NODE_A_TOKEN = "node-a-secret-token-abcdef"
NODE_B_TOKEN = "node-b-secret-token-fedcba"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NODE_A = {"Authorization": f"Bearer {NODE_A_TOKEN}"}
NODE_B = {"Authorization": f"Bearer {NODE_B_TOKEN}"}


@dataclass
class Fleet:
    client: httpx.Client
    clock: Clock


@contextmanager
def fleet_app(url: str, clock: Clock, **kwargs: Any) -> Iterator[httpx.Client]:
    from controller.testing import serve_in_thread

    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=[ADMIN_TOKEN],
                    nodes={"node-a": [NODE_A_TOKEN], "node-b": [NODE_B_TOKEN]})
    app = create_app(engine, tokens, clock=clock, **kwargs)
    try:
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield client
    finally:
        app.state.pull_recorder.close()
        engine.dispose()


@pytest.fixture
def fleet(database_url: str) -> Iterator[Fleet]:
    clock = Clock(datetime(2026, 12, 3, 7, 0, tzinfo=UTC))
    settings = FleetSettings(pull_interval=300, report_history=3)
    with fleet_app(database_url, clock, fleet_settings=settings) as client:
        yield Fleet(client, clock)


def row(schedule_id: str, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": schedule_id, "name": f"nightly {schedule_id}", "repo_id": "r-9",
        "action": "backup", "storage": "b2",
        "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
        "miss_policy": "run-once-within-24h", "enabled": True, "params": None,
    }
    data.update(changes)
    return data


def report(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "agent_version": "0.1.0", "timezone": "America/New_York", "grace_s": 300,
        "reported_at": "2026-12-03T07:31:02Z",
        "last_pull": {"at": "2026-12-03T07:31:00Z", "ok": True, "error": None, "status": "200"},
        "schedules": [{"id": "s-1", "last_fired": "2026-12-03T07:30:00Z",
                       "next_planned": "2026-12-04T07:30:00Z",
                       "latest_job": {"state": "Completed", "window": "2026-12-03T07:30:00Z",
                                      "ended_at": "2026-12-03T07:30:41Z", "flow_run_id": "u-1",
                                      "flow_run_name": "backup-s-1-20261203T0730Z"}}],
        "counts": {"skipped": 0, "missed": 0},
    }
    data.update(changes)
    return data


def put(client: httpx.Client, node: str, data: dict[str, Any]) -> httpx.Response:
    return client.put(f"/api/nodes/{node}/schedules/{data['id']}", json=data, headers=ADMIN)


def node_row(client: httpx.Client, node: str) -> dict[str, Any]:
    found = client.get("/api/status", headers=ADMIN).json()["nodes"]
    return next(item for item in found if item["node"] == node)


# -- reports -------------------------------------------------------------------------------


def test_report_auth_validation_and_status(fleet: Fleet) -> None:
    c = fleet.client
    assert put(c, "node-a", row("s-1")).status_code == 200
    assert c.get("/api/status", headers=ADMIN).json()["nodes"][0]["status"] == "never-seen"
    assert c.post("/api/nodes/node-a/report", json=report(), headers=NODE_B).status_code == 403
    assert c.post("/api/nodes/node-a/report", json=report()).status_code == 401
    bad = c.post("/api/nodes/node-a/report", json=report(surprise=1, grace_s="x"),
                 headers=NODE_A)
    assert bad.status_code == 422
    fields = {entry["field"] for entry in bad.json()["detail"]}
    assert {"surprise", "grace_s"} <= fields
    nested = c.post("/api/nodes/node-a/report", headers=NODE_A, json=report(
        schedules=[{"id": "s-1", "latest_job": {"state": "Failed", "oops": 1}}]))
    assert nested.status_code == 422
    assert "schedules.0.latest_job.oops" in {e["field"] for e in nested.json()["detail"]}
    zone = c.post("/api/nodes/node-a/report", json=report(timezone="Mars/Base"), headers=NODE_A)
    assert zone.status_code == 422 and zone.json()["detail"][0]["field"] == "timezone"
    other = c.post("/api/nodes/node-a/report", json=report(node="node-b"), headers=ADMIN)
    assert other.status_code == 422

    assert c.post("/api/nodes/node-a/report", json=report(), headers=NODE_A).status_code == 204
    got = node_row(c, "node-a")
    assert got["last_report_at"] == "2026-12-03T07:00:00Z"  # the controller's clock
    assert got["timezone"] == "America/New_York" and got["agent_version"] == "0.1.0"
    assert got["failing"] is False and got["status"] == "ok"

    failed = report(agent_version="0.2.0")
    failed["schedules"][0]["latest_job"]["state"] = "Crashed"
    assert c.post("/api/nodes/node-a/report", json=failed, headers=ADMIN).status_code == 204
    got = node_row(c, "node-a")
    assert got["failing"] is True and got["status"] == "failing"
    assert got["agent_version"] == "0.2.0"


def test_report_history_is_bounded(fleet: Fleet) -> None:
    c = fleet.client
    put(c, "node-a", row("s-1"))
    for index in range(6):
        job = report()
        job["schedules"][0]["latest_job"]["flow_run_id"] = f"run-{index}"
        assert c.post("/api/nodes/node-a/report", json=job, headers=NODE_A).status_code == 204
    status = c.get("/api/nodes/node-a/status", headers=NODE_A).json()
    recent = status["schedules"][0]["recent_outcomes"]
    # report_history=3: only the three newest reports are kept, newest first.
    assert [job["flow_run_id"] for job in recent] == ["run-5", "run-4", "run-3"]


# -- pulls ---------------------------------------------------------------------------------


def test_pulls_are_recorded_and_staleness(fleet: Fleet) -> None:
    c = fleet.client
    put(c, "node-a", row("s-1"))
    first = c.get("/api/nodes/node-a/schedules", headers=NODE_A)
    assert first.status_code == 200
    etag = first.headers["etag"]
    got = node_row(c, "node-a")
    assert got["last_pull_status"] == "200" and got["last_pull_at"] == "2026-12-03T07:00:00Z"
    assert got["list_version_served"] == got["list_version_current"] == etag.strip('"')
    fleet.clock.now += timedelta(seconds=60)
    again = c.get("/api/schedules?node=node-a", headers={**NODE_A, "If-None-Match": etag})
    assert again.status_code == 304
    got = node_row(c, "node-a")
    assert got["last_pull_status"] == "304" and got["last_pull_at"] == "2026-12-03T07:01:00Z"

    put(c, "node-a", row("s-2"))
    got = node_row(c, "node-a")
    assert got["list_version_served"] != got["list_version_current"]
    status = c.get("/api/status", headers=ADMIN).json()
    assert status["stale_after_s"] == 900
    assert status["list_versions"]["node-a"] == got["list_version_current"]

    # An admin reading the node's list is not the node: nothing is recorded.
    fleet.clock.now += timedelta(seconds=600)
    assert c.get("/api/nodes/node-a/schedules", headers=ADMIN).status_code == 200
    assert c.get("/api/schedules?node=node-a", headers=ADMIN).status_code == 200
    got = node_row(c, "node-a")
    assert got["last_pull_at"] == got["last_seen_at"] == "2026-12-03T07:01:00Z"
    # No heartbeat announced (an older agent): silent after 3 pull intervals (900 s).
    assert got["silent_after_s"] == 900 and got["heartbeat_s"] is None
    fleet.clock.now += timedelta(seconds=300)
    assert node_row(c, "node-a")["status"] == "ok"
    fleet.clock.now += timedelta(seconds=1)
    got = node_row(c, "node-a")
    assert got["stale"] is True and got["silent"] is True and got["status"] == "silent"
    assert c.get("/api/status", headers=NODE_A).status_code == 403


# -- node status and upcoming --------------------------------------------------------------


def test_node_status_next_windows_with_dst_notes(fleet: Fleet) -> None:
    c = fleet.client
    fleet.clock.now = datetime(2026, 3, 7, 12, 0, tzinfo=UTC)
    put(c, "node-a", row("s-1", schedule={"days": ["sun"], "hours": ["2"], "minute": "30"}))
    put(c, "node-a", row("s-2", schedule={"days": ["*"], "hours": ["*"], "minute": "15"},
                         enabled=False))
    c.post("/api/nodes/node-a/report", json=report(), headers=NODE_A)
    status = c.get("/api/nodes/node-a/status", headers=NODE_A)
    assert status.status_code == 200
    body = status.json()
    assert body["node"] == "node-a" and body["timezone"] == "America/New_York"
    first, second = body["schedules"]
    assert first["when"] == "Sun at 02:30" and first["miss_policy"] == "run-once-within-24h"
    assert first["last_fire"] == "2026-12-03T07:30:00Z"
    assert first["last_outcome"]["state"] == "Completed"
    windows = first["next_windows"]
    assert len(windows) == 10
    # 2026-03-08 02:30 does not exist in New York: the kit runs it at 03:00 EDT (07:00Z).
    assert windows[0]["at"] == "2026-03-08T07:00:00Z"
    assert windows[0]["local"] == "Sun 2026-03-08 03:00 EDT"
    assert "does not exist" in windows[0]["note"]
    assert windows[1] == {"at": "2026-03-15T06:30:00Z", "local": "Sun 2026-03-15 02:30 EDT",
                          "note": ""}
    assert windows[9]["at"] == "2026-05-10T06:30:00Z"
    assert second["enabled"] is False and second["next_windows"] == []
    assert c.get("/api/nodes/node-a/status", headers=NODE_B).status_code == 403
    assert c.get("/api/nodes/nowhere/status", headers=ADMIN).status_code == 404


def test_node_status_row_timezone(fleet: Fleet) -> None:
    c = fleet.client
    put(c, "node-b", row("tokyo", timezone="Asia/Tokyo"))
    windows = c.get("/api/nodes/node-b/status", headers=ADMIN).json()["schedules"][0]
    # The node never reported: its zone is the default, but the row has its own.
    assert windows["next_windows"][0]["local"] == "Fri 2026-12-04 02:30 JST"
    assert windows["next_windows"][0]["at"] == "2026-12-03T17:30:00Z"


def test_upcoming_in_order_across_the_fleet(fleet: Fleet) -> None:
    c = fleet.client
    put(c, "node-a", row("a-1", schedule={"days": ["*"], "hours": ["3"], "minute": "0"}))
    put(c, "node-b", row("b-1", schedule={"days": ["*"], "hours": ["*"], "minute": "0"},
                         timezone="Europe/Paris"))
    put(c, "node-b", row("b-2", schedule={"days": ["*"], "hours": ["4"], "minute": "0"},
                         paused={"note": "disk swap", "until": "2026-12-10T00:00:00Z"}))
    answer = c.get("/api/upcoming?hours=24", headers=ADMIN)
    assert answer.status_code == 200
    windows = answer.json()["windows"]
    assert [w["at"] for w in windows] == sorted(w["at"] for w in windows)
    by_id: dict[str, list[dict[str, Any]]] = {}
    for item in windows:
        by_id.setdefault(item["schedule_id"], []).append(item)
    assert len(by_id["b-1"]) == 24 and by_id["b-1"][0]["timezone"] == "Europe/Paris"
    assert by_id["a-1"] == [{
        "node": "node-a", "schedule_id": "a-1", "name": "nightly a-1", "action": "backup",
        "at": "2026-12-03T08:00:00Z", "local": "Thu 2026-12-03 03:00 EST",
        "timezone": "America/New_York", "note": "", "paused": False,
    }]
    (paused,) = by_id["b-2"]
    assert paused["paused"] is True and "disk swap" in paused["note"]
    only = c.get("/api/upcoming?hours=24&node=node-a", headers=NODE_A).json()["windows"]
    assert {w["node"] for w in only} == {"node-a"}
    assert c.get("/api/upcoming?hours=24", headers=NODE_A).status_code == 403
    assert c.get("/api/upcoming?node=node-b", headers=NODE_A).status_code == 403
    assert c.get("/api/upcoming?hours=0", headers=ADMIN).status_code == 422


# -- PATCH and propagation -----------------------------------------------------------------


def test_patch_pause_resume_and_propagation(fleet: Fleet) -> None:
    c = fleet.client
    created = put(c, "node-a", row("s-1", params={"threads": 4, "tag": "x"})).json()
    assert created["version"] == 1
    prop = created["_propagation"]
    assert prop["event_sent"] is False and NO_PREFECT_API in prop["reason"]
    assert prop["next_window"] == "2026-12-03T07:30:00Z"
    assert prop["next_window_local"] == "Thu 2026-12-03 02:30 EST"
    assert prop["likely_in_time"] is False and "never made a request" in prop["reason"]
    assert prop["node_silent"] is True

    # The node pulled a minute ago; its next periodic pull (300 s) comes before 07:30.
    c.get("/api/nodes/node-a/schedules", headers=NODE_A)
    fleet.clock.now += timedelta(seconds=60)
    url = "/api/nodes/node-a/schedules/s-1"
    paused = c.patch(url, json={"paused": {"note": "disk swap", "until": None},
                                "params": {"tag": None}}, headers=ADMIN)
    assert paused.status_code == 200, paused.text
    body = paused.json()
    assert body["version"] == 2 and body["paused"] == {"note": "disk swap"}  # wire: no until
    assert body["params"] == {"threads": 4}  # RFC 7386: null removes the member
    assert body["name"] == "nightly s-1"
    assert body["_propagation"]["next_window"] is None
    assert "paused until resumed (disk swap)" in body["_propagation"]["reason"]
    stored = c.get(url, headers=NODE_A).json()
    assert stored["paused"]["note"] == "disk swap" and "_propagation" not in stored
    shown = c.get("/api/nodes/node-a/status", headers=ADMIN).json()["schedules"][0]
    assert shown["paused"]["note"] == "disk swap" and shown["paused"].get("until") is None
    assert shown["next_windows"] == []

    resumed = c.patch(url, json={"paused": None}, headers=ADMIN).json()
    assert resumed["version"] == 3 and "paused" not in resumed
    assert resumed["_propagation"]["likely_in_time"] is True
    assert "pulls every 300 s" in resumed["_propagation"]["reason"]

    typo = c.put(url, json={**row("s-1"), "pasued": {"note": "x"}, "colour": 1}, headers=ADMIN)
    assert typo.status_code == 422
    assert [e["field"] for e in typo.json()["detail"]] == ["colour", "pasued"]
    unknown = c.patch(url, json={"pasued": None, "enabled": False}, headers=ADMIN)
    assert unknown.status_code == 422
    assert unknown.json()["detail"][0]["field"] == "pasued"
    invalid = c.patch(url, json={"schedule": {"minute": "61"}}, headers=ADMIN)
    assert invalid.status_code == 422 and "schedule" in invalid.json()["detail"][0]["field"]
    renamed = c.patch(url, json={"id": "other"}, headers=ADMIN)
    assert renamed.status_code == 422
    assert c.get(url, headers=ADMIN).json()["version"] == 3  # nothing refused was kept
    assert c.patch(url, json={"enabled": False}, headers=NODE_A).status_code == 403
    assert c.patch("/api/nodes/node-a/schedules/nope", json={}, headers=ADMIN).status_code == 404


def test_writes_send_prefect_events(database_url: str, prefect_server: str) -> None:
    clock = Clock(datetime.now(UTC))
    # A write waits 2 s for its event by default; a loaded machine (CI's is shared) may take
    # longer to import Prefect's client and send: the event is the point here, not how fast.
    events = PrefectEvents(prefect_server, wait_s=20)
    node = f"ev-{database_url[:6].strip(':/')}"
    tokens_node = node  # admin writes; the node name is unique per database
    try:
        with fleet_app(database_url, clock, events=events) as c:
            answer = put(c, tokens_node, row("s-1"))
            assert answer.status_code == 200
            assert answer.json()["_propagation"]["event_sent"] is True
            patched = c.patch(f"/api/nodes/{node}/schedules/s-1", json={"enabled": False},
                              headers=ADMIN)
            assert patched.json()["_propagation"]["event_sent"] is True
            assert c.delete(f"/api/nodes/{node}/schedules/s-1", headers=ADMIN).status_code == 204
    finally:
        events.close()
    found = agent_events(EVENT_SCHEDULES_UPDATED, node, lambda got: len(got) >= 3)
    payloads = sorted((e["payload"]["op"], e["payload"]["version"]) for e in found)
    assert payloads == [("delete", None), ("patch", 2), ("put", 1)], found
    assert {e["resource"]["prefect.resource.name"] for e in found} == {node}
    assert {e["payload"]["schedule_id"] for e in found} == {"s-1"}


def test_unreachable_prefect_never_fails_a_write(sqlite_url: str) -> None:
    clock = Clock(datetime(2026, 12, 3, 7, 0, tzinfo=UTC))
    events = PrefectEvents("http://127.0.0.1:9/api", wait_s=5)
    try:
        with fleet_app(sqlite_url, clock, events=events) as c:
            answer = put(c, "node-a", row("s-1"))
            assert answer.status_code == 200
            prop = answer.json()["_propagation"]
            assert prop["event_sent"] is False
            assert "http://127.0.0.1:9/api" in prop["reason"]
    finally:
        events.close()


def test_concurrent_patches_are_never_lost(fleet: Fleet) -> None:
    """Each PATCH re-reads and re-applies itself when another write won: all are kept."""
    from concurrent.futures import ThreadPoolExecutor

    c = fleet.client
    put(c, "node-a", row("s-1", params={"base": 0}))
    url = "/api/nodes/node-a/schedules/s-1"

    def patch(index: int) -> int:
        with httpx.Client(base_url=str(c.base_url), timeout=60) as own:
            return own.patch(url, json={"params": {f"k{index}": index}}, headers=ADMIN).status_code

    with ThreadPoolExecutor(max_workers=4) as pool:
        codes = list(pool.map(patch, range(8)))
    assert codes == [200] * 8
    stored = c.get(url, headers=ADMIN).json()
    assert stored["params"] == {"base": 0, **{f"k{i}": i for i in range(8)}}
    assert stored["version"] == 9
