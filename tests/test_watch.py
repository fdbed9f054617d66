"""The fleet watch's decisions (pure) and its exactly-once rows on a real database.

:func:`controller.alert_rules.plan_alerts` over hand-made reports in the shape of
``GET /api/report``; :class:`controller.watch.FleetWatch` over a real database
(SQLite and Postgres) with an emitter that records, and one that fails.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlmodel import Session

from controller import nodes, schedules
from controller.alert_rules import OpenAlert, event_id, plan_alerts
from controller.db import make_engine
from controller.fleet import FleetSettings
from controller.watch import FleetWatch
from sched_core.model import LocalSchedule

T0 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)


def entry(key: str, status: str, window: str, **more: Any) -> dict[str, Any]:
    return {"schedule_id": key.split("@")[0], "key": key, "window": window,
            "local": window, "status": status, "detail": f"{status} detail", "expected": True,
            "state": None, "error": None, "flow_run_id": None, "started_at": None,
            "ended_at": None, **more}


def node(name: str, windows: list[dict[str, Any]], *, silent: bool = False,
         seen: str | None = "2026-12-04T09:59:00Z") -> dict[str, Any]:
    return {"node": name, "silent": silent, "silence": "quiet" if silent else None,
            "last_seen_at": seen, "heartbeat_s": 60, "silent_after_s": 180, "windows": windows}


def test_problems_are_proposed_and_a_later_success_resolves_them() -> None:
    missed = entry("bk@10:05", "missed", "2026-12-04T10:05:00Z")
    failed = entry("bk@10:10", "failed", "2026-12-04T10:10:00Z", error="tar exited 2")
    report = {"nodes": [node("a", [missed, failed], silent=True)]}
    found = {(a.kind, a.subject) for a in plan_alerts(report, [])}
    assert found == {("node-silent", "silent@2026-12-04T09:59:00Z"),
                     ("window-missed", "bk@10:05"), ("window-failed", "bk@10:10")}
    # A never-seen node is silent only once it missed a window (a new node is not alerted).
    fresh = {"nodes": [node("b", [entry("bk@10:15", "due", "2026-12-04T10:15:00Z")],
                            silent=True, seen=None)]}
    assert plan_alerts(fresh, []) == []
    open_alerts = [OpenAlert(1, "a", "window-missed", "bk@10:05", "bk", T0 + timedelta(minutes=5)),
                   OpenAlert(2, "a", "window-failed", "bk@10:10", "bk", T0 + timedelta(minutes=10)),
                   OpenAlert(3, "a", "node-silent", "silent@x", None, None)]
    done = entry("bk@10:15", "completed", "2026-12-04T10:15:00Z")
    later = {"nodes": [node("a", [missed, failed, done])]}
    back = {a.kind: a for a in plan_alerts(later, open_alerts)}
    assert back["window-recovered"].subject == "bk@10:15"
    assert back["window-recovered"].resolves == (1, 2)
    assert back["window-recovered"].payload["resolves"] == ["bk@10:05", "bk@10:10"]
    assert back["node-recovered"].resolves == (3,)
    # One open alert per schedule and kind: later missed windows wait for it to resolve.
    more = {"nodes": [node("a", [missed, entry("bk@10:20", "missed", "2026-12-04T10:20:00Z")])]}
    assert [a.subject for a in plan_alerts(more, open_alerts[:1])] == []
    assert [a.subject for a in plan_alerts(more, [])] == ["bk@10:05"]
    # A missed window whose job the node reported after all is resolved by that report.
    late = {"nodes": [node("a", [entry("bk@10:05", "completed", "2026-12-04T10:05:00Z")])]}
    (resolved,) = plan_alerts(late, open_alerts[:1])
    assert (resolved.kind, resolved.subject, resolved.resolves) == (
        "window-recovered", "reported@bk@10:05", (1,))


def test_event_ids_are_the_same_for_every_instance_and_differ_per_alert() -> None:
    assert event_id("a", "window-missed", "k") == event_id("a", "window-missed", "k")
    assert event_id("a", "window-missed", "k") != event_id("a", "window-failed", "k")


def test_a_failed_send_is_retried_once_its_lease_runs_out(database_url: str) -> None:
    engine = make_engine(database_url)
    row = LocalSchedule.model_validate({
        "id": "bk", "name": "bk", "action": "backup", "miss_policy": "skip", "enabled": True,
        "schedule": {"interval_minutes": 5}})
    try:
        with Session(engine) as session:
            schedules.put_schedule(session, "n", row, now=T0)
            nodes.record_report(session, "n", {"timezone": "UTC", "grace_s": 60},
                                received_at=T0, heartbeat_s=60)
        calls: list[dict[str, Any]] = []

        def failing(event: dict[str, Any]) -> None:
            calls.append(event)
            raise RuntimeError("Prefect is down")

        watch = FleetWatch(engine, FleetSettings(), emit=failing)
        raised = watch.check(T0 + timedelta(minutes=8))
        # Silent (no request since 10:00, 3 x 60 s) and the 10:05 window missed.
        assert {a.kind for a in raised} == {"node-silent", "window-missed"}
        assert len(calls) == 2 and watch.sent == 0
        assert watch.check(T0 + timedelta(minutes=8)) == []  # raised once
        assert len(calls) == 2  # both leased: not retried before the lease runs out
        sent: list[dict[str, Any]] = []
        other = FleetWatch(engine, FleetSettings(), emit=sent.append)
        with engine.begin() as conn:  # the lease ran out (as after 30 s)
            from sqlalchemy import text

            conn.execute(text("UPDATE fleet_alert SET lease_until = :past"),
                         {"past": datetime(2000, 1, 1)})
        assert other.send_pending() == 2 and other.sent == 2
        assert {e["event"] for e in sent} == {"sched.node.silent", "sched.node.window-missed"}
        missed = next(e for e in sent if e["event"] == "sched.node.window-missed")
        assert missed["resource"]["prefect.resource.id"] == "sched.node.n"
        assert missed["related"][0]["prefect.resource.id"] == "sched.schedule.n.bk"
        assert missed["payload"]["window"] == "2026-12-04T10:05:00Z"
        assert missed["id"] == str(event_id("n", "window-missed", "bk@2026-12-04T10:05+00:00"))
        assert other.send_pending() == 0  # sent: never again
    finally:
        engine.dispose()


def test_a_watch_with_no_emitter_only_logs(sqlite_url: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(sqlite_url)
    try:
        with Session(engine) as session:
            schedules.put_schedule(session, "quiet", LocalSchedule.model_validate({
                "id": "bk", "name": "bk", "action": "backup", "miss_policy": "skip",
                "enabled": True, "schedule": {"interval_minutes": 5}}), now=T0)
        watch = FleetWatch(engine, FleetSettings(), emit=None)
        with caplog.at_level("WARNING", logger="controller.watch"):
            raised = watch.check(T0 + timedelta(minutes=12))
        assert {a.kind for a in raised} == {"window-missed", "node-silent"}
        assert watch.sent == len(raised)  # marked sent: there is nowhere to send them
        assert [r.getMessage() for r in caplog.records].count("fleet alert") == len(raised)
    finally:
        engine.dispose()


def test_one_instance_takes_each_turn_and_another_takes_over(database_url: str) -> None:
    """Each interval's pass is one instance's (the turn's row, the database's clock); an
    instance that stops taking turns leaves the next one to the others."""
    import threading

    from sqlalchemy import select, text

    from controller.watch import TURNS, take_turn

    engine = make_engine(database_url)
    try:
        first = FleetWatch(engine, FleetSettings(), emit=None, interval=60)
        second = FleetWatch(engine, FleetSettings(), emit=None, interval=60)
        second.holder = "second"
        assert first.tick() is True
        assert second.tick() is False and first.tick() is False  # the turn is taken
        with engine.begin() as conn:  # an interval passed with no pass (first stopped)
            conn.execute(text("UPDATE watch_turn SET taken_at = :past"),
                         {"past": datetime(2000, 1, 1)})
        assert second.tick() is True and first.tick() is False
        assert (first.passes, second.passes) == (1, 1)
        with Session(engine) as session:
            assert session.execute(select(TURNS.c.holder)).scalar_one() == "second"

        # Eight instances asking at once: one takes it.
        with engine.begin() as conn:
            conn.execute(text("UPDATE watch_turn SET taken_at = :past"),
                         {"past": datetime(2000, 1, 1)})
        gate = threading.Barrier(8)
        taken: list[bool] = []

        def ask(i: int) -> None:
            gate.wait()
            with Session(engine) as session:
                taken.append(take_turn(session, "fleet", 60, f"i{i}"))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(taken) == [False] * 7 + [True]
    finally:
        engine.dispose()


def test_a_fleet_gone_silent_at_once_is_inserted_in_batches_each_once(database_url: str) -> None:
    """More alerts in a pass than a statement holds (a fleet silent at once): each is
    inserted once, the ones already there are not raised again, and a recovery in the same
    pass resolves the open alerts it names."""
    from sqlalchemy import func, select

    from controller.alert_rules import Alert
    from controller.watch import ALERTS, INSERT_BATCH

    engine = make_engine(database_url)
    count = INSERT_BATCH * 2 + 7
    silent = [Alert(f"n{i:04d}", "node-silent", "silent@2026-12-04T10:00:00Z", "quiet")
              for i in range(count)]
    try:
        watch = FleetWatch(engine, FleetSettings(), emit=None)
        with Session(engine) as session:
            first = watch._insert(session, silent[:INSERT_BATCH + 3], T0)
            assert len(first) == INSERT_BATCH + 3
            # The same alert twice in one pass is one row and raised once.
            again = watch._insert(session, [*silent, silent[-1]], T0)
            assert [a.node for a in again] == [a.node for a in silent[INSERT_BATCH + 3:]]
            assert session.execute(select(func.count()).select_from(ALERTS)).scalar_one() \
                == count
            opened = {r.node: r.id for r in session.execute(select(ALERTS.c.node, ALERTS.c.id))}
            back = [Alert(f"n{i:04d}", "node-recovered", "back@2026-12-04T10:05:00Z", "back",
                          resolves=(opened[f"n{i:04d}"],)) for i in range(INSERT_BATCH + 1)]
            assert len(watch._insert(session, back, T0 + timedelta(minutes=5))) == len(back)
            still_open = session.execute(select(func.count()).select_from(ALERTS).where(
                ALERTS.c.kind == "node-silent", ALERTS.c.resolved_at.is_(None))).scalar_one()
            assert still_open == count - len(back)
    finally:
        engine.dispose()
