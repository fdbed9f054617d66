"""Which windows a tick fires, over a loaded cache (the miss check is sched_core.plan.missed).

Pure: no clock reads, no I/O; every function takes ``now`` (an aware UTC
datetime) and returns values. The :class:`~sched_core.scheduler.Scheduler`
fires what these return and stamps what fired.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sched_core.clock import floor_minute
from sched_core.index import DueIndex
from sched_core.misses import eligible_after
from sched_core.model import LocalSchedule
from sched_core.view import NodeView

_MINUTE = timedelta(minutes=1)


DueRow = tuple[LocalSchedule, datetime, int]
"""A schedule's window a tick fires, and how many older pending ones it coalesces."""


def due_windows(index: DueIndex, view: NodeView, *, now: datetime) -> list[DueRow]:
    """Return each enabled clock schedule's latest eligible window in ``[now - grace, now]``.

    Sorted by window, then id. Minutes are walked newest first, so the first
    eligible window found per schedule is its latest; each older one found
    after it is counted as coalesced into it.
    """
    last_fired, first_seen, grace = view.last_fired, view.first_seen, view.grace
    floors: dict[str, datetime | None] = {}
    latest: dict[str, DueRow] = {}
    minute = floor_minute(now)
    while minute >= now - grace:
        for row in index.due_at(minute):
            rid = row.id
            if rid in floors:
                floor = floors[rid]
            else:
                floor = floors[rid] = eligible_after(last_fired.get(rid), first_seen.get(rid))
            if floor is not None and minute < floor:
                continue
            found = latest.get(rid)
            latest[rid] = (row, minute, 0) if found is None else (*found[:2], found[2] + 1)
        minute -= _MINUTE
    return sorted(latest.values(), key=lambda due: (due[1], due[0].id))
