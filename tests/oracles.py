"""Slow, obviously right references that tests check the fast code against.

Pure: no clock reads; every function takes the instant to start after.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.model import DAY_NAMES, Schedule

_MINUTE = timedelta(minutes=1)
# A clock schedule fires at least once a week; a little over that bounds the scan.
_SCAN_LIMIT = 8 * 24 * 60


def _floor_minute(value: datetime) -> datetime:
    return value.replace(second=0, microsecond=0)


def _wall_matches(schedule: Schedule, wall: datetime, *, any_hour: bool) -> bool:
    days = schedule.days or []
    if "*" not in days and DAY_NAMES[wall.weekday()] not in days:
        return False
    if wall.minute != int(schedule.minute):
        return False
    return any_hour or str(wall.hour) in (schedule.hours or [])


def _is_repeat(local: datetime) -> bool:
    """Return True when local is the second copy of a wall time repeated at fall-back."""
    if local.fold != 1:
        return False
    return local.replace(fold=0).utcoffset() != local.utcoffset()


def next_shape_by_minutes(
    schedule: Schedule, timezone: str, *, after: datetime
) -> datetime | None:
    """Return what :func:`controller.timing.next_shape` returns, by scanning every minute.

    The reference the tests check :func:`sched_core.matcher.next_fire` against
    (up to 8 days ahead; far too slow for the scheduler's hot path).
    """
    if schedule.is_event:
        return None
    zone = ZoneInfo(timezone)
    utc = _floor_minute(after.astimezone(UTC))
    prev_wall = utc.astimezone(zone).replace(tzinfo=None)
    any_hour = schedule.has_wildcard_hours
    for _ in range(_SCAN_LIMIT):
        utc += _MINUTE
        local = utc.astimezone(zone)
        wall = local.replace(tzinfo=None)
        before, prev_wall = prev_wall, wall
        if schedule.is_interval:
            interval = schedule.interval_minutes or 1
            if (wall.hour * 60 + wall.minute) % interval == 0:
                return utc
            continue
        if _wall_matches(schedule, wall, any_hour=any_hour):
            if any_hour or not _is_repeat(local):
                return utc
        if not any_hour and wall - before > _MINUTE:
            # Spring-forward: a fixed-hour window in the skipped wall times fires now.
            skipped = before + _MINUTE
            while skipped < wall:
                if _wall_matches(schedule, skipped, any_hour=False):
                    return utc
                skipped += _MINUTE
    return None
