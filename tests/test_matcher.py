"""sched_core.matcher: the plain predicate, exact fire instants across DST, window keys.

DST instants used below (2026, from the tz database as zoneinfo ships it):

- America/New_York spring-forward: 2026-03-08T07:00Z, Sun 01:59:59 EST -> 03:00 EDT
  (gap 02:00-02:59); fall-back: 2026-11-01T06:00Z, Sun 01:59:59 EDT -> 01:00 EST
  (01:00-01:59 twice: 05:00-05:59Z, then 06:00-06:59Z).
- Australia/Lord_Howe (30-minute shift) fall-back: 2026-04-04T15:00Z, Sun Apr 5
  01:59:59 +11:00 -> 01:30 +10:30 (01:30-01:59 twice: 14:30-14:59Z, then
  15:00-15:29Z); spring-forward: 2026-10-03T15:30Z, Sun Oct 4 01:59:59 +10:30 ->
  02:30 +11:00 (gap 02:00-02:29).
- America/Havana (transitions at midnight) spring-forward: 2026-03-08T05:00Z,
  Sat Mar 7 23:59:59 CST -> Sun Mar 8 01:00 CDT (gap 00:00-00:59 of Sunday);
  fall-back: 2026-11-01T05:00Z, Sun 00:59:59 CDT -> 00:00 CST (00:00-00:59 twice).
- Asia/Beirut (transitions at midnight, fall-back across it) spring-forward:
  2026-03-28T22:00Z, Sat 23:59:59 +02:00 -> Sun Mar 29 01:00 +03:00 (gap 00:00-00:59
  of Sunday); fall-back: 2026-10-24T21:00Z, Sat 23:59:59 +03:00 -> Sat 23:00 +02:00
  (Saturday's 23:00-23:59 twice: 20:00-20:59Z, then 21:00-21:59Z).

In 2027 Havana and Beirut again change at midnight (Havana 2027-03-14T05:00Z and
2027-11-07T05:00Z, Beirut 2027-03-27T22:00Z and 2027-10-30T21:00Z; pinned below), and
America/Santiago does too (00:00 -> 01:00 in September, 24:00 -> 23:00 in April); Havana
and Beirut cover both shapes: a midnight gap and a repeated hour on either side of it.
"""

from __future__ import annotations

import re
import time
import tomllib
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from sched_core.matcher import (
    DEFAULT_TZ,
    fire_times,
    last_fire,
    matches,
    next_fire,
    window_key,
    zone_table,
)
from sched_core.model import Schedule

NY = ZoneInfo("America/New_York")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")
HAVANA = ZoneInfo("America/Havana")
BEIRUT = ZoneInfo("Asia/Beirut")

NY_SPRING = datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
NY_FALL = datetime(2026, 11, 1, 6, 0, tzinfo=UTC)
LH_FALL = datetime(2026, 4, 4, 15, 0, tzinfo=UTC)
LH_SPRING = datetime(2026, 10, 3, 15, 30, tzinfo=UTC)
HAVANA_SPRING = datetime(2026, 3, 8, 5, 0, tzinfo=UTC)
HAVANA_FALL = datetime(2026, 11, 1, 5, 0, tzinfo=UTC)
BEIRUT_SPRING = datetime(2026, 3, 28, 22, 0, tzinfo=UTC)
BEIRUT_FALL = datetime(2026, 10, 24, 21, 0, tzinfo=UTC)
# 2027's changes at midnight (the module's docstring).
HAVANA_SPRING_2027 = datetime(2027, 3, 14, 5, tzinfo=UTC)
HAVANA_FALL_2027 = datetime(2027, 11, 7, 5, tzinfo=UTC)
BEIRUT_SPRING_2027 = datetime(2027, 3, 27, 22, tzinfo=UTC)
BEIRUT_FALL_2027 = datetime(2027, 10, 30, 21, tzinfo=UTC)
SECOND = timedelta(seconds=1)
MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)
DST_DATA = tomllib.loads((Path(__file__).parent / "data" / "dst_cases.toml").read_text())
"""tests/data/dst_cases.toml: the transitions pinned, and the cases of fire_times around them."""


def clock(hours: list[str], minute: str, days: list[str] | None = None) -> Schedule:
    return Schedule(days=days or ["*"], hours=hours, minute=minute)


def every(minutes: int) -> Schedule:
    return Schedule(interval_minutes=minutes)


def local_fires(schedule: Schedule, tz: ZoneInfo, start: datetime, end: datetime) -> list[str]:
    """Return the fire instants as local ISO text, which shows the offset of each copy."""
    found = list(fire_times(schedule, start, end, tz))
    assert all(when.tzinfo is UTC for when in found)
    return [when.astimezone(tz).isoformat(timespec="minutes") for when in found]


# --- the transition instants themselves -------------------------------------------


@pytest.mark.parametrize(("tz", "moment", "before", "after"), [
    pytest.param(ZoneInfo(t["zone"]), globals()[t["at"]], t["before"], t["after"], id=t["at"])
    for t in DST_DATA["transition"]])
def test_pinned_transitions_are_what_zoneinfo_says(
    tz: ZoneInfo, moment: datetime, before: str, after: str
) -> None:
    assert (moment - SECOND).astimezone(tz).isoformat() == before
    assert moment.astimezone(tz).isoformat() == after
    table = zone_table(tz)
    stamp = int(moment.timestamp())
    assert table.transitions(stamp - 1, stamp) == [
        (stamp, int(_offset(moment - SECOND, tz)), int(_offset(moment, tz)))
    ]
    assert table.transitions(stamp, stamp + 3600) == []


def _offset(when: datetime, tz: ZoneInfo) -> float:
    offset = when.astimezone(tz).utcoffset()
    assert offset is not None
    return offset.total_seconds()


@pytest.mark.parametrize(
    ("tz", "years"),
    [
        (NY, (1883, 1945, 2026, 2027, 2100)),
        (LORD_HOWE, (1981, 2026, 2027)),
        (HAVANA, (2026, 2027)),
        (BEIRUT, (2026,)),
        (ZoneInfo("Asia/Kathmandu"), (1986, 2026)),
        (ZoneInfo("UTC"), (2026,)),
    ],
)
def test_zone_table_offsets_equal_zoneinfo(tz: ZoneInfo, years: tuple[int, ...]) -> None:
    table = zone_table(tz)
    for year in years:
        start = int(datetime(year, 1, 1, tzinfo=UTC).timestamp())
        for stamp in range(start, start + 366 * 86_400, 3_607):
            expected = datetime.fromtimestamp(stamp, tz).utcoffset()
            assert expected is not None
            assert table.offset_at(stamp) == int(expected.total_seconds()), (tz, stamp)


# --- matches: the plain predicate ---------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "now", "expected"),
    [
        # Mon 2026-11-30 02:30 EST == 07:30Z.
        (clock(["2"], "30", ["mon"]), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), True),
        (clock(["02"], "30", ["mon"]), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), True),
        (clock(["2"], "05", ["mon"]), datetime(2026, 11, 30, 7, 5, tzinfo=UTC), True),
        (clock(["2"], "30", ["tue"]), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), False),
        (clock(["2"], "30", ["*"]), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), True),
        (clock(["3"], "30", ["mon"]), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), False),
        (clock(["2"], "31", ["mon"]), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), False),
        (clock(["*"], "30", ["mon"]), datetime(2026, 11, 30, 12, 30, tzinfo=UTC), True),
        (
            clock(["1", "2"], "30", ["sat", "mon"]),
            datetime(2026, 11, 30, 7, 30, 59, tzinfo=UTC),
            True,
        ),
        # Seconds do not matter; the next minute does.
        (clock(["2"], "30", ["mon"]), datetime(2026, 11, 30, 7, 31, tzinfo=UTC), False),
        # The local date decides the day: Mon 2026-11-30 23:00 EST is Tue 04:00Z.
        (clock(["23"], "0", ["mon"]), datetime(2026, 12, 1, 4, 0, tzinfo=UTC), True),
        (clock(["23"], "0", ["tue"]), datetime(2026, 12, 1, 4, 0, tzinfo=UTC), False),
        # Interval: wall minutes since local midnight.
        (every(15), datetime(2026, 11, 30, 5, 0, tzinfo=UTC), True),  # 00:00 EST
        (every(7), datetime(2026, 11, 30, 4, 58, tzinfo=UTC), False),  # 23:58: 1438 % 7 == 3
        (every(7), datetime(2026, 11, 30, 4, 59, tzinfo=UTC), False),  # 23:59: 1439 % 7 == 4
        (every(7), datetime(2026, 11, 30, 5, 0, tzinfo=UTC), True),  # 00:00: across midnight
        (every(7), datetime(2026, 11, 30, 5, 7, tzinfo=UTC), True),  # 00:07
        (every(7), datetime(2026, 11, 30, 4, 55, tzinfo=UTC), True),  # 23:55: 1435 == 7 * 205
        (every(90), datetime(2026, 11, 30, 6, 30, tzinfo=UTC), True),  # 01:30
        (every(1441), datetime(2026, 11, 30, 5, 0, tzinfo=UTC), True),  # only midnight
        (every(1441), datetime(2026, 11, 30, 5, 1, tzinfo=UTC), False),
        (Schedule(on="after_wave"), datetime(2026, 11, 30, 7, 30, tzinfo=UTC), False),
        (
            Schedule(days=["*"], hours=["*"], minute="0", on="after_wave"),
            datetime(2026, 11, 30, 7, 0, tzinfo=UTC),
            False,
        ),
    ],
)
def test_matches(schedule: Schedule, now: datetime, expected: bool) -> None:
    assert matches(schedule, now) is expected
    assert matches(schedule, now, NY) is expected
    assert matches(schedule, now.astimezone(LORD_HOWE)) is expected


def test_matches_reads_the_given_zone() -> None:
    # 2026-11-30T07:30Z is 18:30 (+11:00) in Lord Howe and 02:30 in New York.
    now = datetime(2026, 11, 30, 7, 30, tzinfo=UTC)
    assert matches(clock(["18"], "30", ["mon"]), now, LORD_HOWE)
    assert not matches(clock(["2"], "30", ["mon"]), now, LORD_HOWE)
    assert matches(clock(["2"], "30", ["mon"]), now.astimezone(timezone(timedelta(hours=5))))
    assert DEFAULT_TZ == NY


def test_matches_is_the_plain_predicate_across_dst() -> None:
    # No DST rules here: 02:30 never exists on the spring day and 01:30 matches twice.
    assert not any(matches(clock(["2"], "30"), NY_SPRING + k * MINUTE) for k in range(-120, 120))
    assert matches(clock(["1"], "30"), NY_FALL - 30 * MINUTE)
    assert matches(clock(["1"], "30"), NY_FALL + 30 * MINUTE)


@pytest.mark.parametrize(
    "call",
    [
        lambda naive: matches(clock(["2"], "30"), naive),
        lambda naive: list(fire_times(clock(["2"], "30"), naive, naive + HOUR)),
        lambda naive: list(fire_times(clock(["2"], "30"), naive.replace(tzinfo=UTC), naive)),
        lambda naive: next_fire(clock(["2"], "30"), naive),
        lambda naive: last_fire(clock(["2"], "30"), naive),
        lambda naive: window_key("s-1", naive),
    ],
)
def test_naive_datetimes_are_rejected(call: object) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match="naive"):
        call(datetime(2026, 11, 30, 7, 30))


# --- fire_times across DST ---------------------------------------------------------

def _dst_cases() -> list[Any]:
    """The cases of tests/data/dst_cases.toml, as parameters of the test below."""
    params = []
    for case in DST_DATA["case"]:
        around: datetime = globals()[case["around"]]
        params.append(pytest.param(
            ZoneInfo(case["zone"]), Schedule.model_validate(case["schedule"]),
            around - case["minutes_before"] * MINUTE, around + case["minutes_after"] * MINUTE,
            case["fires"], id=case["id"]))
    return params


DST_CASES = _dst_cases()


@pytest.mark.parametrize(("tz", "schedule", "start", "end", "expected"), DST_CASES)
def test_fire_times_across_dst(
    tz: ZoneInfo, schedule: Schedule, start: datetime, end: datetime, expected: list[str]
) -> None:
    assert local_fires(schedule, tz, start, end) == expected


def test_fire_times_bounds_are_start_inclusive_end_exclusive() -> None:
    schedule = clock(["2"], "30")
    moved = NY_SPRING  # 02:30 moved to 03:00 EDT
    assert list(fire_times(schedule, moved, moved + SECOND, NY)) == [moved]
    assert list(fire_times(schedule, moved - SECOND, moved, NY)) == []
    assert list(fire_times(schedule, moved + SECOND, moved + HOUR, NY)) == []
    assert list(fire_times(schedule, moved, moved, NY)) == []
    assert list(fire_times(schedule, moved + HOUR, moved, NY)) == []


def test_fire_times_of_an_event_schedule_is_empty() -> None:
    event = Schedule(on="after_wave")
    assert list(fire_times(event, NY_SPRING - 9 * 86_400 * SECOND, NY_SPRING, NY)) == []
    assert next_fire(event, NY_SPRING) is None
    assert last_fire(event, NY_SPRING) is None


def test_fire_times_accepts_any_aware_bounds_and_defaults_to_new_york() -> None:
    plus5 = timezone(timedelta(hours=5))
    found = list(fire_times(clock(["2"], "30"), NY_SPRING.astimezone(plus5), NY_SPRING + HOUR))
    assert found == [NY_SPRING]


def test_fire_times_is_lazy_over_long_ranges() -> None:
    found = fire_times(every(1), datetime(2026, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC))
    assert next(found) == datetime(2026, 1, 1, tzinfo=UTC)
    assert next(found) == datetime(2026, 1, 1, 0, 1, tzinfo=UTC)


def test_leading_zero_and_duplicate_hours_fire_once() -> None:
    schedule = Schedule(days=["mon", "mon"], hours=["02", "2"], minute="05")
    found = list(
        fire_times(
            schedule, datetime(2026, 11, 30, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC), NY
        )
    )
    assert found == [datetime(2026, 11, 30, 7, 5, tzinfo=UTC)]


# --- next_fire / last_fire at the boundaries ----------------------------------------


@pytest.mark.parametrize(
    ("tz", "schedule", "moment"),
    [
        (NY, clock(["2"], "30"), NY_SPRING),  # moved 02:30
        (NY, clock(["1"], "30"), NY_FALL - 30 * MINUTE),  # first copy of 01:30
        (LORD_HOWE, clock(["2"], "15"), LH_SPRING),  # moved 02:15
        (HAVANA, clock(["0"], "30", ["sun"]), HAVANA_SPRING),  # moved midnight window
        (BEIRUT, clock(["23"], "30", ["sat"]), BEIRUT_FALL - 30 * MINUTE),
        (NY, Schedule(days=["*"], hours=["*"], minute="30"), NY_FALL + 30 * MINUTE),
        (LORD_HOWE, every(15), LH_FALL + 15 * MINUTE),  # second copy of 01:45
    ],
)
def test_next_and_last_fire_just_before_at_and_after(
    tz: ZoneInfo, schedule: Schedule, moment: datetime
) -> None:
    assert next_fire(schedule, moment - SECOND, tz) == moment
    assert next_fire(schedule, moment - MINUTE, tz) == moment
    nxt = next_fire(schedule, moment, tz)
    assert nxt is not None and nxt > moment
    assert last_fire(schedule, moment, tz) == moment
    assert last_fire(schedule, moment + SECOND, tz) == moment
    assert last_fire(schedule, moment + MINUTE - SECOND, tz) == moment
    previous = last_fire(schedule, moment - SECOND, tz)
    assert previous is not None and previous < moment


def test_next_fire_skips_the_second_copy_for_fixed_hours() -> None:
    # 01:30 EDT fired at 05:30Z; from inside the second copy of 01:xx, the next is tomorrow.
    schedule = clock(["1"], "30")
    assert next_fire(schedule, NY_FALL + 10 * MINUTE, NY) == datetime(
        2026, 11, 2, 6, 30, tzinfo=UTC
    )
    assert last_fire(schedule, NY_FALL + 40 * MINUTE, NY) == NY_FALL - 30 * MINUTE
    wildcard = Schedule(days=["*"], hours=["*"], minute="30")
    assert next_fire(wildcard, NY_FALL + 10 * MINUTE, NY) == NY_FALL + 30 * MINUTE


def test_next_and_last_fire_return_none_beyond_eight_days() -> None:
    # A weekly window is always within 8 days; an event never is.
    weekly = clock(["2"], "30", ["sun"])
    after = datetime(2026, 12, 6, 7, 30, tzinfo=UTC)  # Sun 02:30 EST
    assert next_fire(weekly, after, NY) == after + 7 * 86_400 * SECOND
    assert last_fire(weekly, after - SECOND, NY) == after - 7 * 86_400 * SECOND


# --- window_key ---------------------------------------------------------------------

KEY_CHARS = re.compile(r"[A-Za-z0-9@:+._-]+")


def test_window_key_of_a_moved_window() -> None:
    assert window_key("s-1", NY_SPRING) == "s-1@2026-03-08T03:00-04:00"
    assert window_key("s-1", NY_SPRING, NY) == "s-1@2026-03-08T03:00-04:00"
    assert window_key("s-1", LH_SPRING, LORD_HOWE) == "s-1@2026-10-04T02:30+11:00"


def test_window_key_tells_the_two_copies_apart() -> None:
    first = window_key("s-1", NY_FALL - 30 * MINUTE, NY)
    second = window_key("s-1", NY_FALL + 30 * MINUTE, NY)
    assert first == "s-1@2026-11-01T01:30-04:00"
    assert second == "s-1@2026-11-01T01:30-05:00"
    assert window_key("s-1", LH_FALL, LORD_HOWE) == "s-1@2026-04-05T01:30+10:30"
    assert window_key("s-1", LH_FALL - 30 * MINUTE, LORD_HOWE) == "s-1@2026-04-05T01:30+11:00"


def test_window_key_is_stable_and_uses_only_safe_characters() -> None:
    when = datetime(2026, 11, 30, 7, 30, tzinfo=UTC)
    key = window_key("s-1", when.astimezone(LORD_HOWE), NY)
    assert key == window_key("s-1", when, NY) == "s-1@2026-11-30T02:30-05:00"
    assert KEY_CHARS.fullmatch(key.removeprefix("s-1"))
    assert window_key("s-1", when, ZoneInfo("UTC")) == "s-1@2026-11-30T07:30+00:00"
    # Seconds do not change the window.
    assert window_key("s-1", when + 30 * SECOND, NY) == key


# --- purity -------------------------------------------------------------------------


def test_results_do_not_depend_on_the_machine_timezone(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = clock(["2"], "30")
    window = (NY_SPRING - 86_400 * SECOND, NY_SPRING + 86_400 * SECOND)

    def observe() -> tuple[object, ...]:
        return (
            list(fire_times(schedule, *window)),
            next_fire(schedule, NY_SPRING - HOUR),
            last_fire(schedule, NY_SPRING + HOUR),
            matches(schedule, datetime(2026, 11, 30, 7, 30, tzinfo=UTC)),
            window_key("s-1", NY_SPRING),
        )

    expected = (
        [
            datetime(2026, 3, 7, 7, 30, tzinfo=UTC),
            NY_SPRING,
            datetime(2026, 3, 9, 6, 30, tzinfo=UTC),
        ],
        NY_SPRING,
        NY_SPRING,
        True,
        "s-1@2026-03-08T03:00-04:00",
    )
    assert observe() == expected
    try:
        for machine_zone in ("Pacific/Chatham", "Asia/Kolkata", "America/Los_Angeles"):
            monkeypatch.setenv("TZ", machine_zone)
            time.tzset()
            assert observe() == expected, machine_zone
    finally:
        monkeypatch.undo()
        time.tzset()


def test_zone_table_moves_between_distant_years() -> None:
    table = zone_table(ZoneInfo("Europe/London"))
    for year in (2026, 2100, 1945, 2027, 2026):
        for month in (1, 4, 7, 10):
            when = datetime(year, month, 15, 12, tzinfo=UTC)
            expected = when.astimezone(ZoneInfo("Europe/London")).utcoffset()
            assert expected is not None
            assert table.offset_at(int(when.timestamp())) == expected.total_seconds()
