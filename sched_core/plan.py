"""Planned runs: which windows get a run ahead of time, and what a run decides when it starts.

Pure: no clock reads, no I/O; every function takes ``now``. The agent's flows
carry these answers to Prefect (create, delete, skip); nothing here knows Prefect.

The design, in four rules:

1. **Plan.** Every enabled clock schedule has a planned run for each of its
   eligible windows in ``[now - grace, now + horizon)``, and for at least its
   next ``min_windows`` windows within 8 days; nearest windows first, at most
   ``max_runs`` for the whole node (:func:`plan_windows`). A window is
   eligible when it is later than the schedule's last fire and not earlier
   than the minute the node first saw the schedule.
2. **Prune.** A planned run that has not been tried yet and whose window is no
   longer a window of its row (removed, disabled, moved to the chain, its
   days, hours or minute changed) is deleted, so the upcoming list is what
   the node will do (:func:`obsolete`).
3. **Guard.** When a run starts, :func:`decide_start` says whether it runs,
   from the cache as it is then: the row must still have the window, the
   window must not have run, and a run first tried more than ``grace`` after
   its window is late and left to the miss policy: ``skip`` never runs it;
   ``run-once-within-24h`` and ``run-all`` run only the latest window of the
   catch-up window (24 h by default), every older late run is coalesced into
   that one. The caller stamps the window in the same locked step.
4. **Recover.** Windows older than the grace that never had a run (the node
   was down for longer than the horizon) are the missed-run check's
   (:func:`missed`): at most the latest one gets a recovery run, policy
   permitting, and every one of them is reported.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo

from sched_core.clock import floor_minute
from sched_core.matcher import fire_times, last_fire, window_key
from sched_core.misses import LOOKBACK, eligible_after
from sched_core.model import LocalSchedule, MissPolicy

PLAN_AHEAD_LIMIT = timedelta(days=8)
"""How far ahead ``min_windows`` may reach for a schedule's next windows."""

TRIGGER_SCHEDULE = "schedule"
TRIGGER_RECOVERY = "schedule-recovery"
WINDOW_TRIGGERS = frozenset({TRIGGER_SCHEDULE, TRIGGER_RECOVERY})
"""Triggers whose runs belong to one window of a clock schedule (and pass the guard)."""

_TICK = timedelta(microseconds=1)


@dataclass(frozen=True, order=True)
class Window:
    """One window of one schedule: its exact UTC instant and its identity.

    ``start`` is when its run is scheduled to start (the window itself; a
    later jitter may move it, never its identity or key).
    """

    start: datetime
    schedule_id: str
    window: datetime = field(compare=False)
    key: str = field(compare=False)
    action: str = field(compare=False, default="")


@dataclass(frozen=True)
class Plan:
    """What the node should have planned, nearest first, and what the cap held back."""

    windows: list[Window]
    held_back: int
    """Windows within the horizon beyond ``max_runs``: planned at a later reconcile."""


def has_window(row: LocalSchedule, window: datetime, tz: ZoneInfo) -> bool:
    """Return whether window is one of the row's fire instants (enabled clock rows only)."""
    if not row.enabled or row.schedule.is_event:
        return False
    return any(True for _ in fire_times(row.schedule, window, window + _TICK, tz))


def _row_plan(
    row: LocalSchedule,
    *,
    floor: datetime,
    now: datetime,
    horizon: timedelta,
    min_windows: int,
    tz: ZoneInfo,
) -> Iterator[Window]:
    """Yield the row's windows from floor: all before now + horizon, and at least min_windows."""
    end = now + horizon
    for count, window in enumerate(fire_times(row.schedule, floor, now + PLAN_AHEAD_LIMIT, tz)):
        if window >= end and count >= min_windows:
            return
        yield Window(start=window, schedule_id=row.id, window=window,
                     key=window_key(row.id, window, tz), action=row.action)


def plan_windows(
    rows: Sequence[LocalSchedule],
    *,
    last_fired: Mapping[str, datetime],
    first_seen: Mapping[str, datetime],
    now: datetime,
    grace: timedelta,
    horizon: timedelta,
    min_windows: int,
    max_runs: int,
    tz: ZoneInfo,
) -> Plan:
    """Return the windows that should have a planned run at now (rule 1 of the module).

    Windows older than ``now - grace`` are not planned: they are missed, and
    belong to :func:`missed`. The cap keeps the ``max_runs`` nearest windows
    of the whole node; the rest is counted in ``held_back``.
    """
    per_row: list[Iterator[Window]] = []
    for row in rows:
        if not row.enabled or row.schedule.is_event:
            continue
        eligible = eligible_after(last_fired.get(row.id), first_seen.get(row.id))
        floor = now - grace if eligible is None else max(now - grace, eligible)
        per_row.append(_row_plan(
            row, floor=floor, now=now, horizon=horizon, min_windows=min_windows, tz=tz
        ))
    windows: list[Window] = []
    held_back = 0
    end = now + horizon
    for item in heapq.merge(*per_row):
        if len(windows) < max_runs:
            windows.append(item)
        elif item.start < end:
            held_back += 1
        else:
            break
    return Plan(windows=windows, held_back=held_back)


@dataclass(frozen=True)
class PlannedRun:
    """A run that exists for a window: its id, window, trigger and state name."""

    run_id: str
    schedule_id: str
    window: datetime
    trigger_key: str
    state_name: str

    @property
    def untried(self) -> bool:
        """True while nobody tried to start it yet (Scheduled, or marked Late by the server)."""
        return self.state_name in ("Scheduled", "Late")


def obsolete(
    runs: Iterable[PlannedRun], rows: Sequence[LocalSchedule], *, tz: ZoneInfo
) -> list[tuple[PlannedRun, str]]:
    """Return the untried window runs to delete, each with why (rule 2 of the module).

    A run is obsolete when its row is gone, disabled or on an event, or no
    longer has the window. A row changed in any other way (name, params,
    policy) keeps its runs: a run reads its row when it starts.
    """
    by_id = {row.id: row for row in rows}
    found: list[tuple[PlannedRun, str]] = []
    for run in runs:
        if not run.untried or run.trigger_key not in WINDOW_TRIGGERS:
            continue
        row = by_id.get(run.schedule_id)
        reason = gone_reason(row, run.schedule_id, run.window, tz)
        if reason is not None:
            found.append((run, reason))
    return found


def gone_reason(
    row: LocalSchedule | None, schedule_id: str, window: datetime, tz: ZoneInfo
) -> str | None:
    """Return why window is no longer a window of the row, or None if it still is."""
    if row is None:
        return f"schedule {schedule_id} was removed from this node's list"
    if not row.enabled:
        return f"schedule {schedule_id} is disabled"
    if row.schedule.is_event:
        return f"schedule {schedule_id} now fires on {row.schedule.on!r}, not on the clock"
    if not has_window(row, window, tz):
        return f"schedule {schedule_id} no longer has this window (its times changed)"
    return None


class Verdict(StrEnum):
    """What a starting run does."""

    RUN = "run"
    SKIP = "skip"


@dataclass(frozen=True)
class StartDecision:
    """The guard's answer for one starting run.

    ``stamp`` is True when the caller must record the window as the
    schedule's last fire in the same locked step (every window run does).
    ``late`` says the run was late and ran under the miss policy.
    """

    verdict: Verdict
    reason: str
    stamp: bool = False
    late: bool = False
    coalesced_into: datetime | None = None

    @property
    def runs(self) -> bool:
        """True when the job runs."""
        return self.verdict is Verdict.RUN


def _minutes(delta: timedelta) -> str:
    """Return a duration for people: ``5 min 1 s``, ``3 h``, ``1 h 30 min``, ``45 s``."""
    seconds = int(delta.total_seconds())
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    parts = [f"{hours} h"] if hours else []
    if minutes:
        parts.append(f"{minutes} min")
    if seconds and not hours:
        parts.append(f"{seconds} s")
    return " ".join(parts) or "0 s"


def _local(instant: datetime, tz: ZoneInfo) -> str:
    return instant.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def decide_start(
    row: LocalSchedule | None,
    *,
    schedule_id: str,
    window: datetime,
    last_fired: datetime | None,
    first_seen: datetime | None,
    first_try: datetime,
    now: datetime,
    grace: timedelta,
    tz: ZoneInfo,
    retry: bool = False,
    lookback: timedelta = LOOKBACK,
) -> StartDecision:
    """Return whether the run of window runs now (rule 3 of the module).

    ``first_try`` is when Prefect first tried to start the run (a run that
    then waited for a job slot is not late); ``now`` is when it decides.
    ``retry`` marks the one re-run of a job interrupted by the node's own
    shutdown or crash: its window may already be stamped (by the interrupted
    run), and it runs while the miss policy would still run that window.

    1. The row must still have the window (:func:`gone_reason`).
    2. A window already stamped, or older than a stamped one, does not run
       again (except the retry of the stamped window itself).
    3. No window before the minute the schedule was first seen runs.
    4. Tried within ``grace`` of the window: it runs.
    5. Late: ``skip`` never runs it; the other policies run it only if it is
       the latest window at now and within ``lookback``, and coalesce it
       into that latest window otherwise.
    """
    gone = gone_reason(row, schedule_id, window, tz)
    if gone is not None or row is None:
        return StartDecision(Verdict.SKIP, gone or f"schedule {schedule_id} was removed")
    shown = _local(window, tz)
    if last_fired is not None and last_fired >= window:
        if not (retry and last_fired == window):
            if last_fired == window:
                return StartDecision(Verdict.SKIP, f"window {shown} already ran")
            return StartDecision(
                Verdict.SKIP,
                f"window {shown} is older than the last fire: coalesced into "
                f"{_local(last_fired, tz)}, which already ran",
                coalesced_into=last_fired,
            )
    if first_seen is not None and window < floor_minute(first_seen):
        return StartDecision(
            Verdict.SKIP,
            f"window {shown} is before the schedule was first seen ({_local(first_seen, tz)})",
        )
    lateness = (now if retry else first_try) - window
    if lateness <= grace:
        why = "re-run of an interrupted job" if retry else "on time"
        return StartDecision(Verdict.RUN, f"window {shown}: {why}", stamp=True)
    policy = row.miss_policy
    late = f"{_minutes(lateness)} late (grace {_minutes(grace)})"
    if retry:
        late = f"interrupted and {_minutes(lateness)} after its window (grace {_minutes(grace)})"
    if policy is MissPolicy.SKIP:
        return StartDecision(Verdict.SKIP, f"window {shown} missed: {late}; miss policy skip")
    latest = last_fire(row.schedule, now, tz)
    if latest is None or latest < now - lookback:
        return StartDecision(
            Verdict.SKIP,
            f"window {shown} missed: {late}; older than the {_minutes(lookback)} catch-up window",
        )
    if latest != window:
        where = "which runs on time" if now - latest <= grace else "the latest missed window"
        return StartDecision(
            Verdict.SKIP,
            f"window {shown} missed: {late}; coalesced into {_local(latest, tz)} ({where})",
            coalesced_into=latest,
        )
    return StartDecision(
        Verdict.RUN,
        f"window {shown}: {late}; run as the latest missed window (miss policy {policy.value})",
        stamp=True,
        late=True,
    )


@dataclass(frozen=True)
class Missed:
    """One schedule's windows that never had a run, and what the miss policy does about it."""

    schedule_id: str
    windows: list[datetime]
    """The unplanned windows, oldest first (at most ``MISSED_SHOWN`` of them)."""
    count: int
    recover: Window | None
    """The window to give a recovery run, or None."""
    truncated: int
    """Older unplanned windows ``run-all`` drops in favour of ``recover``."""


MISSED_SHOWN = 10
"""How many of a schedule's missed windows a report lists (all are counted)."""


def missed(
    rows: Sequence[LocalSchedule],
    *,
    last_fired: Mapping[str, datetime],
    first_seen: Mapping[str, datetime],
    planned_through: Mapping[str, datetime],
    now: datetime,
    grace: timedelta,
    tz: ZoneInfo,
    have: Collection[tuple[str, datetime]] = (),
    lookback: timedelta = LOOKBACK,
) -> list[Missed]:
    """Return, per schedule, the windows older than the grace that never had a run (rule 4).

    ``planned_through`` is, per schedule, the latest window the planner has
    handled (given a run, or reported missed); windows up to it are not
    looked at again. ``have`` holds the (schedule id, window) pairs known to
    have a run: those are the start guard's, not missed. Without a record
    every eligible window of the last ``lookback`` counts, so the check is
    safe after the record is lost: a recovery run reuses the window's
    idempotency key, and a run of that window, if any, is what it gets.
    """
    found: list[Missed] = []
    lookback_start = now - lookback + _TICK
    for row in rows:
        if not row.enabled or row.schedule.is_event:
            continue
        bounds = [lookback_start]
        eligible = eligible_after(last_fired.get(row.id), first_seen.get(row.id))
        if eligible is not None:
            bounds.append(eligible)
        done = planned_through.get(row.id)
        if done is not None:
            bounds.append(done + _TICK)
        start, end = max(bounds), now - grace
        if start >= end:
            continue
        windows = [w for w in fire_times(row.schedule, start, end, tz) if (row.id, w) not in have]
        if not windows:
            continue
        recover: Window | None = None
        truncated = 0
        if row.miss_policy is not MissPolicy.SKIP:
            latest = windows[-1]
            newest = last_fire(row.schedule, now, tz)
            # The latest window's own run (if it had one) or a later window's
            # inside the grace runs under the guard: recovering an older one
            # as well would run the schedule twice in a row.
            if newest is None or newest == latest:
                recover = Window(
                    start=latest, schedule_id=row.id, window=latest,
                    key=window_key(row.id, latest, tz), action=row.action,
                )
                truncated = len(windows) - 1 if row.miss_policy is MissPolicy.RUN_ALL else 0
        found.append(Missed(
            schedule_id=row.id,
            windows=windows[:MISSED_SHOWN],
            count=len(windows),
            recover=recover,
            truncated=truncated,
        ))
    return found


def retry_allowed(
    row: LocalSchedule | None,
    *,
    schedule_id: str,
    window: datetime,
    last_fired: datetime | None,
    now: datetime,
    grace: timedelta,
    tz: ZoneInfo,
    lookback: timedelta = LOOKBACK,
) -> StartDecision:
    """Return whether an interrupted job of window may be run again now.

    The same rule as a retry's start guard (:func:`decide_start` with
    ``retry=True``), checked before creating the retry run so that a window
    the policy no longer allows is reported instead of becoming a run that
    only skips.
    """
    return decide_start(
        row,
        schedule_id=schedule_id,
        window=window,
        last_fired=last_fired,
        first_seen=None,
        first_try=now,
        now=now,
        grace=grace,
        tz=tz,
        retry=True,
        lookback=lookback,
    )
