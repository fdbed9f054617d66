"""The per-node scheduler: the cache, the start guard, the firing loop and the pulls.

The controller is not in the firing path: schedules keep firing from the on-disk cache
while it is down. :class:`Scheduler` is a thin facade (the Go kit's API: ``start``,
``stop``, ``pull``, ``fire_matching``, ``cache``, ``schedules``) over its parts:
:class:`sched_core.store.CacheStore` (the file: lock, reload, save),
:class:`sched_core.loop.FiringLoop` (the only firing loop: it wakes at each window's
start, decides through the start guard, starts the windows of one instant together,
handles missed windows) and :mod:`sched_core.pull` (a pull's fetch, parse and merge).

Every public method takes ``now`` (default: ``Config.clock``, the wall clock) and runs one
procedure under the cache file's lock: lock (the in-process mutex and the file's
``flock``); reload if another process saved since; decide (pure:
:func:`sched_core.guard.decide_start`, :mod:`sched_core.pull`); stamp; save atomically.

A window runs at most once: the start guard decides and stamps it in one locked step
(:meth:`Scheduler.start_windows`), so two processes sharing the cache can never both start
it; a start that raised takes its stamp back (:meth:`Scheduler.unstamp`) and is tried again
within its grace. ``Fire.key`` is a stable idempotency key for the window. A pull is
accepted only together with its save: if the file cannot be written, memory and file stay
as they were and the pull is a ``PullError``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from zoneinfo import ZoneInfo

from sched_core.cache import validate_rows
from sched_core.clock import as_utc, floor_minute, utcnow
from sched_core.config import Config, Fire, FireFunc, TurnReport
from sched_core.errors import PullError
from sched_core.firing import Due
from sched_core.guard import StartDecision, decide_start
from sched_core.loop import Decided, FiringLoop, Guarded, log_fail, log_missed, log_skip
from sched_core.model import Cache, LocalSchedule, copy_row
from sched_core.plan import TRIGGER_RECOVERY, TRIGGER_SCHEDULE
from sched_core.policies import policy_block
from sched_core.pull import (
    MAX_PAYLOAD,
    PullResult,
    fetch,
    merge_pull,
    not_modified,
    parse_schedule_list,
    redact_url,
)
from sched_core.store import CacheStore
from sched_core.view import NodeView

__all__ = [  # the old import paths of names that moved out stay valid
    "MAX_PAYLOAD",
    "TRIGGER_RECOVERY",
    "TRIGGER_SCHEDULE",
    "Config",
    "Fire",
    "FireFunc",
    "PullResult",
    "Scheduler",
    "TurnReport",
    "as_utc",
    "floor_minute",
    "redact_url",
    "utcnow",
]

log = logging.getLogger(__name__)


class Scheduler:
    """The per-node scheduler (see the module docstring)."""

    def __init__(self, config: Config, *, now: datetime | None = None) -> None:
        self._config = config
        self._tz = config.tz
        self._stamped: dict[tuple[str, datetime], datetime | None] = {}
        """Each window start_window stamped, and the stamp it replaced (for unstamp)."""
        now = self._now(now)
        self.store = CacheStore(config.path, config.tz, now=now)
        self.loop = FiringLoop(
            view=self._loop_view, guard=self._guard, start=self._start, clock=config.clock,
            skip=config.skip or log_skip, missed=config.missed or log_missed,
            fail=config.fail or log_fail, decided=Decided(config.decided, now=now),
            ahead=config.ahead)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _now(self, now: datetime | None, name: str = "now") -> datetime:
        """Return now as a plain UTC datetime; the config's clock when None."""
        return as_utc(self._config.clock() if now is None else now, name)

    @contextmanager
    def _current(self, now: datetime) -> Iterator[Cache]:
        """Lock (step 1), reload (step 2), and give the cache in memory."""
        with self.store.locked():
            self.store.reload(now)
            yield self.store.cache

    @property
    def timezone(self) -> ZoneInfo:
        """The timezone schedules are matched in."""
        return self._tz

    def schedules(self) -> list[LocalSchedule]:
        """Return deep copies of the cached schedules, sorted by name."""
        with self.store.mutex:
            rows = [row.model_copy(deep=True) for row in self.store.cache.schedules]
        return sorted(rows, key=lambda row: (row.name, row.id))

    def cache(self) -> Cache:
        """Return a deep copy of the whole cache, last fired times included."""
        with self.store.mutex:
            return self.store.cache.model_copy(deep=True)

    def snapshot(self) -> Cache:
        """Return a copy of the cache to read, not change: own lists and maps, shared rows (a
        pull replaces rows, never changes one); :meth:`cache` costs 60 ms at 1,000 rows."""
        with self.store.mutex:
            cache = self.store.cache
            return Cache.model_construct(
                schedules=list(cache.schedules), last_fired_at=dict(cache.last_fired_at),
                last_fetched_at=cache.last_fetched_at, first_seen_at=dict(cache.first_seen_at),
                etag=cache.etag, etag_url=cache.etag_url)

    def etag(self) -> str | None:
        """Return the cached list's ETag (``cache().etag`` without its copy)."""
        with self.store.mutex:
            return self.store.cache.etag

    # -- the firing loop and its hands -------------------------------------------

    def turn(self, now: datetime) -> TurnReport:
        """Run one turn of the firing loop at now and return what it did (the loop's own
        thread calls it with its clock; tests and agents that drive their own clock, here)."""
        return self.loop.turn(as_utc(now, "now"))

    def run(self, stop: threading.Event) -> None:
        """Run the firing loop in this thread until stop is set (then call :meth:`wake`)."""
        self.loop.run(stop)

    def wake(self) -> None:
        """Make the firing loop look again now (the schedules changed, or it is to stop)."""
        self.loop.wake()

    def _view(self, cache: Cache) -> NodeView:
        """Return cache as the decisions read it (references: only under the lock)."""
        return NodeView(rows=cache.schedules, last_fired=cache.last_fired_at,
                        first_seen=cache.first_seen_at, tz=self._tz,
                        node=self._config.node_name, grace=self._config.fire_grace)

    def _loop_view(self, now: datetime) -> NodeView:
        """Return the cache as it is now (reloaded) as the loop's decisions read it: copies of
        its maps; the rows are the cache's own (the loop copies one before a callback)."""
        with self._current(now) as cache:
            view = self._view(cache)
            return NodeView(rows=list(view.rows), last_fired=dict(view.last_fired),
                            first_seen=dict(view.first_seen), tz=view.tz, node=view.node,
                            grace=view.grace)

    def _guard(self, batch: list[tuple[Due, bool]], now: datetime) -> list[Guarded | Exception]:
        """The start guard of every window due now, in one write of the cache."""
        return self.start_windows([(due.row.id, due.window, False) for due, _ in batch], now=now)

    def _start(self, fire: Fire) -> None:
        """Start a window the guard stamped: the agent's fire; a fire that raised did not
        start, and its stamp goes (the loop tries the window again, or ends it)."""
        assert self._config.fire is not None and fire.window is not None
        try:
            self._config.fire(fire)
        except Exception:
            try:
                self.unstamp(fire.schedule.id, fire.window)
            except OSError as exc:
                log.error("the stamp of window %s of %s cannot be taken back: %r",
                          fire.window.isoformat(), fire.schedule.id, exc,
                          extra={"schedule_id": fire.schedule.id, "error": repr(exc)})
            raise

    # -- the start guard: decide and stamp -------------------------------------

    def start_window(
        self,
        schedule_id: str,
        window: datetime,
        *,
        first_try: datetime,
        now: datetime | None = None,
        retry: bool = False,
    ) -> tuple[StartDecision, LocalSchedule | None]:
        """Decide whether a planned run of window runs, and stamp the window if it does.

        The start guard of :func:`sched_core.guard.decide_start`, in one locked
        step with the stamp: two runs of one window can never both pass.
        Returns the decision and a copy of the row it was made on (None when
        the schedule is gone).
        """
        answer = self.start_windows([(schedule_id, window, retry)], now=now,
                                    first_try=first_try)[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def start_windows(
        self,
        windows: list[tuple[str, datetime, bool]],
        *,
        now: datetime | None = None,
        first_try: datetime | None = None,
    ) -> list[tuple[StartDecision, LocalSchedule | None] | Exception]:
        """Decide and stamp many windows as :meth:`start_window` does, in one locked step
        with one write of the file: (schedule id, window, retry) each, first tried at
        first_try (default now).

        Each answer is the decision and its row, or the exception deciding it raised; a
        write the disk refuses takes back every stamp of the step and is every stamped
        window's answer.
        """
        now = self._now(now)
        first = now if first_try is None else as_utc(first_try, "first_try")
        answers: list[tuple[StartDecision, LocalSchedule | None] | Exception] = []
        stamped: list[tuple[int, str, datetime, datetime | None]] = []
        with self._current(now) as cache:
            rows = {item.id: item for item in cache.schedules}
            view = self._view(cache)
            for index, (schedule_id, window, retry) in enumerate(windows):
                try:
                    window = as_utc(window, "window")
                    row = rows.get(schedule_id)
                    last = cache.last_fired_at.get(schedule_id)
                    decision = decide_start(row, view, schedule_id=schedule_id, window=window,
                                            first_try=first, now=now, retry=retry)
                except Exception as exc:  # one row's bug holds up no other
                    answers.append(exc)
                    continue
                if decision.stamp:
                    cache.last_fired_at[schedule_id] = (window if last is None
                                                        else max(last, window))
                    stamped.append((index, schedule_id, window, last))
                answers.append((decision, None if row is None else copy_row(row)))
            if stamped:
                try:
                    self.store.save()
                except OSError as exc:
                    for index, schedule_id, _window, last in reversed(stamped):
                        _restore(cache.last_fired_at, schedule_id, last)
                        answers[index] = exc
                    return answers
                for _index, schedule_id, window, last in stamped:
                    self._stamped[(schedule_id, window)] = last
                while len(self._stamped) > STAMPS_KEPT:
                    self._stamped.pop(next(iter(self._stamped)))
        return answers

    def unstamp(self, schedule_id: str, window: datetime, *, now: datetime | None = None) -> None:
        """Take back the stamp :meth:`start_window` made for window, when what the caller was
        to start did not start (OSError when the file cannot be written either)."""
        now = self._now(now)
        window = as_utc(window, "window")
        if (schedule_id, window) not in self._stamped:
            return
        before = self._stamped.pop((schedule_id, window))
        with self._current(now) as cache:
            if cache.last_fired_at.get(schedule_id) == window:
                _restore(cache.last_fired_at, schedule_id, before)
                self.store.save()

    # -- on demand --------------------------------------------------------------

    def fire_matching(self, trigger_key: str, pred: Callable[[LocalSchedule], bool], *,
                      now: datetime | None = None, key: str | None = None) -> int:
        """Fire every enabled schedule pred selects, on demand; return how many fired."""
        fired, _ = self.fire_matching_report(trigger_key, pred, now=now, key=key)
        return len(fired)

    def fire_matching_report(
        self,
        trigger_key: str,
        pred: Callable[[LocalSchedule], bool],
        *,
        now: datetime | None = None,
        key: str | None = None,
        skip_ids: frozenset[str] = frozenset(),
    ) -> tuple[list[Fire], list[tuple[Fire, str]]]:
        """Fire on demand and return (fired, failed).

        The idempotency key is ``<id>@<key>`` when key is given (a chain passes
        its stage and day), else ``<id>@<trigger_key>@<UTC minute>``. Each
        success stamps the schedule's last fire with now, as the Go kit does.
        A row whose policies hold now back (paused, outside its dates, in a
        blackout, or fired less than ``min_interval`` ago) is not fired, and
        the reason is logged (:func:`sched_core.policies.policy_block`).
        """
        now = self._now(now)
        suffix = key or f"{trigger_key}@{floor_minute(now).strftime('%Y-%m-%dT%H:%MZ')}"
        fired: list[Fire] = []
        failed: list[tuple[Fire, str]] = []
        with self._current(now) as cache:
            for row in cache.schedules:
                if not row.enabled or row.id in skip_ids or not pred(row):
                    continue
                held = policy_block(
                    row, now, last_fired=cache.last_fired_at.get(row.id), tz=self._tz
                )
                if held is not None:
                    log.info(
                        "not firing %s (%s) on %s: %s", row.id, row.action, trigger_key, held,
                        extra={"schedule_id": row.id, "trigger_key": trigger_key,
                               "node": self._config.node_name, "reason": held},
                    )
                    continue
                fire = Fire(
                    schedule=copy_row(row),
                    trigger_key=trigger_key,
                    missed_recovery=False,
                    window=None,
                    key=f"{row.id}@{suffix}",
                )
                error = _call_fire(self._config, fire)
                if error is not None:
                    failed.append((fire, error))
                    continue
                cache.last_fired_at[row.id] = now
                fired.append(fire)
            if fired:
                self.store.save()
        return fired, failed

    # -- pull: fetch, parse, lock, reload, merge, save -------------------------

    def pull(self, now: datetime | None = None) -> PullResult:
        """Replace the schedule list from the pull URL, or raise PullError and change nothing.

        Surviving ids keep their last fire; a new id is first seen now; an
        invalid row with a valid id is dropped with a warning and reported in
        ``rejected``, and if its id was cached before its last good version is
        kept. An empty list empties the schedules.

        The whole pull is refused, and the cache stays exactly as it was
        (schedules, last fires, first-seen times, ETag; in memory and on disk), when:

        1. the answer is not a schedule list: an HTTP error, invalid JSON,
           more than :data:`MAX_PAYLOAD` bytes, an object without ``schedules``,
           a ``schedules`` that is not a list;
        2. a value breaks a JSON wire rule (:mod:`sched_core.jsonwire`: ``NaN``,
           ``Infinity``, a number beyond a float64, an unpaired surrogate,
           nesting deeper than 102 levels); the error names where;
        3. a row names no schedule: it is not a JSON object, or its ``id`` is
           missing or not a non-empty string (the error names the first such
           row, by position, and why). Such a list cannot be diffed, and
           reading it as "no rows" would delete every schedule and its history;
        4. an id is repeated;
        5. schedules are cached and every row of a non-empty list is invalid:
           that is a broken controller, not an instruction to stop every
           schedule (the error names the first row and its reason). On an
           empty cache such a list is accepted, its rows reported rejected;
        6. the cache file cannot be written.
        """
        now = self._now(now)
        shown = redact_url(self._config.pull_url)
        with self.store.mutex:
            cache = self.store.cache
            etag = cache.etag if cache.etag_url == shown and cache.schedules else None
        try:
            body, answer_etag = fetch(self._config.pull_url, self._config.http_client, etag=etag)
            if body is None:
                return self._not_modified(now)
            rows = parse_schedule_list(body, shown)
            good, rejected = validate_rows(rows, source=shown, warn=False)  # logged if accepted
            with self._current(now) as current:
                old = {row.id: row for row in current.schedules}
                merged, result = merge_pull(
                    current, good, rejected, rows=len(rows), etag=answer_etag,
                    etag_url=shown, source=shown, now=now,
                )
                self.store.adopt(merged)
        except PullError as exc:
            log.error(
                "pull from %s rejected; keeping the last good schedule list: %s", shown, exc,
                extra={"url": shown, "node": self._config.node_name, "error": str(exc)},
            )
            raise
        _log_accepted(result, good, rejected, old, shown, self._config.node_name)
        if result.changed_anything:
            self.wake()
        return result

    def _not_modified(self, now: datetime) -> PullResult:
        """Record a 304: the list is unchanged, and it was fetched now."""
        with self._current(now) as cache:
            self.store.adopt(not_modified(cache, now=now))
            count = len(self.store.cache.schedules)
        log.info(
            "schedules not modified (%d cached)", count,
            extra={"node": self._config.node_name, "count": count},
        )
        return PullResult(added=[], removed=[], changed=[], rejected=[], kept_last_good=[])

    # -- the threads -----------------------------------------------------------

    def start(self) -> None:
        """Start the firing loop and the pull loop (a pull at once, then every
        ``pull_interval``), each in a thread of its own; a second call does nothing."""
        if self._threads:
            return
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.run, args=(self._stop,), name="sched-fire",
                             daemon=True),
            threading.Thread(target=self._pull_loop, args=(self._stop,), name="sched-pull",
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop the loops and wait for them (and the starts in progress); safe to call more
        than once, or without :meth:`start`."""
        self._stop.set()
        self.wake()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _pull_loop(self, stop: threading.Event) -> None:
        """Pull now and every ``pull_interval`` until stop; a failed pull changes nothing."""
        while not stop.is_set():
            try:
                self.pull()
            except PullError:
                pass  # logged by pull; the cache keeps firing
            except Exception:
                log.exception("pull failed", extra={"node": self._config.node_name})
            stop.wait(self._config.pull_interval.total_seconds())


STAMPS_KEPT = 1000
"""How many of start_window's stamps unstamp can still take back (the latest)."""


def _restore(stamps: dict[str, datetime], schedule_id: str, before: datetime | None) -> None:
    """Put a schedule's last-fire stamp back as it was (none: no stamp)."""
    if before is None:
        stamps.pop(schedule_id, None)
    else:
        stamps[schedule_id] = before


def _log_accepted(result: PullResult, good: list[LocalSchedule], rejected: list[tuple[str, str]],
                  old: dict[str, LocalSchedule], shown: str, node: str) -> None:
    """Log an accepted pull: each row dropped, each last good version kept, the counts."""
    for rid, reason in rejected:
        log.warning(
            "dropped invalid schedule %s from %s: %s", rid, shown, reason,
            extra={"schedule_id": rid, "reason": reason, "source": shown},
        )
    for rid in result.kept_last_good:
        log.warning(
            "kept the last good version (%d) of invalid schedule %s",
            old[rid].version, rid,
            extra={"schedule_id": rid, "version": old[rid].version},
        )
    log.info(
        "pulled %d schedules: %d added, %d removed, %d changed, %d rejected",
        len(good) + len(result.kept_last_good), len(result.added), len(result.removed),
        len(result.changed), len(result.rejected),
        extra={
            "node": node,
            "count": len(good) + len(result.kept_last_good),
            "added": len(result.added),
            "removed": len(result.removed),
            "changed": len(result.changed),
            "rejected": len(result.rejected),
        },
    )


def _call_fire(config: Config, fire: Fire) -> str | None:
    """Call the agent's fire on demand; return None on success or the error (logged)."""
    assert config.fire is not None
    try:
        config.fire(fire)
    except Exception as exc:
        log.error(
            "fire of %s (%s) failed; it stays unfired: %r", fire.schedule.id, fire.trigger_key,
            exc, extra={"schedule_id": fire.schedule.id, "trigger_key": fire.trigger_key,
                        "node": config.node_name, "error": repr(exc)},
        )
        return repr(exc)
    log.info(
        "fired %s (%s, %s) as %s", fire.schedule.id, fire.schedule.action, fire.trigger_key,
        fire.key, extra={"schedule_id": fire.schedule.id, "action": fire.schedule.action,
                         "trigger_key": fire.trigger_key, "key": fire.key,
                         "node": config.node_name},
    )
    return None

