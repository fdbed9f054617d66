"""When a central task runs next.

Pure: no clock reads, no I/O; every function takes the instant to start after.
Cron expressions go through ``croniter``; a :class:`sched_core.Schedule` shape
goes through the agents' matcher, with ISC/Vixie cron's DST rules (SPEC
"Time"): a fixed-hour window in a spring-forward gap fires once at the first
minute after the jump, one in a fall-back repeat fires at the first occurrence
only, and wildcard-hour and interval schedules fire in both copies.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import croniter

from sched_core.matcher import next_fire
from sched_core.model import DAY_NAMES, Schedule

_MINUTE = timedelta(minutes=1)
# A clock schedule fires at least once a week; a little over that bounds the scan.
_SCAN_LIMIT = 8 * 24 * 60


def check_cron(expr: str) -> None:
    """Raise ValueError unless expr is a valid five-field cron expression."""
    if len(expr.split()) != 5 or not croniter.is_valid(expr):
        raise ValueError(f"invalid cron expression {expr!r} (expected five fields)")


def next_cron(expr: str, timezone: str, *, after: datetime) -> datetime:
    """Return the first time after ``after`` that cron expr matches in timezone, in UTC.

    As ISC cron does, an expression with a fixed hour fires once in a repeated
    (fall-back) hour, at the first copy; one whose hour field starts with ``*``
    fires in both copies.
    """
    zone = ZoneInfo(timezone)
    wildcard_hour = expr.split()[1].startswith("*")
    times = croniter(expr, after.astimezone(zone))
    for _ in range(4):
        found: datetime = times.get_next(datetime)
        utc = found.astimezone(UTC)
        if wildcard_hour or not _is_repeat(utc.astimezone(zone)):
            return utc
    raise ValueError(f"cron expression {expr!r} found no time outside a repeated hour")


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


def next_shape(schedule: Schedule, timezone: str, *, after: datetime) -> datetime | None:
    """Return the first window after ``after`` of a schedule shape in timezone, in UTC.

    The agents' own matcher decides (:func:`sched_core.matcher.next_fire`), so a
    central task and an agent schedule of the same shape fire at the same
    instants. None for an event schedule (``on`` set), which never fires on the
    clock.
    """
    if schedule.is_event:
        return None
    return next_fire(schedule, after, ZoneInfo(timezone))


def next_shape_by_minutes(
    schedule: Schedule, timezone: str, *, after: datetime
) -> datetime | None:
    """Return what :func:`next_shape` returns, by scanning every minute.

    The reference the tests check :func:`sched_core.matcher.next_fire` against
    (up to 8 days ahead; it is far too slow for the scheduler's hot path).
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
