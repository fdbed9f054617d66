"""When a central task runs next.

Pure: no clock reads, no I/O; every function takes the instant to start after.
Cron expressions go through ``cronsim``, the SPEC's reference for ISC/Vixie
cron ("Time"): a job with a fixed minute and hour fires once in a
spring-forward gap, at the first minute after the jump, and once in a
fall-back repeat, at the first copy; any other job (its minute or hour field
starts with ``*``) fires in both copies of a repeated hour and skips wall times
that do not exist. The day-of-month and day-of-week fields are ANDed when
either starts with ``*``, ORed otherwise, as Vixie cron does. A
:class:`sched_core.Schedule` shape goes through the agents' matcher, with the
same DST rules.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

from sched_core.matcher import next_fire
from sched_core.model import DAY_NAMES, Schedule

_MINUTE = timedelta(minutes=1)
# A clock schedule fires at least once a week; a little over that bounds the scan.
_SCAN_LIMIT = 8 * 24 * 60
# Where check_cron starts looking. The Gregorian calendar repeats its dates and
# weekdays every 28 years between 1901 and 2099, so cronsim's 50-year search
# from here finds a match for every expression that ever matches.
_CHECK_FROM = datetime(2000, 1, 1, tzinfo=UTC)


def check_cron(expr: str) -> None:
    """Raise ValueError unless expr is a valid five-field cron expression that matches.

    The message names the expression and what is wrong with it: a bad field,
    or a day that none of its months has (``"0 0 30 2 *"``), which never matches.
    """
    next_cron(expr, "UTC", after=_CHECK_FROM)


def _cron_times(expr: str, start: datetime) -> CronSim:
    """Return cronsim's iterator of expr's times after start; ValueError naming what is wrong."""
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(f"invalid cron expression {expr!r} (expected five fields)")
    try:
        return CronSim(expr, start)
    except CronSimError:
        pass
    # cronsim's constructor rejects a bad field, and also a day of the month
    # that none of the listed months has. Each probe keeps some fields and puts
    # a value that always parses in the other, so the one that fails names the field.
    minute, hour, day, month, weekday = fields
    for probe in ((minute, hour, day, "*", weekday), (minute, hour, "1", month, weekday)):
        try:
            CronSim(" ".join(probe), start)
        except CronSimError as exc:
            reason = str(exc).lower()
            raise ValueError(f"invalid cron expression {expr!r} ({reason})") from None
    raise ValueError(
        f"cron expression {expr!r} never matches (none of its months has that day)"
    )


def next_cron(expr: str, timezone: str, *, after: datetime) -> datetime:
    """Return the first time after ``after`` that cron expr matches in timezone, in UTC.

    The time cronsim iterating from ``after`` in timezone yields (see the module
    docstring for its DST rules). Raises ValueError for an invalid expression
    or one that never matches.
    """
    if after.tzinfo is None:
        raise ValueError("after has no UTC offset")
    times = _cron_times(expr, after.astimezone(ZoneInfo(timezone)))
    for found in times:
        utc = found.astimezone(UTC)
        # cronsim matches a fixed-time job on wall times and takes the first copy
        # of a repeated one: from inside the second copy it can yield a time
        # before ``after``, a window that already fired in the first copy.
        if utc > after:
            return utc
    raise ValueError(f"cron expression {expr!r} never matches (no time in 50 years)")


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
