"""The per-node scheduler: lock, reload, plan, fire, stamp, save.

The controller is not in the firing path: schedules keep firing from the on-disk cache
while it is down. Every public method takes ``now`` (default: the wall clock, read
visibly with :func:`~sched_core.clock.utcnow`) and runs one procedure under the cache
file's lock: lock (the in-process mutex and the file's ``flock``); reload if another
process saved since (salvaging bad parts, clamping times in the future); plan (the pure
decision of :mod:`sched_core.due`, :mod:`sched_core.pull`); fire (the agent's ``fire``
per window); stamp each window whose fire returned (never one that raised); save
atomically.

A window fires at most once: stamps happen only after ``fire`` returned, and
``Fire.key`` is a stable idempotency key for the window, so a crash between
the fire and its stamp is deduplicated downstream. A pull is accepted only
together with its save: if the file cannot be written, memory and file stay as
they were and the pull is a ``PullError``.

The parts: :class:`Scheduler` is a thin facade (the Go kit's API) over
:class:`sched_core.store.CacheStore` (lock, reload, save), :mod:`sched_core.ticking`
(what a tick and the miss check fire), :mod:`sched_core.pull` (a pull's fetch, parse and
merge) and :class:`sched_core.runner.Runner` (the loops).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.cache import validate_rows
from sched_core.clock import as_utc, floor_minute, now_or_clock, utcnow
from sched_core.config import Config, Fire, FireFunc, TickReport
from sched_core.due import DueRow
from sched_core.errors import PullError
from sched_core.facade import Forward
from sched_core.guard import StartDecision, decide_start
from sched_core.model import Cache, LocalSchedule
from sched_core.plan import TRIGGER_RECOVERY, TRIGGER_SCHEDULE, missed
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
from sched_core.runner import Runner
from sched_core.store import CacheStore
from sched_core.ticking import (
    call_fire,
    copy_row,
    decide_due,
    held_missed,
    window_fire,
)
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
    "TickReport",
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
        self._held_logged: dict[str, str] = {}
        self._stamped: dict[tuple[str, datetime], datetime | None] = {}
        """Each window start_window stamped, and the stamp it replaced (for unstamp)."""
        self.store = CacheStore(config.path, config.tz, now=now_or_clock(now))
        self._runner = Runner(
            tick=self.tick,
            pull=self.pull,
            missed_run_check=self.missed_run_check,
            fire_interval=config.fire_interval,
            pull_interval=config.pull_interval,
            node_name=config.node_name,
        )

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

    node_name: Forward[str] = Forward("_config.node_name", "The node this scheduler runs for.")
    fire_grace: Forward[timedelta] = Forward(
        "_config.fire_grace", "How late a tick may still fire a window.")

    def schedules(self) -> list[LocalSchedule]:
        """Return deep copies of the cached schedules, sorted by name."""
        with self.store.mutex:
            rows = [row.model_copy(deep=True) for row in self.store.cache.schedules]
        return sorted(rows, key=lambda row: (row.name, row.id))

    def cache(self) -> Cache:
        """Return a deep copy of the whole cache, last fired times included."""
        with self.store.mutex:
            return self.store.cache.model_copy(deep=True)

    # -- decide, fire and stamp ------------------------------------------------

    def due(self, now: datetime) -> list[DueRow]:
        """Return (schedule, window, older windows coalesced) for each schedule due at now.

        Pure over the loaded cache: :func:`sched_core.ticking.decide_due`.
        """
        return self._decide_due(as_utc(now))[0]

    def _view(self, cache: Cache) -> NodeView:
        """Return cache as the decisions read it (references: only under the lock)."""
        return NodeView(rows=cache.schedules, last_fired=cache.last_fired_at,
                        first_seen=cache.first_seen_at, tz=self._tz,
                        node=self._config.node_name, grace=self._config.fire_grace)

    def _decide_due(self, now: datetime) -> tuple[list[DueRow], dict[str, str]]:
        return decide_due(self.store.index, self._view(self.store.cache), now=now)

    def _fire_windows(
        self, windows: list[tuple[LocalSchedule, datetime]], *, recovery: bool
    ) -> tuple[list[Fire], list[tuple[Fire, str]]]:
        """Fire each (schedule, window), stamp those that fired and save; the caller holds the lock.

        A stamp is written only after ``fire`` returned: a crash in between
        leaves the window unstamped, and its key deduplicates the second fire.
        """
        fired: list[Fire] = []
        failed: list[tuple[Fire, str]] = []
        for row, window in windows:
            fire = window_fire(row, window, self._tz, recovery=recovery)
            error = call_fire(self._config, fire)
            if error is not None:
                failed.append((fire, error))
                continue
            self.store.cache.last_fired_at[row.id] = window
            fired.append(fire)
        if fired:
            self.store.save()
        return fired, failed

    def due_fires(self, now: datetime | None = None) -> list[Fire]:
        """Return the fires a tick at now would make, without firing or stamping anything.

        For callers that prepare the work in bulk first (the Prefect tick creates
        the runs in one request) and then run ``tick`` with the same keys.
        """
        now = now_or_clock(now)
        with self._current(now):
            return [window_fire(row, w, self._tz, recovery=False) for row, w, _ in self.due(now)]

    def tick(self, now: datetime | None = None) -> int:
        """Fire each enabled schedule's latest unfired window in the grace; return the count."""
        return len(self.tick_report(now).fired)

    def tick_report(self, now: datetime | None = None) -> TickReport:
        """Run one tick and return what it fired, coalesced and failed."""
        now = now_or_clock(now)
        coalesced: dict[str, int] = {}
        with self._current(now):
            due, held = self._decide_due(as_utc(now))
            for schedule_id, reason in held.items():
                if self._held_logged.get(schedule_id) != reason:
                    self._held_logged[schedule_id] = reason  # once per window, not per tick
                    log.info("not firing %s: %s", schedule_id, reason,
                             extra={"schedule_id": schedule_id, "reason": reason})
            for row, window, older in due:
                if older:
                    coalesced[row.id] = older
                    log.warning(
                        "coalesced %d older pending windows of %s into %s", older, row.id, window,
                        extra={"schedule_id": row.id, "coalesced": older, "window": str(window)},
                    )
            fired, failed = self._fire_windows([(row, w) for row, w, _ in due], recovery=False)
        return TickReport(fired=fired, failed=failed, coalesced=coalesced, held=held)

    def missed_run_check(self, now: datetime | None = None) -> int:
        """Apply each schedule's miss policy to its latest missed window; return fires."""
        return len(self.missed_run_report(now).fired)

    def missed_run_report(self, now: datetime | None = None) -> TickReport:
        """Run the missed-run check and return what it fired and failed.

        The agent's rule (:func:`sched_core.plan.missed`): per row, the latest missed
        window of its catch-up window is recovered once, policy permitting; ``run-all``
        reports the older ones it drops (in ``coalesced``).
        """
        now = now_or_clock(now)
        with self._current(now) as cache:
            view = self._view(cache)
            recoveries = [item for item in missed(view, planned_through={}, now=now, listed=False)
                          if item.recover is not None]
            truncated = {item.schedule_id: item.truncated for item in recoveries
                         if item.truncated}
            for schedule_id, dropped in truncated.items():
                log.warning("run-all of %s truncated to the latest missed window: %d dropped",
                            schedule_id, dropped,
                            extra={"schedule_id": schedule_id, "truncated": dropped})
            held = held_missed(view, {item.schedule_id for item in recoveries}, now=now)
            for schedule_id, reason in held.items():
                log.info("not firing %s: %s", schedule_id, reason,
                         extra={"schedule_id": schedule_id, "reason": reason})
            wanted = {item.schedule_id for item in recoveries}
            rows = {row.id: row for row in cache.schedules if row.id in wanted} if wanted else {}
            fired, failed = self._fire_windows(
                [(rows[item.schedule_id], item.recover.window) for item in recoveries
                 if item.recover is not None],
                recovery=True,
            )
        return TickReport(fired=fired, failed=failed, coalesced=truncated, held=held)

    def fire_matching(self, trigger_key: str, pred: Callable[[LocalSchedule], bool], *,
                      now: datetime | None = None, key: str | None = None) -> int:
        """Fire every enabled schedule pred selects, on demand; return how many fired."""
        fired, _ = self.fire_matching_report(trigger_key, pred, now=now, key=key)
        return len(fired)

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
        now = now_or_clock(now)
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
        now = now_or_clock(now)
        window = as_utc(window, "window")
        if (schedule_id, window) not in self._stamped:
            return
        before = self._stamped.pop((schedule_id, window))
        with self._current(now) as cache:
            if cache.last_fired_at.get(schedule_id) == window:
                _restore(cache.last_fired_at, schedule_id, before)
                self.store.save()

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
        now = now_or_clock(now)
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
                error = call_fire(self._config, fire)
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
        now = now_or_clock(now)
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

    # -- loops -------------------------------------------------------------

    def start(self) -> None:
        """Start the fire loop, the pull loop and an initial pull plus missed-run check."""
        self._runner.start()

    def stop(self) -> None:
        """Stop the loops and wait for them; safe to call more than once."""
        self._runner.stop()


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
