"""What a node fires now, and when it must look again: the firing loop's decisions.

Pure: no clock reads, no I/O; every function takes ``now``. The firing loop
(:mod:`sched_core.loop`) wakes at each window's start, asks :func:`due_now`, hands each
answer to the start guard (:func:`sched_core.guard.decide_start`, which decides
and stamps under the cache's lock), and sleeps until :func:`next_start`.

Rules:

1. A clock row's window is **due** when its start (the window plus the row's
   jitter) is in ``[now - grace, now]``, it is eligible (later than the row's
   last fire, not before the minute the row was first seen), later than the
   latest window the node already decided for the row (``decided``), and the
   row's policies let it fire.
2. One window per row and call: the latest due one. Older due windows of the
   same row are **coalesced** into it: they piled up while the node was not
   looking (stopped, suspended); a node that is running decides every window
   at its start, so they never pile up, and a window that waits for a job
   slot was decided at its start and runs in its turn.
3. Windows older than the grace belong to the miss policy
   (:func:`sched_core.plan.missed`), never to this module.
4. The next start is the earliest start after ``now`` of any row's next window
   that rule 1 would let fire (policies and eligibility applied), within 8
   days; the loop wakes then, or earlier when the schedules change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sched_core.misses import eligible_after
from sched_core.model import LocalSchedule
from sched_core.policies import policy_block, window_starts
from sched_core.values import TICK
from sched_core.view import NodeView

__all__ = ["LOOK_AHEAD", "Due", "NodeView", "due_now", "next_start"]

LOOK_AHEAD = timedelta(days=8)
"""How far ahead :func:`next_start` looks (the matcher's horizon)."""



@dataclass(frozen=True)
class Due:
    """A row's window to fire now, and the older windows coalesced into it (rule 2)."""

    row: LocalSchedule
    window: datetime
    start: datetime
    coalesced: list[datetime] = field(default_factory=list)


def _clock_rows(view: NodeView) -> list[LocalSchedule]:
    return [row for row in view.rows if row.enabled and not row.schedule.is_event]


def _floor(view: NodeView, row: LocalSchedule, decided: Mapping[str, datetime]) -> datetime | None:
    """Return the earliest window instant rule 1 lets fire for row, or None for no bound."""
    bound = eligible_after(view.last_fired.get(row.id), view.first_seen.get(row.id))
    done = decided.get(row.id)
    if done is not None:
        bound = done + TICK if bound is None else max(bound, done + TICK)
    return bound


def _scan(view: NodeView, row: LocalSchedule, decided: Mapping[str, datetime],
          starts_from: datetime) -> tuple[datetime | None, datetime]:
    """Return the row's floor (rule 1) and where to scan its windows for starts from starts_from.

    A window starts at most the row's jitter after it, so the scan begins that much
    earlier, and never before the floor.
    """
    floor = _floor(view, row, decided)
    scan = starts_from - timedelta(seconds=row.jitter)
    return floor, scan if floor is None else max(scan, floor)


def due_now(view: NodeView, *, now: datetime, decided: Mapping[str, datetime]) -> list[Due]:
    """Return, per clock row, the latest due window and the older due ones (rules 1 and 2)."""
    found: list[Due] = []
    low = now - view.grace
    for row in _clock_rows(view):
        floor, scan = _scan(view, row, decided, low)
        last = view.last_fired.get(row.id)
        windows = [
            (window, start)
            for window, start in window_starts(row, scan, now + TICK, node=view.node, tz=view.tz)
            if low <= start <= now and (floor is None or window >= floor)
            and policy_block(row, window, last_fired=last, tz=view.tz) is None
        ]
        if windows:
            window, start = windows[-1]
            found.append(Due(row=row, window=window, start=start,
                             coalesced=[item for item, _ in windows[:-1]]))
    return found


def next_start(
    view: NodeView, *, now: datetime, decided: Mapping[str, datetime]
) -> datetime | None:
    """Return the earliest start after now of a window that will be due (rule 4), or None."""
    best: datetime | None = None
    for row in _clock_rows(view):
        floor, scan = _scan(view, row, decided, now)
        last = view.last_fired.get(row.id)
        for window, start in window_starts(row, scan, now + LOOK_AHEAD, node=view.node,
                                           tz=view.tz):
            if start <= now or (floor is not None and window < floor):
                continue
            if best is not None and start >= best:
                break
            if policy_block(row, window, last_fired=last, tz=view.tz) is None:
                best = start
                break
    return best
