"""The fleet's words for people (pure): schedules in words, DST notes, node status rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from controller.events import Announced
from controller.fleet import FleetSettings, node_row, propagation
from controller.nodes import Pull, Seen, StoredReport
from sched_core.explain import dst_note, schedule_words
from sched_core.model import LocalSchedule, Schedule

NY = ZoneInfo("America/New_York")


@pytest.mark.parametrize(("shape", "words"), [
    ({"days": ["mon", "tue"], "hours": ["2"], "minute": "30"}, "Mon, Tue at 02:30"),
    ({"days": ["*"], "hours": ["2", "14"], "minute": "30"}, "daily at 02:30, 14:30"),
    ({"days": ["sat"], "hours": ["*"], "minute": "5"}, "Sat hourly at :05"),
    ({"days": ["*"], "hours": ["*"], "minute": "0"}, "hourly at :00"),
    ({"days": None, "hours": None, "minute": "", "interval_minutes": 15}, "every 15 min"),
    ({"days": None, "hours": None, "minute": "", "interval_minutes": 120}, "every 2 h"),
])
def test_schedule_words(shape: dict[str, object], words: str) -> None:
    assert schedule_words(Schedule.model_validate(shape)) == words


def test_dst_notes_spring_gap_and_fall_back() -> None:
    fixed = Schedule.model_validate({"days": ["*"], "hours": ["1"], "minute": "30"})
    hourly = Schedule.model_validate({"days": ["*"], "hours": ["*"], "minute": "30"})
    # 2026-11-01 01:30 happens twice in New York: 05:30Z (EDT) and 06:30Z (EST).
    first, second = datetime(2026, 11, 1, 5, 30, tzinfo=UTC), datetime(2026, 11, 1, 6, 30,
                                                                         tzinfo=UTC)
    assert dst_note(fixed, first, NY) == (
        "01:30 happens twice on 2026-11-01 (DST fall-back): runs at the first only (EDT)")
    assert "runs at both, this is the first (EDT)" in dst_note(hourly, first, NY)
    assert dst_note(hourly, second, NY) == "the second 01:30 of 2026-11-01 (DST fall-back, EST)"
    assert dst_note(fixed, datetime(2026, 11, 2, 6, 30, tzinfo=UTC), NY) == ""
    gap = Schedule.model_validate({"days": ["*"], "hours": ["2"], "minute": "30"})
    note = dst_note(gap, datetime(2026, 3, 8, 7, 0, tzinfo=UTC), NY)
    assert note.startswith("02:30 does not exist on 2026-03-08")


NOW = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)


def report(state: str) -> StoredReport:
    return StoredReport(NOW, {"timezone": "Europe/Paris", "agent_version": "0.1.0",
                              "schedules": [{"id": "s-1", "latest_job": {"state": state}}]})


def seen(ago: float, heartbeat: float | None = None, via: str = "pull") -> Seen:
    return Seen("n", NOW - timedelta(seconds=ago), via, heartbeat, NOW - timedelta(days=1))


def test_node_status_order_never_seen_silent_failing_ok() -> None:
    settings = FleetSettings(pull_interval=300)
    pull = Pull("n", NOW - timedelta(seconds=899), "304", "e-1")

    def status(last: Seen | None, rep: StoredReport | None, ids: list[str]) -> str:
        row = node_row("n", schedules=len(ids), schedule_ids=ids, pull=pull, report=rep,
                       version="e-1", now=NOW, settings=settings, seen=last)
        return str(row["status"])

    # A pull or report the controller did not see from the node itself is no sign of life.
    assert status(None, report("Completed"), ["s-1"]) == "never-seen"
    # No heartbeat announced: silent after max(3 x 300 s, 3 pull intervals) = 900 s.
    assert status(seen(900), report("Failed"), ["s-1"]) == "failing"
    assert status(seen(901), report("Failed"), ["s-1"]) == "silent"
    assert status(seen(899), report("Crashed"), ["s-1"]) == "failing"
    assert status(seen(899), report("Failed"), ["s-2"]) == "ok"  # s-1 was deleted since
    assert status(seen(899), report("Completed"), ["s-1"]) == "ok"
    # A 60 s heartbeat: silent after 180 s, whatever the pull interval.
    assert status(seen(180, 60, "report"), report("Completed"), ["s-1"]) == "ok"
    assert status(seen(181, 60, "report"), report("Completed"), ["s-1"]) == "silent"
    row = node_row("n", schedules=1, schedule_ids=["s-1"], pull=pull, report=None,
                   version="e-1", now=NOW, settings=settings, seen=seen(200, 60, "report"))
    assert (row["silent_after_s"], row["heartbeat_s"], row["last_seen_via"]) == (
        180, 60, "report")
    assert row["last_seen_at"] == "2026-12-03T06:56:40Z" and row["stale"] is True


def test_a_job_record_decides_failing_over_the_reports_latest_job() -> None:
    from controller.jobs import JobRecord

    def record(state: str) -> JobRecord:
        at = NOW - timedelta(hours=1)
        return JobRecord("n", "s-1@x", "s-1", at, "schedule", state, at, at, None, None,
                         False, None, 1, at, at)

    settings = FleetSettings()
    # A job that only started (Running: a retry of a schedule that keeps failing) changes no
    # status: the report's latest job, the latest that ended, holds until it ends.
    for state, reported, expected in (("Completed", "Failed", "ok"),
                                      ("Failed", "Completed", "failing"),
                                      ("Running", "Failed", "failing"),
                                      ("Running", "Completed", "ok")):
        row = node_row("n", schedules=1, schedule_ids=["s-1"], pull=None,
                       report=report(reported), version=None, now=NOW, settings=settings,
                       seen=seen(10), records={"s-1": record(state)})
        assert row["status"] == expected


def test_propagation_counts_on_the_event_or_the_periodic_pull() -> None:
    row = LocalSchedule.model_validate({
        "id": "s-1", "name": "n", "action": "backup", "miss_policy": "skip", "enabled": True,
        "schedule": {"days": ["*"], "hours": ["2"], "minute": "5"}})
    settings = FleetSettings(pull_interval=900)
    now = datetime(2026, 12, 3, 6, 58, tzinfo=UTC)  # 01:58 EST; next window 02:05 EST
    pull = Pull("n", now - timedelta(seconds=60), "304", "e")
    alive = Seen("n", pull.at, "pull", None, pull.at)
    sent = propagation(row, node="n", tz=NY, now=now, pull=pull, settings=settings,
                       announced=Announced(True, "event accepted"), seen=alive)
    assert sent["next_window"] == "2026-12-03T07:05:00Z" and sent["likely_in_time"] is True
    quiet = propagation(row, node="n", tz=NY, now=now, pull=pull, settings=settings,
                        announced=Announced(False, "no Prefect API"), seen=alive)
    # The next periodic pull is at 07:12Z, after the 07:05 window's minute.
    assert quiet["likely_in_time"] is False and "probably after" in quiet["reason"]
    silent = propagation(row, node="n", tz=NY, now=now, settings=settings,
                         pull=Pull("n", now - timedelta(hours=1), "304", "e"),
                         seen=Seen("n", now - timedelta(hours=1), "pull", 60, now),
                         announced=Announced(True, "event accepted"))
    assert silent["likely_in_time"] is False and silent["node_silent"] is True
    assert "pulls within" not in silent["reason"]
    assert silent["reason"].startswith(
        "node n is silent: no request of its own for 1 h (last pull 2026-12-03T05:58:00Z; "
        "it promised one every 1 min); it gets the change when it is back")
