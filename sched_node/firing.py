"""The firing loop: wake at each window's start, decide it, hand it to the node's jobs.

Nobody else is in the firing path: the loop reads the node's cache, decides
with the kit's start guard, and starts the job itself; the Prefect server and
the controller may both be gone.

One turn of the loop (:meth:`FiringLoop.turn`), at ``now``:

1. The windows older than the grace that the node never decided (it was
   stopped) go to the miss policy (:func:`sched_core.plan.missed`): the latest
   may be run once as ``schedule-recovery``; a window that had a planned run
   in Prefect ends it Skipped with the reason; the others are counted in one
   ``sched.window.missed`` event per schedule.
2. The windows due now (:func:`sched_core.firing.due_now`): older due windows
   of a row are Skipped as coalesced into its latest; the latest goes through
   the start guard (:meth:`sched_core.Scheduler.start_window`, which decides
   and stamps under the cache's lock, so no window runs twice) and becomes a
   job, or a Skipped record naming the guard's reason.
3. Every window decided is written to ``decided.json`` before the loop sleeps,
   so a restart neither decides a window twice nor loses one.
4. Sleep until the next start (:func:`sched_core.firing.next_start`), never
   past :data:`MAX_SLEEP_S` (the wall clock may jump), and wake early when the
   schedules change. A window never starts before its start: the loop checks
   the wall clock after waking and sleeps on until it is there.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from sched_core.firing import Due, NodeView, due_now, next_start
from sched_core.guard import StartDecision
from sched_core.jsonwire import MAX_DEPTH
from sched_core.plan import Missed, missed
from sched_core.statefile import locked, read_json_file, write_atomic
from sched_core.values import format_go_time

log = logging.getLogger(__name__)

MAX_SLEEP_S = 30.0
"""The longest the loop sleeps without looking at the clock again."""


class Decided:
    """Per schedule, the latest window the node decided (ran, skipped, missed): ``decided.json``."""

    def __init__(self, path: Path, *, now: datetime) -> None:
        self.path = path
        self._values: dict[str, datetime] = {}
        self._saved: dict[str, datetime] | None = None
        data = read_json_file(path, now=now, max_depth=MAX_DEPTH)
        from sched_node.outbox import parse_time

        for key, value in (data or {}).items() if isinstance(data, dict) else ():
            parsed = parse_time(value)
            if isinstance(key, str) and parsed is not None:
                self._values[key] = parsed

    def values(self) -> dict[str, datetime]:
        """Return a copy of the record."""
        return dict(self._values)

    def note(self, schedule_id: str, window: datetime) -> None:
        """Record window as decided for the schedule (only ever later)."""
        old = self._values.get(schedule_id)
        if old is None or window > old:
            self._values[schedule_id] = window

    def save(self, keep: set[str]) -> None:
        """Write the record (only the schedules in keep) atomically, when it changed."""
        kept = {key: value for key, value in self._values.items() if key in keep}
        if kept == self._saved:
            return
        self._values = kept
        self._saved = dict(kept)
        body = {key: format_go_time(value) for key, value in sorted(self._values.items())}
        with locked(self.path):
            write_atomic(self.path, json.dumps(body, separators=(",", ":")).encode())


@dataclass(eq=False, kw_only=True)
class FiringLoop:
    """The loop of the module (steps 1-4); what it does with a window is the node's.

    ``view(now)`` reads the cache; ``guard(schedule_id, window, now, recovery)``
    is the start guard (decide and stamp); ``fire(due, decision, trigger)``
    starts a job; ``skip(row, window, reason)`` records a window that does not
    run; ``on_missed(items)`` reports windows the miss policy does not run.
    """

    view: Callable[[datetime], NodeView]
    decided: Decided
    clock: Callable[[], datetime]
    guard: Callable[[str, datetime, datetime, bool], StartDecision]
    fire: Callable[[Due, StartDecision, bool], None]
    skip: Callable[[Due, datetime, str], None]
    on_missed: Callable[[list[Missed], NodeView], None]
    turns: int = field(default=0, init=False)
    _wake: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    def wake(self) -> None:
        """Look again now (the schedules changed)."""
        self._wake.set()

    def turn(self, now: datetime) -> datetime | None:
        """Decide everything due at now (steps 1-3); return the next start (or None)."""
        view = self.view(now)
        decided = self.decided.values()
        items = missed(view, planned_through=decided, now=now)
        for item in items:
            self.decided.note(item.schedule_id, item.latest or item.windows[-1])
        recoveries = [item for item in items if item.recover is not None]
        if items:
            self.on_missed(items, view)
        rows = {row.id: row for row in view.rows}
        for item in recoveries:
            assert item.recover is not None
            row = rows[item.schedule_id]
            window = item.recover.window
            decision = self.guard(row.id, window, now, True)
            due = Due(row=row, window=window, start=item.recover.start)
            self._act(due, decision, recovery=True)
        for due in due_now(view, now=now, decided=self.decided.values()):
            for older in due.coalesced:
                self.skip(due, older, f"coalesced into {format_go_time(due.window)}: the node "
                                       "was not running at its start; only the latest due "
                                       "window of a schedule runs")
            decision = self.guard(due.row.id, due.window, now, False)
            self._act(due, decision, recovery=False)
            self.decided.note(due.row.id, due.window)
        self.decided.save({row.id for row in view.rows})
        self.turns += 1
        return next_start(view, now=now, decided=self.decided.values())

    def _act(self, due: Due, decision: StartDecision, *, recovery: bool) -> None:
        if decision.runs:
            self.fire(due, decision, recovery)
        else:
            self.skip(due, due.window, decision.reason)

    def run(self, stop: threading.Event) -> None:
        """Turn until stop is set (step 4); whoever sets stop calls :meth:`wake` too."""
        while not stop.is_set():
            self._wake.clear()
            try:
                upcoming = self.turn(self.clock())
            except Exception:  # a bug must not stop the node's firing: look again soon
                log.exception("the firing loop failed a turn; trying again in 5 s")
                stop.wait(5.0)
                continue
            self._sleep_until(upcoming, stop)

    def _sleep_until(self, upcoming: datetime | None, stop: threading.Event) -> None:
        while not stop.is_set() and not self._wake.is_set():
            now = self.clock()
            if upcoming is not None and now >= upcoming:
                return
            left = MAX_SLEEP_S if upcoming is None else (upcoming - now).total_seconds()
            if left > MAX_SLEEP_S:
                self._wake.wait(MAX_SLEEP_S)
                return  # look at everything again (a clock jump, a pause that ended)
            self._wake.wait(max(left, 0.0005))


