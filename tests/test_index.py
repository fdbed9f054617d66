"""DueIndex.due_at: exactly the schedules whose fire_times contain the instant.

DST instants (2026) are those of tests/test_matcher.py: New York 03-08T07:00Z (spring,
gap 02:00-02:59) and 11-01T06:00Z (fall, 01:xx twice); Lord Howe 04-04T15:00Z (fall,
01:30-01:59 twice) and 10-03T15:30Z (spring, gap 02:00-02:29); Havana 03-08T05:00Z
(spring, Sunday's 00:xx missing) and 11-01T05:00Z (fall, 00:xx twice); Beirut
03-28T22:00Z (spring, Sunday's 00:xx missing) and 10-24T21:00Z (fall, Saturday's 23:xx
twice).
"""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from sched_core.index import DueIndex
from sched_core.matcher import fire_times, zone_table
from sched_core.model import DAY_NAMES, LocalSchedule, MissPolicy, Schedule

NY = ZoneInfo("America/New_York")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")
NY_SPRING = datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
NY_FALL = datetime(2026, 11, 1, 6, 0, tzinfo=UTC)
LH_SPRING = datetime(2026, 10, 3, 15, 30, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def row(ident: str, schedule: Schedule, *, enabled: bool = True) -> LocalSchedule:
    return LocalSchedule(
        id=ident,
        name=f"schedule {ident}",
        action="backup",
        schedule=schedule,
        miss_policy=MissPolicy.SKIP,
        enabled=enabled,
    )


def ids(rows: list[LocalSchedule]) -> list[str]:
    return sorted(item.id for item in rows)


PINNED = [
    row("fixed-0230", Schedule(days=["*"], hours=["2"], minute="30")),
    row("fixed-0200-0300", Schedule(days=["sun"], hours=["02", "3"], minute="0")),
    row("fixed-0130", Schedule(days=["*"], hours=["1"], minute="30")),
    row("wild-30", Schedule(days=["sun"], hours=["*"], minute="30")),
    row("every-30", Schedule(interval_minutes=30)),
    row("every-1441", Schedule(interval_minutes=1441)),
    row("monday-0230", Schedule(days=["mon"], hours=["2"], minute="30")),
    row("disabled", Schedule(days=["*"], hours=["*"], minute="30"), enabled=False),
    row("event", Schedule(on="after_wave")),
]


@pytest.mark.parametrize(
    ("instant", "expected"),
    [
        # Spring-forward in New York: 01:59 EST, then 03:00 EDT == 07:00Z.
        (NY_SPRING - 31 * MINUTE, []),
        (NY_SPRING - 30 * MINUTE, ["every-30", "fixed-0130", "wild-30"]),  # 01:30 EST
        (NY_SPRING - MINUTE, []),
        (NY_SPRING, ["every-30", "fixed-0200-0300", "fixed-0230"]),  # moved 02:00 and 02:30
        (NY_SPRING + MINUTE, []),
        (NY_SPRING + 30 * MINUTE, ["every-30", "wild-30"]),  # 03:30 EDT
        # Fall-back: 01:30 EDT (05:30Z), then 01:30 EST (06:30Z) again.
        (NY_FALL - 30 * MINUTE, ["every-30", "fixed-0130", "wild-30"]),
        (NY_FALL - MINUTE, []),
        (NY_FALL, ["every-30"]),  # 01:00 EST
        (NY_FALL + MINUTE, []),
        (NY_FALL + 30 * MINUTE, ["every-30", "wild-30"]),  # the second 01:30
        (NY_FALL + 90 * MINUTE, ["every-30", "fixed-0230", "wild-30"]),  # 02:30 EST
        # Midnight: intervals divide 0.
        (datetime(2026, 11, 30, 5, 0, tzinfo=UTC), ["every-1441", "every-30"]),
        (datetime(2026, 11, 30, 7, 30, tzinfo=UTC), ["every-30", "fixed-0230", "monday-0230"]),
    ],
)
def test_due_at_in_new_york(instant: datetime, expected: list[str]) -> None:
    index = DueIndex.build(PINNED)
    assert ids(index.due_at(instant)) == expected
    assert ids(index.due_at(instant.astimezone(LORD_HOWE))) == expected


def test_due_at_after_a_30_minute_jump() -> None:
    # Lord Howe 02:00 +10:30 -> 02:30 +11:00 at 15:30Z: 02:00 and 02:15 move to 02:30.
    rows = [
        row("0200", Schedule(days=["sun"], hours=["2"], minute="0")),
        row("0215", Schedule(days=["sun"], hours=["2"], minute="15")),
        row("0230", Schedule(days=["sun"], hours=["2"], minute="30")),
        row("sat-0215", Schedule(days=["sat"], hours=["2"], minute="15")),
        row("wild-15", Schedule(days=["*"], hours=["*"], minute="15")),
        row("wild-30", Schedule(days=["*"], hours=["*"], minute="30")),
    ]
    index = DueIndex.build(rows, LORD_HOWE)
    assert ids(index.due_at(LH_SPRING)) == ["0200", "0215", "0230", "wild-30"]
    assert ids(index.due_at(LH_SPRING - 15 * MINUTE)) == []  # 01:45 +10:30
    assert ids(index.due_at(LH_SPRING + 15 * MINUTE)) == []  # 02:45 +11:00
    assert index.tz == LORD_HOWE
    assert len(index) == 6


def test_due_at_lists_a_schedule_once() -> None:
    rows = [row("s", Schedule(days=["*", "sun"], hours=["2", "02", "3"], minute="0"))]
    assert ids(DueIndex.build(rows).due_at(NY_SPRING)) == ["s"]


def test_due_at_rejects_naive_and_partial_minutes() -> None:
    index = DueIndex.build(PINNED)
    with pytest.raises(ValueError, match="naive"):
        index.due_at(datetime(2026, 11, 30, 7, 30))
    with pytest.raises(ValueError, match="whole UTC minute"):
        index.due_at(datetime(2026, 11, 30, 7, 30, 1, tzinfo=UTC))
    with pytest.raises(ValueError, match="whole UTC minute"):
        index.due_at(datetime(2026, 11, 30, 7, 30, 0, 5, tzinfo=UTC))


def test_due_at_returns_a_fresh_list() -> None:
    index = DueIndex.build(PINNED)
    instant = datetime(2026, 11, 30, 7, 30, tzinfo=UTC)
    index.due_at(instant).clear()
    assert ids(index.due_at(instant)) == ["every-30", "fixed-0230", "monday-0230"]


def test_empty_index() -> None:
    index = DueIndex.build([])
    assert len(index) == 0
    assert index.due_at(NY_SPRING) == []


# --- property: due_at agrees with fire_times -----------------------------------------


def random_row(rng: random.Random, number: int) -> LocalSchedule:
    roll = rng.random()
    if roll < 0.03:
        return row(f"e{number}", Schedule(on="after_wave"))
    if roll < 0.2:
        interval = rng.choice([5, 7, 10, 15, 20, 30, 45, 60, 90, 120, 360, 720, 1440, 1441])
        if rng.random() < 0.2:
            interval = rng.randint(1, 1500)
        return row(f"i{number}", Schedule(interval_minutes=interval), enabled=rng.random() > 0.1)
    days = ["*"] if rng.random() < 0.3 else rng.sample(DAY_NAMES, rng.randint(1, 4))
    minute = rng.choice(["0", "15", "30", "45", "59", str(rng.randint(0, 59))])
    if roll < 0.4:
        schedule = Schedule(days=days, hours=["*"], minute=minute)
    else:
        hours = [str(rng.choice([0, 1, 2, 3, 22, 23, rng.randint(0, 23)]))]
        hours += [f"{rng.randint(0, 23):02d}" for _ in range(rng.randint(0, 3))]
        schedule = Schedule(days=days, hours=hours, minute=minute)
    return row(f"c{number}", schedule, enabled=rng.random() > 0.1)


@pytest.mark.parametrize(
    "zone",
    [
        "America/New_York",
        "Australia/Lord_Howe",
        "America/Havana",
        "Asia/Beirut",
        "America/Santiago",
    ],
)
def test_due_at_equals_fire_times_across_dst_days(zone: str) -> None:
    tz = ZoneInfo(zone)
    rng = random.Random(f"due-{zone}")
    rows = [random_row(rng, number) for number in range(1000)]
    index = DueIndex.build(rows, tz)
    assert len(index) == sum(1 for item in rows if item.enabled and not item.schedule.on)
    table = zone_table(tz)
    year = (
        int(datetime(2026, 1, 1, tzinfo=UTC).timestamp()),
        int(datetime(2027, 1, 1, tzinfo=UTC).timestamp()),
    )
    moments = [instant for instant, _, _ in table.transitions(*year)]
    moments.append(int(datetime(2026, 6, 15, 12, tzinfo=UTC).timestamp()))
    for moment in moments:
        start = datetime.fromtimestamp(moment, UTC) - timedelta(hours=5)
        end = start + timedelta(hours=10)
        expected: dict[datetime, set[str]] = defaultdict(set)
        for item in rows:
            if item.enabled:
                for when in fire_times(item.schedule, start, end, tz):
                    expected[when].add(item.id)
        when = start
        while when < end:
            found = [item.id for item in index.due_at(when)]
            assert len(found) == len(set(found)), when
            assert set(found) == expected.get(when, set()), (zone, when)
            when += MINUTE
