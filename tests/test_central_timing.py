"""When central tasks run next: cron via croniter, schedule shapes via the agents' matcher.

DST instants used (2026):
- America/New_York springs forward 2026-03-08 02:00 EST -> 03:00 EDT (07:00 UTC)
  and falls back 2026-11-01 02:00 EDT -> 01:00 EST (06:00 UTC).
- Europe/London: 2026-03-29 01:00 GMT -> 02:00 BST; 2026-10-25 02:00 BST -> 01:00 GMT.
- Australia/Lord_Howe moves by 30 minutes: 2026-04-05 02:00 -> 01:30; 2026-10-04 02:00 -> 02:30.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from controller.timing import check_cron, next_cron, next_run, next_shape, next_shape_by_minutes
from sched_core.model import Schedule

NY = "America/New_York"


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


@pytest.mark.parametrize("expr", ["* * * *", "* * * * * *", "61 * * * *", "nonsense"])
def test_check_cron_rejects_what_is_not_five_valid_fields(expr: str) -> None:
    with pytest.raises(ValueError, match="invalid cron expression"):
        check_cron(expr)
