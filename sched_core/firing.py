"""What a node fires now, and when it must look again: the firing loop's decisions.

Pure: no clock reads, no I/O; every function takes ``now``. The firing loop
(:mod:`sched_core.loop`) wakes at each window's start, asks :func:`due_now`, hands each
answer to the start guard (:func:`sched_core.guard.decide_start`, which decides
and stamps under the cache's lock), and sleeps until :func:`next_start`.

Rules:

1. A clock row's window is **due** when its start (the window plus the row's
   jitter) is in ``[now - grace, now]``, it is eligible (later than the row's
   last fire, not before the minute the row was first seen), later than the
   latest window the node already decided for the row (``decided``), and the
   row's policies let it fire.
2. One window per row and call: the latest due one. Older due windows of the
   same row are **coalesced** into it: they piled up while the node was not
   looking (stopped, suspended); a node that is running decides every window
   at its start, so they never pile up, and a window that waits for a job
   slot was decided at its start and runs in its turn.
3. Windows older than the grace belong to the miss policy
   (:func:`sched_core.plan.missed`), never to this module.
4. The next start is the earliest start after ``now`` of any row's next window
   that rule 1 would let fire (policies and eligibility applied), within 8
   days; the loop wakes then, or earlier when the schedules change.
5. Between turns each row's next start is kept (:class:`Starts`) for as long as what it
   was computed from holds (the row object, its last fire, first-seen time and latest
   decided window): a turn looks at the windows of the rows whose start has come, so an
   idle turn costs next to nothing however many rows the node has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from sched_core.misses import eligible_after
from sched_core.model import LocalSchedule
from sched_core.policies import policy_block, window_starts
from sched_core.values import TICK
from sched_core.view import NodeView

__all__ = ["LOOK_AHEAD", "Due", "NodeView", "Starts", "due_now", "next_start"]

LOOK_AHEAD = timedelta(days=8)
"""How far ahead :func:`next_start` looks (the matcher's horizon)."""



@dataclass(frozen=True)
class Due:
    """A row's window to fire now, and the older windows coalesced into it (rule 2)."""

    row: LocalSchedule
    window: datetime
    start: datetime
    coalesced: list[datetime] = field(default_factory=list)


def _clock_rows(view: NodeView) -> list[LocalSchedule]:
    return [row for row in view.rows if row.enabled and not row.schedule.is_event]


def _floor(view: NodeView, row: LocalSchedule, decided: Mapping[str, datetime]) -> datetime | None:
    """Return the earliest window instant rule 1 lets fire for row, or None for no bound."""
    bound = eligible_after(view.last_fired.get(row.id), view.first_seen.get(row.id))
    done = decided.get(row.id)
    if done is not None:
        bound = done + TICK if bound is None else max(bound, done + TICK)
    return bound


def _scan(view: NodeView, row: LocalSchedule, decided: Mapping[str, datetime],
          starts_from: datetime) -> tuple[datetime | None, datetime]:
    """Return the row's floor (rule 1) and where to scan its windows for starts from starts_from.

    A window starts at most the row's jitter after it, so the scan begins that much
    earlier, and never before the floor.
    """
    floor = _floor(view, row, decided)
    scan = starts_from - timedelta(seconds=row.jitter)
    return floor, scan if floor is None else max(scan, floor)


def due_now(view: NodeView, *, now: datetime, decided: Mapping[str, datetime]) -> list[Due]:
    """Return, per clock row, the latest due window and the older due ones (rules 1 and 2)."""
    found: list[Due] = []
    low = now - view.grace
    for row in _clock_rows(view):
        floor, scan = _scan(view, row, decided, low)
        last = view.last_fired.get(row.id)
        windows = [
            (window, start)
            for window, start in window_starts(row, scan, now + TICK, node=view.node, tz=view.tz)
            if low <= start <= now and (floor is None or window >= floor)
            and policy_block(row, window, last_fired=last, tz=view.tz) is None
        ]
        if windows:
            window, start = windows[-1]
            found.append(Due(row=row, window=window, start=start,
                             coalesced=[item for item, _ in windows[:-1]]))
    return found


def next_start(
    view: NodeView, *, now: datetime, decided: Mapping[str, datetime]
) -> datetime | None:
    """Return the earliest start after now of a window that will be due (rule 4), or None."""
    best: datetime | None = None
    for row in _clock_rows(view):
        floor, scan = _scan(view, row, decided, now)
        last = view.last_fired.get(row.id)
        for window, start in window_starts(row, scan, now + LOOK_AHEAD, node=view.node,
                                           tz=view.tz):
            if start <= now or (floor is not None and window < floor):
                continue
            if best is not None and start >= best:
                break
            if policy_block(row, window, last_fired=last, tz=view.tz) is None:
                best = start
                break
    return best


@dataclass
class _Kept:
    """A row's next start, and what it was computed from (rule 5)."""

    row: LocalSchedule
    facts: tuple[datetime | None, datetime | None, datetime | None]
    start: datetime | None
    until: datetime
    """When the answer must be worked out again (a row with no start within LOOK_AHEAD)."""


class Starts:
    """Each clock row's next start, kept between turns (rule 5); the loop's one instance.

    :meth:`due` answers :func:`due_now` for the rows whose start has come (or is not
    known, or is named in ``also``: windows tried again); :meth:`next` answers
    :func:`next_start` from what it keeps, working a row out again only when its start has
    come or what it was computed from changed. Both answer what the functions answer on
    the whole view.
    """

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self._node: tuple[object, str, timedelta] | None = None
        self._basis: tuple[list[LocalSchedule], dict[str, datetime], dict[str, datetime],
                           dict[str, datetime]] | None = None
        """What the last whole pass of :meth:`next` read (rows by identity, the maps)."""
        self._soonest: datetime | None = None
        self._until: datetime | None = None
        """Until when every kept answer holds (the earliest start, or re-check)."""
        self._at: datetime | None = None
        """When the last whole pass was made: a clock that goes back forgets everything."""

    def _forget_if_earlier(self, now: datetime) -> None:
        if self._at is not None and now < self._at:
            self._kept.clear()
            self._basis = self._until = self._at = None

    def _unchanged(self, view: NodeView, decided: Mapping[str, datetime],
                   now: datetime) -> bool:
        """Whether nothing the kept answers were computed from changed, and none expired."""
        basis = self._basis
        if basis is None or self._until is None or now >= self._until:
            return False
        _, last_fired, first_seen, through = basis
        return (self.same_rows(view)
                and (view.tz, view.node, view.grace) == self._node
                and last_fired == view.last_fired and first_seen == view.first_seen
                and through == decided)

    def same_rows(self, view: NodeView) -> bool:
        """Whether view's rows are, object for object, those the last whole pass read (the
        rows of the loop's last turn: a turn always ends with :meth:`next`)."""
        rows = self._basis[0] if self._basis is not None else None
        return (rows is not None and len(rows) == len(view.rows)
                and all(a is b for a, b in zip(rows, view.rows, strict=True)))

    def _valid(self, view: NodeView, row: LocalSchedule, decided: Mapping[str, datetime],
               now: datetime) -> _Kept | None:
        """Return row's kept answer while it holds (now before its start or re-check)."""
        kept = self._kept.get(row.id)
        if kept is None or kept.row is not row or kept.facts != _facts(view, row, decided):
            return None
        return kept if now < kept.until else None

    def _same_node(self, view: NodeView) -> None:
        node = (view.tz, view.node, view.grace)
        if node != self._node:
            self._kept.clear()
            self._node = node

    def due(self, view: NodeView, *, now: datetime, decided: Mapping[str, datetime],
            through: Mapping[str, datetime], also: Iterable[str] = ()) -> list[Due]:
        """Return :func:`due_now`'s answer, looking only at rows that may have one.

        ``through`` is what :meth:`next` was last given (the windows decided or being tried).
        """
        self._forget_if_earlier(now)
        again = set(also)
        if not again and self._unchanged(view, through, now):
            return []
        self._same_node(view)
        rows = []
        for row in _clock_rows(view):
            if row.id in again or self._valid(view, row, through, now) is None:
                rows.append(row)
        return due_now(replace(view, rows=rows), now=now, decided=decided) if rows else []

    def next(self, view: NodeView, *, now: datetime,
             decided: Mapping[str, datetime]) -> datetime | None:
        """Return :func:`next_start`'s answer, working out only the rows that need it."""
        self._forget_if_earlier(now)
        if self._unchanged(view, decided, now):
            return self._soonest
        self._same_node(view)
        best: datetime | None = None
        until: datetime | None = None
        seen = set()
        for row in _clock_rows(view):
            seen.add(row.id)
            kept = self._valid(view, row, decided, now)
            if kept is None:
                start = next_start(replace(view, rows=[row]), now=now, decided=decided)
                kept = _Kept(row=row, facts=_facts(view, row, decided), start=start,
                             until=start if start is not None else now + timedelta(days=1))
                self._kept[row.id] = kept
            if kept.start is not None and (best is None or kept.start < best):
                best = kept.start
            until = kept.until if until is None else min(until, kept.until)
        for gone in set(self._kept) - seen:
            del self._kept[gone]
        self._basis = (list(view.rows), dict(view.last_fired), dict(view.first_seen),
                       dict(decided))
        self._soonest = best
        self._until = until if until is not None else now + timedelta(days=1)
        self._at = now
        return best

    def starting_at(self, when: datetime | None) -> int:
        """Return how many rows' kept next start is when (after :meth:`next`)."""
        if when is None:
            return 0
        return sum(1 for kept in self._kept.values() if kept.start == when)


def _facts(view: NodeView, row: LocalSchedule,
           decided: Mapping[str, datetime]) -> tuple[datetime | None, datetime | None,
                                                     datetime | None]:
    return (view.last_fired.get(row.id), view.first_seen.get(row.id), decided.get(row.id))
