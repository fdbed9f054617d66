"""The per-node scheduler: lock, reload, plan, fire, stamp, save.

The controller is not in the firing path: schedules keep firing from the
on-disk cache while it is down. Every public method takes ``now`` (default:
the wall clock, read visibly with :func:`~sched_core.clock.utcnow`) and runs
one procedure under the cache file's lock:

1. lock: the in-process mutex and the file's ``flock``;
2. reload: read the file again if another process saved since (its
   generation or its stamp changed), salvaging bad parts and clamping times in
   the future;
3. plan: the pure decision (:mod:`sched_core.due`, :mod:`sched_core.pull`);
4. fire: call the agent's ``fire`` for each window;
5. stamp: record each window whose fire returned (never one that raised);
6. save: write the file atomically, with the next generation.

A window fires at most once: stamps happen only after ``fire`` returned, and
``Fire.key`` is a stable idempotency key for the window, so a crash between
the fire and its stamp is deduplicated downstream. A pull is accepted only
together with its save: if the file cannot be written, memory and file stay as
they were and the pull is a ``PullError``.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.cache import (
    FileStamp,
    clamp_future,
    dump_rows,
    load_cache_file,
    read_generation,
    save_cache,
    stamp_of,
    validate_rows,
)
from sched_core.clock import as_utc, floor_minute, now_or_clock, utcnow
from sched_core.config import Config, Fire, FireFunc, TickReport
from sched_core.due import due_windows, missed_windows
from sched_core.errors import PullError
from sched_core.guard import StartDecision, decide_start
from sched_core.index import DueIndex
from sched_core.matcher import window_key
from sched_core.misses import eligible_after
from sched_core.model import Cache, LocalSchedule
from sched_core.plan import TRIGGER_RECOVERY, TRIGGER_SCHEDULE
from sched_core.policies import latest_window, policy_block, row_zone
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
from sched_core.statefile import locked, remove_stale_temporaries

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

def _own_clock(row: LocalSchedule) -> bool:
    """Whether the row's windows are not the node zone's minutes: its own zone, or a jitter."""
    return bool(row.timezone) or row.jitter > 0


def _plain(row: LocalSchedule) -> bool:
    """Whether the row has no policy that can hold a window back (the Go kit's row)."""
    return not (_own_clock(row) or row.paused or row.not_before or row.not_after
                or row.blackouts or row.min_interval)


def _copy_row(row: LocalSchedule) -> LocalSchedule:
    """Return a copy of row the fire callback may change without touching the cache."""
    return row.model_copy(
        update={
            "schedule": row.schedule.model_copy(deep=True),
            "params": copy.deepcopy(row.params) if row.params else row.params,
            "paused": row.paused.model_copy() if row.paused else None,
            "blackouts": [item.model_copy(deep=True) for item in row.blackouts]
            if row.blackouts else row.blackouts,
        }
    )


class Scheduler:
    """The per-node scheduler (see the module docstring)."""

    def __init__(self, config: Config, *, now: datetime | None = None) -> None:
        self._config = config
        self._tz = config.tz
        self._held_logged: dict[str, str] = {}
        self._path = config.path
        self._mutex = threading.RLock()
        self._cache = Cache()
        self._stamp: FileStamp | None = None
        self._generation: int | None = None
        self._index = DueIndex.build([], self._tz)
        self._indexed: list[LocalSchedule] | None = None
        self._rows_json: str | None = None  # the cached rows' JSON, None when stale
        self._runner = Runner(
            tick=self.tick,
            pull=self.pull,
            missed_run_check=self.missed_run_check,
            fire_interval=config.fire_interval,
            pull_interval=config.pull_interval,
            node_name=config.node_name,
        )
        now = now_or_clock(now)
        with self._locked():
            remove_stale_temporaries(self._path)
            self._reload(now)

    # -- lock, reload, save --------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the in-process mutex and the cache file's lock."""
        with self._mutex, locked(self._path):
            yield

    def _reload(self, now: datetime) -> None:
        """Reload the cache file if another process (or nobody yet) wrote a new version.

        A file of ours opens with its generation, raised by every save under the
        lock, so an unchanged generation and stamp mean an unchanged file (the
        stamp alone does not: an inode and a modification time can repeat). A
        file without one (the Go kit's) is judged by its stamp.
        """
        generation = read_generation(self._path)
        stamp = stamp_of(self._path)
        if stamp is not None and stamp == self._stamp and generation == self._generation:
            return
        loaded = load_cache_file(self._path, now=now)
        cache = loaded.cache
        # A cache the Go kit wrote has no first-seen times: count its schedules
        # as first seen when it last fetched them, or now if it never did.
        seen_at = cache.last_fetched_at or now
        for row in cache.schedules:
            cache.first_seen_at.setdefault(row.id, seen_at)
        clamped = clamp_future(cache, now=now, source=str(self._path))
        self._cache = cache
        self._generation = loaded.generation
        self._stamp = stamp_of(self._path)
        self._reindex()
        if loaded.dropped or clamped:
            self._rewrite_salvaged(loaded.dropped + clamped)

    def _rewrite_salvaged(self, dropped: list[str]) -> None:
        """Write the cache without the parts load dropped, so they are reported once.

        Best effort: if the write fails the loaded cache still fires, and the
        next save writes it.
        """
        try:
            self._save()
        except OSError as exc:
            log.error(
                "could not rewrite cache file %s without its invalid parts: %r", self._path, exc,
                extra={"path": str(self._path), "dropped": dropped, "error": repr(exc)},
            )
            return
        log.warning(
            "rewrote cache file %s without its invalid parts: %s",
            self._path, ", ".join(dropped),
            extra={"path": str(self._path), "dropped": dropped},
        )

    def _reindex(self) -> None:
        """Rebuild the due index and forget the rows' JSON if the schedule list changed."""
        if self._indexed != self._cache.schedules:
            self._index = DueIndex.build(self._cache.schedules, self._tz)
            self._indexed = list(self._cache.schedules)
            self._rows_json = None

    def _save(self) -> None:
        """Write the cache in memory with the next generation; the caller holds the lock."""
        if self._rows_json is None:
            self._rows_json = dump_rows(self._cache.schedules)
        generation = (self._generation or 0) + 1
        save_cache(self._path, self._cache, self._rows_json, generation)
        self._generation = generation
        self._stamp = stamp_of(self._path)

    def _adopt(self, cache: Cache) -> None:
        """Save cache, then make it the cache in memory; the caller holds the lock.

        Nothing is adopted that cannot be written: if encoding or writing
        fails, memory and file stay as they were and the failure is a PullError.
        """
        same_rows = cache.schedules == self._indexed and self._rows_json is not None
        generation = (self._generation or 0) + 1
        try:
            rows_json = self._rows_json if same_rows else dump_rows(cache.schedules)
            save_cache(self._path, cache, rows_json, generation)
        except Exception as exc:
            raise PullError(
                f"could not save the cache file {self._path}, so the pull is not accepted: "
                f"{exc!r}"
            ) from exc
        self._cache = cache
        self._generation = generation
        self._stamp = stamp_of(self._path)
        self._reindex()
        self._rows_json = rows_json

    @property
    def timezone(self) -> ZoneInfo:
        """The timezone schedules are matched in."""
        return self._tz

    @property
    def node_name(self) -> str:
        """The node this scheduler runs for."""
        return self._config.node_name

    def schedules(self) -> list[LocalSchedule]:
        """Return deep copies of the cached schedules, sorted by name."""
        with self._mutex:
            rows = [row.model_copy(deep=True) for row in self._cache.schedules]
        return sorted(rows, key=lambda row: (row.name, row.id))

    def cache(self) -> Cache:
        """Return a deep copy of the whole cache, last fired times included."""
        with self._mutex:
            return self._cache.model_copy(deep=True)

    # -- fire and stamp ----------------------------------------------------

    def _fire(self, fire: Fire) -> str | None:
        """Call the agent's fire; return None on success or the error text."""
        assert self._config.fire is not None
        try:
            self._config.fire(fire)
        except Exception as exc:
            log.error(
                "fire of %s (%s, window %s) failed; it stays unfired and will be retried: %r",
                fire.schedule.id, fire.trigger_key, fire.window, exc,
                extra={
                    "schedule_id": fire.schedule.id,
                    "trigger_key": fire.trigger_key,
                    "window": fire.window.isoformat() if fire.window else None,
                    "node": self._config.node_name,
                    "error": repr(exc),
                },
            )
            return repr(exc)
        log.info(
            "fired %s (%s, %s, window %s) as %s",
            fire.schedule.id, fire.schedule.action, fire.trigger_key, fire.window, fire.key,
            extra={
                "schedule_id": fire.schedule.id,
                "action": fire.schedule.action,
                "trigger_key": fire.trigger_key,
                "window": fire.window.isoformat() if fire.window else None,
                "key": fire.key,
                "node": self._config.node_name,
            },
        )
        return None

    def _window_fire(self, row: LocalSchedule, window: datetime, *, recovery: bool) -> Fire:
        return Fire(
            schedule=_copy_row(row),
            trigger_key=TRIGGER_RECOVERY if recovery else TRIGGER_SCHEDULE,
            missed_recovery=recovery,
            window=window,
            key=window_key(row.id, window, self._tz),
        )

    @property
    def fire_grace(self) -> timedelta:
        """How late a tick may still fire a window."""
        return self._config.fire_grace

    def due(self, now: datetime) -> list[tuple[LocalSchedule, datetime, int]]:
        """Return (schedule, window, older windows coalesced) for each schedule due at now.

        Pure over the loaded cache: see :meth:`_decide_due`.
        """
        return self._decide_due(as_utc(now))[0]

    def _decide_due(
        self, now: datetime
    ) -> tuple[list[tuple[LocalSchedule, datetime, int]], dict[str, str]]:
        """Return the windows due at now, and the rows whose policies hold theirs back.

        The candidates: per enabled clock schedule, the latest eligible window
        in ``[now - grace, now]`` (:func:`sched_core.due.due_windows`, in the
        node's zone); for a row with its own ``timezone`` or a ``jitter``, the
        latest window in its zone whose start (window plus the node's offset)
        has come, within the grace of that start. A row with policies then goes
        to the agent's own start guard (:func:`sched_core.guard.decide_start`,
        tried now): a pause, a blackout, the row's dates or ``min_interval``
        hold it back with the guard's reason, as they do on the agent. A row
        without any is the Go kit's and fires as it always did (the guard would
        say "on time"). One rule for every engine the kit offers; a late window
        is the miss check's, never the tick's.
        """
        grace, node = self._config.fire_grace, self._config.node_name
        cache = self._cache
        candidates = [
            (due.schedule, due.window, due.coalesced)
            for due in due_windows(self._index, cache, now=now, grace=grace)
            if not _own_clock(due.schedule)
        ]
        for row in cache.schedules:
            if not _own_clock(row) or not row.enabled or row.schedule.is_event:
                continue
            found = latest_window(row, now, since=now - grace - timedelta(seconds=row.jitter),
                                  node=node, tz=row_zone(row, self._tz))
            floor = eligible_after(cache.last_fired_at.get(row.id), cache.first_seen_at.get(row.id))
            if found is not None and now - found[1] <= grace and (
                floor is None or found[0] >= floor
            ):
                candidates.append((row, found[0], 0))
        due: list[tuple[LocalSchedule, datetime, int]] = []
        held: dict[str, str] = {}
        for row, window, older in sorted(candidates, key=lambda c: (c[1], c[0].id)):
            if _plain(row):
                due.append((row, window, older))
                continue
            decision = decide_start(
                row, schedule_id=row.id, window=window,
                last_fired=cache.last_fired_at.get(row.id),
                first_seen=cache.first_seen_at.get(row.id),
                first_try=now, now=now, grace=grace, tz=self._tz, node=node,
            )
            if decision.runs and not decision.late:
                due.append((row, window, older))
            else:
                held[row.id] = decision.reason
        return due, held

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
            fire = self._window_fire(row, window, recovery=recovery)
            error = self._fire(fire)
            if error is not None:
                failed.append((fire, error))
                continue
            self._cache.last_fired_at[row.id] = window
            fired.append(fire)
        if fired:
            self._save()
        return fired, failed

    def due_fires(self, now: datetime | None = None) -> list[Fire]:
        """Return the fires a tick at now would make, without firing or stamping anything.

        For callers that prepare the work in bulk first (the Prefect tick creates
        the runs in one request) and then run ``tick`` with the same keys.
        """
        now = now_or_clock(now)
        with self._locked():
            self._reload(now)
            return [self._window_fire(row, w, recovery=False) for row, w, _ in self.due(now)]

    def tick(self, now: datetime | None = None) -> int:
        """Fire each enabled schedule's latest unfired window in the grace; return the count."""
        return len(self.tick_report(now).fired)

    def tick_report(self, now: datetime | None = None) -> TickReport:
        """Run one tick and return what it fired, coalesced and failed."""
        now = now_or_clock(now)
        coalesced: dict[str, int] = {}
        with self._locked():
            self._reload(now)
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
        """Run the missed-run check and return what it fired and failed."""
        now = now_or_clock(now)
        truncated: dict[str, int] = {}
        with self._locked():
            self._reload(now)
            missed = missed_windows(
                self._cache, now=now, grace=self._config.fire_grace, tz=self._tz
            )
            for item in missed:
                if item.truncated:
                    truncated[item.schedule.id] = item.truncated
                    log.warning(
                        "run-all of %s truncated to the latest missed window: %d dropped",
                        item.schedule.id, item.truncated,
                        extra={"schedule_id": item.schedule.id, "truncated": item.truncated},
                    )
            held: dict[str, str] = {}
            for item in missed:
                row = item.schedule
                block = policy_block(row, item.window, tz=row_zone(row, self._tz),
                                     last_fired=self._cache.last_fired_at.get(row.id))
                if block is not None:  # the start guard's rule 4, as on the agent
                    held[row.id] = f"missed window {item.window.isoformat()} skipped: {block}"
                    log.info("not firing %s: %s", row.id, held[row.id],
                             extra={"schedule_id": row.id, "reason": held[row.id]})
            fired, failed = self._fire_windows(
                [(item.schedule, item.window) for item in missed if item.schedule.id not in held],
                recovery=True,
            )
        return TickReport(fired=fired, failed=failed, coalesced=truncated, held=held)

    def fire_matching(
        self,
        trigger_key: str,
        pred: Callable[[LocalSchedule], bool],
        *,
        now: datetime | None = None,
        key: str | None = None,
    ) -> int:
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
        now = now_or_clock(now)
        window = as_utc(window, "window")
        with self._locked():
            self._reload(now)
            row = next((item for item in self._cache.schedules if item.id == schedule_id), None)
            last = self._cache.last_fired_at.get(schedule_id)
            decision = decide_start(
                row,
                schedule_id=schedule_id,
                window=window,
                last_fired=last,
                first_seen=self._cache.first_seen_at.get(schedule_id),
                first_try=as_utc(first_try, "first_try"),
                now=now,
                grace=self._config.fire_grace,
                tz=self._tz,
                retry=retry,
                node=self._config.node_name,
            )
            if decision.stamp:
                self._cache.last_fired_at[schedule_id] = window if last is None else max(
                    last, window
                )
                self._save()
        return decision, None if row is None else _copy_row(row)

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
        with self._locked():
            self._reload(now)
            for row in self._cache.schedules:
                if not row.enabled or row.id in skip_ids or not pred(row):
                    continue
                held = policy_block(
                    row, now, last_fired=self._cache.last_fired_at.get(row.id), tz=self._tz
                )
                if held is not None:
                    log.info(
                        "not firing %s (%s) on %s: %s", row.id, row.action, trigger_key, held,
                        extra={"schedule_id": row.id, "trigger_key": trigger_key,
                               "node": self._config.node_name, "reason": held},
                    )
                    continue
                fire = Fire(
                    schedule=_copy_row(row),
                    trigger_key=trigger_key,
                    missed_recovery=False,
                    window=None,
                    key=f"{row.id}@{suffix}",
                )
                error = self._fire(fire)
                if error is not None:
                    failed.append((fire, error))
                    continue
                self._cache.last_fired_at[row.id] = now
                fired.append(fire)
            if fired:
                self._save()
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
        with self._mutex:
            cache = self._cache
            etag = cache.etag if cache.etag_url == shown and cache.schedules else None
        try:
            body, answer_etag = fetch(self._config.pull_url, self._config.http_client, etag=etag)
            if body is None:
                return self._not_modified(now)
            rows = parse_schedule_list(body, shown)
            good, rejected = validate_rows(rows, source=shown, warn=False)  # logged if accepted
            with self._locked():
                self._reload(now)
                old = {row.id: row for row in self._cache.schedules}
                merged, result = merge_pull(
                    self._cache, good, rejected, rows=len(rows), etag=answer_etag,
                    etag_url=shown, source=shown, now=now,
                )
                self._adopt(merged)
        except PullError as exc:
            log.error(
                "pull from %s rejected; keeping the last good schedule list: %s", shown, exc,
                extra={"url": shown, "node": self._config.node_name, "error": str(exc)},
            )
            raise
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
                "node": self._config.node_name,
                "count": len(good) + len(result.kept_last_good),
                "added": len(result.added),
                "removed": len(result.removed),
                "changed": len(result.changed),
                "rejected": len(result.rejected),
            },
        )
        return result

    def _not_modified(self, now: datetime) -> PullResult:
        """Record a 304: the list is unchanged, and it was fetched now."""
        with self._locked():
            self._reload(now)
            self._adopt(not_modified(self._cache, now=now))
            count = len(self._cache.schedules)
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
