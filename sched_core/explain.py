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
from sched_core.model import DAY_NAMES, LocalSchedule, Schedule
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


def schedule_words(schedule: Schedule) -> str:
    """Return when the schedule fires, for people: ``Mon, Tue at 02:30``, ``every 15 min``.

    ``daily at 02:30, 14:30``, ``Sat hourly at :05``, ``after the wave`` (an
    ``after_wave`` schedule), ``on <event>`` (another event schedule).
    """
    if schedule.is_event:
        return "after the wave" if schedule.on == "after_wave" else f"on {schedule.on}"
    if schedule.is_interval:
        minutes = schedule.interval_minutes or 0
        return f"every {minutes // 60} h" if minutes % 60 == 0 else f"every {minutes} min"
    days = schedule.days or []
    if "*" in days or set(days) >= set(DAY_NAMES):
        when = "daily"
    else:
        when = ", ".join(day.capitalize() for day in DAY_NAMES if day in days)
    minute = int(schedule.minute)
    hours = schedule.hours or []
    if "*" in hours:
        return f"{'' if when == 'daily' else when + ' '}hourly at :{minute:02d}"
    times = ", ".join(f"{hour:02d}:{minute:02d}" for hour in sorted({int(h) for h in hours}))
    return f"{when} at {times}"


def dst_note(schedule: Schedule, window: datetime, tz: ZoneInfo) -> str:
    """Return what DST does to one window of the schedule in tz, in words ('' when nothing).

    A window a spring-forward gap moved (its wall time does not exist that
    day); the first or second copy of a wall time a fall-back repeats, and
    whether the schedule fires in both (wildcard hours, intervals) or at the
    first only (a fixed hour).
    """
    local = window.astimezone(tz)
    wall = local.replace(tzinfo=None)
    if not matches(schedule, window, tz):
        before = (window - _MINUTE).astimezone(tz)
        jump = local.utcoffset() - before.utcoffset()  # type: ignore[operator]
        missing = wall - jump
        while missing < wall and not wall_matches(schedule, missing):
            missing += _MINUTE
        return (f"{missing:%H:%M} does not exist on {local:%Y-%m-%d} (DST: clocks jump from "
                f"{wall - jump:%H:%M} to {local:%H:%M}): runs at {local:%H:%M %Z}")
    first = wall.replace(tzinfo=tz, fold=0)
    second = wall.replace(tzinfo=tz, fold=1)
    if first.utcoffset() == second.utcoffset():
        return ""
    both = schedule.is_interval or schedule.has_wildcard_hours
    if local.fold == 1:
        return f"the second {wall:%H:%M} of {local:%Y-%m-%d} (DST fall-back, {local:%Z})"
    if both:
        return (f"{wall:%H:%M} happens twice on {local:%Y-%m-%d} (DST fall-back): "
                f"runs at both, this is the first ({local:%Z})")
    return (f"{wall:%H:%M} happens twice on {local:%Y-%m-%d} (DST fall-back): "
            f"runs at the first only ({local:%Z})")
