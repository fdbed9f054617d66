"""Benchmark the time core: the firing loop's decision and turn over a fleet, next/last_fire
against cron libs.

Run: ``.venv/bin/python bench/bench_core.py [--no-write]``.  Every baseline is measured
in the same run (the machine is shared and noisy); each timing is the best of a few
repeats, as process CPU time (what the work costs, whatever else the machine runs) and
as wall time; ratios use CPU time.  The figures are printed and written into the
"Core (sched_core)" section of docs/benchmarks.md, between its ``core:begin`` /
``core:end`` markers.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from croniter import croniter
from cronsim import CronSim

from bench.prefect_bench import machine, write_section
from sched_core.firing import due_now
from sched_core.matcher import last_fire, matches, next_fire
from sched_core.model import (
    DAY_NAMES,
    Cache,
    LocalSchedule,
    MissPolicy,
    Schedule,
)
from sched_core.scheduler import Config, Scheduler
from sched_core.view import NodeView

TZ = ZoneInfo("America/New_York")
SEED = 20261202
FLEET = 100_000
NEXT_LAST = 10_000
CRONITER_MATCH_SAMPLE = 1_000
GRACE_MINUTES = 6  # a 5-minute grace window [now - 5 min, now] holds 6 whole minutes
TICK = datetime(2026, 12, 2, 7, 30, tzinfo=UTC)  # 02:30 EST, a Wednesday
BEGIN, END = "<!-- core:begin -->", "<!-- core:end -->"
CRON_DOW = {name: (index + 1) % 7 for index, name in enumerate(DAY_NAMES)}


def random_schedule(rng: random.Random) -> Schedule:
    """Return a random valid schedule: mostly fixed hours, some wildcard hours and intervals."""
    roll = rng.random()
    if roll < 0.03:
        return Schedule(on="after_wave")
    if roll < 0.23:
        interval = rng.choice([1, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 360, 720, 1440])
        return Schedule(interval_minutes=interval)
    days = ["*"] if rng.random() < 0.3 else rng.sample(DAY_NAMES, rng.randint(1, 5))
    minute = str(rng.randint(0, 59))
    if roll < 0.38:
        return Schedule(days=days, hours=["*"], minute=minute)
    hours = [str(hour) for hour in rng.sample(range(24), rng.randint(1, 3))]
    return Schedule(days=days, hours=hours, minute=minute)


def make_fleet(count: int) -> list[LocalSchedule]:
    """Return ``count`` rows; each Schedule is validated, the row around it is trusted."""
    rng = random.Random(SEED)
    return [
        LocalSchedule.model_construct(
            id=f"s-{number}",
            name=f"schedule {number}",
            action=rng.choice(["backup", "copy", "prune", "check"]),
            schedule=random_schedule(rng),
            miss_policy=MissPolicy.SKIP,
            enabled=rng.random() > 0.05,
        )
        for number in range(count)
    ]


def cron_expr(schedule: Schedule) -> str | None:
    """Return the equivalent 5-field cron expression, or None when cron cannot say it.

    An interval is exact in cron only when it divides 60 (``*/n * * * *``) or is a
    whole number of hours dividing 24 (``0 */h * * *``); other intervals are left out.
    """
    if schedule.is_event:
        return None
    if schedule.interval_minutes is not None:
        interval = schedule.interval_minutes
        if 60 % interval == 0:
            return f"*/{interval} * * * *"
        if interval % 60 == 0 and 24 % (interval // 60) == 0:
            return f"0 */{interval // 60} * * *"
        return None
    days, hours = schedule.days or [], schedule.hours or []
    dow = "*" if "*" in days else ",".join(str(CRON_DOW[day]) for day in days)
    hour = "*" if "*" in hours else ",".join(str(int(value)) for value in hours)
    return f"{int(schedule.minute)} {hour} * * {dow}"


@dataclass(frozen=True)
class Timing:
    cpu: float
    wall: float

    def __truediv__(self, count: float) -> Timing:
        return Timing(self.cpu / count, self.wall / count)

    def __mul__(self, count: float) -> Timing:
        return Timing(self.cpu * count, self.wall * count)


def best_of(repeats: int, run: Callable[[], object]) -> Timing:
    """Return the best CPU and the best wall time of ``repeats`` runs, in seconds."""
    cpu = wall = float("inf")
    for _ in range(repeats):
        gc.collect()
        started, started_cpu = time.perf_counter(), time.process_time()
        run()
        cpu = min(cpu, time.process_time() - started_cpu)
        wall = min(wall, time.perf_counter() - started)
    return Timing(cpu, wall)


def fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


class Table:
    """Rows of (measure, CPU time, wall time, ratio or target)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, measure: str, timing: Timing | str, note: str) -> None:
        if isinstance(timing, Timing):
            self.rows.append((measure, fmt(timing.cpu), fmt(timing.wall), note))
        else:
            self.rows.append((measure, timing, "", note))

    def lines(self) -> list[str]:
        head = ("measure", "CPU", "wall", "ratio (CPU) / target")
        widths = [max(len(row[k]) for row in [head, *self.rows]) for k in range(4)]
        out = [
            "| "
            + " | ".join(cell.ljust(width) for cell, width in zip(head, widths, strict=True))
            + " |",
            "|" + "|".join("-" * (width + 2) for width in widths) + "|",
        ]
        out += [
            "| "
            + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            + " |"
            for row in self.rows
        ]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = parser.parse_args()
    table = Table()
    notes: list[str] = []

    started = time.perf_counter()
    fleet = make_fleet(FLEET)
    print(f"made {FLEET:,} random schedules in {time.perf_counter() - started:.1f} s")

    # 1. What the firing loop decides at one instant over the whole fleet: every row's due
    # window in the 5-minute grace (sched_core.firing.due_now), against a loop over matches().
    seen = TICK - timedelta(minutes=GRACE_MINUTES - 1)  # first seen at the grace's start
    view = NodeView(rows=fleet, last_fired={}, first_seen={item.id: seen for item in fleet},
                    tz=TZ, node="bench", grace=timedelta(minutes=GRACE_MINUTES - 1))
    minutes = [TICK - timedelta(minutes=k) for k in range(GRACE_MINUTES)]

    def by_loop() -> int:
        return len(due_now(view, now=TICK, decided={}))

    def by_matches() -> int:
        return sum(
            1
            for item in fleet
            if item.enabled and any(matches(item.schedule, minute, TZ) for minute in minutes)
        )

    due = by_loop()
    loop = best_of(1, by_matches)
    assert due == by_matches(), "due_now disagrees with matches() on an ordinary day"
    window = best_of(3, by_loop)
    table.add(f"due_now, the {GRACE_MINUTES} minutes of a 5-min grace ({due:,} due)", window,
              "1x")
    table.add(
        f"loop over matches(), the {GRACE_MINUTES} minutes",
        loop,
        f"{loop.cpu / window.cpu:,.2f}x the CPU of due_now",
    )

    # The Scheduler's whole turn over the fleet: decide, the start guard (stamp and write the
    # cache once), start each window (a no-op callback); and loading the cache it starts from.
    logging.getLogger("sched_core").setLevel(logging.ERROR)  # no per-fire log lines
    with tempfile.TemporaryDirectory() as tmp:
        cache_path = Path(tmp) / "cache.json"
        cache_path.write_text(Cache(schedules=fleet, last_fetched_at=seen,
                                    first_seen_at=dict(view.first_seen)).model_dump_json())
        config = Config(
            pull_url="file:///dev/null", node_name="bench", cache_path=cache_path,
            fire=lambda fire: None, timezone=TZ, fire_grace=view.grace,
        )
        load = best_of(1, lambda: Scheduler(config, now=TICK))
        scheduler = Scheduler(config, now=TICK)
        turn = best_of(1, lambda: scheduler.turn(TICK))
        fired = len(Scheduler(config, now=TICK).turn(TICK).fired)  # decided: starts nothing
    table.add(
        f"Scheduler.turn: decide, guard and start {due:,} windows (no-op), write the cache",
        turn, f"{turn.cpu / loop.cpu:.2f}x the CPU of the matches() loop alone",
    )
    table.add(f"Scheduler start: load a {FLEET:,}-row cache", load, "")
    assert fired == 0, "a restart starts no window twice"

    # croniter.match per schedule on a sample (far too slow for the whole fleet).
    exprs = [(item, cron_expr(item.schedule)) for item in fleet if item.enabled]
    expressible = [(item, expr) for item, expr in exprs if expr is not None]
    left_out = sum(1 for item, expr in exprs if expr is None and not item.schedule.is_event)
    sample = expressible[:CRONITER_MATCH_SAMPLE]
    local_tick = TICK.astimezone(TZ)
    cron_match = best_of(1, lambda: [croniter.match(expr, local_tick) for _, expr in sample])
    cron_window = cron_match * (FLEET / len(sample) * GRACE_MINUTES)
    table.add(
        f"croniter.match per schedule, the {GRACE_MINUTES} minutes (scaled)",
        cron_window,
        f"{cron_window.cpu / window.cpu:,.0f}x slower",
    )
    notes.append(
        f"croniter.match was timed on {len(sample):,} schedules at one minute and scaled to "
        f"{FLEET:,} schedules and {GRACE_MINUTES} minutes. {left_out:,} enabled interval "
        "schedules have no exact cron expression (the interval neither divides 60 nor is a "
        "whole number of hours dividing 24) and are left out of every croniter and cronsim "
        "comparison; the others use `*/n * * * *` or `0 */h * * *`."
    )

    # 3. next_fire / last_fire over 10,000 schedules at random instants of 2026.
    rng = random.Random(SEED + 1)
    pairs = []
    for item, expr in expressible:
        if len(pairs) == NEXT_LAST:
            break
        when = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randrange(365 * 86_400))
        pairs.append((item.schedule, expr, when, when.astimezone(TZ)))

    cold = best_of(1, lambda: [next_fire(s, w, TZ) for s, _, w, _ in pairs])
    ours_next = best_of(3, lambda: [next_fire(s, w, TZ) for s, _, w, _ in pairs])
    ours_last = best_of(3, lambda: [last_fire(s, w, TZ) for s, _, w, _ in pairs])
    croniter_next = best_of(
        1, lambda: [croniter(e, local).get_next(datetime) for _, e, _, local in pairs]
    )
    croniter_prev = best_of(
        1, lambda: [croniter(e, local).get_prev(datetime) for _, e, _, local in pairs]
    )
    cronsim_next = best_of(1, lambda: [next(CronSim(e, local)) for _, e, _, local in pairs])
    cronsim_prev = best_of(
        1, lambda: [next(CronSim(e, local, reverse=True)) for _, e, _, local in pairs]
    )

    # Agreement (New York has no 30-minute shift, so cronsim should agree everywhere).
    # cronsim's reverse iteration is strictly before its start, last_fire is "at or
    # before": start it a second later (the instants are whole seconds).
    second = timedelta(seconds=1)
    agree_next = sum(
        next_fire(s, w, TZ) == next(CronSim(e, local)).astimezone(UTC) for s, e, w, local in pairs
    )
    agree_last = sum(
        last_fire(s, w, TZ) == next(CronSim(e, local + second, reverse=True)).astimezone(UTC)
        for s, e, w, local in pairs
    )
    notes.append(
        f"next_fire agreed with cronsim on {agree_next:,} of {len(pairs):,} and last_fire "
        f"with cronsim's reverse iteration (from a second later) on {agree_last:,} of "
        f"{len(pairs):,}."
    )

    count = len(pairs)
    each = 1e6 / count
    table.add(
        f"next_fire, {count:,} schedules, first call (compiles)",
        cold,
        f"{cold.cpu * each:.1f} µs each",
    )
    table.add(f"next_fire, {count:,} schedules", ours_next, f"{ours_next.cpu * each:.1f} µs each")
    for name, theirs in (
        ("croniter get_next (construct + get)", croniter_next),
        ("cronsim next (construct + next)", cronsim_next),
    ):
        table.add(name, theirs, f"{theirs.cpu / ours_next.cpu:.0f}x slower than next_fire")
    table.add(f"last_fire, {count:,} schedules", ours_last, f"{ours_last.cpu * each:.1f} µs each")
    for name, theirs in (
        ("croniter get_prev (construct + get)", croniter_prev),
        ("cronsim reverse (construct + next)", cronsim_prev),
    ):
        table.add(name, theirs, f"{theirs.cpu / ours_last.cpu:.0f}x slower than last_fire")

    # 4. next_fire over the whole fleet: as many shapes as it has (past a small cache).
    whole = []
    for item, expr in expressible:
        when = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randrange(365 * 86_400))
        whole.append((item.schedule, expr, when, when.astimezone(TZ)))
    shapes = len({compile_key(s) for s, _, _, _ in whole})
    fleet_next = best_of(2, lambda: [next_fire(s, w, TZ) for s, _, w, _ in whole])
    fleet_cronsim = best_of(1, lambda: [next(CronSim(e, local)) for _, e, _, local in whole])
    table.add(f"next_fire, the fleet's {len(whole):,} schedules ({shapes:,} shapes)", fleet_next,
              f"{fleet_next.cpu * 1e6 / len(whole):.1f} µs each")
    table.add("cronsim next, the same", fleet_cronsim,
              f"{fleet_cronsim.cpu / fleet_next.cpu:.1f}x slower than next_fire (target >= 5x)")

    lines = table.lines()
    print("\n".join(lines))
    for note in notes:
        print("-", note)
    print(f"total {time.perf_counter() - started:.0f} s")
    if not args.no_write:
        write_docs(lines, notes)


def compile_key(schedule: Schedule) -> tuple[object, ...]:
    """A schedule's shape: what the matcher compiles it from."""
    return (tuple(schedule.days or ()), tuple(schedule.hours or ()), schedule.minute,
            schedule.interval_minutes)


def write_docs(table: list[str], notes: list[str]) -> None:
    """Rewrite only the core section of docs/benchmarks.md, between its markers."""
    body = "\n".join(
        [
            f"Measured by `bench/bench_core.py` on {datetime.now(UTC):%Y-%m-%d} ({machine()}); "
            f"{FLEET:,} random schedules (seed {SEED}) in America/New_York, deciding at "
            f"{TICK:%Y-%m-%dT%H:%MZ}. Best of 1-7 repeats; baselines measured in the same run; "
            "ratios use CPU time, which the other work on the machine disturbs less than "
            "wall time.",
            "",
            *table,
            "",
            *[f"- {note}" for note in notes],
        ]
    )
    write_section(BEGIN, END, "## Core (sched_core)", body)


if __name__ == "__main__":
    main()
