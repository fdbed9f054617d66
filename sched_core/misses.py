"""Which window to fire: the tick's choice and the miss policy, as pure functions.

Pure: no clock reads, no I/O; every function takes ``now``.

A window is eligible when it is later than the schedule's last fire and not
earlier than the minute in which this agent first saw the schedule. The tick
owns eligible windows in ``[now - grace, now]``; older ones are missed and
belong to the miss policy, which looks back 24 hours at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.clock import floor_minute  # re-exported: flows import it from here
from sched_core.matcher import fire_times, last_fire
from sched_core.model import MissPolicy, Schedule

__all__ = ["LOOKBACK", "Recovery", "eligible_after", "floor_minute", "plan_recovery"]

LOOKBACK = timedelta(hours=24)
"""How far back the miss policy looks for a missed window."""

_TICK = timedelta(microseconds=1)


def eligible_after(last_fired: datetime | None, first_seen: datetime | None) -> datetime | None:
    """Return the earliest instant a window may have to be eligible (inclusive), or None."""
    bounds = []
    if last_fired is not None:
        bounds.append(last_fired + _TICK)
    if first_seen is not None:
        bounds.append(floor_minute(first_seen))
    return max(bounds) if bounds else None


@dataclass(frozen=True)
class Recovery:
    """A missed window the policy fires, and how many older ones ``run-all`` drops."""

    window: datetime
    truncated: int


def plan_recovery(
    schedule: Schedule,
    policy: MissPolicy,
    *,
    last_fired: datetime | None,
    first_seen: datetime | None,
    now: datetime,
    grace: timedelta,
    tz: ZoneInfo,
) -> Recovery | None:
    """Return the window the miss policy fires now, or None.

    1. Take the windows of the last 24 h that are older than the grace (the
       tick still owns the rest) and eligible (after the last fire, not before
       first seen).
    2. ``skip`` fires none of them; ``run-once-within-24h`` and ``run-all``
       fire the latest once, ``run-all`` reporting the older ones it drops.
    3. If the latest window of the last 24 h is still inside the grace, the
       tick will fire it: nothing is recovered, since firing an older window
       just before it would fire twice in a row.
    """
    if schedule.is_event or policy is MissPolicy.SKIP:
        return None
    lookback_start = now - LOOKBACK + _TICK
    latest = last_fire(schedule, now, tz)
    if latest is None or latest < lookback_start or latest >= now - grace:
        return None
    floor = eligible_after(last_fired, first_seen)
    start = lookback_start if floor is None else max(lookback_start, floor)
    if latest < start:
        return None
    truncated = 0
    if policy is MissPolicy.RUN_ALL:
        truncated = sum(1 for _ in fire_times(schedule, start, latest, tz))
    return Recovery(window=latest, truncated=truncated)
