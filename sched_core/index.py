"""Which schedules are due at an instant, for a whole fleet at once.

Rule: pure, like :mod:`sched_core.matcher`, and exactly its DST rules: a schedule is
due at an instant if and only if ``fire_times`` yields that instant for it.

Built once per schedule list (a pull), queried every tick.  Slots are keyed by wall
clock so a query costs a few list lookups plus the size of its answer:

- fixed-hour schedules by ``(weekday, hour, minute)``;
- wildcard-hour schedules by ``(weekday, minute)``;
- interval schedules by interval, with the intervals dividing each minute of the day.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from zoneinfo import ZoneInfo

from sched_core.matcher import DAY, DEFAULT_TZ, ZoneTable, zone_table
from sched_core.model import DAY_NAMES, LocalSchedule

__all__ = ["DueIndex"]

_DAY_INDEX = {name: index for index, name in enumerate(DAY_NAMES)}
_ALL_DAYS = tuple(range(7))
_MINUTES_PER_DAY = 1440
# Instants this long after a transition are ordinary (no shift is this large).
_SETTLE = 3 * 3600


class DueIndex:
    """The enabled clock and interval schedules of a list, indexed by wall-clock minute."""

    __slots__ = ("_divisors", "_fixed", "_intervals", "_size", "_wild", "_zone", "tz")

    def __init__(self, tz: ZoneInfo) -> None:
        self.tz = tz
        self._zone: ZoneTable = zone_table(tz)
        self._fixed: list[list[LocalSchedule] | None] = [None] * (7 * _MINUTES_PER_DAY)
        self._wild: list[list[LocalSchedule] | None] = [None] * (7 * 60)
        self._intervals: dict[int, list[LocalSchedule]] = {}
        self._divisors: list[tuple[int, ...]] = []
        self._size = 0

    @classmethod
    def build(cls, schedules: Sequence[LocalSchedule], tz: ZoneInfo | None = None) -> DueIndex:
        """Return an index of the enabled, non-event schedules in ``schedules``."""
        index = cls(tz or DEFAULT_TZ)
        fixed, wild, intervals = index._fixed, index._wild, index._intervals
        day_index = _DAY_INDEX
        size = 0
        for row in schedules:
            schedule = row.schedule
            if not row.enabled or schedule.on:
                continue
            size += 1
            if schedule.interval_minutes is not None:
                bucket = intervals.get(schedule.interval_minutes)
                if bucket is None:
                    intervals[schedule.interval_minutes] = [row]
                else:
                    bucket.append(row)
                continue
            days = schedule.days or ()
            weekdays: Collection[int] = (
                _ALL_DAYS if "*" in days else {day_index[day] for day in days}
            )
            minute = int(schedule.minute)
            hours = schedule.hours or ()
            if "*" in hours:
                for weekday in weekdays:
                    slot = weekday * 60 + minute
                    bucket = wild[slot]
                    if bucket is None:
                        wild[slot] = [row]
                    else:
                        bucket.append(row)
                continue
            walls = {int(hour) * 60 + minute for hour in hours}
            for weekday in weekdays:
                base = weekday * _MINUTES_PER_DAY
                for wall in walls:
                    bucket = fixed[base + wall]
                    if bucket is None:
                        fixed[base + wall] = [row]
                    else:
                        bucket.append(row)
        index._size = size
        every: list[list[int]] = [[] for _ in range(_MINUTES_PER_DAY)]
        for interval in sorted(intervals):
            for minute in range(0, _MINUTES_PER_DAY, interval):
                every[minute].append(interval)
        index._divisors = [tuple(values) for values in every]
        return index

    def __len__(self) -> int:
        return self._size

    def _ordinary(self, local: int, *, fixed: bool = True) -> list[LocalSchedule]:
        """Return the schedules whose wall time is ``local`` (local seconds, a whole minute)."""
        day, second = divmod(local, DAY)
        minute_of_day = second // 60
        weekday = (day + 3) % 7
        found: list[LocalSchedule] = []
        if fixed:
            bucket = self._fixed[weekday * _MINUTES_PER_DAY + minute_of_day]
            if bucket:
                found.extend(bucket)
        bucket = self._wild[weekday * 60 + minute_of_day % 60]
        if bucket:
            found.extend(bucket)
        intervals = self._intervals
        for interval in self._divisors[minute_of_day]:
            found.extend(intervals[interval])
        return found

    def due_at(self, instant: datetime) -> list[LocalSchedule]:
        """Return the schedules that fire exactly at ``instant``, a whole UTC minute.

        1. Read the wall time of ``instant`` in the index's zone.
        2. Look for a transition in the three hours up to ``instant``.
        3. At the first instant after a spring-forward jump, add the fixed-hour
           schedules whose windows fell in the gap (each schedule once).
        4. In the second copy of a repeated hour, leave fixed-hour schedules out.
        """
        if instant.tzinfo is None or instant.utcoffset() is None:
            raise ValueError(
                f"instant {instant.isoformat()} is a naive datetime; pass a timezone-aware one"
            )
        stamp = instant.timestamp()
        now = int(stamp)
        if now != stamp or now % 60:
            raise ValueError(f"instant {instant.isoformat()} is not a whole UTC minute")
        zone = self._zone
        offset = zone.offset_at(now)
        if offset % 60:
            return []  # wall minutes are not UTC minutes here: see fire_times
        local = now + offset
        if not zone.has_transition(now - _SETTLE, now):
            return self._ordinary(local)
        moment, before, after = zone.transitions(now - _SETTLE, now)[-1]
        if after > before and now == moment:
            found = self._ordinary(local)
            seen = {id(row) for row in found}
            for wall in range(local - (after - before), local, 60):
                day, second = divmod(wall, DAY)
                bucket = self._fixed[((day + 3) % 7) * _MINUTES_PER_DAY + second // 60]
                for row in bucket or ():
                    if id(row) not in seen:
                        seen.add(id(row))
                        found.append(row)
            return found
        if after < before and now < moment + (before - after):
            return self._ordinary(local, fixed=False)
        return self._ordinary(local)
