"""The per-node scheduler: pull the list, fire due windows, recover missed ones.

The controller is not in the firing path: schedules keep firing from the
on-disk cache while it is down. Every public method takes ``now`` (default:
the wall clock, read in one place, :func:`utcnow`) and works under the cache
file's lock, reloading the file first when another process changed it, so
several processes can share one cache.

A window fires at most once: the cache stamps each schedule's last fired
window, stamps happen only after ``fire`` returned, and ``Fire.key`` is a
stable idempotency key for the window, so a crash between the fire and its
stamp is deduplicated downstream.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit
from zoneinfo import ZoneInfo

import httpx

from sched_core.cache import (
    FileStamp,
    dump_rows,
    json_type,
    load_cache_report,
    locked,
    save_cache,
    stamp_of,
    validate_rows,
)
from sched_core.errors import ConfigError, PullError
from sched_core.index import DueIndex
from sched_core.matcher import DEFAULT_TZ, window_key, zone
from sched_core.misses import eligible_after, floor_minute, plan_recovery
from sched_core.model import Cache, LocalSchedule

log = logging.getLogger(__name__)

MAX_PAYLOAD = 16 * 1024 * 1024
"""The largest schedule list a pull accepts, in bytes."""

TRIGGER_SCHEDULE = "schedule"
TRIGGER_RECOVERY = "schedule-recovery"


def utcnow() -> datetime:
    """Return the wall clock as an aware UTC datetime: the one clock read of the kit."""
    return datetime.now(UTC)


def as_utc(value: datetime | None, name: str = "now") -> datetime:
    """Return value as a plain ``datetime`` in UTC (the wall clock for None).

    Subclasses such as Prefect's pendulum-style ``DateTime`` are turned into the
    standard type, whose arithmetic and comparisons the kit relies on; a naive
    value is a ``ValueError`` naming it.
    """
    if value is None:
        return utcnow()
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} {value!r} is naive; pass a timezone-aware datetime")
    utc = value.astimezone(UTC)
    return datetime(
        utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond,
        tzinfo=UTC,
    )


@dataclass(frozen=True)
class Fire:
    """One fire handed to the agent's callback."""

    schedule: LocalSchedule
    trigger_key: str
    missed_recovery: bool
    window: datetime | None
    key: str


FireFunc = Callable[[Fire], object]


@dataclass
class Config:
    """How a scheduler pulls, where it keeps its cache and what it calls to fire.

    ``pull_url``, ``node_name``, ``cache_path`` and ``fire`` are required; a
    missing or invalid field raises :class:`ConfigError` naming it.
    """

    pull_url: str = ""
    node_name: str = ""
    cache_path: str | Path = ""
    fire: FireFunc | None = None
    http_client: httpx.Client | None = None
    timezone: ZoneInfo | str = field(default_factory=lambda: DEFAULT_TZ)
    fire_interval: timedelta = timedelta(seconds=60)
    pull_interval: timedelta = timedelta(seconds=300)
    fire_grace: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        for name in ("pull_url", "node_name", "cache_path"):
            if not getattr(self, name):
                raise ConfigError(f"Config.{name} is required")
        if self.fire is None or not callable(self.fire):
            raise ConfigError("Config.fire is required and must be callable")
        scheme = urlsplit(self.pull_url).scheme
        if scheme not in ("http", "https", "file"):
            raise ConfigError(
                f"Config.pull_url {redact_url(self.pull_url)!r} must be http(s):// or file://"
            )
        if isinstance(self.timezone, str):
            try:
                self.timezone = zone(self.timezone)
            except ValueError as exc:
                raise ConfigError(f"Config.timezone {self.timezone!r} is unknown") from exc
        for name in ("fire_interval", "pull_interval", "fire_grace"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ConfigError(f"Config.{name} must be a positive timedelta, got {value!r}")
        self.cache_path = Path(self.cache_path)
        if not self.cache_path.parent.is_dir():
            raise ConfigError(f"Config.cache_path folder {self.cache_path.parent} does not exist")

    @property
    def tz(self) -> ZoneInfo:
        """The timezone as a ZoneInfo."""
        assert isinstance(self.timezone, ZoneInfo)
        return self.timezone

    @property
    def path(self) -> Path:
        """The cache path as a Path."""
        return Path(self.cache_path)


def _copy_row(row: LocalSchedule) -> LocalSchedule:
    """Return a copy of row the fire callback may change without touching the cache."""
    return row.model_copy(
        update={
            "schedule": row.schedule.model_copy(deep=True),
            "params": copy.deepcopy(row.params) if row.params else row.params,
        }
    )


def redact_url(url: str) -> str:
    """Return url without any user or password in it, for logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class PullResult:
    """What a pull changed: ids added, removed and changed, and rows rejected with reasons."""

    added: list[str]
    removed: list[str]
    changed: list[str]
    rejected: list[tuple[str, str]]
    kept_last_good: list[str]

    @property
    def changed_anything(self) -> bool:
        """True when the schedule list is different after the pull."""
        return bool(self.added or self.removed or self.changed)


@dataclass(frozen=True)
class TickReport:
    """What one tick fired, coalesced and failed, for logs and artifacts."""

    fired: list[Fire]
    failed: list[tuple[Fire, str]]
    coalesced: dict[str, int]


class Scheduler:
    """The per-node scheduler (see the module docstring)."""

    def __init__(self, config: Config, *, now: datetime | None = None) -> None:
        self._config = config
        self._tz = config.tz
        self._path = config.path
        self._mutex = threading.RLock()
        self._cache = Cache()
        self._stamp: FileStamp | None = None
        self._index = DueIndex.build([], self._tz)
        self._indexed: list[LocalSchedule] | None = None
        self._rows_json: str | None = None  # the cached rows' JSON, None when stale
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._client = config.http_client
        self._owns_client = False
        with self._locked():
            self._reload(as_utc(now))

    # -- state -------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the in-process mutex and the cache file's lock."""
        with self._mutex, locked(self._path):
            yield

    def _reload(self, now: datetime) -> None:
        """Reload the cache file if another process (or nobody yet) wrote a new version."""
        stamp = stamp_of(self._path)
        if stamp is not None and stamp == self._stamp:
            return
        cache, dropped = load_cache_report(self._path, now=now)
        # A cache the Go kit wrote has no first-seen times: count its schedules
        # as first seen when it last fetched them, or now if it never did.
        seen_at = cache.last_fetched_at or now
        for row in cache.schedules:
            cache.first_seen_at.setdefault(row.id, seen_at)
        self._cache = cache
        self._stamp = stamp_of(self._path)
        self._reindex()
        if dropped:
            self._rewrite_salvaged(dropped)

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
        if self._rows_json is None:
            self._rows_json = dump_rows(self._cache.schedules)
        save_cache(self._path, self._cache, self._rows_json)
        self._stamp = stamp_of(self._path)

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

    # -- firing ------------------------------------------------------------

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

        Pure over the loaded cache: the latest eligible window in
        ``[now - grace, now]`` per enabled clock schedule.
        """
        now = as_utc(now)
        grace = self._config.fire_grace
        last_fired, first_seen = self._cache.last_fired_at, self._cache.first_seen_at
        floors: dict[str, datetime | None] = {}
        latest: dict[str, tuple[LocalSchedule, datetime, int]] = {}
        minute = floor_minute(now)
        while minute >= now - grace:  # newest first: the first eligible window is the latest
            for row in self._index.due_at(minute):
                rid = row.id
                if rid in floors:
                    floor = floors[rid]
                else:
                    floor = floors[rid] = eligible_after(last_fired.get(rid), first_seen.get(rid))
                if floor is not None and minute < floor:
                    continue
                found = latest.get(rid)
                latest[rid] = (row, minute, 0) if found is None else (*found[:2], found[2] + 1)
            minute -= timedelta(minutes=1)
        return sorted(latest.values(), key=lambda item: (item[1], item[0].id))

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
        now = as_utc(now)
        with self._locked():
            self._reload(now)
            return [self._window_fire(row, w, recovery=False) for row, w, _ in self.due(now)]

    def tick(self, now: datetime | None = None) -> int:
        """Fire each enabled schedule's latest unfired window in the grace; return the count."""
        return len(self.tick_report(now).fired)

    def tick_report(self, now: datetime | None = None) -> TickReport:
        """Run one tick and return what it fired, coalesced and failed."""
        now = as_utc(now)
        coalesced: dict[str, int] = {}
        with self._locked():
            self._reload(now)
            due = self.due(now)
            for row, window, older in due:
                if older:
                    coalesced[row.id] = older
                    log.warning(
                        "coalesced %d older pending windows of %s into %s", older, row.id, window,
                        extra={"schedule_id": row.id, "coalesced": older, "window": str(window)},
                    )
            fired, failed = self._fire_windows([(row, w) for row, w, _ in due], recovery=False)
        return TickReport(fired=fired, failed=failed, coalesced=coalesced)

    def missed_run_check(self, now: datetime | None = None) -> int:
        """Apply each schedule's miss policy to its latest missed window; return fires."""
        return len(self.missed_run_report(now).fired)

    def missed_run_report(self, now: datetime | None = None) -> TickReport:
        """Run the missed-run check and return what it fired and failed."""
        now = as_utc(now)
        truncated: dict[str, int] = {}
        with self._locked():
            self._reload(now)
            windows: list[tuple[LocalSchedule, datetime]] = []
            for row in self._cache.schedules:
                if not row.enabled or row.schedule.is_event:
                    continue
                recovery = plan_recovery(
                    row.schedule,
                    row.miss_policy,
                    last_fired=self._cache.last_fired_at.get(row.id),
                    first_seen=self._cache.first_seen_at.get(row.id),
                    now=now,
                    grace=self._config.fire_grace,
                    tz=self._tz,
                )
                if recovery is None:
                    continue
                if recovery.truncated:
                    truncated[row.id] = recovery.truncated
                    log.warning(
                        "run-all of %s truncated to the latest missed window: %d dropped",
                        row.id, recovery.truncated,
                        extra={"schedule_id": row.id, "truncated": recovery.truncated},
                    )
                windows.append((row, recovery.window))
            fired, failed = self._fire_windows(windows, recovery=True)
        return TickReport(fired=fired, failed=failed, coalesced=truncated)

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
        """
        now = as_utc(now)
        suffix = key or f"{trigger_key}@{floor_minute(now).strftime('%Y-%m-%dT%H:%MZ')}"
        fired: list[Fire] = []
        failed: list[tuple[Fire, str]] = []
        with self._locked():
            self._reload(now)
            for row in self._cache.schedules:
                if not row.enabled or row.id in skip_ids or not pred(row):
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

    # -- pulling -----------------------------------------------------------

    def _fetch(self, etag: str | None) -> tuple[bytes | None, str | None]:
        """Return the raw schedule list (None for a 304 to etag) and the answer's ETag."""
        url = self._config.pull_url
        shown = redact_url(url)
        parts = urlsplit(url)
        if parts.scheme == "file":
            path = Path(unquote(parts.path))
            try:
                with path.open("rb") as handle:
                    body = handle.read(MAX_PAYLOAD + 1)
            except OSError as exc:
                raise PullError(f"cannot read schedule file {path}: {exc}") from exc
        else:
            if self._client is None:
                self._client = httpx.Client(timeout=httpx.Timeout(30.0))
                self._owns_client = True
            headers = {"If-None-Match": etag} if etag else {}
            try:
                with self._client.stream("GET", url, headers=headers) as response:
                    if response.status_code == 304 and etag:
                        return None, etag
                    if not 200 <= response.status_code < 300:
                        raise PullError(f"pull from {shown} answered HTTP {response.status_code}")
                    chunks: list[bytes] = []
                    size = 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > MAX_PAYLOAD:
                            break
                        chunks.append(chunk)
                    body = b"".join(chunks) if size <= MAX_PAYLOAD else b"x" * (MAX_PAYLOAD + 1)
                    answer_etag = response.headers.get("ETag")
            except httpx.HTTPError as exc:
                raise PullError(f"pull from {shown} failed: {exc!r}") from exc
            if len(body) <= MAX_PAYLOAD:
                return body, answer_etag
        if len(body) > MAX_PAYLOAD:
            raise PullError(f"schedule list from {shown} is larger than {MAX_PAYLOAD} bytes")
        return body, None

    def _parse(self, body: bytes) -> list[Any]:
        """Return the raw rows of a pull answer, or raise PullError for a bad payload."""
        shown = redact_url(self._config.pull_url)
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PullError(f"schedule list from {shown} is not valid JSON: {exc}") from exc
        if isinstance(data, dict):
            if "schedules" not in data:
                raise PullError(f"schedule list from {shown} has no 'schedules' field")
            data = data["schedules"]
        if not isinstance(data, list):
            raise PullError(
                f"schedules from {shown} must be a JSON list, got {type(data).__name__}"
            )
        seen: set[str] = set()
        for position, row in enumerate(data):
            # A row that names no schedule cannot be diffed against the cache:
            # treating it as absent would read the list as deleting every id.
            if not isinstance(row, dict):
                raise PullError(
                    f"schedule list from {shown}: row {position} is not a JSON object "
                    f"(got {json_type(row)})"
                )
            if "id" not in row:
                raise PullError(f"schedule list from {shown}: row {position} has no id")
            row_id = row["id"]
            if not isinstance(row_id, str) or not row_id:
                raise PullError(
                    f"schedule list from {shown}: row {position} has id {row_id!r}, "
                    "not a non-empty string"
                )
            if row_id in seen:
                raise PullError(f"schedule list from {shown} repeats id {row_id!r}")
            seen.add(row_id)
        return data

    def pull(self, now: datetime | None = None) -> PullResult:
        """Replace the schedule list from the pull URL, or raise PullError and change nothing.

        Surviving ids keep their last fire; a new id is first seen now; an
        invalid row with a valid id is dropped with a warning and reported in
        ``rejected``, and if its id was cached before its last good version is
        kept. An empty list empties the schedules.

        The whole pull is refused, and the cache stays exactly as it was
        (schedules, last fires, first-seen times, ETag), when:

        1. the answer is not a schedule list: an HTTP error, invalid JSON,
           more than :data:`MAX_PAYLOAD` bytes, an object without ``schedules``,
           a ``schedules`` that is not a list;
        2. a row names no schedule: it is not a JSON object, or its ``id`` is
           missing or not a non-empty string (the error names the first such
           row, by position, and why). Such a list cannot be diffed, and
           reading it as "no rows" would delete every schedule and its history;
        3. an id is repeated;
        4. schedules are cached and every row of a non-empty list is invalid:
           that is a broken controller, not an instruction to stop every
           schedule (the error names the first row and its reason). On an
           empty cache such a list is accepted, its rows reported rejected.
        """
        now = as_utc(now)
        shown = redact_url(self._config.pull_url)
        with self._mutex:
            cache = self._cache
            etag = cache.etag if cache.etag_url == shown and cache.schedules else None
        try:
            body, answer_etag = self._fetch(etag)
            if body is None:
                return self._not_modified(now)
            rows = self._parse(body)
            good, rejected = validate_rows(rows, source=shown, warn=False)  # logged if accepted
            with self._locked():
                self._reload(now)
                if rows and not good and self._cache.schedules:
                    label, reason = rejected[0]
                    raise PullError(
                        f"every one of the {len(rows)} rows of the schedule list from {shown} "
                        f"is invalid (first: {label}: {reason}); keeping the "
                        f"{len(self._cache.schedules)} cached schedules"
                    )
                result = self._replace(good, rejected, answer_etag, now)
        except PullError as exc:
            log.error(
                "pull from %s rejected; keeping the last good schedule list: %s", shown, exc,
                extra={"url": shown, "node": self._config.node_name, "error": str(exc)},
            )
            raise
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

    def _replace(
        self,
        good: list[LocalSchedule],
        rejected: list[tuple[str, str]],
        answer_etag: str | None,
        now: datetime,
    ) -> PullResult:
        """Make good the schedule list, keeping last good versions; the caller holds the lock."""
        shown = redact_url(self._config.pull_url)
        for rid, reason in rejected:
            log.warning(
                "dropped invalid schedule %s from %s: %s", rid, shown, reason,
                extra={"schedule_id": rid, "reason": reason, "source": shown},
            )
        old = {row.id: row for row in self._cache.schedules}
        new = {row.id: row for row in good}
        kept = [rid for rid, _ in rejected if rid in old and rid not in new]
        for rid in kept:
            new[rid] = old[rid]
            log.warning(
                "kept the last good version (%d) of invalid schedule %s",
                old[rid].version, rid,
                extra={"schedule_id": rid, "version": old[rid].version},
            )
        result = PullResult(
            added=sorted(set(new) - set(old)),
            removed=sorted(set(old) - set(new)),
            changed=sorted(rid for rid in set(new) & set(old) if new[rid] != old[rid]),
            rejected=rejected,
            kept_last_good=kept,
        )
        cache = self._cache
        cache.schedules = [new[row.id] for row in good] + [new[rid] for rid in kept]
        cache.last_fired_at = {k: v for k, v in cache.last_fired_at.items() if k in new}
        cache.first_seen_at = {rid: cache.first_seen_at.get(rid, now) for rid in new}
        cache.last_fetched_at = now
        cache.etag, cache.etag_url = (answer_etag, shown) if answer_etag else (None, None)
        self._reindex()
        self._save()
        return result

    def _not_modified(self, now: datetime) -> PullResult:
        """Record a 304: the list is unchanged, and it was fetched now."""
        with self._locked():
            self._reload(now)
            self._cache.last_fetched_at = now
            self._save()
        log.info(
            "schedules not modified (%d cached)", len(self._cache.schedules),
            extra={"node": self._config.node_name, "count": len(self._cache.schedules)},
        )
        return PullResult(added=[], removed=[], changed=[], rejected=[], kept_last_good=[])

    # -- loops -------------------------------------------------------------

    def start(self) -> None:
        """Start the fire loop, the pull loop and an initial pull plus missed-run check."""
        if self._threads:
            return
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._fire_loop, name="sched-fire", daemon=True),
            threading.Thread(target=self._pull_loop, name="sched-pull", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop the loops and wait for them; safe to call more than once."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None
            self._owns_client = False

    def _fire_loop(self) -> None:
        interval = self._config.fire_interval.total_seconds()
        while not self._stop.is_set():
            now = utcnow()
            if interval == 60:
                # Tick just after each minute boundary, so a window is never late by a minute.
                wait = 60 - (now.second + now.microsecond / 1e6) + 0.05
            else:
                wait = interval
            if self._stop.wait(wait):
                return
            try:
                self.tick()
            except Exception:
                log.exception("tick failed", extra={"node": self._config.node_name})

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.pull()
            except PullError:
                pass  # logged by pull; the cache keeps firing
            except Exception:
                log.exception("pull failed", extra={"node": self._config.node_name})
            try:
                self.missed_run_check()
            except Exception:
                log.exception("missed-run check failed", extra={"node": self._config.node_name})
            if self._stop.wait(self._config.pull_interval.total_seconds()):
                return
