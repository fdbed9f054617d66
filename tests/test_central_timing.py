"""When central tasks run next: cron via cronsim, schedule shapes via the agents' matcher.

DST instants used (2026):
- America/New_York springs forward 2026-03-08 02:00 EST -> 03:00 EDT (07:00 UTC)
  and falls back 2026-11-01 02:00 EDT -> 01:00 EST (06:00 UTC).
- Europe/London: 2026-03-29 01:00 GMT -> 02:00 BST; 2026-10-25 02:00 BST -> 01:00 GMT.
- Australia/Lord_Howe moves by 30 minutes: 2026-04-05 02:00 -> 01:30; 2026-10-04 02:00 -> 02:30.
"""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from controller.claims import Claim
from controller.cron import check_cron, next_cron
from controller.timing import (
    next_run,
    next_shape,
    plan_after_dispatch,
    plan_catch_up,
)
from sched_core.model import Schedule
from tests.oracles import next_shape_by_minutes

NY = "America/New_York"


def _at(month: int, day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, month, day, hour, minute, tzinfo=UTC)


def _shape(days: list[str], hours: list[str], minute: str) -> Schedule:
    return Schedule(days=days, hours=hours, minute=minute)


def test_a_fixed_hour_window_in_the_spring_gap_fires_at_the_first_minute_after_the_jump() -> None:
    nightly = _shape(["*"], ["2"], "30")
    before = datetime(2026, 3, 8, 6, 59, tzinfo=UTC)  # 01:59 EST
    assert next_shape(nightly, NY, after=before) == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
    # Once: the next is the following night's 02:30 EDT.
    assert next_shape(nightly, NY, after=datetime(2026, 3, 8, 7, 0, tzinfo=UTC)) == datetime(
        2026, 3, 9, 6, 30, tzinfo=UTC
    )


def test_a_fixed_hour_window_in_the_fall_repeat_fires_once_at_the_first_copy() -> None:
    nightly = _shape(["*"], ["1"], "30")
    before = datetime(2026, 11, 1, 5, 0, tzinfo=UTC)  # 01:00 EDT
    first = datetime(2026, 11, 1, 5, 30, tzinfo=UTC)  # 01:30 EDT
    assert next_shape(nightly, NY, after=before) == first
    assert next_shape(nightly, NY, after=first) == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)


def test_wildcard_hours_fire_in_both_copies_of_the_repeated_hour() -> None:
    hourly = _shape(["*"], ["*"], "30")
    first = datetime(2026, 11, 1, 5, 30, tzinfo=UTC)  # 01:30 EDT
    assert next_shape(hourly, NY, after=first) == datetime(2026, 11, 1, 6, 30, tzinfo=UTC)


def test_interval_schedules_count_minutes_since_local_midnight() -> None:
    every_90 = Schedule(interval_minutes=90)
    at = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)  # 01:00 EST
    assert next_shape(every_90, NY, after=at) == datetime(2026, 12, 2, 6, 30, tzinfo=UTC)


def test_an_event_schedule_never_runs_on_the_clock() -> None:
    assert next_shape(Schedule(on="after_wave"), NY, after=datetime.now(UTC)) is None


@pytest.mark.parametrize("zone", [NY, "Europe/London", "Australia/Lord_Howe", "UTC"])
def test_the_matcher_agrees_with_a_minute_scan_around_every_transition(zone: str) -> None:
    shapes = [
        _shape(["*"], ["2"], "30"),
        _shape(["*"], ["1"], "30"),
        _shape(["*"], ["*"], "15"),
        _shape(["sun"], ["1", "2", "3"], "0"),
        _shape(["mon", "fri"], ["23"], "59"),
        Schedule(interval_minutes=90),
    ]
    transitions = [
        datetime(2026, 3, 8, 7, tzinfo=UTC), datetime(2026, 11, 1, 6, tzinfo=UTC),
        datetime(2026, 3, 29, 1, tzinfo=UTC), datetime(2026, 10, 25, 1, tzinfo=UTC),
        datetime(2026, 4, 4, 15, tzinfo=UTC), datetime(2026, 10, 3, 15, 30, tzinfo=UTC),
    ]
    rng = random.Random(4)
    for shape in shapes:
        for transition in transitions:
            for _ in range(3):
                after = transition + timedelta(minutes=rng.randint(-200, 200))
                assert next_shape(shape, zone, after=after) == next_shape_by_minutes(
                    shape, zone, after=after
                ), (shape, after)


def test_cron_runs_in_its_timezone() -> None:
    at = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)  # 07:00 EST
    assert next_cron("30 7 * * *", NY, after=at) == datetime(2026, 12, 2, 12, 30, tzinfo=UTC)
    assert next_run(cron="*/5 * * * *", schedule=None, timezone="UTC", after=at) == (
        at + timedelta(minutes=5)
    )
    assert next_run(cron=None, schedule=None, timezone="UTC", after=at) is None


def test_cron_follows_isc_cron_across_dst() -> None:
    # Spring: 02:30 does not exist on 2026-03-08; it fires once, at 03:00 EDT.
    gap = next_cron("30 2 * * *", NY, after=datetime(2026, 3, 8, 6, 59, tzinfo=UTC))
    assert gap == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
    # Fall: 01:30 happens twice on 2026-11-01; a fixed hour fires at the first copy only.
    first = next_cron("30 1 * * *", NY, after=datetime(2026, 11, 1, 4, 0, tzinfo=UTC))
    assert first == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)
    assert next_cron("30 1 * * *", NY, after=first) == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)
    # A wildcard hour fires in both copies.
    assert next_cron("30 * * * *", NY, after=first) == datetime(2026, 11, 1, 6, 30, tzinfo=UTC)


# Both New York transition days of 2026, from local midnight (EST on 03-08, EDT on 11-01).
TRANSITION_DAYS = [datetime(2026, 3, 8, 5, tzinfo=UTC), datetime(2026, 11, 1, 4, tzinfo=UTC)]


def _chained(expr: str, zone: str, start: datetime, until: datetime) -> list[datetime]:
    """Return next_cron's times in (start, until), each computed from the one before."""
    times: list[datetime] = []
    current = next_cron(expr, zone, after=start)
    while current < until:
        times.append(current)
        current = next_cron(expr, zone, after=current)
    return times


def _cronsim(expr: str, zone: str, start: datetime, until: datetime) -> list[datetime]:
    """Return cronsim's own iteration from start in zone, in UTC, up to until."""
    times: list[datetime] = []
    for found in CronSim(expr, start.astimezone(ZoneInfo(zone))):
        utc = found.astimezone(UTC)
        if utc >= until:
            return times
        times.append(utc)
    return times


@pytest.mark.parametrize(
    "expr",
    [
        "*/15 1 * * *", "*/5 1 * * *", "* 1 * * *",  # stepped minute, fixed hour
        "*/15 2 * * *", "0 */2 * * *", "0 1-3 * * *",
        "30 1 * * *", "30 2 * * *", "0,30 2 * * *", "59 1 * * *", "15 * * * *",
    ],
)
@pytest.mark.parametrize("start", TRANSITION_DAYS, ids=["spring", "fall"])
def test_cron_times_across_dst_are_cronsims(expr: str, start: datetime) -> None:
    until = start + timedelta(hours=30)
    assert _chained(expr, NY, start, until) == _cronsim(expr, NY, start, until)


def test_a_stepped_minute_in_a_fixed_hour_fires_in_both_copies_of_the_fall_repeat() -> None:
    # 2026-11-01: 01:00-01:59 EDT (05:00-05:59 UTC), then 01:00-01:59 EST (06:00-06:59 UTC).
    start = datetime(2026, 11, 1, 4, 59, tzinfo=UTC)
    times = _chained("*/15 1 * * *", NY, start, datetime(2026, 11, 1, 7, tzinfo=UTC))
    assert times == [_at(11, 1, hour, minute) for hour in (5, 6) for minute in (0, 15, 30, 45)]
    every_minute = _chained("* 1 * * *", NY, start, datetime(2026, 11, 1, 7, tzinfo=UTC))
    assert len(every_minute) == 120


def test_only_a_fixed_minute_and_hour_fires_in_the_spring_gap() -> None:
    # 2026-03-08 02:00 EST jumps to 03:00 EDT (07:00 UTC); 02:xx does not exist.
    start = datetime(2026, 3, 8, 4, 59, tzinfo=UTC)  # 23:59 EST the day before
    # Stepped minute: no 03:00 EDT stand-in; the next is 02:00 EDT the following day.
    assert next_cron("*/15 2 * * *", NY, after=start) == datetime(2026, 3, 9, 6, tzinfo=UTC)
    # Stepped hour: 00:00 EST, then 04:00 EDT; 02:00 is skipped, not moved to 03:00.
    two_hourly = _chained("0 */2 * * *", NY, start, datetime(2026, 3, 8, 9, tzinfo=UTC))
    assert two_hourly == [datetime(2026, 3, 8, 5, tzinfo=UTC), datetime(2026, 3, 8, 8, tzinfo=UTC)]
    # Fixed minute and hour: once, at 03:00 EDT.
    assert next_cron("30 2 * * *", NY, after=start) == datetime(2026, 3, 8, 7, tzinfo=UTC)


def test_from_inside_the_second_copy_a_fixed_time_moves_to_the_next_day() -> None:
    # 01:30 EDT fired already; after 01:10 EST the next 01:30 is tomorrow's, never an earlier time.
    after = datetime(2026, 11, 1, 6, 10, tzinfo=UTC)  # 01:10 EST
    assert next_cron("30 1 * * *", NY, after=after) == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        # Either field starts with "*": AND. After Mon 08-24 (even), the next odd-day
        # Monday is the 31st; the next Monday on the 1st, 11th, 21st or 31st too.
        ("0 0 */2 * 1", _at(8, 24, 19, 23), _at(8, 31, 4)),
        ("0 0 */10 * 1", _at(8, 1, 12), _at(8, 31, 4)),
        # Neither does: OR. After Sat 08-01, Sun 08-02 is in 1-7; Fri 08-28 comes before the 13th.
        ("0 0 1-7 * 1", _at(8, 1, 12), _at(8, 2, 4)),
        ("0 0 13 * 5", _at(8, 24, 12), _at(8, 28, 4)),
        ("0 0 13 * 5", _at(9, 12, 12), _at(9, 13, 4)),
    ],
)
def test_day_of_month_and_day_of_week_combine_as_vixie_cron_does(
    expr: str, after: datetime, expected: datetime
) -> None:
    assert next_cron(expr, NY, after=after) == expected
    assert next_cron(expr, NY, after=after) == next(CronSim(expr, after.astimezone(ZoneInfo(NY))))


@pytest.mark.parametrize("expr", ["* * * *", "* * * * * *", "61 * * * *", "nonsense", "0 0 ? * 1"])
def test_check_cron_rejects_what_is_not_five_valid_fields(expr: str) -> None:
    with pytest.raises(ValueError, match=r"invalid cron expression '.*' \("):
        check_cron(expr)


@pytest.mark.parametrize("expr", ["0 0 30 2 *", "0 0 31 4,6 *", "0 0 31 2,4,6,9,11 *"])
def test_check_cron_rejects_an_expression_that_never_matches(expr: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"cron expression '{expr}' never matches")):
        check_cron(expr)
    with pytest.raises(ValueError, match="never matches"):
        next_cron(expr, NY, after=datetime(2026, 12, 2, tzinfo=UTC))


@pytest.mark.parametrize("expr", ["0 0 29 2 *", "0 0 30 2 1", "0 0 * 2 mon#5", "0 0 L * *"])
def test_check_cron_accepts_rare_but_real_days(expr: str) -> None:
    check_cron(expr)  # Feb 29; Mondays in February (OR); a fifth Monday in February (2044)


def test_next_cron_refuses_a_naive_instant() -> None:
    with pytest.raises(ValueError, match="no UTC offset"):
        next_cron("* * * * *", NY, after=datetime(2026, 12, 2, 12))


# ---------------------------------------------------------------- plans


def _claim(scheduled_at: datetime, **kw: Any) -> Claim:
    return Claim(task_id=1, name="t", scheduled_at=scheduled_at, worker_id="w",
                 locked_until=scheduled_at, event="sched.task.x", deployment=None, **kw)


def test_catch_up_is_none_for_a_current_or_one_shot_claim() -> None:
    at = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    hourly = _claim(at, cron="0 * * * *")
    assert plan_catch_up(hourly, at + timedelta(minutes=59, seconds=59)) is None
    assert plan_catch_up(_claim(at), at + timedelta(days=3)) is None  # one-shot: dispatched late


def test_catch_up_dispatches_only_the_latest_missed_window_counting_the_rest() -> None:
    at = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    plan = plan_catch_up(_claim(at, cron="0 * * * *"), at + timedelta(hours=3, minutes=1))
    assert plan is not None
    assert (plan.next_run_at, plan.skipped) == (at + timedelta(hours=3), 3)
    assert (plan.first_skipped, plan.last_skipped) == (at, at + timedelta(hours=2))
    # Exactly at the next window it is already due: that one is the latest.
    plan = plan_catch_up(_claim(at, cron="0 * * * *"), at + timedelta(hours=1))
    assert plan is not None and (plan.next_run_at, plan.skipped) == (at + timedelta(hours=1), 1)


def test_catch_up_counts_both_copies_of_a_repeated_hour() -> None:
    # New York, 2026-11-01: 01:00-01:59 EDT is 05:xxZ, then 01:00-01:59 EST is 06:xxZ.
    start = datetime(2026, 11, 1, 5, 0, tzinfo=UTC)
    claim = _claim(start, cron="*/15 1 * * *", timezone="America/New_York")
    plan = plan_catch_up(claim, datetime(2026, 11, 1, 6, 50, tzinfo=UTC))
    assert plan is not None
    # 05:00, 05:15, 05:30, 05:45, 06:00, 06:15, 06:30 skipped; 06:45 (01:45 EST) is dispatched.
    assert (plan.next_run_at, plan.skipped) == (datetime(2026, 11, 1, 6, 45, tzinfo=UTC), 7)


def test_a_late_dispatch_plan_counts_what_it_passed_over() -> None:
    at = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    on_time = plan_after_dispatch(_claim(at, cron="*/5 * * * *"), at + timedelta(seconds=3))
    assert (on_time.next_run_at, on_time.skipped) == (at + timedelta(minutes=5), 0)
    late = plan_after_dispatch(_claim(at, cron="*/5 * * * *"), at + timedelta(minutes=11))
    assert (late.next_run_at, late.skipped) == (at + timedelta(minutes=15), 2)
    assert (late.first_skipped, late.last_skipped) == (
        at + timedelta(minutes=5), at + timedelta(minutes=10))
