"""The planner and the start guard (sched_core.plan), pure: times are passed in.

New York, 2026: the spring-forward day 2026-03-08 jumps from 02:00 EST (07:00Z)
to 03:00 EDT; the fall-back day 2026-11-01 repeats 01:00-01:59 (05:00Z-05:59Z as
EDT, 06:00Z-06:59Z as EST). Asia/Kolkata (+05:30, no DST) is the half-hour zone.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from sched_core.guard import Verdict, decide_start, retry_allowed, stage_retry_allowed
from sched_core.matcher import fire_times, window_key
from sched_core.model import LocalSchedule
from sched_core.plan import MISSED_SHOWN, Fate, missed, plan_windows, planned_fate
from tests.factories import at, every
from tests.views import GRACE, NY, guard_view, row, utc, view_of

HOUR = timedelta(hours=1)



def plan(rows: list[LocalSchedule], now: datetime, **kw: Any) -> list[tuple[str, datetime]]:
    options: dict[str, Any] = {
        "last_fired": {}, "first_seen": {}, "now": now, "grace": GRACE, "horizon": HOUR,
        "min_windows": 3, "max_runs": 1000, "tz": NY,
    }
    options.update(kw)
    view = view_of(rows, options)
    return [(w.schedule_id, w.window) for w in plan_windows(view, **options).windows]



# -- planning ---------------------------------------------------------------------------


def test_fixed_hour_in_the_spring_gap_is_planned_once_at_three() -> None:
    # 02:30 does not exist on 2026-03-08: the window is 03:00 EDT (07:00Z).
    got = plan([row("s", at(["2"], "30"))], utc(2026, 3, 8, 5, 0))
    assert got == [("s", utc(2026, 3, 8, 7, 0)), ("s", utc(2026, 3, 9, 6, 30)),
                   ("s", utc(2026, 3, 10, 6, 30))]


def test_fixed_hour_in_the_repeated_hour_is_planned_once_at_its_first_copy() -> None:
    got = plan([row("s", at(["1"], "30"))], utc(2026, 11, 1, 4, 0), min_windows=1,
               horizon=timedelta(hours=3))
    assert got == [("s", utc(2026, 11, 1, 5, 30))]  # 01:30 EDT; 01:30 EST (06:30Z) is not


def test_wildcard_hour_and_interval_are_planned_in_both_copies_of_the_repeated_hour() -> None:
    now = utc(2026, 11, 1, 5, 0)  # 01:00 EDT
    wild = plan([row("w", at(["*"], "30"))], now, horizon=timedelta(hours=2), min_windows=0)
    assert wild == [("w", utc(2026, 11, 1, 5, 30)), ("w", utc(2026, 11, 1, 6, 30))]
    interval = plan([row("i", every(30))], now, horizon=timedelta(hours=2), min_windows=0)
    assert [w for _, w in interval] == [
        utc(2026, 11, 1, 5, 0), utc(2026, 11, 1, 5, 30), utc(2026, 11, 1, 6, 0),
        utc(2026, 11, 1, 6, 30),
    ]


@pytest.mark.parametrize("day", [utc(2026, 3, 8), utc(2026, 11, 1), utc(2026, 6, 1)])
@pytest.mark.parametrize("schedule", [at(["2"], "30"), at(["1"], "30"), at(["*"], "15"),
                                      every(20), at(["1", "2", "3"], "0", ["sun", "mon"])])
def test_a_whole_day_of_plans_equals_fire_times(day: datetime, schedule: dict[str, Any]) -> None:
    """Oracle: planning every hour of a day gives exactly the matcher's fire times."""
    r = row("s", schedule)
    planned: set[datetime] = set()
    now = day
    while now < day + timedelta(days=1):
        planned |= {w for _, w in plan([r], now, min_windows=0)}
        now += HOUR
    assert sorted(planned) == list(fire_times(r.schedule, day - GRACE, now, NY))


def test_a_half_hour_zone_plans_its_local_wall_times() -> None:
    kolkata = ZoneInfo("Asia/Kolkata")
    got = plan([row("s", at(["2"], "30"))], utc(2026, 3, 7, 20, 0), tz=kolkata, min_windows=1)
    assert got == [("s", utc(2026, 3, 7, 21, 0))]  # 02:30 IST is 21:00Z the day before


def test_windows_inside_the_grace_are_planned_and_older_ones_are_not() -> None:
    now = utc(2026, 11, 30, 15, 4, 30)
    got = plan([row("s", every(2))], now, horizon=timedelta(minutes=5), min_windows=0)
    # 14:59:30 is the grace's start: 15:00, 15:02, 15:04 are still due, 15:06, 15:08 ahead.
    assert [w.minute for _, w in got] == [0, 2, 4, 6, 8]


def test_the_grace_boundary_is_inclusive() -> None:
    now = utc(2026, 11, 30, 15, 5)
    got = plan([row("s", every(5))], now, horizon=timedelta(minutes=1), min_windows=0)
    assert [w for _, w in got] == [utc(2026, 11, 30, 15, 0), utc(2026, 11, 30, 15, 5)]


def test_fired_windows_and_windows_before_first_seen_are_not_planned() -> None:
    now = utc(2026, 11, 30, 15, 3)
    got = plan([row("a", every(1)), row("b", every(1))], now, min_windows=0,
               horizon=timedelta(minutes=2),
               last_fired={"a": utc(2026, 11, 30, 15, 1)},
               first_seen={"b": utc(2026, 11, 30, 15, 2, 40)})
    assert got == [("a", utc(2026, 11, 30, 15, 2)), ("b", utc(2026, 11, 30, 15, 2)),
                   ("a", utc(2026, 11, 30, 15, 3)), ("b", utc(2026, 11, 30, 15, 3)),
                   ("a", utc(2026, 11, 30, 15, 4)), ("b", utc(2026, 11, 30, 15, 4))]


def test_disabled_and_event_rows_are_never_planned() -> None:
    rows = [row("off", every(1), enabled=False),
            row("ev", {"days": None, "hours": None, "minute": "", "on": "after_wave"})]
    assert plan(rows, utc(2026, 11, 30, 15, 0)) == []


def test_at_least_min_windows_within_eight_days_and_no_further() -> None:
    weekly = row("w", at(["2"], "30", ["sat"]))
    got = plan([weekly], utc(2026, 11, 30, 15, 0))  # a Monday
    assert [w.date().isoformat() for _, w in got] == ["2026-12-05"]  # next Saturday only


def test_the_cap_keeps_the_nearest_windows_of_the_whole_node() -> None:
    rows = [row("a", every(1)), row("b", at(["10"], "30"))]
    now = utc(2026, 11, 30, 15, 0)  # 10:00 EST
    result = plan_windows(view_of(rows, {}), now=now, horizon=HOUR, min_windows=3,
                          max_runs=40)
    assert len(result.windows) == 40
    assert result.windows == sorted(result.windows)
    assert ("b", utc(2026, 11, 30, 15, 30)) in [(w.schedule_id, w.window) for w in result.windows]
    # "a" from the grace's start, 14:55, to 15:33 (39 windows), and "b" at 15:30.
    assert result.windows[-1].window == utc(2026, 11, 30, 15, 33)
    # 15:34..15:59 of "a" (26) lie within the hour: held back for the next reconcile.
    assert result.held_back == 26


def test_a_planned_window_carries_the_kits_window_key() -> None:
    result = plan_windows(view_of([row("s", at(["2"], "30"))], {}),
                          now=utc(2026, 3, 8, 5, 0), horizon=HOUR, min_windows=1, max_runs=10)
    [w] = result.windows
    assert w.key == "s@2026-03-08T03:00-04:00" == window_key("s", w.window, NY)
    assert w.start == w.window and w.action == "backup"


# -- pruning ----------------------------------------------------------------------------


def fate(row_: LocalSchedule | None, sid: str, window: datetime, **kw: Any) -> Fate:
    return planned_fate(row_, sid, window, window, last_fired=kw.pop("last_fired", None),
                        tz=kw.pop("tz", NY), node=kw.pop("node", "node-a"))


def test_planned_runs_whose_row_no_longer_has_the_window_are_deleted_saying_why() -> None:
    w = utc(2026, 11, 30, 7, 30)  # 02:30 EST
    rows = {r.id: r for r in [
        row("same", at(["2"], "30")), row("params", at(["2"], "30"), params={"x": 1}),
        row("moved", at(["3"], "30")), row("off", at(["2"], "30"), enabled=False),
        row("ev", {"days": None, "hours": None, "minute": "", "on": "after_wave"})]}
    got = {sid: fate(rows.get(sid), sid, w).delete
           for sid in ("same", "params", "moved", "off", "ev", "gone")}
    assert got == {
        "same": None, "params": None,
        "moved": "schedule moved no longer has this window (its times changed)",
        "off": "schedule off is disabled",
        "ev": "schedule ev now fires on 'after_wave', not on the clock",
        "gone": "schedule gone was removed from this node's list",
    }
    assert fate(rows["same"], "same", w) == Fate()


# -- the start guard --------------------------------------------------------------------

W = utc(2026, 11, 30, 7, 30)  # 02:30 EST, a nightly window


def guard(r: LocalSchedule | None, *, first_try: datetime, now: datetime | None = None,
          **kw: Any) -> Any:
    options: dict[str, Any] = {"schedule_id": "s", "window": W, "last_fired": None,
                               "first_seen": utc(2026, 11, 1), "grace": GRACE, "tz": NY}
    options.update(kw)
    view = guard_view(r, options)
    return decide_start(r, view, first_try=first_try, now=now or first_try, **options)


NIGHTLY = row("s", at(["2"], "30"))


@pytest.mark.parametrize("delay", [timedelta(0), timedelta(seconds=-0.5), GRACE])
def test_a_run_tried_within_the_grace_runs_and_stamps(delay: timedelta) -> None:
    d = guard(NIGHTLY, first_try=W + delay)
    assert d.verdict is Verdict.RUN and d.stamp and not d.late
    assert d.reason == "window 2026-11-30 02:30 EST: on time"


def test_waiting_for_a_job_slot_is_not_being_late() -> None:
    d = guard(NIGHTLY, first_try=W + timedelta(seconds=3), now=W + timedelta(hours=3))
    assert d.runs and not d.late


def test_a_late_run_under_skip_never_runs() -> None:
    d = guard(row("s", at(["2"], "30"), miss_policy="skip"),
              first_try=W + GRACE + timedelta(seconds=1))
    assert d.verdict is Verdict.SKIP and not d.stamp
    assert d.reason == ("window 2026-11-30 02:30 EST missed: 5 min 1 s late (grace 5 min); "
                        "miss policy skip")


@pytest.mark.parametrize("policy", ["run-once-within-24h", "run-all"])
def test_a_late_run_of_the_latest_window_runs_under_the_miss_policy(policy: str) -> None:
    d = guard(row("s", at(["2"], "30"), miss_policy=policy), first_try=W + timedelta(hours=3))
    assert d.runs and d.stamp and d.late
    assert d.reason == (f"window 2026-11-30 02:30 EST: 3 h late (grace 5 min); "
                        f"run as the latest missed window (miss policy {policy})")


def test_older_late_runs_are_coalesced_into_the_latest_window() -> None:
    hourly = row("s", at(["*"], "30"))
    now = utc(2026, 11, 30, 10, 40)  # the 10:30Z window is the latest, 10 min ago
    d = guard(hourly, first_try=now, now=now)
    assert d.verdict is Verdict.SKIP and d.coalesced_into == utc(2026, 11, 30, 10, 30)
    assert d.reason.endswith("coalesced into 2026-11-30 05:30 EST (the latest missed window)")
    d = guard(hourly, first_try=utc(2026, 11, 30, 10, 32), now=utc(2026, 11, 30, 10, 32))
    assert d.reason.endswith("coalesced into 2026-11-30 05:30 EST (which runs on time)")


def test_a_late_window_beyond_the_catch_up_window_does_not_run() -> None:
    d = guard(NIGHTLY, first_try=W + timedelta(hours=25), now=W + timedelta(hours=25))
    assert d.verdict is Verdict.SKIP  # the latest window is now 2026-12-01's
    weekly = row("s", at(["2"], "30", ["mon"]))
    d = guard(weekly, first_try=W + timedelta(hours=25), now=W + timedelta(hours=25))
    assert d.verdict is Verdict.SKIP
    assert d.reason.endswith("older than the 24 h catch-up window")


def test_a_window_runs_once_whatever_the_order_of_its_runs() -> None:
    assert guard(NIGHTLY, first_try=W, last_fired=W).reason == (
        "window 2026-11-30 02:30 EST already ran")
    d = guard(NIGHTLY, first_try=W, last_fired=W + timedelta(days=1))
    assert d.verdict is Verdict.SKIP and d.coalesced_into == W + timedelta(days=1)
    assert d.reason == ("window 2026-11-30 02:30 EST is older than the last fire: coalesced "
                        "into 2026-12-01 02:30 EST, which already ran")


def test_a_removed_disabled_or_changed_row_skips_saying_why() -> None:
    assert guard(None, first_try=W).reason == "schedule s was removed from this node's list"
    assert guard(row("s", at(["2"], "30"), enabled=False), first_try=W).reason == (
        "schedule s is disabled")
    assert guard(row("s", at(["3"], "30")), first_try=W).reason == (
        "schedule s no longer has this window (its times changed)")


def test_no_window_before_first_seen_runs() -> None:
    d = guard(NIGHTLY, first_try=W, first_seen=W + timedelta(minutes=1))
    assert d.verdict is Verdict.SKIP and "before the schedule was first seen" in d.reason
    assert guard(NIGHTLY, first_try=W, first_seen=W + timedelta(seconds=59)).runs


def test_the_retry_of_an_interrupted_job_runs_its_stamped_window_once_more() -> None:
    d = guard(NIGHTLY, first_try=W, now=W + timedelta(minutes=2), last_fired=W, retry=True)
    assert d.runs and d.reason == "window 2026-11-30 02:30 EST: re-run of an interrupted job"
    late = guard(NIGHTLY, first_try=W, now=W + timedelta(hours=2), last_fired=W, retry=True)
    assert late.runs and late.late
    skip = row("s", at(["2"], "30"), miss_policy="skip")
    d = guard(skip, first_try=W, now=W + timedelta(hours=2), last_fired=W, retry=True)
    assert d.verdict is Verdict.SKIP and d.reason.startswith(
        "window 2026-11-30 02:30 EST missed: interrupted and 2 h after its window")
    assert not guard(NIGHTLY, first_try=W, now=W + timedelta(hours=2),
                     last_fired=W + timedelta(days=1), retry=True).runs
    view = guard_view(NIGHTLY, {"schedule_id": "s", "last_fired": W})
    assert retry_allowed(NIGHTLY, view, schedule_id="s", window=W,
                         now=W + timedelta(hours=2)).runs


def test_a_chain_stage_job_is_rerun_while_its_row_is_still_of_the_stage() -> None:
    prune = row("p", {"on": "after_wave"}, action="prune")
    stopped = utc(2026, 12, 3, 20, 20)

    def decide(candidate: LocalSchedule | None, now: datetime) -> Any:
        return stage_retry_allowed(candidate, schedule_id="p", stage="prune", action="prune",
                                   on="after_wave", stopped_at=stopped, now=now,
                                   follow=timedelta(hours=24), tz=NY)

    soon = stopped + timedelta(minutes=3)
    assert decide(prune, soon).runs
    assert decide(prune, soon).reason == "interrupted job of the chain stage prune: run once more"
    for candidate, reason in [
        (None, "schedule p was removed from this node's list"),
        (row("p", {"on": "after_wave"}, action="prune", enabled=False),
         "schedule p is disabled"),
        (row("p", {"on": "manual"}, action="prune"),
         "schedule p is no longer a 'after_wave' prune schedule of the chain stage prune"),
        (row("p", {"on": "after_wave"}, action="check"),
         "schedule p is no longer a 'after_wave' prune schedule of the chain stage prune"),
    ]:
        decision = decide(candidate, soon)
        assert decision.verdict is Verdict.SKIP and decision.reason == reason
    paused = row("p", {"on": "after_wave"}, action="prune",
                 paused={"note": "repo moved", "until": None})
    assert not decide(paused, soon).runs and "repo moved" in decide(paused, soon).reason
    late = decide(prune, stopped + timedelta(hours=25))
    assert not late.runs
    assert late.reason == ("interrupted at 2026-12-03 15:20 EST, more than 24 h ago: "
                           "the chain has moved on")


# -- windows nobody planned -------------------------------------------------------------


def lost(rows: list[LocalSchedule], now: datetime, **kw: Any) -> list[Any]:
    options: dict[str, Any] = {"last_fired": {}, "first_seen": {}, "planned_through": {},
                               "now": now, "grace": GRACE, "tz": NY}
    options.update(kw)
    return missed(view_of(rows, options), **options)


def test_after_a_long_downtime_the_latest_unplanned_window_is_recovered() -> None:
    hourly = row("s", at(["*"], "0"))
    now = utc(2026, 11, 30, 15, 10)
    [m] = lost([hourly], now, planned_through={"s": utc(2026, 11, 30, 11, 0)},
               first_seen={"s": utc(2026, 11, 1)})
    assert m.windows == [utc(2026, 11, 30, h, 0) for h in (12, 13, 14, 15)]
    assert m.count == 4 and m.truncated == 0
    assert m.recover is not None and m.recover.window == utc(2026, 11, 30, 15, 0)
    assert m.recover.key == window_key("s", utc(2026, 11, 30, 15, 0), NY)


def test_unplanned_windows_under_skip_are_reported_and_not_recovered() -> None:
    [m] = lost([row("s", at(["*"], "0"), miss_policy="skip")], utc(2026, 11, 30, 15, 10),
               planned_through={"s": utc(2026, 11, 30, 13, 0)})
    assert m.count == 2 and m.recover is None


def test_run_all_counts_what_it_truncates() -> None:
    [m] = lost([row("s", every(10), miss_policy="run-all")], utc(2026, 11, 30, 15, 7),
               planned_through={"s": utc(2026, 11, 30, 13, 0)})
    # 13:10 .. 15:00: twelve windows, the latest one recovered, eleven dropped.
    assert m.count == 12 and m.truncated == 11 and len(m.windows) == MISSED_SHOWN
    assert m.recover is not None and m.recover.window == utc(2026, 11, 30, 15, 0)


def test_nothing_is_recovered_when_a_later_window_is_inside_the_grace() -> None:
    # Every 2 minutes: the 15:08 window is inside the grace and has its planned run.
    [m] = lost([row("s", every(2))], utc(2026, 11, 30, 15, 10),
               planned_through={"s": utc(2026, 11, 30, 14, 0)})
    assert m.count == 32 and m.recover is None


def test_planned_and_fired_windows_and_those_before_first_seen_are_not_missed() -> None:
    now = utc(2026, 11, 30, 15, 10)
    hourly = [row("s", at(["*"], "0"))]
    assert lost(hourly, now, planned_through={"s": utc(2026, 11, 30, 15, 0)}) == []
    assert lost(hourly, now, last_fired={"s": utc(2026, 11, 30, 15, 0)}) == []
    assert lost(hourly, now, first_seen={"s": utc(2026, 11, 30, 15, 0, 30)})[0].count == 1
    assert lost(hourly, now, first_seen={"s": utc(2026, 11, 30, 15, 1)}) == []


def test_without_a_record_the_whole_catch_up_window_counts() -> None:
    [m] = lost([row("s", at(["*"], "0"))], utc(2026, 11, 30, 15, 10))
    assert m.count == 24 and m.windows[0] == utc(2026, 11, 29, 16, 0)
    [m] = lost([row("s", at(["*"], "0"))], utc(2026, 11, 30, 15, 10),
               lookback=timedelta(hours=2))
    assert m.windows == [utc(2026, 11, 30, 14, 0), utc(2026, 11, 30, 15, 0)]


def test_windows_that_had_a_run_are_the_guards_not_missed() -> None:
    hourly = row("s", at(["*"], "0"))
    now = utc(2026, 11, 30, 15, 10)
    ran = {("s", utc(2026, 11, 30, 13, 0)), ("s", utc(2026, 11, 30, 15, 0))}
    [m] = lost([hourly], now, planned_through={"s": utc(2026, 11, 30, 11, 0)}, have=ran)
    # 12:00 and 14:00 never had a run; 15:00 has its own (late) run: no recovery.
    assert m.windows == [utc(2026, 11, 30, 12, 0), utc(2026, 11, 30, 14, 0)]
    assert m.recover is None
    [m] = lost([hourly], now, planned_through={"s": utc(2026, 11, 30, 11, 0)},
               have={("s", utc(2026, 11, 30, 13, 0))})
    assert m.recover is not None and m.recover.window == utc(2026, 11, 30, 15, 0)


# -- the next planned window, remembered between reports ---------------------------------


def test_the_remembered_next_window_is_always_upcomings_and_is_asked_again_when_it_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: every 7 minutes over the fall-back day, for rows with jitter, a minimum
    interval, an end and the repeated hour, the memo answers what :func:`upcoming` says;
    it asks upcoming again only when the remembered start has passed or the row or its last
    fire changed."""
    from sched_core import plan as plan_module

    rows = [row("j", every(20), jitter=300), row("m", at(["*"], "0"), min_interval=7200),
            row("e", every(30), not_after=utc(2026, 11, 1, 9, 10)),
            row("r", at(["1"], "30"))]
    memo = plan_module.NextPlanned(node="n-1", tz=NY)
    fired: dict[str, datetime | None] = {r.id: None for r in rows}
    asked = 0
    real = plan_module.upcoming

    def counted(*args: Any, **kw: Any) -> plan_module.Upcoming:
        nonlocal asked
        asked += 1
        return real(*args, **kw)

    now, checks = utc(2026, 11, 1, 3, 0), 0
    monkeypatch.setattr(plan_module, "upcoming", counted)
    while now < utc(2026, 11, 2, 3, 0):
        for r in rows:
            want = real(r, now=now, last_fired=fired[r.id], count=1, node="n-1", tz=NY).windows
            got = memo(r, now=now, last_fired=fired[r.id])
            assert got == (want[0] if want else None), (r.id, now)
            checks += 1
            if got is not None and got.start <= now + timedelta(minutes=7):
                fired[r.id] = got.window  # it runs before the next look
        now += timedelta(minutes=7)
    assert checks == 4 * 206 and asked < checks / 2  # remembered most of the time

    changed = row("j", every(45))  # a pull brings a new row for the same id
    want = real(changed, now=now, last_fired=fired["j"], count=1, node="n-1", tz=NY).windows
    assert memo(changed, now=now, last_fired=fired["j"]) == want[0]
    memo.keep(["j"])
    assert set(memo._known) == {"j"}
