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
2. **Prune.** A planned run that has not started yet and whose window is no
   longer a window of its row (removed, disabled, moved to the chain, its
   days, hours or minute changed, or its policies now skip it) is deleted, so
   the upcoming list is what the node will do; one whose row's jitter changed
   moves its start (:func:`planned_fate`).
3. **Guard.** When a run starts, :func:`sched_core.guard.decide_start` says whether it runs,
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

Each row's policies (:mod:`sched_core.policies`) apply at every step: a window
they skip is not planned, not run, and neither missed nor recovered.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.matcher import fire_times, window_key
from sched_core.misses import LOOKBACK, eligible_after
from sched_core.model import LocalSchedule, MissPolicy
from sched_core.policies import (
    catchup,
    interval_block,
    latest_window,
    policy_block,
    row_zone,
    run_start,
    window_block,
    window_starts,
)
from sched_core.values import TICK
from sched_core.view import NodeView

PLAN_AHEAD_LIMIT = timedelta(days=8)
"""How far ahead ``min_windows`` may reach for a schedule's next windows."""

TRIGGER_SCHEDULE = "schedule"
TRIGGER_RECOVERY = "schedule-recovery"
WINDOW_TRIGGERS = frozenset({TRIGGER_SCHEDULE, TRIGGER_RECOVERY})
"""Triggers whose runs belong to one window of a clock schedule (and pass the guard)."""



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
    return any(True for _ in fire_times(row.schedule, window, window + TICK, row_zone(row, tz)))


def _row_plan(
    row: LocalSchedule,
    *,
    eligible: datetime | None,
    last_fired: datetime | None,
    now: datetime,
    grace: timedelta,
    horizon: timedelta,
    min_windows: int,
    node: str,
    tz: ZoneInfo,
) -> Iterator[Window]:
    """Yield the row's plan: every window starting before now + horizon, and at least min_windows.

    Windows start from ``now - grace`` (their jittered start) and from
    eligible (their window). A window the row's policies skip is left out;
    min_interval counts from the last fire, then from each window planned
    before it (the plan assumes its runs run).
    """
    low, end = now - grace, now + horizon
    scan = low - timedelta(seconds=row.jitter)
    if eligible is not None:
        scan = max(scan, eligible)
    # Skip what the row's dates and an ending pause rule out in one step.
    if row.paused is not None:
        if row.paused.until is None:
            return
        scan = max(scan, row.paused.until)
    if row.not_before is not None:
        scan = max(scan, row.not_before)
    z = row_zone(row, tz)
    previous = last_fired
    count = 0
    for window, start in window_starts(row, scan, now + PLAN_AHEAD_LIMIT, node=node, tz=tz):
        if start < low:
            continue
        if start >= end and count >= min_windows:
            return
        if row.not_after is not None and window > row.not_after:
            return
        if window_block(row, window, tz=tz) is not None:
            continue
        if interval_block(row, window, last_fired=previous, tz=tz) is not None:
            continue
        previous = window
        count += 1
        yield Window(start=start, schedule_id=row.id, window=window,
                     key=window_key(row.id, window, z), action=row.action)


def plan_windows(
    view: NodeView, *, now: datetime, horizon: timedelta, min_windows: int, max_runs: int,
) -> Plan:
    """Return the windows that should have a planned run at now (rule 1 of the module).

    Windows whose run starts before ``now - grace`` are not planned: they are
    missed, and belong to :func:`missed`. A window's run starts at the window
    plus the row's jitter for node (:func:`sched_core.policies.run_start`).
    The cap keeps the ``max_runs`` nearest runs of the whole node; the rest
    is counted in ``held_back``.
    """
    per_row: list[Iterator[Window]] = []
    for row in view.rows:
        if not row.enabled or row.schedule.is_event:
            continue
        last = view.last_fired.get(row.id)
        per_row.append(_row_plan(
            row, eligible=eligible_after(last, view.first_seen.get(row.id)), last_fired=last,
            now=now, grace=view.grace, horizon=horizon, min_windows=min_windows,
            node=view.node, tz=view.tz,
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
class Upcoming:
    """A row's next windows that will run, and the ones its policies skip among them."""

    windows: list[Window]
    skipped: list[tuple[datetime, str]]
    """(window, reason) for each skipped window before the last one shown, at most ``count``."""


def upcoming(
    row: LocalSchedule,
    *,
    now: datetime,
    last_fired: datetime | None,
    count: int,
    node: str,
    tz: ZoneInfo,
    ahead: timedelta = PLAN_AHEAD_LIMIT,
) -> Upcoming:
    """Return the row's next count windows whose run starts at or after now and that will run.

    The same rules as :func:`plan_windows` (policies, jitter, min_interval
    counted from the last fire and then from each window before), looking at
    most ``ahead`` (8 days) ahead; the windows skipped on the way are returned with why.
    """
    if not row.enabled or row.schedule.is_event or count <= 0:
        return Upcoming([], [])
    if (row.paused is not None and row.paused.until is None) or (
            row.not_after is not None and row.not_after < now):
        return Upcoming([], [])  # nothing will run: the row's policies say why
    found: list[Window] = []
    skipped: list[tuple[datetime, str]] = []
    previous = last_fired
    z = row_zone(row, tz)
    scan = now - timedelta(seconds=row.jitter)
    for window, start in window_starts(row, scan, now + ahead, node=node, tz=tz):
        if start < now:
            continue
        reason = policy_block(row, window, last_fired=previous, tz=tz)
        if reason is not None:
            if len(skipped) < count:
                skipped.append((window, reason))
            continue
        previous = window
        found.append(Window(start=start, schedule_id=row.id, window=window,
                            key=window_key(row.id, window, z), action=row.action))
        if len(found) >= count:
            break
    return Upcoming(found, skipped)


class NextPlanned:
    """Each row's next window that will run (:func:`upcoming`, ``count=1``), remembered until
    its start passes or the row or its last fire changes: a report asks for every row's next
    window at each heartbeat, and no window can appear between ``now`` and the remembered
    start later.

    Rows are never changed in place (a pull brings new row objects), so the row object is
    part of what is remembered. Rows with no window within ``ahead`` are asked again."""

    def __init__(self, *, node: str, tz: ZoneInfo) -> None:
        self.node = node
        self.tz = tz
        self._known: dict[str, tuple[LocalSchedule, datetime | None, Window]] = {}

    def __call__(self, row: LocalSchedule, *, now: datetime,
                 last_fired: datetime | None) -> Window | None:
        known = self._known.get(row.id)
        if (known is not None and known[0] is row and known[1] == last_fired
                and known[2].start > now
                and (row.not_after is None or row.not_after >= now)):
            return known[2]
        found = upcoming(row, now=now, last_fired=last_fired, count=1, node=self.node,
                         tz=self.tz).windows
        if found:
            self._known[row.id] = (row, last_fired, found[0])
        else:
            self._known.pop(row.id, None)
        return found[0] if found else None

    def keep(self, ids: Collection[str]) -> None:
        """Forget the rows not among ids (removed from the node's list)."""
        for gone in self._known.keys() - set(ids):
            self._known.pop(gone, None)


@dataclass(frozen=True)
class Fate:
    """What becomes of a planned run not started yet (rule 2): kept, deleted, or moved."""

    delete: str | None = None
    """Why it is deleted (None: it stays)."""
    move_to: datetime | None = None
    """Its new start, when the row's jitter (or the node's name) moved it."""


def planned_fate(row: LocalSchedule | None, schedule_id: str, window: datetime,
                 start: datetime, *, last_fired: datetime | None, tz: ZoneInfo,
                 node: str) -> Fate:
    """Return what becomes of the planned run of window, due to start at start (rule 2).

    It is deleted when its row is gone, disabled or on an event, no longer has the
    window, or its policies now skip the window (a new pause, dates or blackout, or
    ``min_interval`` counted from ``last_fired``). A row changed in any other way
    (name, params, overlap) keeps its runs: a run reads its row when it starts. A
    changed jitter (or a renamed node) keeps the run's window and key and moves only
    its start.
    """
    reason = gone_reason(row, schedule_id, window, tz)
    if reason is None and row is not None:
        block = policy_block(row, window, last_fired=last_fired, tz=tz)
        if block is not None:
            reason = f"schedule {row.id} skips this window: {block}"
    if reason is not None or row is None:
        return Fate(delete=reason or f"schedule {schedule_id} was removed")
    new_start = run_start(row, window, node=node, tz=tz)
    if abs(new_start - start) >= timedelta(seconds=1):
        return Fate(move_to=new_start)
    return Fate()


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
    latest: datetime | None = None
    """The latest of the windows (``windows`` shows the oldest few)."""


MISSED_SHOWN = 10
"""How many of a schedule's missed windows a report lists (all are counted)."""


def missed(
    view: NodeView,
    *,
    planned_through: Mapping[str, datetime],
    now: datetime,
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

    A window whose run would start within the grace (its jitter) is the
    planner's, not missed; a window the row's policies skip is not missed
    either (it was never to run); the look-back is the row's catch-up window.
    """
    found: list[Missed] = []
    for row in view.rows:
        if not row.enabled or row.schedule.is_event:
            continue
        windows = _unrun_windows(view, row, planned_through.get(row.id), now=now, have=have,
                                 lookback=lookback)
        if windows:
            found.append(_missed_of(view, row, windows, now=now, lookback=lookback))
    return found


def _unrun_windows(view: NodeView, row: LocalSchedule, done: datetime | None, *,
                   now: datetime, have: Collection[tuple[str, datetime]],
                   lookback: timedelta) -> list[datetime]:
    """Return row's windows older than the grace that never had a run (rule 4's windows)."""
    bounds = [now - catchup(row, lookback) + TICK]
    last = view.last_fired.get(row.id)
    eligible = eligible_after(last, view.first_seen.get(row.id))
    if eligible is not None:
        bounds.append(eligible)
    if done is not None:
        bounds.append(done + TICK)
    start, end = max(bounds), now - view.grace
    if start >= end:
        return []
    return [
        window for window, begins in window_starts(row, start, end, node=view.node, tz=view.tz)
        if begins < end and (row.id, window) not in have
        and policy_block(row, window, last_fired=last, tz=view.tz) is None
    ]


def _missed_of(view: NodeView, row: LocalSchedule, windows: list[datetime], *, now: datetime,
               lookback: timedelta) -> Missed:
    """Return what the miss policy does about row's missed windows: at most one recovery."""
    recover: Window | None = None
    truncated = 0
    if row.miss_policy is not MissPolicy.SKIP:
        latest = windows[-1]
        newest = latest_window(row, now, since=now - catchup(row, lookback) + TICK,
                               node=view.node, tz=view.tz)
        # The latest window's own run (if it had one) or a later window's
        # inside the grace runs under the guard: recovering an older one
        # as well would run the schedule twice in a row.
        if newest is None or newest[0] == latest:
            recover = Window(
                start=latest, schedule_id=row.id, window=latest,
                key=window_key(row.id, latest, row_zone(row, view.tz)), action=row.action,
            )
            truncated = len(windows) - 1 if row.miss_policy is MissPolicy.RUN_ALL else 0
    return Missed(schedule_id=row.id, windows=windows[:MISSED_SHOWN], count=len(windows),
                  recover=recover, truncated=truncated, latest=windows[-1])

