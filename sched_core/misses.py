"""When a window is eligible, and how far back the miss policy looks: pure.

Pure: no clock reads, no I/O; every function takes ``now``.

A window is eligible when it is later than the schedule's last fire and not
earlier than the minute in which this agent first saw the schedule. The firing loop
starts eligible windows in ``[now - grace, now]``; older ones are missed and
belong to the miss policy (:func:`sched_core.plan.missed`), which
looks back 24 hours unless the row sets its own catch-up window.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sched_core.clock import floor_minute  # re-exported: flows import it from here
from sched_core.values import TICK

__all__ = ["LOOKBACK", "eligible_after", "floor_minute"]

LOOKBACK = timedelta(hours=24)
"""How far back the miss policy looks for a missed window."""



def eligible_after(last_fired: datetime | None, first_seen: datetime | None) -> datetime | None:
    """Return the earliest instant a window may have to be eligible (inclusive), or None."""
    bounds = []
    if last_fired is not None:
        bounds.append(last_fired + TICK)
    if first_seen is not None:
        bounds.append(floor_minute(first_seen))
    return max(bounds) if bounds else None
