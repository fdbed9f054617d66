"""The operator's morning over real HTTP: job records, liveness, ``GET /api/report``.

A real controller (``create_app`` served by uvicorn on loopback) on SQLite and on
Postgres; nodes post their reports with their own tokens as an agent does, and
the test moves the controller's clock (the app's ``clock`` parameter).

The fleet: three nodes in New York, each with a nightly backup ``bk`` at 02:30
(07:30Z in December); node-a also copies every 6 h (``cp``: 00:00, 06:00,
12:00, 18:00 local). The rows are written on 2026-12-03 at 12:00Z; the morning
is read on Friday 2026-12-04 at 12:00Z (07:00 EST), so the default range starts
on Thursday at 18:00 EST (23:00Z).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.fleet import FleetSettings
from controller.testing import fast_reports, serve_in_thread
from tests.factories import Clock

ADMIN = {"Authorization": "Bearer morning-admin-token"}
NODES = ("node-a", "node-b", "node-c")
TOKENS = {node: {"Authorization": f"Bearer {node}-token-0123"} for node in NODES}
WRITTEN = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
MORNING = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
BK_WINDOW = "2026-12-04T07:30:00Z"
BK_KEY = "bk@2026-12-04T02:30-05:00"


@contextmanager
def controller(url: str, clock: Clock, **settings: Any) -> Iterator[httpx.Client]:
    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=["morning-admin-token"],
                    nodes={node: [f"{node}-token-0123"] for node in NODES})
    app = create_app(engine, tokens, clock=clock, report_rate=fast_reports(),
                     fleet_settings=FleetSettings(pull_interval=300, **settings))
    try:
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield client
    finally:
        engine.dispose()


def row(rid: str, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": rid, "name": f"nightly {rid}", "repo_id": "r-1", "action": "backup",
        "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
        "miss_policy": "run-once-within-24h", "enabled": True, "params": None}
    data.update(changes)
    return data


def report(node: str, jobs: list[dict[str, Any]] | None = None, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "node": node, "agent_version": "0.2.0", "timezone": "America/New_York",
        "grace_s": 300, "reported_at": "2026-12-04T07:31:00Z", "schedules": [],
        "heartbeat_s": 60, "jobs": jobs or []}
    data.update(changes)
    return data


def job(key: str, state: str, seq: int, **changes: Any) -> dict[str, Any]:
    schedule_id = key.split("@")[0]
    data: dict[str, Any] = {
        "key": key, "schedule_id": schedule_id, "window": BK_WINDOW, "trigger_key": "schedule",
        "state": state, "started_at": "2026-12-04T07:30:01Z",
        "ended_at": None if state == "Running" else "2026-12-04T07:34:21Z",
        "error": None, "reason": None, "offline": False,
        "flow_run_id": "0b7c2b0f-1a11-4a3b-8f53-9b2f64c60d4e", "seq": seq}
    data.update(changes)
    return data


def post(client: httpx.Client, node: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    return client.post(f"/api/nodes/{node}/report", json=body,
                       headers=headers or TOKENS[node])


def status_of(client: httpx.Client, node: str) -> dict[str, Any]:
    found = client.get("/api/status", headers=ADMIN).json()["nodes"]
    return next(item for item in found if item["node"] == node)


@pytest.fixture
def clock() -> Clock:
    return Clock(WRITTEN)


@pytest.fixture
def fleet(database_url: str, clock: Clock) -> Iterator[httpx.Client]:
    with controller(database_url, clock) as client:
        yield client


# -- job records ---------------------------------------------------------------------------


def test_job_records_a_later_seq_replaces_an_older_or_equal_one_changes_nothing(
    fleet: httpx.Client, clock: Clock,
) -> None:
    assert fleet.put("/api/nodes/node-a/schedules/bk", json=row("bk"),
                     headers=ADMIN).status_code == 200
    clock.now = datetime(2026, 12, 4, 7, 31, tzinfo=UTC)
    assert post(fleet, "node-a", report("node-a", [job(BK_KEY, "Running", 7)])).status_code == 204
    clock.now = datetime(2026, 12, 4, 7, 35, tzinfo=UTC)
    done = job(BK_KEY, "Completed", 8, offline=True)
    assert post(fleet, "node-a", report("node-a", [done])).status_code == 204
    # A lost answer: the node sends both again; neither the old nor the same seq changes it.
    again = [job(BK_KEY, "Running", 7), job(BK_KEY, "Failed", 8, error="late copy")]
    assert post(fleet, "node-a", report("node-a", again)).status_code == 204
    clock.now = MORNING
    got = fleet.get("/api/report", params={"node": "node-a"}, headers=ADMIN).json()
    (entry,) = [w for w in got["nodes"][0]["windows"] if w["key"] == BK_KEY]
    assert entry["status"] == "completed" and entry["state"] == "Completed"
    assert entry["offline"] is True and entry["duration_s"] == 260
    assert entry["detail"] == "Completed in 4 min 20 s (ran offline, recorded later)"
    # Within one report the highest seq counts, whatever the order.
    both = [job(BK_KEY, "Failed", 10, error="\n tar exited with code 2\nusage: ..."),
            job(BK_KEY, "Running", 9)]
    assert post(fleet, "node-a", report("node-a", both)).status_code == 204
    got = fleet.get("/api/report", params={"node": "node-a"}, headers=ADMIN).json()
    (entry,) = [w for w in got["nodes"][0]["windows"] if w["key"] == BK_KEY]
    assert (entry["status"], entry["error"]) == ("failed", "tar exited with code 2")
    # A long error line is cut, not refused: a refused report would block the node's next.
    long = job(BK_KEY, "Failed", 11, error="x" * 5000)
    assert post(fleet, "node-a", report("node-a", [long])).status_code == 204
    got = fleet.get("/api/report", params={"node": "node-a"}, headers=ADMIN).json()
    (entry,) = [w for w in got["nodes"][0]["windows"] if w["key"] == BK_KEY]
    assert len(entry["error"]) == 1000 and entry["error"].endswith("\u2026")


def test_bad_job_records_and_times_out_of_range_are_422_naming_the_field(
    fleet: httpx.Client,
) -> None:
    def refused(body: dict[str, Any]) -> set[str]:
        answer = post(fleet, "node-a", body)
        assert answer.status_code == 422, answer.text
        return {entry["field"] for entry in answer.json()["detail"]}

    assert refused(report("node-a", reported_at="9999-12-31T23:59:59-14:00")) == {"reported_at"}
    assert refused(report("node-a", [job(BK_KEY, "Completed", 1,
                                         started_at="0001-01-01T00:00:00+14:00")])) == {
        "jobs.0.started_at"}
    assert refused(report("node-a", [job(BK_KEY, "Running", 1,
                                         ended_at="2026-12-04T07:34:21Z")])) == {"jobs.0"}
    assert refused(report("node-a", [job("other@2026-12-04T02:30-05:00", "Completed", 1,
                                         schedule_id="bk")])) == {"jobs.0"}
    assert refused(report("node-a", [job(BK_KEY, "Done", 1)])) == {"jobs.0.state"}
    assert refused(report("node-a", [job(BK_KEY, "Completed", -1)])) == {"jobs.0.seq"}
    assert refused(report("node-a", [job(BK_KEY, "Completed", 1, extra=1)])) == {
        "jobs.0.extra"}
    assert refused(report("node-a", [job(BK_KEY, "Completed", 1, offline="yes")])) == {
        "jobs.0.offline"}
    assert refused(report("node-a", [job(BK_KEY, "Failed", 1, error=2)])) == {"jobs.0.error"}
    assert refused(report("node-a", heartbeat_s=5)) == {"heartbeat_s"}
    assert refused(report("node-a", heartbeat_s=3601)) == {"heartbeat_s"}
    many = [job(f"bk@manual@{n}", "Completed", n, window=None) for n in range(1001)]
    assert refused(report("node-a", many)) == {"jobs"}
    # Nothing refused was stored: the node is still unknown.
    assert fleet.get("/api/status", headers=ADMIN).json()["nodes"] == []


def test_a_refused_report_keeps_a_known_node_alive(fleet: httpx.Client, clock: Clock) -> None:
    """A node whose outbox holds a record the controller refuses re-sends it: still alive."""
    assert fleet.get("/api/schedules", params={"node": "node-a"},
                     headers=TOKENS["node-a"]).status_code == 200
    clock.now = WRITTEN + timedelta(minutes=14)
    bad = report("node-a", [job(BK_KEY, "Completed", 1, started_at="2026-12-04T07:30:01")])
    assert post(fleet, "node-a", bad).status_code == 422
    (only,) = fleet.get("/api/status", headers=ADMIN).json()["nodes"]
    assert (only["status"], only["last_seen_via"]) == ("ok", "report")
    assert only["last_seen_at"] == "2026-12-03T12:14:00Z" and only["last_report_at"] is None
    # The admin's refused report is no sign of the node's life.
    clock.now += timedelta(minutes=10)
    assert post(fleet, "node-a", bad, headers=ADMIN).status_code == 422
    assert status_of(fleet, "node-a")["last_seen_at"] == "2026-12-03T12:14:00Z"


def test_the_job_history_is_bounded_per_node(database_url: str, clock: Clock) -> None:
    with controller(database_url, clock, job_history=3) as fleet:
        fleet.put("/api/nodes/node-a/schedules/bk", json=row("bk"), headers=ADMIN)
        for n in range(5):
            clock.now = WRITTEN + timedelta(minutes=n + 1)
            body = report("node-a", [job(f"bk@manual@run-{n}", "Completed", n, window=None,
                                         started_at=f"2026-12-03T12:0{n}:00Z",
                                         ended_at=f"2026-12-03T12:0{n}:30Z")])
            assert post(fleet, "node-a", body).status_code == 204
        got = fleet.get("/api/report", params={"node": "node-a",
                                               "since": "2026-12-03T11:00:00Z"},
                        headers=ADMIN).json()
        keys = [w["key"] for w in got["nodes"][0]["windows"]]
        assert keys == ["bk@manual@run-2", "bk@manual@run-3", "bk@manual@run-4"]


# -- liveness ------------------------------------------------------------------------------


def test_liveness_comes_from_the_nodes_own_requests_and_its_heartbeat(
    fleet: httpx.Client, clock: Clock,
) -> None:
    fleet.put("/api/nodes/node-a/schedules/bk", json=row("bk"), headers=ADMIN)
    # The admin reads the node's list and posts a report for it: the node is still unseen.
    assert fleet.get("/api/nodes/node-a/schedules", headers=ADMIN).status_code == 200
    assert post(fleet, "node-a", report("node-a"), headers=ADMIN).status_code == 204
    got = status_of(fleet, "node-a")
    assert got["status"] == "never-seen" and got["last_seen_at"] is None
    assert got["last_pull_at"] is None
    # Its own pull: seen; no heartbeat announced yet, so silent after 900 s.
    assert fleet.get("/api/schedules", params={"node": "node-a"},
                     headers=TOKENS["node-a"]).status_code == 200
    got = status_of(fleet, "node-a")
    assert (got["status"], got["last_seen_via"], got["silent_after_s"]) == ("ok", "pull", 900)
    # Its own report announces 60 s: silent after 180 s without a request.
    clock.now += timedelta(seconds=30)
    assert post(fleet, "node-a", report("node-a")).status_code == 204
    got = status_of(fleet, "node-a")
    assert (got["heartbeat_s"], got["silent_after_s"], got["last_seen_via"]) == (60, 180,
                                                                                  "report")
    clock.now += timedelta(seconds=180)
    assert status_of(fleet, "node-a")["status"] == "ok"
    clock.now += timedelta(seconds=1)
    got = status_of(fleet, "node-a")
    assert got["status"] == "silent" and got["stale"] is True
    # A write's answer says so instead of promising a pull.
    answer = fleet.put("/api/nodes/node-a/schedules/bk", json=row("bk"), headers=ADMIN).json()
    prop = answer["_propagation"]
    assert prop["node_silent"] is True and prop["likely_in_time"] is False
    assert prop["reason"].startswith("node node-a is silent: no request of its own for 3 min 1 s")
    assert "it promised one every 1 min" in prop["reason"]
    # Another node's token is refused; the admin's read never revives it.
    assert fleet.get("/api/schedules", params={"node": "node-a"},
                     headers=TOKENS["node-b"]).status_code == 403
    fleet.get("/api/nodes/node-a/schedules", headers=ADMIN)
    assert status_of(fleet, "node-a")["status"] == "silent"
    assert fleet.get("/api/nodes/node-a/schedules", headers=TOKENS["node-a"]).status_code == 200
    assert status_of(fleet, "node-a")["status"] == "ok"


# -- the report ----------------------------------------------------------------------------


def morning_fleet(fleet: httpx.Client, clock: Clock) -> None:
    """Rows at WRITTEN; node-a completes, node-b fails, node-c never shows up."""
    for node in NODES:
        assert fleet.put(f"/api/nodes/{node}/schedules/bk", json=row("bk"),
                         headers=ADMIN).status_code == 200
    assert fleet.put("/api/nodes/node-a/schedules/cp", headers=ADMIN, json=row(
        "cp", action="copy", schedule={"interval_minutes": 360})).status_code == 200
    cp = ["cp@2026-12-03T18:00-05:00", "cp@2026-12-04T00:00-05:00", "cp@2026-12-04T06:00-05:00"]
    cp_at = ["2026-12-03T23:00:00Z", "2026-12-04T05:00:00Z", "2026-12-04T11:00:00Z"]
    clock.now = MORNING - timedelta(seconds=30)
    a_jobs = [job(BK_KEY, "Completed", 1),
              job(cp[0], "Completed", 2, window=cp_at[0], started_at=cp_at[0],
                  ended_at="2026-12-03T23:01:00Z", offline=True),
              job(cp[1], "Skipped", 3, window=cp_at[1], started_at=None, ended_at=None,
                  reason="window 2026-12-04 00:00 EST missed: 14 min late (grace 5 min); "
                         "miss policy skip"),
              job(cp[2], "Running", 4, window=cp_at[2], started_at=cp_at[2]),
              job("bk@manual@6f1c", "Completed", 5, window=None, trigger_key="manual",
                  started_at="2026-12-04T09:00:00Z", ended_at="2026-12-04T09:00:05Z")]
    assert post(fleet, "node-a", report("node-a", a_jobs)).status_code == 204
    b_jobs = [job(BK_KEY, "Failed", 1, error="tar exited with code 2")]
    assert post(fleet, "node-b", report("node-b", b_jobs)).status_code == 204
    clock.now = MORNING


def test_the_morning_report_every_window_worst_first_with_the_summary(
    fleet: httpx.Client, clock: Clock,
) -> None:
    morning_fleet(fleet, clock)
    answer = fleet.get("/api/report", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    # Each node counted once (node-c silent, its missed window beside it), one schedule's
    # failures as one item: the counts add up to the 3 nodes.
    assert got["summary"]["text"] == (
        "1 of 3 nodes backed up (each schedule's latest window completed); "
        "1 failing: node-b bk failed 1 window since 2026-12-04 02:30 EST, last: tar exited "
        "with code 2; 0 missed; 1 silent: node-c (bk missed 1)")
    assert (got["summary"]["backed_up"], got["summary"]["failing"],
            got["summary"]["silent"]) == (["node-a"], ["node-b"], ["node-c"])
    assert [n["node"] for n in got["nodes"]] == ["node-c", "node-b", "node-a"]
    c, b, a = got["nodes"]
    assert c["since"] == "2026-12-03T23:00:00Z"  # Thursday 18:00 EST
    (missed,) = c["windows"]
    assert (missed["key"], missed["status"], missed["window"]) == (BK_KEY, "missed", BK_WINDOW)
    assert missed["local"] == "2026-12-04 02:30 EST"
    assert missed["detail"] == ("missed: no report from the node (node node-c has never made "
                                "a request to this controller with its own token)")
    assert c["silent"] is True
    (failed,) = b["windows"]
    assert (failed["status"], failed["error"]) == ("failed", "tar exited with code 2")
    assert [(w["key"], w["status"], w["expected"]) for w in a["windows"]] == [
        ("cp@2026-12-03T18:00-05:00", "completed", True),
        ("cp@2026-12-04T00:00-05:00", "skipped", True),
        (BK_KEY, "completed", True),
        ("bk@manual@6f1c", "completed", False),
        ("cp@2026-12-04T06:00-05:00", "running", True),
    ]
    assert a["windows"][0]["detail"] == "Completed in 1 min (ran offline, recorded later)"
    assert "miss policy skip" in a["windows"][1]["detail"]
    assert a["counts"]["completed"] == 3 and a["silent"] is False
    # One node, and a node token for its own node only.
    own = fleet.get("/api/report", params={"node": "node-b"}, headers=TOKENS["node-b"])
    assert own.status_code == 200 and [n["node"] for n in own.json()["nodes"]] == ["node-b"]
    assert fleet.get("/api/report", headers=TOKENS["node-b"]).status_code == 403
    assert fleet.get("/api/report", params={"node": "node-a"},
                     headers=TOKENS["node-b"]).status_code == 403


def test_a_missed_window_shows_due_until_its_grace_and_slack_have_passed(
    fleet: httpx.Client, clock: Clock,
) -> None:
    fleet.put("/api/nodes/node-c/schedules/bk", json=row("bk"), headers=ADMIN)
    window = datetime(2026, 12, 4, 7, 30, tzinfo=UTC)
    # Grace 300 s (the default, node-c never reported), then 60 s for the report to arrive.
    for after, status in ((0, "due"), (359, "due"), (360, "missed")):
        clock.now = window + timedelta(seconds=after)
        got = fleet.get("/api/report", params={"node": "node-c"}, headers=ADMIN).json()
        (entry,) = got["nodes"][0]["windows"]
        assert entry["status"] == status, after
        assert entry["missed_after"] == "2026-12-04T07:36:00Z"


def test_windows_before_the_row_existed_or_paused_at_the_time_are_not_missed(
    fleet: httpx.Client, clock: Clock,
) -> None:
    # Written Thursday 12:00Z: the window of Thursday 02:30 EST is before it.
    fleet.put("/api/nodes/node-c/schedules/bk", json=row("bk"), headers=ADMIN)
    # Paused on Friday from 07:00Z to 08:00Z: its 07:30Z window was paused then.
    clock.now = datetime(2026, 12, 4, 7, 0, tzinfo=UTC)
    assert fleet.patch("/api/nodes/node-c/schedules/bk", headers=ADMIN,
                       json={"paused": {"note": "disk swap"}}).status_code == 200
    clock.now = datetime(2026, 12, 4, 8, 0, tzinfo=UTC)
    assert fleet.patch("/api/nodes/node-c/schedules/bk", headers=ADMIN,
                       json={"paused": None}).status_code == 200
    clock.now = MORNING
    got = fleet.get("/api/report", params={"node": "node-c", "since": "2026-12-02T00:00:00Z"},
                    headers=ADMIN).json()
    (node,) = got["nodes"]
    assert node["windows"] == []
    assert node["held"] == [{"schedule_id": "bk", "count": 1, "first": BK_WINDOW,
                             "reason": "paused: disk swap (until resumed)"}]
    # A row written 20 s before its window: the node could not have had it.
    clock.now = datetime(2026, 12, 4, 15, 29, 40, tzinfo=UTC)
    fleet.put("/api/nodes/node-c/schedules/late", headers=ADMIN, json=row(
        "late", schedule={"days": ["*"], "hours": ["10"], "minute": "30"}))
    clock.now = datetime(2026, 12, 5, 15, 40, tzinfo=UTC)
    got = fleet.get("/api/report", params={"node": "node-c", "since": "2026-12-04T12:00:00Z"},
                    headers=ADMIN).json()
    # Its first window (Friday 10:30 EST) is not held against the node; the next day's is.
    assert [(w["key"], w["status"]) for w in got["nodes"][0]["windows"]] == [
        ("bk@2026-12-05T02:30-05:00", "missed"), ("late@2026-12-05T10:30-05:00", "missed")]


def test_report_query_times_are_checked(fleet: httpx.Client) -> None:
    def refused(**params: str) -> str:
        answer = fleet.get("/api/report", params=params, headers=ADMIN)
        assert answer.status_code == 422, answer.text
        (entry,) = answer.json()["detail"]
        return f"{entry['field']}: {entry['msg']}"

    assert "out of range in UTC" in refused(since="0001-01-01T00:00:00+14:00")
    assert "has no UTC offset" in refused(since="2026-12-04T00:00")
    assert refused(since="2026-12-05T00:00:00Z", until="2026-12-04T00:00:00Z") == (
        "since: since must be before until (or now)")
    assert "longer than 31 days" in refused(since="2026-10-01T00:00:00Z",
                                            until="2026-12-04T00:00:00Z")
    assert fleet.get("/api/report", headers={}).status_code == 401


def test_an_agent_that_reports_no_jobs_is_unreported_not_missed(
    fleet: httpx.Client, clock: Clock,
) -> None:
    """A node seen (its own pulls and reports) with no heartbeat announced: an older agent."""
    fleet.put("/api/nodes/node-b/schedules/bk", json=row("bk"), headers=ADMIN)
    clock.now = MORNING
    assert fleet.get("/api/schedules", params={"node": "node-b"},
                     headers=TOKENS["node-b"]).status_code == 200
    old = report("node-b")
    del old["heartbeat_s"], old["jobs"]
    assert post(fleet, "node-b", old).status_code == 204
    got = fleet.get("/api/report", headers=ADMIN).json()
    (entry,) = got["nodes"][0]["windows"]
    assert (entry["key"], entry["status"]) == (BK_KEY, "unreported")
    assert got["summary"]["text"] == ("0 of 1 nodes backed up (each schedule's latest "
                                      "window completed); 0 failing; "
                                      "0 missed; 1 unreported (an agent that reports no "
                                      "jobs): node-b")
    # Once it announces a heartbeat, it reports its jobs: the window without one is missed.
    assert post(fleet, "node-b", report("node-b")).status_code == 204
    got = fleet.get("/api/report", headers=ADMIN).json()
    assert got["nodes"][0]["windows"][0]["status"] == "missed"


def test_until_without_since_reads_the_evening_before_until(
    fleet: httpx.Client, clock: Clock,
) -> None:
    morning_fleet(fleet, clock)
    clock.now = MORNING + timedelta(days=3)
    got = fleet.get("/api/report", params={"node": "node-b", "until": "2026-12-04T12:00:00Z"},
                    headers=ADMIN).json()
    (node,) = got["nodes"]
    assert node["since"] == "2026-12-03T23:00:00Z"
    assert [(w["key"], w["status"]) for w in node["windows"]] == [(BK_KEY, "failed")]


def test_an_error_with_control_or_bidi_characters_is_cleaned_not_refused(
    fleet: httpx.Client, clock: Clock,
) -> None:
    """The kit's text rule holds for what is stored and shown, and no record blocks a node."""
    fleet.put("/api/nodes/node-a/schedules/bk", json=row("bk"), headers=ADMIN)
    clock.now = MORNING
    odd = job(BK_KEY, "Failed", 1, error="tar: \x1b[31mdisk\u202e full\x07",
              reason=None)
    assert post(fleet, "node-a", report("node-a", [odd])).status_code == 204
    got = fleet.get("/api/report", params={"node": "node-a"}, headers=ADMIN).json()
    (entry,) = got["nodes"][0]["windows"]
    assert entry["error"] == "tar: \ufffd[31mdisk\ufffd full\ufffd"


def _window(sid: str, status: str, hour: int, *, error: str | None = None) -> dict[str, Any]:
    """A window entry of the report as summary() reads it."""
    at = f"2026-12-04T{hour:02d}:03:00Z"
    return {"schedule_id": sid, "status": status, "expected": True, "window": at,
            "started_at": at, "local": f"2026-12-04 {hour - 5:02d}:03 EST",
            "key": f"{sid}@{at}", "error": error,
            "state": {"failed": "Failed", "completed": "Completed"}.get(status, status)}


def test_the_summary_judges_each_schedule_by_its_latest_window_and_groups_repeats() -> None:
    from controller.morning import summary

    failing = [_window("r-10-backup", "failed", 13, error="restic exited with code 1: Fatal"),
               _window("r-10-backup", "failed", 14, error="restic exited with code 1: Fatal"),
               _window("r-10-backup", "failed", 15, error="restic exited with code 1: gone")]
    recovered = [_window("bk", "failed", 13, error="tar exited with code 2"),
                 _window("bk", "completed", 14), _window("cp", "completed", 14)]
    running = [{**_window("bk", "completed", 13)}, {**_window("bk", "running", 14)}]
    nodes = [{"node": "node-a", "silent": False, "windows": failing},
             {"node": "node-b", "silent": False, "windows": recovered},
             {"node": "node-c", "silent": False, "windows": running},
             {"node": "node-d", "silent": False, "windows": [_window("bk", "due", 15)]}]
    got = summary(nodes)
    assert got["text"] == (
        "2 of 4 nodes backed up (each schedule's latest window completed); 1 failing: node-a "
        "r-10-backup failed 3 windows since 2026-12-04 08:03 EST, last: restic exited with "
        "code 1: gone; 0 missed; 1 with nothing ended yet: node-d; 1 recovered: node-b bk "
        "(failed 1, then completed)")
    # The counts add up to the nodes; a window still running keeps its schedule's last end.
    assert (got["backed_up"], got["failing"], got["missing"], got["pending"]) == (
        ["node-b", "node-c"], ["node-a"], [], ["node-d"])
    assert len(got["backed_up"]) + len(got["failing"]) + len(got["missing"]) + len(
        got["pending"]) + len(got["silent"]) == got["nodes"] == 4
    (item,) = got["failed"]
    assert (item["windows"], item["since"], item["error"]) == (
        3, "2026-12-04T13:03:00Z", "restic exited with code 1: gone")


def test_storing_job_records_counts_what_changed_on_either_database(session: Any) -> None:
    """The records go in as one statement with 450 parameter sets (more than SQLite's bound
    parameters allow in one VALUES): each new key counts, a re-send counts nothing, a later
    seq counts again ([sqlite] and [postgres])."""
    from controller.jobs import JobKeep, store_jobs
    from controller.report_in import JobRecordIn

    at = datetime(2026, 12, 7, 2, 30, tzinfo=UTC)

    def records(seq: int, count: int) -> list[JobRecordIn]:
        return [JobRecordIn.model_validate({
            "key": f"s-{i}@2026-12-07T02:30Z", "schedule_id": f"s-{i}",
            "window": "2026-12-07T02:30:00Z", "trigger_key": "schedule", "state": "Completed",
            "started_at": "2026-12-07T02:30:01Z", "ended_at": "2026-12-07T02:31:00Z",
            "seq": seq + i}) for i in range(count)]

    def store(jobs: list[JobRecordIn]) -> int:
        changed = store_jobs(session, "node-a", jobs, received_at=at + timedelta(hours=1),
                             keep=JobKeep())
        session.commit()
        return changed

    assert store(records(0, 450)) == 450
    assert store(records(0, 450)) == 0            # the same seqs again: nothing changes
    assert store(records(1000, 3)) == 3           # later seqs replace their keys
