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
   of a row are Skipped as coalesced into its latest; the latest of every row
   goes through the start guard together (:meth:`sched_core.Scheduler.start_windows`,
   which decides and stamps under the cache's lock in one write of the cache, so
   no window runs twice), and each becomes a job, or a Skipped record naming the
   guard's reason: all at once, each in a thread of its own, so the tenth window
   of an instant starts with the first.
3. Every window decided is written to ``decided.json`` before the loop sleeps,
   so a restart neither decides a window twice nor loses one.
4. Sleep until the next start (:func:`sched_core.firing.next_start`), never
   past :data:`MAX_SLEEP_S` (the wall clock may jump), and wake early when the
   schedules change. A window never starts before its start: the loop checks
   the wall clock after waking and sleeps on until it is there.
5. A window that cannot start (a full or read-only state folder) is neither run
   nor stamped and holds up no other window: it is tried again every
   :data:`RETRY_S` within its grace, then ends Failed with its reason, recorded
   as soon as the disk takes it.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
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
RETRY_S = 1.0
"""How soon a window that could not start (step 5) is tried again."""


@dataclass(frozen=True)
class Failing:
    """A window that could not start yet: when it first failed, and why."""

    due: Due
    since: datetime
    reason: str


def failure_reason(exc: BaseException) -> str:
    """Return why a window could not start, in words (a full or read-only disk said so)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the node's state folder is full ({exc.strerror}: {exc.filename})"
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the node's state folder cannot be written ({exc.strerror}: {exc.filename})"
    return f"{type(exc).__name__}: {exc}"


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
    fail: Callable[[Due, str], None] = lambda due, reason: None
    guard_many: Callable[[list[tuple[Due, bool]], datetime],
                         list[StartDecision | BaseException]] | None = None
    """The start guard of many windows in one step (one write of the cache); ``guard`` each
    when None."""
    turns: int = field(default=0, init=False)
    failing: dict[tuple[str, datetime], Failing] = field(default_factory=dict, init=False)
    """Windows that could not start yet (step 5), by schedule and window."""
    _wake: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _unsaved: str = field(default="", init=False, repr=False)

    def wake(self) -> None:
        """Look again now (the schedules changed)."""
        self._wake.set()

    def turn(self, now: datetime) -> datetime | None:
        """Decide everything due at now (steps 1-5); return when to look again (or None)."""
        view = self.view(now)
        self._expire(view, now)
        items = missed(view, planned_through=self._through(), now=now)
        for item in items:
            self.decided.note(item.schedule_id, item.latest or item.windows[-1])
        recoveries = [item for item in items if item.recover is not None]
        if items:
            self.on_missed(items, view)
        rows = {row.id: row for row in view.rows}
        batch: list[tuple[Due, bool]] = []
        for item in recoveries:
            assert item.recover is not None
            batch.append((Due(row=rows[item.schedule_id], window=item.recover.window,
                              start=item.recover.start), True))
        for due in due_now(view, now=now, decided=self.decided.values()):
            for older in due.coalesced:
                try:
                    self.skip(due, older, f"coalesced into {format_go_time(due.window)}: the "
                                           "node was not running at its start; only the "
                                           "latest due window of a schedule runs")
                except OSError as exc:  # its Skipped record only: the latest one still runs
                    log.error("window %s of schedule %s: its Skipped record cannot be "
                              "written: %s", format_go_time(older), due.row.id,
                              failure_reason(exc))
            batch.append((due, False))
        if batch:
            self._start(batch, now)
        self._save(view)
        self.turns += 1
        upcoming = next_start(view, now=now, decided=self._through())
        if self.failing:  # step 5: tried again soon, each on its own
            soon = now + timedelta(seconds=RETRY_S)
            upcoming = soon if upcoming is None else min(upcoming, soon)
        return upcoming

    def _start(self, batch: list[tuple[Due, bool]], now: datetime) -> None:
        """Decide every window due now in one step (``guard_many``: one write of the cache),
        then start them all at once, each in a thread of its own (step 2): one slow or
        failing start holds up no other (step 5)."""
        decisions: list[StartDecision | BaseException]
        try:
            if self.guard_many is not None:
                decisions = list(self.guard_many(batch, now))
            else:
                decisions = [self.guard(due.row.id, due.window, now, recovery)
                             for due, recovery in batch]
        except Exception as exc:  # nothing decided, nothing stamped: each tried again
            decisions = [exc] * len(batch)
        outcomes: list[BaseException | None] = [None] * len(batch)

        def act(index: int) -> None:
            due, recovery = batch[index]
            decision = decisions[index]
            try:
                if isinstance(decision, BaseException):
                    raise decision
                self._act(due, decision, recovery=recovery)
            except Exception as exc:  # the window is neither run nor stamped: tried again
                outcomes[index] = exc

        if len(batch) == 1:
            act(0)
        else:
            threads = [threading.Thread(target=act, args=(index,), daemon=True,
                                        name=f"start-{due.row.id}")
                       for index, (due, _) in enumerate(batch)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        for (due, recovery), error in zip(batch, outcomes, strict=True):
            self._settle(due, now, recovery=recovery, error=error)

    def _settle(self, due: Due, now: datetime, *, recovery: bool,
                error: BaseException | None) -> None:
        """Note how one window's start went: decided, or failing with its reason (step 5)."""
        key = (due.row.id, due.window)
        if error is not None:
            exc = error
            reason = failure_reason(exc)
            if key not in self.failing:
                log.error("window %s of schedule %s could not start: %s; tried again every "
                          "%g s while within its grace", format_go_time(due.window),
                          due.row.id, reason, RETRY_S,
                          exc_info=None if isinstance(exc, OSError) else exc,
                          extra={"schedule_id": due.row.id, "reason": reason})
            self.failing[key] = Failing(due=due, since=self.failing[key].since
                                        if key in self.failing else now, reason=reason)
            return
        self.failing.pop(key, None)
        if not recovery:
            self.decided.note(due.row.id, due.window)

    def _expire(self, view: NodeView, now: datetime) -> None:
        """End each window that could not start within its grace, with its reason (step 5)."""
        for key, item in list(self.failing.items()):
            if now - item.due.start <= view.grace:
                continue
            reason = (f"not started: {item.reason} (tried from {format_go_time(item.since)} "
                      f"until its grace of {view.grace.total_seconds():g} s ended)")
            try:
                self.fail(item.due, reason)
            except Exception as exc:  # not even its record can be written: next turn
                log.warning("window %s of schedule %s: its failure cannot be recorded yet: "
                            "%s", format_go_time(item.due.window), item.due.row.id,
                            failure_reason(exc))
                continue
            self.decided.note(item.due.row.id, item.due.window)
            del self.failing[key]

    def _through(self) -> dict[str, datetime]:
        """Return, per schedule, the latest window decided or being tried (step 5)."""
        through = self.decided.values()
        for schedule_id, window in self.failing:
            if schedule_id not in through or window > through[schedule_id]:
                through[schedule_id] = window
        return through

    def _save(self, view: NodeView) -> None:
        """Write ``decided.json`` (step 3); a disk that refuses keeps it in memory till later."""
        try:
            self.decided.save({row.id for row in view.rows})
        except OSError as exc:
            reason = failure_reason(exc)
            if reason != self._unsaved:
                log.error("could not write %s: %s; kept in memory, written again at the next "
                          "turn", self.decided.path, reason)
            self._unsaved = reason
            return
        self._unsaved = ""

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


