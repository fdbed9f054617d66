"""When a central task runs next.

Pure: no clock reads, no I/O; every function takes the instant to start after.
Cron expressions go through ``croniter``; a :class:`sched_core.Schedule` shape
is matched minute by minute in its timezone with ISC/Vixie cron's DST rules
(SPEC "Time"): a fixed-hour window in a spring-forward gap fires once at the
first minute after the jump, one in a fall-back repeat fires at the first
occurrence only, and wildcard-hour and interval schedules fire in both copies.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import croniter

from sched_core.model import DAY_NAMES, Schedule

_MINUTE = timedelta(minutes=1)
# A clock schedule fires at least once a week; a little over that bounds the scan.
_SCAN_LIMIT = 8 * 24 * 60


def check_cron(expr: str) -> None:
    """Raise ValueError unless expr is a valid five-field cron expression."""
    if len(expr.split()) != 5 or not croniter.is_valid(expr):
        raise ValueError(f"invalid cron expression {expr!r} (expected five fields)")


def next_cron(expr: str, timezone: str, *, after: datetime) -> datetime:
    """Return the first time after ``after`` that cron expr matches in timezone, in UTC."""
    start = after.astimezone(ZoneInfo(timezone))
    nxt: datetime = croniter(expr, start).get_next(datetime)
    return nxt.astimezone(UTC)


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


def _resolve(wall: datetime, zone: ZoneInfo) -> tuple[datetime, ...]:
    """Return the UTC instants of a local wall time: none (a gap), one, or two (a repeat)."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    instants = tuple(
        sorted({t for t in (first, second) if t.astimezone(zone).replace(tzinfo=None) == wall})
    )
    return instants


def _after_gap(wall: datetime, zone: ZoneInfo) -> datetime:
    """Return the first whole minute (UTC) after the jump over a wall time in a gap."""
    # fold=1 reads the wall time with the offset from after the jump: an instant
    # before the jump; fold=0 with the one from before it: an instant after it.
    low = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    high = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    instant = _floor_minute(low)
    while instant < high and instant.astimezone(zone).replace(tzinfo=None) <= wall:
        instant += _MINUTE
    return instant


def next_shape(schedule: Schedule, timezone: str, *, after: datetime) -> datetime | None:
    """Return the first window after ``after`` of a schedule shape in timezone, in UTC.

    None for an event schedule (``on`` set), which never fires on the clock.
    Clock schedules resolve each candidate day's windows to instants (a few
    hundred at most); interval schedules scan minutes, which they match often.
    """
    if schedule.is_event:
        return None
    if schedule.is_interval:
        return next_shape_by_minutes(schedule, timezone, after=after)
    zone = ZoneInfo(timezone)
    after_utc = after.astimezone(UTC)
    start = after_utc.astimezone(zone).date() - timedelta(days=1)
    any_hour = schedule.has_wildcard_hours
    hours = range(24) if any_hour else sorted({int(h) for h in schedule.hours or []})
    days = schedule.days or []
    minute = int(schedule.minute)
    for offset in range(9):
        day = start + timedelta(days=offset)
        if "*" not in days and DAY_NAMES[day.weekday()] not in days:
            continue
        candidates = []
        for hour in hours:
            wall = datetime(day.year, day.month, day.day, hour, minute)
            instants = _resolve(wall, zone)
            if not instants:
                if not any_hour:
                    candidates.append(_after_gap(wall, zone))
                continue
            # A fixed-hour window in a repeated hour fires at its first copy only.
            candidates.extend(instants if any_hour else instants[:1])
        later = [t for t in candidates if t > after_utc]
        if later:
            return min(later)
    return None


def next_shape_by_minutes(
    schedule: Schedule, timezone: str, *, after: datetime
) -> datetime | None:
    """Return what :func:`next_shape` returns, by scanning every minute (the reference)."""
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


def next_run(
    *,
    cron: str | None,
    schedule: Schedule | None,
    timezone: str,
    after: datetime,
) -> datetime | None:
    """Return a recurring task's next run after ``after`` in UTC; None if it has no clock."""
    if cron is not None:
        return next_cron(cron, timezone, after=after)
    if schedule is not None:
        return next_shape(schedule, timezone, after=after)
    return None
