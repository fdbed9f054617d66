"""Cron expressions of the central scheduler: checked, and their next time.

Pure: no clock reads, no I/O. They go through ``cronsim``, the SPEC's reference for ISC/Vixie
cron ("Time"): a job with a fixed minute and hour fires once in a spring-forward gap, at the
first minute after the jump, and once in a fall-back repeat, at the first copy; any other job
(its minute or hour field starts with ``*``) fires in both copies of a repeated hour and skips
wall times that do not exist. The day-of-month and day-of-week fields are ANDed when either
starts with ``*``, ORed otherwise, as Vixie cron does.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

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
