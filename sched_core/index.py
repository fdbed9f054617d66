"""Which schedules are due at an instant, for a whole fleet at once.

Rule: pure, like :mod:`sched_core.matcher`, and exactly its DST rules: a schedule is
due at an instant if and only if ``fire_times`` yields that instant for it.

Built once per schedule list (a pull), queried every tick.  Slots are keyed by wall
clock, and each slot keeps its schedules beside their weekdays as a 7-bit mask, so a
query tests the masks of one slot (a fleet's size / 1440 on average) and a build
appends each schedule once per hour rather than once per (day, hour):

- fixed-hour schedules by minute of the day;
- wildcard-hour schedules by minute of the hour;
- interval schedules by interval, with the intervals dividing each minute of the day.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from zoneinfo import ZoneInfo

from sched_core.matcher import DAY, DEFAULT_TZ, SETTLE, ZoneTable, zone_table
from sched_core.model import DAY_NAMES, LocalSchedule

__all__ = ["DueIndex"]

_DAY_BIT = {name: 1 << index for index, name in enumerate(DAY_NAMES)}
_ALL_DAYS = 0b111_1111
_MINUTES_PER_DAY = 1440
_MINUTE = {text: int(text) for value in range(60) for text in (str(value), f"{value:02d}")}

_Slot = tuple[list[int], list[LocalSchedule]]
"""Weekday masks (bit 0 is Monday) and, at the same positions, their schedules."""


def _day_mask(days: tuple[str, ...]) -> int:
    if "*" in days:
        return _ALL_DAYS
    mask = 0
    for day in days:
        mask |= _DAY_BIT[day]
    return mask


def _hour_walls(hours: tuple[str, ...]) -> tuple[int, ...] | None:
    """Return the distinct hours as minutes of the day, None for wildcard hours."""
    if "*" in hours:
        return None
    return tuple(sorted({int(hour) * 60 for hour in hours}))


class DueIndex:
    """The enabled clock and interval schedules of a list, indexed by wall-clock minute."""

    __slots__ = ("_divisors", "_fixed", "_intervals", "_size", "_wild", "_zone", "tz")

    def __init__(self, tz: ZoneInfo) -> None:
        self.tz = tz
        self._zone: ZoneTable = zone_table(tz)
        self._fixed: list[_Slot] = [([], []) for _ in range(_MINUTES_PER_DAY)]
        self._wild: list[_Slot] = [([], []) for _ in range(60)]
        self._intervals: dict[int, list[LocalSchedule]] = {}
        self._divisors: list[tuple[int, ...]] = []
        self._size = 0

    @classmethod
    def build(cls, schedules: Sequence[LocalSchedule], tz: ZoneInfo | None = None) -> DueIndex:
        """Return an index of the enabled, non-event schedules in ``schedules``."""
        index = cls(tz or DEFAULT_TZ)
        fixed, wild, intervals = index._fixed, index._wild, index._intervals
        # Fleets share few day lists and hour lists: parse each once.
        masks: dict[tuple[str, ...], int] = {}
        walls_of: dict[tuple[str, ...], tuple[int, ...] | None] = {}
        size = 0
        for row in schedules:
            schedule = row.schedule
            if not row.enabled or schedule.on:
                continue
            size += 1
            interval = schedule.interval_minutes
            if interval is not None:
                bucket = intervals.get(interval)
                if bucket is None:
                    intervals[interval] = [row]
                else:
                    bucket.append(row)
                continue
            days = tuple(schedule.days or ())
            mask = masks.get(days)
            if mask is None:
                mask = masks[days] = _day_mask(days)
            hours = tuple(schedule.hours or ())
            if hours in walls_of:
                walls = walls_of[hours]
            else:
                walls = walls_of[hours] = _hour_walls(hours)
            minute = _MINUTE[schedule.minute]
            if walls is None:
                slot_masks, slot_rows = wild[minute]
                slot_masks.append(mask)
                slot_rows.append(row)
            else:
                for wall in walls:
                    slot_masks, slot_rows = fixed[wall + minute]
                    slot_masks.append(mask)
                    slot_rows.append(row)
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
        bit = 1 << ((day + 3) % 7)
        found: list[LocalSchedule] = []
        if fixed:
            masks, rows = self._fixed[minute_of_day]
            found.extend([row for mask, row in zip(masks, rows, strict=True) if mask & bit])
        masks, rows = self._wild[minute_of_day % 60]
        found.extend([row for mask, row in zip(masks, rows, strict=True) if mask & bit])
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
        if not zone.has_transition(now - SETTLE, now):
            return self._ordinary(local)
        moment, before, after = zone.transitions(now - SETTLE, now)[-1]
        if after > before and now == moment:
            found = self._ordinary(local)
            seen = {id(row) for row in found}
            for wall in range(local - (after - before), local, 60):
                day, second = divmod(wall, DAY)
                bit = 1 << ((day + 3) % 7)
                masks, rows = self._fixed[second // 60]
                for mask, row in zip(masks, rows, strict=True):
                    if mask & bit and id(row) not in seen:
                        seen.add(id(row))
                        found.append(row)
            return found
        if after < before and now < moment + (before - after):
            return self._ordinary(local, fixed=False)
        return self._ordinary(local)
