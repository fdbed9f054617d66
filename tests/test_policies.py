"""Row policies, pure: planner, start guard and missed check, with times passed in.

New York, 2026: the spring-forward day 2026-03-08 jumps from 02:00 EST (07:00Z)
to 03:00 EDT; the fall-back day 2026-11-01 repeats 01:00-01:59 (05:00Z-05:59Z as
EDT, 06:00Z-06:59Z as EST). 2026-03-07 is a Saturday, 2026-11-30 a Monday.
Australia/Adelaide is the half-hour zone with DST: on 2026-10-04 it jumps from
02:00 ACST (+09:30, 16:30Z the day before) to 03:00 ACDT (+10:30). Asia/Kolkata
is +05:30 all year.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from sched_core.guard import Verdict, decide_start, retry_allowed
from sched_core.matcher import fire_times
from sched_core.model import LocalSchedule
from sched_core.plan import Fate, missed, plan_windows, planned_fate
from sched_core.policies import (
    describe_policies,
    jitter_offset,
    latest_window,
    run_start,
    window_block,
    window_starts,
)
from tests.factories import at, every
from tests.views import GRACE, NY, guard_view, row, utc, view_of

ADELAIDE = ZoneInfo("Australia/Adelaide")
KOLKATA = ZoneInfo("Asia/Kolkata")
HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)
SECOND = timedelta(seconds=1)
DAY = timedelta(days=1)


NIGHTLY = at(["2"], "30")


def plan(rows: list[LocalSchedule], now: datetime, **kw: Any) -> list[Any]:
    options: dict[str, Any] = {
        "last_fired": {}, "first_seen": {}, "now": now, "grace": GRACE, "horizon": HOUR,
        "min_windows": 3, "max_runs": 1000, "tz": NY, "node": "node-a",
    }
    options.update(kw)
    view = view_of(rows, options)
    return plan_windows(view, **options).windows



def windows(rows: list[LocalSchedule], now: datetime, **kw: Any) -> list[datetime]:
    return [w.window for w in plan(rows, now, **kw)]


def guard(r: LocalSchedule | None, window: datetime, *, first_try: datetime,
          now: datetime | None = None, **kw: Any) -> Any:
    options: dict[str, Any] = {"schedule_id": r.id if r else "s", "window": window,
                               "last_fired": None, "first_seen": utc(2026, 1, 1),
                               "grace": GRACE, "tz": NY, "node": "node-a"}
    options.update(kw)
    view = guard_view(r, options)
    return decide_start(r, view, first_try=first_try, now=now or first_try, **options)


def missed_of(rows: list[LocalSchedule], now: datetime, **kw: Any) -> list[Any]:
    options: dict[str, Any] = {"last_fired": {}, "first_seen": {}, "planned_through": {},
                               "now": now, "grace": GRACE, "tz": NY, "node": "node-a"}
    options.update(kw)
    return missed(view_of(rows, options), **options)


# -- jitter ------------------------------------------------------------------------------


def test_the_jitter_offset_is_stable_in_range_and_differs_by_node_and_schedule() -> None:
    # Pinned: a node's runs must not move when the code is upgraded.
    assert jitter_offset("node-a", "s-1", 3600) == 2499
    assert jitter_offset("node-b", "s-1", 3600) == 1442
    assert jitter_offset("node-a", "s-2", 3600) == 1644
    assert jitter_offset("node-a", "s-1", 0) == 0
    offsets = {jitter_offset(f"node-{n}", "s-1", 600) for n in range(200)}
    assert min(offsets) >= 0 and max(offsets) < 600 and len(offsets) > 150


@pytest.mark.parametrize("day", [utc(2026, 3, 8), utc(2026, 11, 1), utc(2026, 6, 1)])
def test_a_nightly_runs_at_the_same_offset_every_day_dst_days_included(day: datetime) -> None:
    r = row("s-1", NIGHTLY, jitter=3600)
    got = plan([r], day - 2 * HOUR, min_windows=3)
    assert [w.start - w.window for w in got] == [timedelta(seconds=2499)] * 3
    # The identity stays the window's: 02:30 local (03:00 EDT on the spring-forward day).
    expected = list(fire_times(r.schedule, day - 2 * HOUR, day + 4 * DAY, NY))[:3]
    assert [w.window for w in got] == expected
    assert got[0].key.startswith("s-1@") and got[0].key.endswith(
        ("T03:00-04:00", "T02:30-05:00", "T02:30-04:00"))


def test_two_nodes_with_the_same_row_start_at_different_instants() -> None:
    r = row("s-1", NIGHTLY, jitter=3600)
    a = plan([r], utc(2026, 11, 30, 6), node="node-a", min_windows=1)[0]
    b = plan([r], utc(2026, 11, 30, 6), node="node-b", min_windows=1)[0]
    assert a.window == b.window == utc(2026, 11, 30, 7, 30) and a.key == b.key
    assert a.start == utc(2026, 11, 30, 7, 30) + timedelta(seconds=2499)
    assert b.start == utc(2026, 11, 30, 7, 30) + timedelta(seconds=1442)


def test_jitter_never_moves_a_run_to_or_past_the_next_window() -> None:
    """Every 5 minutes with an hour's jitter: the offset is taken modulo the 300 s gap."""
    r = row("s-1", every(5), jitter=3600)
    pairs = list(window_starts(r, utc(2026, 3, 8, 6), utc(2026, 3, 8, 9), node="node-a", tz=NY))
    assert len(pairs) == 36  # 01:00 EST to 05:00 EDT: the gap costs no 5-minute UTC step
    for (window, start), (following, _) in itertools.pairwise(pairs):
        assert window <= start < following
    assert {start - window for window, start in pairs} == {timedelta(seconds=2499 % 300)}


def test_a_window_whose_jittered_run_starts_inside_the_grace_is_planned_not_missed() -> None:
    r = row("s-1", NIGHTLY, jitter=3600)
    window = utc(2026, 11, 30, 7, 30)  # its run starts at 08:11:39
    now = window + timedelta(seconds=2499) + GRACE  # the grace's last instant
    assert [w.window for w in plan([r], now, min_windows=1)] == [window]
    assert missed_of([r], now) == []
    later = now + SECOND
    assert window not in [w.window for w in plan([r], later, min_windows=1)]
    [item] = missed_of([r], later)
    assert item.windows == [window] and item.recover is not None


def test_the_guard_measures_lateness_from_the_jittered_start() -> None:
    r = row("s-1", NIGHTLY, jitter=3600, miss_policy="skip")
    window = utc(2026, 11, 30, 7, 30)
    start = window + timedelta(seconds=2499)
    assert run_start(r, window, node="node-a", tz=NY) == start
    on_time = guard(r, window, first_try=start + GRACE)
    assert on_time.runs and on_time.reason == "window 2026-11-30 02:30 EST: on time"
    late = guard(r, window, first_try=start + GRACE + SECOND)
    assert late.verdict is Verdict.SKIP
    assert late.reason == ("window 2026-11-30 02:30 EST missed: 5 min 1 s late (grace 5 min); "
                           "miss policy skip")


def test_a_changed_jitter_moves_the_untried_run_and_keeps_its_window() -> None:
    r = row("s-1", NIGHTLY, jitter=600)
    window = utc(2026, 11, 30, 7, 30)
    offset = timedelta(seconds=2499 % 600)  # node-a's share of the 600 s jitter
    assert planned_fate(r, "s-1", window, window, last_fired=None, tz=NY,
                        node="node-a") == Fate(move_to=window + offset)
    assert planned_fate(r, "s-1", window + DAY, window + DAY + offset, last_fired=None, tz=NY,
                        node="node-a") == Fate()


# -- catchup_window ----------------------------------------------------------------------


def test_two_hours_down_with_a_one_hour_catchup_window_recovers_nothing_older() -> None:
    """Hourly at :00, down from 09:58 to 12:10 (10:00, 11:00 and 12:00 never ran)."""
    r = row("h", at(["*"], "0"), catchup_window=3600)
    now = utc(2026, 11, 30, 17, 10)  # 12:10 EST
    down = {"h": utc(2026, 11, 30, 14, 58)}  # the planner last handled 09:58
    [item] = missed_of([r], now, planned_through=down)
    assert item.windows == [utc(2026, 11, 30, 17)] and item.recover is not None
    assert item.recover.window == utc(2026, 11, 30, 17)
    # The planned 11:00 run, started now, is coalesced into 12:00; 10:00 is out of reach.
    eleven = guard(r, utc(2026, 11, 30, 16), first_try=now)
    assert eleven.reason.endswith("coalesced into 2026-11-30 12:00 EST (the latest missed window)")
    default = row("h", at(["*"], "0"))
    assert missed_of([default], now, planned_through=down)[0].count == 3  # 10:00 .. 12:00


@pytest.mark.parametrize(("now", "recovered"), [
    (utc(2026, 11, 30, 8, 29, 59), True),   # 03:29:59 EST: the 02:30 window is 59:59 old
    (utc(2026, 11, 30, 8, 30), False),      # exactly the catch-up window old
    (utc(2026, 11, 30, 8, 30, 1), False),
])
def test_the_catchup_window_boundary_in_the_guard_and_the_missed_check(
    now: datetime, recovered: bool
) -> None:
    r = row("s", NIGHTLY, catchup_window=3600)
    window = utc(2026, 11, 30, 7, 30)
    assert bool(missed_of([r], now)) is recovered
    decision = guard(r, window, first_try=now)
    assert decision.runs is recovered
    if not recovered:
        assert decision.reason.endswith("older than the 1 h catch-up window")


# -- paused ------------------------------------------------------------------------------

UNTIL = utc(2026, 11, 30, 17)  # 12:00 EST
PAUSED = {"note": "disk swap", "until": "2026-11-30T17:00:00Z"}


def test_a_paused_row_plans_nothing_before_until_and_resumes_at_it() -> None:
    r = row("p", every(30), paused=PAUSED)
    got = windows([r], utc(2026, 11, 30, 16, 0), horizon=2 * HOUR, min_windows=0)
    assert got == [UNTIL, UNTIL + 30 * MINUTE]  # 11:00 and 11:30 are in the pause


@pytest.mark.parametrize(("window", "runs"), [
    (UNTIL - 30 * MINUTE, False), (UNTIL, True), (UNTIL + 30 * MINUTE, True)])
def test_the_guard_skips_windows_in_the_pause_and_runs_from_until(
    window: datetime, runs: bool
) -> None:
    r = row("p", every(30), paused=PAUSED)
    decision = guard(r, window, first_try=window + SECOND)
    assert decision.runs is runs
    if not runs:
        assert decision.reason == ("window 2026-11-30 11:30 EST skipped: paused: disk swap "
                                   "(until 2026-11-30 12:00 EST)")


def test_windows_in_the_pause_are_never_recovered_nor_reported_missed() -> None:
    r = row("p", every(30), paused=PAUSED)
    # Down across the end of the pause: only the windows from until on are missed.
    [item] = missed_of([r], utc(2026, 11, 30, 18, 10))
    assert item.windows == [UNTIL, UNTIL + 30 * MINUTE, UNTIL + HOUR]
    # Down only during the pause: nothing is missed, nothing recovered.
    assert missed_of([r], UNTIL + 4 * MINUTE) == []
    # A late run of a paused window after the pause ended is still skipped.
    late = guard(r, UNTIL - HOUR, first_try=UNTIL + 2 * HOUR)
    assert late.verdict is Verdict.SKIP and "paused: disk swap" in late.reason


def test_a_pause_without_until_plans_and_runs_nothing() -> None:
    r = row("p", every(30), paused={"note": "repo moved"})
    assert windows([r], utc(2026, 11, 30, 16)) == []
    decision = guard(r, UNTIL, first_try=UNTIL)
    assert decision.reason == "window 2026-11-30 12:00 EST skipped: paused: repo moved " \
                              "(until resumed)"


def test_a_new_pause_makes_the_planned_runs_in_it_obsolete_with_the_reason() -> None:
    r = row("p", every(30), paused=PAUSED)
    got = [planned_fate(r, "p", UNTIL + n * 30 * MINUTE, UNTIL + n * 30 * MINUTE,
                        last_fired=None, tz=NY, node="node-a").delete for n in (-1, 0, 1)]
    assert got == [
        "schedule p skips this window: paused: disk swap (until 2026-11-30 12:00 EST)",
        None, None]


# -- not_before, not_after ---------------------------------------------------------------


def test_active_dates_include_both_ends() -> None:
    r = row("d", every(30), not_before="2026-11-30T16:00:00Z", not_after="2026-11-30T17:00:00Z")
    got = windows([r], utc(2026, 11, 30, 15), horizon=4 * HOUR, min_windows=0)
    assert got == [utc(2026, 11, 30, 16), utc(2026, 11, 30, 16, 30), utc(2026, 11, 30, 17)]
    before = guard(r, utc(2026, 11, 30, 15, 30), first_try=utc(2026, 11, 30, 15, 30))
    assert before.reason == ("window 2026-11-30 10:30 EST skipped: before not_before "
                             "(2026-11-30 11:00 EST)")
    after = guard(r, utc(2026, 11, 30, 17, 30), first_try=utc(2026, 11, 30, 17, 30))
    assert after.reason == ("window 2026-11-30 12:30 EST skipped: after not_after "
                            "(2026-11-30 12:00 EST)")
    assert guard(r, utc(2026, 11, 30, 17), first_try=utc(2026, 11, 30, 17)).runs


def test_not_before_one_second_after_a_window_skips_it() -> None:
    r = row("d", every(30), not_before="2026-11-30T16:00:01Z")
    assert windows([r], utc(2026, 11, 30, 15, 50), horizon=HOUR, min_windows=0) == [
        utc(2026, 11, 30, 16, 30)]


# -- blackouts ---------------------------------------------------------------------------

NIGHT = {"days": ["sat"], "from": "22:00", "to": "06:00"}


@pytest.mark.parametrize(("local", "blocked"), [
    ((2026, 11, 28, 21, 59), False),  # Saturday, just before
    ((2026, 11, 28, 22, 0), True),    # at the start
    ((2026, 11, 29, 0, 0), True),     # Sunday midnight, carried over from Saturday
    ((2026, 11, 29, 5, 59), True),    # just before the end
    ((2026, 11, 29, 6, 0), False),    # the end is not in it
    ((2026, 11, 29, 22, 0), False),   # Sunday is not a start day
    ((2026, 11, 28, 3, 0), False),    # Saturday early: Friday started no blackout
])
def test_a_blackout_across_midnight(local: tuple[int, ...], blocked: bool) -> None:
    r = row("b", every(1), blackouts=[NIGHT])
    window = datetime(*local, tzinfo=NY).astimezone(UTC)
    reason = window_block(r, window, tz=NY)
    assert (reason == "in the blackout sat 22:00-06:00 (to the next day)") is blocked


def test_a_blackout_across_midnight_and_the_spring_forward_gap() -> None:
    """Saturday 22:00 to Sunday 06:00 EDT is 7 hours; every 30 min, 02:00-02:30 do not exist."""
    r = row("b", every(30), blackouts=[NIGHT])
    got = windows([r], utc(2026, 3, 8, 2, 0), horizon=10 * HOUR, min_windows=0)  # Sat 21:00 EST
    local = [w.astimezone(NY).strftime("%H:%M") for w in got]
    assert local == ["21:00", "21:30", "06:00", "06:30", "07:00", "07:30"]
    assert guard(r, utc(2026, 3, 8, 7), first_try=utc(2026, 3, 8, 7)).reason == (
        "window 2026-03-08 03:00 EDT skipped: in the blackout sat 22:00-06:00 (to the next day)")


def test_a_blackout_judges_the_window_after_its_dst_move() -> None:
    """02:30 does not exist on 2026-03-08: the nightly runs at 03:00 EDT, after 01:00-03:00."""
    r = row("b", NIGHTLY, blackouts=[{"days": ["sun"], "from": "01:00", "to": "03:00"}])
    assert windows([r], utc(2026, 3, 8, 5), min_windows=1) == [utc(2026, 3, 8, 7)]
    early = row("b", at(["1"], "30"), blackouts=[{"days": ["sun"], "from": "01:00", "to": "03:00"}])
    assert windows([early], utc(2026, 3, 8, 5), min_windows=1) == [utc(2026, 3, 9, 5, 30)]


def test_a_blackout_covers_both_copies_of_the_repeated_hour() -> None:
    r = row("b", at(["*"], "30"), blackouts=[{"days": ["sun"], "from": "01:00", "to": "02:00"}])
    got = windows([r], utc(2026, 11, 1, 4, 0), horizon=4 * HOUR, min_windows=0)  # 00:00 EDT
    assert [w.astimezone(NY).strftime("%H:%M%Z") for w in got] == [
        "00:30EDT", "02:30EST"]  # 01:30 EDT and 01:30 EST are both blacked out


def test_a_blackout_in_a_half_hour_zone_across_its_dst_jump() -> None:
    """Adelaide, 2026-10-04: 02:00 ACST jumps to 03:00 ACDT; a blackout 01:30-03:30 that night."""
    r = row("b", every(30), timezone="Australia/Adelaide",
            blackouts=[{"days": ["sun"], "from": "01:30", "to": "03:30"}])
    got = windows([r], utc(2026, 10, 3, 15, 0), horizon=2 * HOUR + 30 * MINUTE, min_windows=0)
    local = [w.astimezone(ADELAIDE).strftime("%H:%M%Z") for w in got]
    # 00:30 ACST, 01:00 ACST, then 01:30 .. 03:00 are dark (02:xx does not exist), 03:30 ACDT.
    assert local == ["00:30ACST", "01:00ACST", "03:30ACDT"]


def test_windows_in_a_blackout_are_not_missed_and_a_late_run_coalesces_past_them() -> None:
    """Hourly; 11:00 is blacked out; down 08:50-11:20: 10:00 is the latest that may run."""
    r = row("h", at(["*"], "0"), blackouts=[{"days": ["*"], "from": "11:00", "to": "11:30"}])
    now = utc(2026, 11, 30, 16, 20)  # 11:20 EST
    [item] = missed_of([r], now, planned_through={"h": utc(2026, 11, 30, 13, 50)})
    assert item.windows == [utc(2026, 11, 30, 14), utc(2026, 11, 30, 15)]
    assert item.recover is not None and item.recover.window == utc(2026, 11, 30, 15)
    nine = guard(r, utc(2026, 11, 30, 14), first_try=now)
    assert nine.reason.endswith("coalesced into 2026-11-30 10:00 EST (the latest missed window)")
    ten = guard(r, utc(2026, 11, 30, 15), first_try=now)
    assert ten.runs and ten.late


# -- timezone ----------------------------------------------------------------------------


def test_a_row_in_a_half_hour_zone_on_a_new_york_node() -> None:
    r = row("k", NIGHTLY, timezone="Asia/Kolkata")
    [w] = plan([r], utc(2026, 3, 7, 20), min_windows=1)
    assert w.window == utc(2026, 3, 7, 21) and w.key == "k@2026-03-08T02:30+05:30"
    decision = guard(r, w.window, first_try=w.window)
    assert decision.reason == "window 2026-03-08 02:30 IST: on time"
    # The node's own zone would have been 02:30 EST: that window is no longer the row's.
    est = utc(2026, 3, 7, 7, 30)
    assert planned_fate(r, "k", est, est, last_fired=None, tz=NY, node="node-a").delete == (
        "schedule k no longer has this window (its times changed)")


def test_a_new_york_row_on_a_utc_node_follows_new_yorks_dst() -> None:
    r = row("n", NIGHTLY, timezone="America/New_York")
    got = plan([r], utc(2026, 3, 8, 5), tz=ZoneInfo("UTC"), min_windows=2)
    assert [w.window for w in got] == [utc(2026, 3, 8, 7), utc(2026, 3, 9, 6, 30)]
    assert got[0].key == "n@2026-03-08T03:00-04:00"


# -- min_interval ------------------------------------------------------------------------

WEEK = 7 * 86400


def test_min_interval_counts_on_the_wall_clock_across_spring_forward() -> None:
    """Fired Mon 2026-03-02 02:30 EST; a week later is 02:30 EDT, only 6 d 23 h of real time."""
    r = row("c", NIGHTLY, min_interval=WEEK)
    last = utc(2026, 3, 2, 7, 30)
    week = utc(2026, 3, 9, 6, 30)
    assert guard(r, week, first_try=week, last_fired=last).runs
    sunday = utc(2026, 3, 8, 7)  # 03:00 EDT: 02:30 does not exist that day
    day_before = guard(r, sunday, first_try=sunday, last_fired=last)
    assert day_before.reason == (
        "window 2026-03-08 03:00 EDT skipped: min_interval 7 d: the last fire "
        "(2026-03-02 02:30 EST) was 6 d 30 min before")


@pytest.mark.parametrize(("last", "runs"), [
    (utc(2026, 11, 23, 7, 30, 1), False),  # a second less than 7 days before
    (utc(2026, 11, 23, 7, 30), True),      # exactly 7 days
    (utc(2026, 11, 23, 7, 29, 59), True),
])
def test_min_interval_boundary(last: datetime, runs: bool) -> None:
    r = row("c", NIGHTLY, min_interval=WEEK)
    window = utc(2026, 11, 30, 7, 30)
    assert guard(r, window, first_try=window, last_fired=last).runs is runs


def test_min_interval_plans_only_the_windows_that_will_run() -> None:
    """Nightly with min_interval 2 days, last fired Sunday: Tuesday, Thursday, Saturday."""
    r = row("c", NIGHTLY, min_interval=2 * 86400)
    got = windows([r], utc(2026, 11, 30, 6), min_windows=3,
                  last_fired={"c": utc(2026, 11, 29, 7, 30)})
    assert [w.strftime("%a") for w in got] == ["Tue", "Thu", "Sat"]
    # A planned run the last fire now holds back is obsolete, saying why.
    stale = utc(2026, 11, 30, 7, 30)
    why = planned_fate(r, "c", stale, stale, last_fired=utc(2026, 11, 29, 7, 30), tz=NY,
                       node="node-a").delete
    assert why is not None and why.startswith("schedule c skips this window: min_interval 2 d")


def test_min_interval_does_not_hold_back_the_rerun_of_an_interrupted_job() -> None:
    r = row("c", NIGHTLY, min_interval=WEEK)
    window = utc(2026, 11, 30, 7, 30)
    view = guard_view(r, {"schedule_id": "c", "last_fired": window, "node": "node-a"})
    decision = retry_allowed(r, view, schedule_id="c", window=window, now=window + MINUTE)
    assert decision.runs


def test_a_paused_window_is_not_rerun_after_an_interruption() -> None:
    r = row("p", NIGHTLY, paused={"note": "stop"})
    window = utc(2026, 11, 30, 7, 30)
    view = guard_view(r, {"schedule_id": "p", "last_fired": window, "node": "node-a"})
    decision = retry_allowed(r, view, schedule_id="p", window=window, now=window + MINUTE)
    assert decision.verdict is Verdict.SKIP and "paused: stop" in decision.reason


# -- shared helpers ----------------------------------------------------------------------


def test_latest_window_passes_over_blocked_windows() -> None:
    r = row("h", at(["*"], "0"), blackouts=[{"days": ["*"], "from": "11:00", "to": "12:00"}])
    now = utc(2026, 11, 30, 16, 30)  # 11:30 EST
    assert latest_window(r, now, since=now - DAY, node="n", tz=NY) == (
        utc(2026, 11, 30, 15), utc(2026, 11, 30, 15))


def test_policies_are_described_for_people() -> None:
    r = row("s-1", NIGHTLY, timezone="Asia/Kolkata", jitter=3600, paused=PAUSED,
            blackouts=[NIGHT], min_interval=WEEK, catchup_window=7200, overlap="buffer-one",
            repo_lock=True, not_after="2027-01-01T00:00:00Z")
    assert describe_policies(r, node="node-a", tz=NY) == [
        "zone Asia/Kolkata", "paused: disk swap (until 2026-11-30 22:30 IST)",
        "not after 2027-01-01 05:30 IST", "blackout sat 22:00-06:00 (to the next day)",
        "jitter 3600 s (this node: +41 min 39 s)", "min_interval 7 d", "catchup_window 2 h",
        "overlap buffer-one", "repo_lock r-1",
    ]


def test_a_planned_window_before_the_last_fire_is_left_to_the_guard() -> None:
    r = row("c", NIGHTLY, min_interval=WEEK)
    window = utc(2026, 11, 30, 7, 30)
    # A run of a window before the last fire is the guard's ("older than the last fire").
    assert planned_fate(r, "c", window - DAY, window - DAY, last_fired=window, tz=NY,
                        node="node-a") == Fate()
    assert guard(r, window - DAY, first_try=window - DAY, last_fired=window).reason == (
        "window 2026-11-29 02:30 EST is older than the last fire: coalesced into "
        "2026-11-30 02:30 EST, which already ran")


def test_on_demand_fires_honour_pause_dates_blackouts_and_min_interval(tmp_path: Any) -> None:
    """The chain fires its stages with fire_matching: a weekly check, a paused prune."""
    import json
    from pathlib import Path

    from sched_core import Config, Scheduler

    folder = Path(str(tmp_path))
    event = {"days": None, "hours": None, "minute": "", "on": "after_wave"}
    rows = [
        {**row("k", event, action="check", min_interval=6 * 86400).model_dump(mode="json")},
        {**row("p", event, action="prune", paused={"note": "audit"}).model_dump(mode="json")},
        {**row("n", event, action="prune", blackouts=[
            {"days": ["*"], "from": "03:00", "to": "04:00"}]).model_dump(mode="json")},
    ]
    (folder / "list.json").write_text(json.dumps({"schedules": rows}))
    fired: list[str] = []
    scheduler = Scheduler(Config(pull_url=(folder / "list.json").as_uri(), node_name="n-1",
                                 cache_path=folder / "cache.json",
                                 fire=lambda fire: fired.append(fire.schedule.id)),
                          now=utc(2026, 11, 1))
    scheduler.pull(utc(2026, 11, 1))
    night = utc(2026, 11, 23, 8, 10)  # Monday 03:10 EST: inside n's blackout
    assert scheduler.fire_matching("chain-after", lambda r: True, now=night) == 1
    assert fired == ["k"]
    after = night + HOUR  # 04:10: n fires; k fired an hour ago, p stays paused
    scheduler.fire_matching("chain-after", lambda r: True, now=after)
    assert fired == ["k", "n"]
    week = night + timedelta(days=6)  # Sunday 03:10 EST, in n's blackout again
    assert scheduler.fire_matching("chain-after", lambda r: True, now=week - SECOND) == 0
    assert scheduler.fire_matching("chain-after", lambda r: True, now=week) == 1
    assert fired == ["k", "n", "k"]  # k exactly 6 days after its last fire


def test_ago_is_one_rule_for_the_cli_and_the_fleet_page() -> None:
    from controller.fleetpage import _ago
    from sched_core.policies import ago_text
    from sched_ops.render import ago

    now = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    then = now - timedelta(days=2, hours=3, minutes=4)
    assert ago(then, now) == ago_text(then, now) == "2 d 3 h"  # the CLI: two units
    assert _ago(then, now) == "2 d ago"  # the page: the largest unit
    assert _ago(now - timedelta(seconds=125), now) == "2 min ago"
    assert _ago(now - timedelta(seconds=45), now) == "45 s ago"
    assert ago(now + timedelta(minutes=5), now) == _ago(now + timedelta(minutes=5), now) \
        == "in 5 min"
    assert ago(None, now) == _ago(None, now) == "-"
