"""The firing loop: wake at each window's start, decide it, hand it to the agent.

Rule: this is the kit's only firing loop. It reads the clock it is given and sleeps; every
decision is pure code that takes ``now`` (:mod:`sched_core.firing`, :mod:`sched_core.plan`,
:mod:`sched_core.guard`). :class:`~sched_core.scheduler.Scheduler` runs it (``start``,
``run``; one turn: ``turn``) and gives it its hands: the cache as it is now, the start guard
(decide and stamp in one locked step), and the agent's callbacks. Nobody else is in the
firing path: the controller and Prefect may both be gone.

One turn of the loop (:meth:`FiringLoop.turn`), at ``now``:

1. The windows older than the grace that the loop never decided (it was
   stopped) go to the miss policy (:func:`sched_core.plan.missed`): the latest
   may be run once as ``schedule-recovery``; all are reported (``missed``).
2. The windows due now (:func:`sched_core.firing.due_now`): older due windows
   of a row are coalesced into its latest (``skip``); the latest of every row
   goes through the start guard together, in one write of the cache (so no
   window runs twice, whoever shares the cache), and each is started
   (``fire``) or skipped with the guard's reason: all at once, each in a thread
   of its own, so the tenth window of an instant starts with the first and one
   slow or failing start holds up no other.
3. Every window decided is written to the record of decided windows
   (:class:`Decided`) before the loop sleeps, so a restart neither decides a
   window twice nor loses one.
4. Sleep until the next start (:func:`sched_core.firing.next_start`), never
   past :data:`MAX_SLEEP_S` (the wall clock may jump), and wake early when the
   schedules change. A window never starts before its start: the loop checks
   the clock after waking and sleeps on until it is there.
5. A window that cannot start (its stamp or its start raised: a full or
   read-only state folder) is neither run nor stamped, and holds up no other
   window: it is tried again every :data:`RETRY_S` while within its grace, then
   ends with its reason (``fail``), as soon as that can be recorded. A record
   of decided windows the disk refuses is kept in memory and written at a later turn.
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

from sched_core.config import Fire, FireFunc, MissedFunc, TurnReport
from sched_core.firing import Due, Starts
from sched_core.guard import StartDecision
from sched_core.jsonwire import MAX_DEPTH
from sched_core.matcher import window_key
from sched_core.model import LocalSchedule, copy_row
from sched_core.plan import TRIGGER_RECOVERY, TRIGGER_SCHEDULE, Missed, missed
from sched_core.policies import row_zone, run_start
from sched_core.statefile import locked, read_json_file, write_atomic
from sched_core.values import format_go_time, parse_go_time
from sched_core.view import NodeView

log = logging.getLogger(__name__)

MAX_SLEEP_S = 30.0
"""The longest the loop sleeps without looking at the clock again."""
RETRY_S = 1.0
"""How soon a window that could not start (step 5) is tried again."""

Guarded = tuple[StartDecision, LocalSchedule | None]
"""The start guard's answer for one window: its decision and a copy of the row it read."""
GuardFunc = Callable[[list[tuple[Due, bool]], datetime], list[Guarded | Exception]]
"""Decide and stamp (due, recovery) windows at now in one step; an exception is one's answer."""


@dataclass(frozen=True)
class Failing:
    """A window that could not start yet: when it first failed, and why."""

    due: Due
    recovery: bool
    since: datetime
    reason: str


def failure_reason(exc: BaseException) -> str:
    """Return why a window could not start, in words (a full or read-only disk said so)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the node's state folder is full ({exc.strerror}: {exc.filename})"
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the node's state folder cannot be written ({exc.strerror}: {exc.filename})"
    return f"{type(exc).__name__}: {exc}"


def _parse_time(value: object) -> datetime | None:
    try:
        return parse_go_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


class Decided:
    """Per schedule, the latest window the loop decided (ran, skipped, missed), on disk."""

    def __init__(self, path: Path, *, now: datetime) -> None:
        self.path = path
        self._values: dict[str, datetime] = {}
        self._saved: dict[str, datetime] | None = None
        data = read_json_file(path, now=now, max_depth=MAX_DEPTH)
        for key, value in (data or {}).items() if isinstance(data, dict) else ():
            parsed = _parse_time(value)
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


def log_skip(fire: Fire) -> None:
    """The default ``skip``: log the window that does not run, and why."""
    log.info("window %s of %s does not run: %s", fire.window and fire.window.isoformat(),
             fire.schedule.id, fire.reason,
             extra={"schedule_id": fire.schedule.id, "reason": fire.reason})


def log_fail(fire: Fire) -> None:
    """The default ``fail``: log the window that could not start within its grace."""
    log.error("window %s of %s: %s", fire.window and fire.window.isoformat(),
              fire.schedule.id, fire.reason,
              extra={"schedule_id": fire.schedule.id, "reason": fire.reason})


def log_missed(items: list[Missed], view: NodeView) -> None:
    """The default ``missed``: log each schedule's missed windows and what is recovered."""
    for item in items:
        log.warning("schedule %s missed %d window(s) while the loop was not running; %s%s",
                    item.schedule_id, item.count,
                    "the latest is recovered" if item.recover else "none is recovered",
                    f" ({item.truncated} older dropped: run-all runs the latest only)"
                    if item.truncated else "",
                    extra={"schedule_id": item.schedule_id, "missed": item.count,
                           "truncated": item.truncated})


@dataclass
class _Turn:
    """What one turn did so far (collected from the start threads by index)."""

    fired: list[Fire] = field(default_factory=list)
    skipped: list[Fire] = field(default_factory=list)
    failed: list[tuple[Fire, str]] = field(default_factory=list)
    ended: list[Fire] = field(default_factory=list)
    missed: list[Missed] = field(default_factory=list)
    coalesced: dict[str, int] = field(default_factory=dict)

    def report(self, upcoming: datetime | None, starting: int) -> TurnReport:
        return TurnReport(fired=self.fired, skipped=self.skipped, failed=self.failed,
                          ended=self.ended, missed=self.missed, coalesced=self.coalesced,
                          upcoming=upcoming, starting=starting)


def window_fire(row: LocalSchedule, due: Due, view: NodeView, *, recovery: bool,
                reason: str, window: datetime | None = None) -> Fire:
    """Return the Fire of row's window (due's, or window), keyed in the row's zone."""
    tz = row_zone(row, view.tz)
    window = due.window if window is None else window
    start = due.start if window == due.window else run_start(row, window, node=view.node, tz=tz)
    return Fire(schedule=row, trigger_key=TRIGGER_RECOVERY if recovery else TRIGGER_SCHEDULE,
                missed_recovery=recovery, window=window, key=window_key(row.id, window, tz),
                start=start, reason=reason)


@dataclass(eq=False, kw_only=True)
class FiringLoop:
    """The loop of the module (steps 1-5); what it does with a window is the agent's.

    ``view(now)`` reads the cache (copies); ``guard`` is the start guard (decide and
    stamp, many windows in one step); ``start(fire)`` starts a window and raises when it
    did not start (its stamp taken back); ``skip(fire)`` hears of a window that does not
    run; ``missed(items, view)`` of the windows the miss policy looked at; ``fail(fire)``
    of a window that could not start within its grace.
    """

    view: Callable[[datetime], NodeView]
    guard: GuardFunc
    start: FireFunc
    skip: FireFunc
    missed: MissedFunc
    fail: FireFunc
    decided: Decided
    clock: Callable[[], datetime]
    ahead: Callable[[int], None] | None = None
    turns: int = field(default=0, init=False)
    failing: dict[tuple[str, datetime], Failing] = field(default_factory=dict, init=False)
    """Windows that could not start yet (step 5), by schedule and window."""
    _wake: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _turning: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _unsaved: str = field(default="", init=False, repr=False)
    _starts: Starts = field(default_factory=Starts, init=False, repr=False)
    _looked: datetime | None = field(default=None, init=False, repr=False)
    """The last turn's time: the miss policy looks only when windows may have been missed."""

    def wake(self) -> None:
        """Look again now (the schedules changed, or the loop is to stop)."""
        self._wake.set()

    def turn(self, now: datetime) -> TurnReport:
        """Decide everything due at now (steps 1-5); one turn at a time."""
        with self._turning:
            return self._turn(now)

    def _turn(self, now: datetime) -> TurnReport:
        done = _Turn()
        view = self.view(now)
        self._expire(view, now, done)
        batch = self._missed(view, now, done)
        retried = {schedule_id for schedule_id, _ in self.failing}
        for due in self._starts.due(view, now=now, decided=self.decided.values(),
                                    through=self._through(), also=retried):
            if due.coalesced:
                done.coalesced[due.row.id] = len(due.coalesced)
            for older in due.coalesced:
                self._coalesce(due, older, view, done)
            batch.append((due, False))
        if batch:
            self._start(batch, now, view, done)
        self._save(view)
        self.turns += 1
        upcoming = self._starts.next(view, now=now, decided=self._through())
        starting = self._starts.starting_at(upcoming)
        if self.failing:  # step 5: tried again soon, each on its own
            soon = now + timedelta(seconds=RETRY_S)
            if upcoming is None or soon < upcoming:
                upcoming, starting = soon, 0
        return done.report(upcoming, starting)

    def _may_have_missed(self, view: NodeView, now: datetime) -> bool:
        """Return whether a window may have been missed since the last turn: the first turn,
        a turn more than the grace after the last (stopped, suspended, a clock jump), or new
        or changed rows. Otherwise every window since was decided at its start."""
        looked, self._looked = self._looked, now
        if looked is None or not timedelta(0) <= now - looked <= view.grace:
            return True
        return not self._starts.same_rows(view)

    def _missed(self, view: NodeView, now: datetime, done: _Turn) -> list[tuple[Due, bool]]:
        """Report the windows missed while stopped; return the recoveries to start (step 1)."""
        if not self._may_have_missed(view, now):
            return []
        items = missed(view, planned_through=self._through(), now=now)
        if not items:
            return []
        done.missed = items
        for item in items:
            self.decided.note(item.schedule_id, item.latest or item.windows[-1])
        rows = {row.id: row for row in view.rows}
        try:
            self.missed(items, NodeView(rows=[copy_row(row) for row in view.rows],
                                        last_fired=dict(view.last_fired),
                                        first_seen=dict(view.first_seen), tz=view.tz,
                                        node=view.node, grace=view.grace))
        except Exception:  # the report only: the recoveries still run
            log.exception("the report of missed windows failed",
                          extra={"schedules": [item.schedule_id for item in items]})
        return [(Due(row=rows[item.schedule_id], window=item.recover.window,
                     start=item.recover.start), True)
                for item in items if item.recover is not None]

    def _coalesce(self, due: Due, older: datetime, view: NodeView, done: _Turn) -> None:
        """Tell skip of an older due window coalesced into due's (step 2)."""
        fire = window_fire(copy_row(due.row), due, view, recovery=False, window=older,
                           reason=f"coalesced into {format_go_time(due.window)}: the node was "
                                  "not running at its start; only the latest due window of a "
                                  "schedule runs")
        try:
            self.skip(fire)
        except Exception as exc:  # its report only: the latest one still runs
            log.error("window %s of schedule %s: its skip cannot be recorded: %s",
                      format_go_time(older), due.row.id, failure_reason(exc),
                      extra={"schedule_id": due.row.id, "window": format_go_time(older)})
        done.skipped.append(fire)

    def _start(self, batch: list[tuple[Due, bool]], now: datetime, view: NodeView,
               done: _Turn) -> None:
        """Decide every window due now in one step (one write of the cache), then start them
        all at once, each in a thread of its own (step 2): one slow or failing start holds up
        no other (step 5)."""
        answers: list[Guarded | Exception]
        try:
            answers = list(self.guard(batch, now))
        except Exception as exc:  # nothing decided, nothing stamped: each tried again
            answers = [exc] * len(batch)
        outcomes: list[tuple[Fire, bool] | Exception | None] = [None] * len(batch)

        def act(index: int) -> None:
            due, recovery = batch[index]
            try:
                outcomes[index] = self._act(due, answers[index], view, recovery=recovery)
            except Exception as exc:  # the window is neither run nor stamped: tried again
                outcomes[index] = exc

        threads: list[threading.Thread] = []
        for index, (due, _) in enumerate(batch[1:], start=1):
            thread = threading.Thread(target=act, args=(index,), daemon=True,
                                      name=f"start-{due.row.id}")
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: this one starts here, in turn
                act(index)
                continue
            threads.append(thread)
        act(0)  # the first in this thread, beside the others
        for thread in threads:
            thread.join()
        for (due, recovery), outcome in zip(batch, outcomes, strict=True):
            self._settle(due, now, view, done, recovery=recovery, outcome=outcome)

    def _act(self, due: Due, answer: Guarded | Exception, view: NodeView, *,
             recovery: bool) -> tuple[Fire, bool]:
        """Start or skip one window as the guard decided; return its Fire and whether it ran."""
        if isinstance(answer, Exception):
            raise answer
        decision, row = answer
        fire = window_fire(row or copy_row(due.row), due, view, recovery=recovery,
                           reason=decision.reason)
        if decision.runs:
            self.start(fire)
            log.debug("started %s (%s, window %s) as %s", row and row.id, fire.trigger_key,
                      format_go_time(fire.window), fire.key)
        else:
            self.skip(fire)
        return fire, decision.runs

    def _settle(self, due: Due, now: datetime, view: NodeView, done: _Turn, *,
                recovery: bool, outcome: tuple[Fire, bool] | Exception | None) -> None:
        """Note how one window's start went: decided, or failing with its reason (step 5)."""
        key = (due.row.id, due.window)
        if isinstance(outcome, tuple):
            fire, ran = outcome
            (done.fired if ran else done.skipped).append(fire)
            self.failing.pop(key, None)
            if not recovery:
                self.decided.note(due.row.id, due.window)
            return
        exc = outcome if outcome is not None else RuntimeError("not started")
        reason = failure_reason(exc)
        done.failed.append((window_fire(copy_row(due.row), due, view, recovery=recovery,
                                        reason=reason), reason))
        if key not in self.failing:
            log.error("window %s of schedule %s could not start: %s; tried again every "
                      "%g s while within its grace", format_go_time(due.window),
                      due.row.id, reason, RETRY_S,
                      exc_info=None if isinstance(exc, OSError) else exc,
                      extra={"schedule_id": due.row.id, "reason": reason})
        self.failing[key] = Failing(due=due, recovery=recovery, reason=reason,
                                    since=self.failing[key].since if key in self.failing
                                    else now)

    def _expire(self, view: NodeView, now: datetime, done: _Turn) -> None:
        """End each window that could not start within its grace, with its reason (step 5)."""
        for key, item in list(self.failing.items()):
            if now - item.due.start <= view.grace:
                continue
            reason = (f"not started: {item.reason} (tried from {format_go_time(item.since)} "
                      f"until its grace of {view.grace.total_seconds():g} s ended)")
            fire = window_fire(copy_row(item.due.row), item.due, view, recovery=item.recovery,
                               reason=reason)
            try:
                self.fail(fire)
            except Exception as exc:  # not even its record can be written: next turn
                log.warning("window %s of schedule %s: its failure cannot be recorded yet: "
                            "%s", format_go_time(item.due.window), item.due.row.id,
                            failure_reason(exc))
                continue
            done.ended.append(fire)
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
        """Write the record of decided windows (step 3); a disk that refuses keeps it in
        memory till later."""
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

    def run(self, stop: threading.Event) -> None:
        """Turn until stop is set (step 4); whoever sets stop calls :meth:`wake` too."""
        while not stop.is_set():
            self._wake.clear()
            try:
                report = self.turn(self.clock())
            except Exception:  # a bug must not stop the firing: look again soon
                log.exception("the firing loop failed a turn; trying again in 5 s")
                stop.wait(5.0)
                continue
            self._get_ready(report)
            self._sleep_until(report.upcoming, stop)

    def _get_ready(self, report: TurnReport) -> None:
        """Tell ``ahead`` how many windows start at the next start, when it is this sleep's."""
        upcoming = report.upcoming
        if (self.ahead is None or upcoming is None or report.starting < 1
                or (upcoming - self.clock()).total_seconds() > MAX_SLEEP_S):
            return
        try:
            self.ahead(report.starting)
        except Exception:  # getting ready is an optimisation: the windows start anyway
            log.exception("ahead(%d) failed", report.starting)

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
