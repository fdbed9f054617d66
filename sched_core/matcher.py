"""When schedules fire: the per-minute predicate and exact fire instants under DST.

Rule: pure. No clock reads, no I/O, never the machine's local timezone; every
function takes the instant it reasons about and a ``ZoneInfo`` (default
America/New_York).

DST follows ISC/Vixie cron, as ``cronsim`` does:

1. A *fixed-hour* window (hours without ``*``) whose wall time falls in a
   spring-forward gap fires once, at the first instant after the jump.
2. A fixed-hour window whose wall time is repeated by a fall-back fires once,
   at its first occurrence.
3. Wildcard-hour and interval schedules fire in both copies of a repeated
   hour, and not at all for wall times that do not exist.
4. Windows landing on the same instant give one fire; days are matched on the
   nominal local date of the wall time.

Internally instants are integer seconds since the epoch (UTC) and wall times
are "local seconds": the wall clock read as if it were UTC.  ``_ZoneTable``
finds a zone's UTC offset transitions once per year, so the common case (no
transition nearby) is plain integer arithmetic.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sched_core.model import DAY_NAMES, Schedule

__all__ = [
    "DEFAULT_TZ",
    "fire_times",
    "last_fire",
    "matches",
    "next_fire",
    "wall_matches",
    "window_key",
    "zone",
]

DEFAULT_TZ = ZoneInfo("America/New_York")
"""The zone every function uses when none is given, as in the Go kit."""


def zone(name: str) -> ZoneInfo:
    """Return the IANA zone called name; an unknown name is a ValueError naming it."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown timezone {name!r}") from exc

DAY = 86_400
HORIZON = 8 * DAY
"""``next_fire``/``last_fire`` look this far (seconds) and return None beyond it."""

# No real transition moves the clock by this much or more, so an instant this far
# after the last transition is neither in a repeated hour nor a moved window.
SETTLE = 3 * 3600
_PROBE = 3600
_EPOCH_DATE = date(1970, 1, 1)
_DAY_INDEX = {name: index for index, name in enumerate(DAY_NAMES)}

KIND_EVENT = 0
KIND_FIXED = 1
"""Fixed hours: moved out of a gap, first copy only of a repeated hour."""
KIND_REPEAT = 2
"""Wildcard hours or an interval: both copies of a repeated hour, nothing in a gap."""


def _require_aware(value: datetime, name: str) -> None:
    zone = value.tzinfo
    if zone is not UTC and (zone is None or value.utcoffset() is None):
        raise ValueError(
            f"{name} {value.isoformat()} is a naive datetime; pass a timezone-aware one "
            "(e.g. datetime(..., tzinfo=UTC))"
        )


# --- the plain predicate ---------------------------------------------------------------


def matches(schedule: Schedule, now: datetime, tz: ZoneInfo | None = None) -> bool:
    """Return True if the minute of ``now``, read in ``tz``, is one of the schedule's windows.

    The Go kit's ``Matches``: no DST rules, only the local wall clock.
    """
    _require_aware(now, "now")
    return wall_matches(schedule, now.astimezone(tz or DEFAULT_TZ))


def wall_matches(schedule: Schedule, wall: datetime) -> bool:
    """Return True if the wall time (naive, or read in its own zone) is one of the windows.

    The one wall-time predicate: no DST rules; a wall time a gap skips or a
    fall-back repeats matches like any other (see :mod:`sched_core.explain`).
    """
    if schedule.is_event:
        return False
    if schedule.interval_minutes is not None:
        return (wall.hour * 60 + wall.minute) % schedule.interval_minutes == 0
    days = schedule.days or []
    if "*" not in days and DAY_NAMES[wall.weekday()] not in days:
        return False
    if int(schedule.minute) != wall.minute:
        return False
    hours = schedule.hours or []
    return "*" in hours or any(hour != "*" and int(hour) == wall.hour for hour in hours)


# --- compiled schedules --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compiled:
    """A schedule reduced to what firing needs: its kind and, per weekday, its wall minutes."""

    kind: int
    minutes_by_weekday: tuple[tuple[int, ...], ...]
    """Sorted minutes since local midnight, indexed Monday=0 like ``date.weekday()``."""


_EVENT = Compiled(KIND_EVENT, ((),) * 7)


def compile_schedule(schedule: Schedule) -> Compiled:
    """Return the compiled form of a schedule, cached by its shape."""
    if schedule.is_event:
        return _EVENT
    return _compile(
        tuple(schedule.days or ()),
        tuple(schedule.hours or ()),
        schedule.minute,
        schedule.interval_minutes,
    )


@lru_cache(maxsize=1 << 17)  # a 100,000-node fleet has ~61,000 shapes
def _compile(
    days: tuple[str, ...], hours: tuple[str, ...], minute: str, interval: int | None
) -> Compiled:
    if interval is not None:
        every = tuple(range(0, 1440, interval))
        return Compiled(KIND_REPEAT, (every,) * 7)
    weekdays: Collection[int] = range(7) if "*" in days else {_DAY_INDEX[day] for day in days}
    wildcard = "*" in hours
    hour_set: Collection[int] = range(24) if wildcard else {int(hour) for hour in hours}
    walls = tuple(sorted(hour * 60 + int(minute) for hour in hour_set))
    return Compiled(
        KIND_REPEAT if wildcard else KIND_FIXED,
        tuple(walls if weekday in weekdays else () for weekday in range(7)),
    )


# --- zone transitions ----------------------------------------------------------------


@lru_cache(maxsize=1024)
def _year_start(year: int) -> int:
    return (date(year, 1, 1) - _EPOCH_DATE).days * DAY


class ZoneTable:
    """A zone's UTC offset transitions, found once per UTC year by probing ``zoneinfo``.

    A year's chunk holds the transitions ``T`` with ``start < T <= end`` (``T`` is the
    first second of the new offset) and the offsets in force between them.  Queries
    read ``_flat``: the chunks of a few consecutive years joined, replaced whole (so
    concurrent readers see one consistent version) when a query falls outside it.
    """

    __slots__ = ("_chunks", "_flat", "tz")

    def __init__(self, tz: ZoneInfo) -> None:
        self.tz = tz
        self._chunks: dict[int, tuple[list[int], list[int]]] = {}
        self._flat: tuple[int, int, int, int, list[int], list[int]] = (0, -1, 0, 0, [], [])
        """First year, last year, covered [low, high) seconds, transitions, offsets."""

    def _probe(self, instant: int) -> int:
        offset = datetime.fromtimestamp(instant, self.tz).utcoffset()
        assert offset is not None
        return offset.days * DAY + offset.seconds

    def _chunk(self, year: int) -> tuple[list[int], list[int]]:
        chunk = self._chunks.get(year)
        if chunk is None:
            chunk = self._chunks.setdefault(year, self._scan(year))
        return chunk

    def _scan(self, year: int) -> tuple[list[int], list[int]]:
        start, end = _year_start(year), _year_start(year + 1)
        previous = self._probe(start)
        starts: list[int] = []
        offsets = [previous]
        low = start
        while low < end:
            high = min(low + _PROBE, end)
            current = self._probe(high)
            if current != previous:
                # Assume one transition per probe step: bisect to its first second.
                lo, hi = low, high
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self._probe(mid) == previous:
                        lo = mid
                    else:
                        hi = mid
                starts.append(hi)
                offsets.append(current)
                previous = current
            low = high
        return starts, offsets

    @staticmethod
    def _year_of(instant: int) -> int:
        year = 1970 + instant // 31_556_952
        while instant < _year_start(year):
            year -= 1
        while instant >= _year_start(year + 1):
            year += 1
        return year

    def _cover(self, low: int, high: int) -> tuple[list[int], list[int]]:
        """Return transitions and offsets covering at least ``[low, high]``."""
        first, last, covered_low, covered_high, starts, offsets = self._flat
        if covered_low <= low and high < covered_high:
            return starts, offsets
        want_first, want_last = self._year_of(low), self._year_of(high)
        if first <= last and max(last, want_last) - min(first, want_first) < 4:
            want_first, want_last = min(first, want_first), max(last, want_last)
        chunks = [self._chunk(year) for year in range(want_first, want_last + 1)]
        starts = [instant for chunk in chunks for instant in chunk[0]]
        offsets = chunks[0][1][:1] + [offset for chunk in chunks for offset in chunk[1][1:]]
        self._flat = (
            want_first,
            want_last,
            _year_start(want_first),
            _year_start(want_last + 1),
            starts,
            offsets,
        )
        return starts, offsets

    def offset_at(self, instant: int) -> int:
        """Return the UTC offset in seconds in force at ``instant``."""
        starts, offsets = self._cover(instant, instant)
        return offsets[bisect_right(starts, instant)]

    def transitions(self, low: int, high: int) -> list[tuple[int, int, int]]:
        """Return ``(instant, offset_before, offset_after)`` for transitions in ``(low, high]``."""
        starts, offsets = self._cover(low, high)
        found: list[tuple[int, int, int]] = []
        index = bisect_right(starts, low)
        while index < len(starts) and starts[index] <= high:
            found.append((starts[index], offsets[index], offsets[index + 1]))
            index += 1
        return found

    def has_transition(self, low: int, high: int) -> bool:
        """Return True if a transition falls in ``(low, high]``."""
        starts, _ = self._cover(low, high)
        index = bisect_right(starts, low)
        return index < len(starts) and starts[index] <= high

    def segments(self, low: int, high: int) -> list[tuple[int, int, int]]:
        """Return ``(start, end, offset)`` pieces of constant offset covering ``[low, high)``."""
        pieces: list[tuple[int, int, int]] = []
        start, offset = low, self.offset_at(low)
        for instant, _, after in self.transitions(low, high - 1):
            pieces.append((start, instant, offset))
            start, offset = instant, after
        pieces.append((start, high, offset))
        return pieces


_ZONES: dict[ZoneInfo, ZoneTable] = {}


def zone_table(tz: ZoneInfo) -> ZoneTable:
    """Return the shared transition table of ``tz``."""
    table = _ZONES.get(tz)
    if table is None:
        table = _ZONES.setdefault(tz, ZoneTable(tz))
    return table


# --- exact fire instants -------------------------------------------------------------


def day_instants(compiled: Compiled, zone: ZoneTable, day: int) -> list[int]:
    """Return the sorted fire instants of the windows whose nominal local date is ``day``.

    ``day`` counts days since 1970-01-01; two windows on one instant give one.
    """
    walls = compiled.minutes_by_weekday[(day + 3) % 7]
    if not walls:
        return []
    base = day * DAY
    pieces = zone.segments(base - DAY, base + 2 * DAY)
    if len(pieces) == 1:
        offset = pieces[0][2]
        return [base + minute * 60 - offset for minute in walls]
    fixed = compiled.kind == KIND_FIXED
    found: list[int] = []
    for minute in walls:
        wall = base + minute * 60
        hits = [wall - off for start, end, off in pieces if start <= wall - off < end]
        if hits:
            # A repeated wall time: fixed hours fire at the first copy only.
            found.extend(hits[:1] if fixed else hits)
        elif fixed:
            # A wall time in a gap fires at the first instant after the jump.
            found.append(next(start for start, _, off in pieces if start + off > wall))
    return sorted(set(found))


def instants(compiled: Compiled, zone: ZoneTable, start: float, end: float) -> Iterator[int]:
    """Yield the fire instants in ``[start, end)`` (epoch seconds), increasing, no duplicates."""
    if compiled.kind == KIND_EVENT or start >= end:
        return
    # A local date's instants lie within a day of it (offsets are under 15 h), so
    # nothing outside these dates can land in [start, end).
    first_day = math.floor(start / DAY) - 1
    last_day = math.floor(end / DAY) + 1
    pending: list[int] = []
    previous: int | None = None
    for day in range(first_day, last_day + 1):
        for instant in day_instants(compiled, zone, day):
            heapq.heappush(pending, instant)
        # Later dates only give instants at or after this day's local midnight read as UTC.
        while pending and (pending[0] < day * DAY or day == last_day):
            instant = heapq.heappop(pending)
            if instant != previous and start <= instant < end:
                yield instant
            previous = instant


def _to_utc(instant: int) -> datetime:
    return datetime.fromtimestamp(instant, UTC)


def fire_times(
    schedule: Schedule, start: datetime, end: datetime, tz: ZoneInfo | None = None
) -> Iterator[datetime]:
    """Yield the UTC instants in ``[start, end)`` at which the schedule fires, in order."""
    _require_aware(start, "start")
    _require_aware(end, "end")
    zone = zone_table(tz or DEFAULT_TZ)
    for instant in instants(compile_schedule(schedule), zone, start.timestamp(), end.timestamp()):
        yield _to_utc(instant)


def _wall_minute(zone: ZoneTable, now: int) -> tuple[int, int, int] | None:
    """Return (local day number, minute of that day, UTC offset) at now; None when the offset
    is not whole minutes (the fast paths of next_instant and last_instant then step aside)."""
    offset = zone.offset_at(now)
    if offset % 60 != 0:
        return None
    day, second = divmod((now // 60) * 60 + offset, DAY)
    return day, second // 60, offset


def next_instant(compiled: Compiled, zone: ZoneTable, after: float) -> int | None:
    """Return the first fire instant strictly after ``after``, None beyond ``HORIZON``."""
    if compiled.kind == KIND_EVENT:
        return None
    now = math.floor(after)
    wall = _wall_minute(zone, now)
    if wall is not None:
        day, minute_now, offset = wall
        by_weekday = compiled.minutes_by_weekday
        for ahead in range(9):
            walls = by_weekday[(day + ahead + 3) % 7]
            index = bisect_right(walls, minute_now) if ahead == 0 else 0
            if index < len(walls):
                candidate = (day + ahead) * DAY + walls[index] * 60 - offset
                # With no transition from SETTLE before ``after`` up to the candidate,
                # wall times map one to one onto instants in between.
                if not zone.has_transition(now - SETTLE, candidate):
                    return candidate if candidate <= after + HORIZON else None
                break
    for horizon in (DAY, HORIZON):
        for instant in instants(compiled, zone, after, after + horizon + 1):
            if instant > after:
                return instant if instant <= after + HORIZON else None
    return None


# next_instant's fast path run backwards: kept as its mirror, one direction per function.
def last_instant(compiled: Compiled, zone: ZoneTable, before: float) -> int | None:
    """Return the latest fire instant at or before ``before``, None beyond ``HORIZON``."""
    if compiled.kind == KIND_EVENT:
        return None
    now = math.floor(before)
    wall = _wall_minute(zone, now)
    if wall is not None:
        day, minute_now, offset = wall
        by_weekday = compiled.minutes_by_weekday
        for back in range(9):
            walls = by_weekday[(day - back + 3) % 7]
            index = bisect_right(walls, minute_now) if back == 0 else len(walls)
            if index > 0:
                candidate = (day - back) * DAY + walls[index - 1] * 60 - offset
                if not zone.has_transition(candidate - SETTLE, now):
                    return candidate if candidate >= before - HORIZON else None
                break
    for horizon in (DAY, HORIZON):
        found = None
        for instant in instants(compiled, zone, before - horizon, before + 1):
            if instant <= before:
                found = instant
        if found is not None:
            return found
    return None


def next_fire(schedule: Schedule, after: datetime, tz: ZoneInfo | None = None) -> datetime | None:
    """Return the first fire strictly after ``after``, or None if none within 8 days."""
    _require_aware(after, "after")
    found = next_instant(
        compile_schedule(schedule), zone_table(tz or DEFAULT_TZ), after.timestamp()
    )
    return None if found is None else _to_utc(found)


def last_fire(schedule: Schedule, before: datetime, tz: ZoneInfo | None = None) -> datetime | None:
    """Return the latest fire at or before ``before``, or None if none within 8 days."""
    _require_aware(before, "before")
    found = last_instant(
        compile_schedule(schedule), zone_table(tz or DEFAULT_TZ), before.timestamp()
    )
    return None if found is None else _to_utc(found)


# --- window identity -----------------------------------------------------------------


def window_key(schedule_id: str, window: datetime, tz: ZoneInfo | None = None) -> str:
    """Return ``id@YYYY-MM-DDTHH:MM±HH:MM``: the window's local date, time and UTC offset.

    The offset tells the two copies of a repeated hour apart.
    """
    _require_aware(window, "window")
    local = window.astimezone(tz or DEFAULT_TZ)
    offset = local.utcoffset() or timedelta(0)
    seconds = offset.days * DAY + offset.seconds
    sign = "-" if seconds < 0 else "+"
    hours, rest = divmod(abs(seconds), 3600)
    text = f"{sign}{hours:02d}:{rest // 60:02d}"
    if rest % 60:
        text += f":{rest % 60:02d}"
    return f"{schedule_id}@{local:%Y-%m-%dT%H:%M}{text}"
