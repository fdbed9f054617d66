"""What DST and a row's policies do to its windows, in words, for ``sched preview``.

Pure: no clock reads, no I/O; every function takes the span it describes. The
engine (:mod:`sched_core.matcher`) decides when things fire and
:mod:`sched_core.policies` which windows a row's policies skip; this module
only says so: which wall times a spring-forward gap moves or skips, which a
fall-back repeat suppresses (by scanning minutes: slow, and fine for a
preview), and why a window is skipped or starts late.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.matcher import matches, wall_matches
from sched_core.model import LocalSchedule, Schedule
from sched_core.policies import policy_block, row_zone

_MINUTE = timedelta(minutes=1)


def describe(schedule: Schedule) -> str:
    """Return the schedule's shape in a few words."""
    if schedule.is_event:
        return f"on {schedule.on} (never on the clock)"
    if schedule.is_interval:
        return f"every {schedule.interval_minutes} min since local midnight"
    days = ",".join(schedule.days or [])
    hours = ",".join(schedule.hours or [])
    return f"days {days}, hours {hours}, minute {schedule.minute}"


def gap_notes(schedule: Schedule, start: datetime, end: datetime, tz: ZoneInfo) -> list[str]:
    """Describe the schedule's wall times that fall in DST gaps between start and end."""
    notes = []
    minute = start.astimezone(UTC).replace(second=0, microsecond=0)
    while minute < end:
        before, after = minute.astimezone(tz), (minute + _MINUTE).astimezone(tz)
        jump = after.utcoffset() - before.utcoffset()  # type: ignore[operator]
        if jump > timedelta(0):
            wall = (before + _MINUTE).replace(tzinfo=None)
            first_after = after.replace(tzinfo=None)
            while wall < first_after:
                if wall_matches(schedule, wall):
                    if schedule.is_interval or schedule.has_wildcard_hours:
                        what = "skipped: that time does not exist (DST gap)"
                    else:
                        what = f"moved to {first_after:%H:%M} (DST gap)"
                    notes.append(f"{wall:%Y-%m-%d %H:%M} {what}")
                wall += _MINUTE
        minute += _MINUTE
    return notes


def repeat_notes(
    schedule: Schedule, start: datetime, end: datetime, tz: ZoneInfo, fires: Collection[datetime]
) -> list[str]:
    """Describe the fixed-hour windows a fall-back repeat suppresses between start and end.

    fires are the schedule's fire instants over the span: a matching minute of
    the repeated hour that is not among them was suppressed. Wildcard-hour and
    interval schedules fire in both copies, so nothing is suppressed for them.
    """
    if schedule.is_event or schedule.is_interval or schedule.has_wildcard_hours:
        return []
    notes = []
    minute = start.astimezone(UTC).replace(second=0, microsecond=0)
    while minute < end:
        local = minute.astimezone(tz)
        if local.fold == 1 and matches(schedule, minute, tz) and minute not in fires:
            notes.append(
                f"{local:%Y-%m-%d %H:%M %Z} suppressed: repeated hour (DST fall-back), "
                "fired at the first occurrence"
            )
        minute += _MINUTE
    return notes


def window_notes(
    row: LocalSchedule,
    window: datetime,
    start: datetime,
    *,
    previous: datetime | None,
    node: str,
    tz: ZoneInfo,
) -> tuple[list[str], bool]:
    """Return what to say about one window of the row, and whether it fires.

    ``previous`` is the last window before it that fires (min_interval counts
    from it); ``start`` is its run's start, shown when a node's jitter moves it.
    """
    z = row_zone(row, tz)
    notes = [] if matches(row.schedule, window, z) else ["moved here by DST"]
    block = policy_block(row, window, last_fired=previous, tz=tz)
    if block is not None:
        return [*notes, f"skipped: {block}"], False
    if node and start != window:
        notes.append(f"starts {start.astimezone(z):%H:%M:%S} on {node} (jitter)")
    return notes, True
