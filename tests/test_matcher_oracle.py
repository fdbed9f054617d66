"""fire_times against cronsim over whole years, and next_fire/last_fire against fire_times.

cronsim implements the ISC/Vixie DST rules we follow, so for every schedule cron can
express (fixed-hour and wildcard-hour day/hour/minute combinations) the two must give
the same instants over 2026 and 2027, with one documented exception: at Lord Howe's
30-minute shifts cronsim skips wildcard-hour minutes :30-:58 of the shifted hour, both
the real 02:30-02:58 (+11:00) after the spring jump and the second copy of 01:30-01:58
(+10:30) at the fall-back.  Those wall times exist (the first) or recur (the second),
and our rule fires them; the tests assert exactly that difference.  Intervals that cron
can express (``*/15``, ``0 */2``) are compared on the transition days, with one more
Lord Howe difference: cronsim's ``0 */2 * * *`` skips 02:00 +10:30 on the fall-back day.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from sched_core.matcher import fire_times, last_fire, next_fire, zone_table
from sched_core.model import DAY_NAMES, Schedule

START = datetime(2026, 1, 1, tzinfo=UTC)
END = datetime(2028, 1, 1, tzinfo=UTC)
CRON_DOW = {name: (index + 1) % 7 for index, name in enumerate(DAY_NAMES)}  # sun == 0

ZONES = ["America/New_York", "Australia/Lord_Howe", "America/Havana", "Asia/Beirut"]


def cron_expr(schedule: Schedule) -> str:
    days, hours = schedule.days or [], schedule.hours or []
    dow = "*" if "*" in days else ",".join(str(CRON_DOW[day]) for day in days)
    hour = "*" if "*" in hours else ",".join(str(int(value)) for value in hours)
    return f"{int(schedule.minute)} {hour} * * {dow}"


def cronsim_times(schedule: Schedule, tz: ZoneInfo) -> Iterator[datetime]:
    """Yield cronsim's instants in [START, END), iterating in tz."""
    for when in CronSim(cron_expr(schedule), (START - timedelta(minutes=1)).astimezone(tz)):
        instant = when.astimezone(UTC)
        if instant >= END:
            return
        if instant >= START:
            yield instant


def oracle_schedules(zone: str) -> list[Schedule]:
    """Return the fixed and wildcard-hour schedules to check in a zone, some random.

    cronsim takes ~0.1 ms per fire in a zone, so most schedules run on weekends only:
    every DST transition of these zones falls on a local Saturday or Sunday.
    """
    weekend = ["sat", "sun"]
    fixed = [
        Schedule(days=weekend, hours=[str(hour)], minute=str(minute))
        for hour in (0, 1, 2, 3, 23)
        for minute in (0, 30, 45)
    ]
    fixed += [
        Schedule(days=["*"], hours=["1", "2"], minute="30"),
        Schedule(days=["*"], hours=["0", "23"], minute="15"),
        Schedule(days=weekend, hours=["0", "1", "2", "3"], minute="0"),
        Schedule(days=["sun"], hours=["01", "2", "23"], minute="30"),
        Schedule(days=["mon", "wed", "fri"], hours=["12", "2"], minute="5"),
    ]
    rng = random.Random(f"oracle-{zone}")
    for _ in range(6):
        days = rng.sample(DAY_NAMES, rng.randint(1, 3))
        hours = [str(hour) for hour in rng.sample(range(24), rng.randint(1, 3))]
        fixed.append(Schedule(days=days, hours=hours, minute=str(rng.randint(0, 59))))
    wildcard = [Schedule(days=weekend, hours=["*"], minute=str(minute)) for minute in (0, 30, 45)]
    return fixed + wildcard


# cronsim skips these (ours fire them): see the module docstring.
LORD_HOWE_ONLY_OURS = {
    minute: [
        f"2026-04-05T01:{minute}+10:30",
        f"2026-10-04T02:{minute}+11:00",
        f"2027-04-04T01:{minute}+10:30",
        f"2027-10-03T02:{minute}+11:00",
    ]
    for minute in ("30", "45")
}


@pytest.mark.parametrize("zone", ZONES)
def test_fire_times_equal_cronsim_over_2026_and_2027(zone: str) -> None:
    tz = ZoneInfo(zone)
    for schedule in oracle_schedules(zone):
        ours = list(fire_times(schedule, START, END, tz))
        theirs = list(cronsim_times(schedule, tz))
        assert ours == sorted(set(ours)), cron_expr(schedule)
        only_ours = sorted(set(ours) - set(theirs))
        only_theirs = sorted(set(theirs) - set(ours))
        expected: list[str] = []
        if zone == "Australia/Lord_Howe" and schedule.has_wildcard_hours:
            expected = LORD_HOWE_ONLY_OURS.get(schedule.minute, [])
        assert [when.astimezone(tz).isoformat(timespec="minutes") for when in only_ours] == (
            expected
        ), cron_expr(schedule)
        assert only_theirs == [], cron_expr(schedule)


def test_lord_howe_difference_is_for_minutes_30_to_58() -> None:
    # The full extent of the disagreement over the 2026 Lord Howe transition days.
    tz = ZoneInfo("Australia/Lord_Howe")
    days = [(datetime(2026, 4, 4, tzinfo=UTC), datetime(2026, 4, 6, tzinfo=UTC))]
    days.append((datetime(2026, 10, 3, tzinfo=UTC), datetime(2026, 10, 5, tzinfo=UTC)))
    differing = []
    for minute in range(60):
        schedule = Schedule(days=["*"], hours=["*"], minute=str(minute))
        for start, end in days:
            ours = set(fire_times(schedule, start, end, tz))
            theirs = set()
            for when in CronSim(cron_expr(schedule), (start - timedelta(minutes=1)).astimezone(tz)):
                if when.astimezone(UTC) >= end:
                    break
                theirs.add(when.astimezone(UTC))
            assert theirs <= ours
            differing += [when.astimezone(tz).strftime("%H:%M%z") for when in ours - theirs]
    assert sorted(differing) == sorted(
        [f"01:{minute}+1030" for minute in range(30, 59)]
        + [f"02:{minute}+1100" for minute in range(30, 59)]
    )


INTERVAL_EXPRS = {15: "*/15 * * * *", 20: "*/20 * * * *", 30: "*/30 * * * *", 120: "0 */2 * * *"}
"""Intervals cron can express exactly: minutes since midnight divisible by n."""

# cronsim treats "0 */2" as fixed hours and skips 02:00 +10:30 on Lord Howe's fall-back
# day, a wall time that occurs exactly once (01:30-01:59 repeat, 02:00 does not); an
# interval fires at every real wall time it divides.
LORD_HOWE_INTERVAL_ONLY_OURS = {120: ["2026-04-05T02:00+10:30", "2027-04-04T02:00+10:30"]}


@pytest.mark.parametrize("zone", [*ZONES, "America/Santiago"])
def test_interval_fire_times_equal_cronsim_on_transition_days(zone: str) -> None:
    tz = ZoneInfo(zone)
    transitions = zone_table(tz).transitions(int(START.timestamp()), int(END.timestamp()))
    assert len(transitions) == 4
    for interval, expr in INTERVAL_EXPRS.items():
        only_ours: list[datetime] = []
        for moment, _, _ in transitions:
            start = datetime.fromtimestamp(moment, UTC) - timedelta(days=1)
            end = start + timedelta(days=2)
            ours = set(fire_times(Schedule(interval_minutes=interval), start, end, tz))
            theirs = set()
            for when in CronSim(expr, (start - timedelta(minutes=1)).astimezone(tz)):
                if when.astimezone(UTC) >= end:
                    break
                if when.astimezone(UTC) >= start:
                    theirs.add(when.astimezone(UTC))
            assert theirs <= ours, expr
            only_ours += sorted(ours - theirs)
        expected = []
        if zone == "Australia/Lord_Howe":
            expected = LORD_HOWE_INTERVAL_ONLY_OURS.get(interval, [])
        assert [when.astimezone(tz).isoformat(timespec="minutes") for when in only_ours] == (
            expected
        ), expr


# --- next_fire / last_fire against fire_times ---------------------------------------


def random_schedule(rng: random.Random) -> Schedule:
    """Return a random valid clock or interval schedule."""
    roll = rng.random()
    if roll < 0.25:
        interval = rng.choice([1, 2, 5, 7, 13, 15, 30, 45, 60, 90, 360, 1440, 1441, 2000])
        return Schedule(interval_minutes=interval)
    days = ["*"] if rng.random() < 0.3 else rng.sample(DAY_NAMES, rng.randint(1, 3))
    minute = rng.choice(["0", "00", "15", "30", "45", "59", str(rng.randint(0, 59))])
    if roll < 0.45:
        return Schedule(days=days, hours=["*"], minute=minute)
    hours = [rng.choice(["0", "1", "01", "2", "02", "3", "23", str(rng.randint(0, 23))])]
    hours += [str(rng.randint(0, 23)) for _ in range(rng.randint(0, 2))]
    return Schedule(days=days, hours=hours, minute=minute)


def brute_next(schedule: Schedule, after: datetime, tz: ZoneInfo) -> datetime | None:
    for when in fire_times(schedule, after, after + timedelta(days=8, seconds=1), tz):
        if when > after:
            return when
    return None


def brute_last(schedule: Schedule, before: datetime, tz: ZoneInfo) -> datetime | None:
    for days in (1, 8):
        found = [
            when
            for when in fire_times(
                schedule, before - timedelta(days=days), before + timedelta(seconds=1), tz
            )
            if when <= before
        ]
        if found:
            return found[-1]
    return None


@pytest.mark.parametrize("zone", [*ZONES, "America/Santiago", "Asia/Kathmandu"])
def test_next_and_last_fire_equal_fire_times_near_transitions(zone: str) -> None:
    tz = ZoneInfo(zone)
    table = zone_table(tz)
    lo, hi = int(START.timestamp()), int(END.timestamp())
    moments = [instant for instant, _, _ in table.transitions(lo, hi)]
    moments.append(int(datetime(2026, 6, 15, 12, tzinfo=UTC).timestamp()))  # far from any
    rng = random.Random(f"next-last-{zone}")
    for moment in moments:
        for _ in range(80):
            schedule = random_schedule(rng)
            shift = rng.choice([0, 0, -1, 1, 60, -60]) + 60 * rng.randint(-26 * 60, 26 * 60)
            if rng.random() < 0.3:
                shift += rng.randint(1, 59)
            when = datetime.fromtimestamp(moment + shift, UTC)
            assert next_fire(schedule, when, tz) == brute_next(schedule, when, tz), (
                schedule,
                when,
            )
            assert last_fire(schedule, when, tz) == brute_last(schedule, when, tz), (
                schedule,
                when,
            )
