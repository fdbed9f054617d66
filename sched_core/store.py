"""The node's cache file and its copy in memory: lock, reload, save.

Steps 1, 2 and 6 of :class:`sched_core.scheduler.Scheduler`'s procedure, for one file:

1. lock: the in-process mutex and the file's ``flock`` (:meth:`CacheStore.locked`);
2. reload: read the file again if another process saved since (its generation or
   its stamp changed), salvaging bad parts and clamping times in the future, and
   rewrite it without them so they are reported once (:meth:`CacheStore.reload`);
6. save: write the file atomically with the next generation (:meth:`CacheStore.save`);
   a new cache (a pull's) is adopted only together with its save
   (:meth:`CacheStore.adopt`), so memory and file never disagree.

The rows' JSON follows the schedule list: made again only when it changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from sched_core.cache import (
    FileStamp,
    clamp_future,
    dump_rows,
    load_cache_file,
    read_generation,
    save_cache,
    stamp_of,
)
from sched_core.errors import PullError
from sched_core.model import Cache, LocalSchedule
from sched_core.statefile import locked, remove_stale_temporaries

log = logging.getLogger("sched_core.scheduler")


class CacheStore:
    """One cache file and its copy in memory (the module's rules)."""

    def __init__(self, path: Path, tz: ZoneInfo, *, now: datetime) -> None:
        self.path = path
        self.tz = tz
        self.mutex = threading.RLock()
        self.cache = Cache()
        self.stamp: FileStamp | None = None
        self.generation: int | None = None
        self._dumped: list[LocalSchedule] | None = None
        self._rows_json: str | None = None  # the cached rows' JSON, None when stale
        with self.locked():
            remove_stale_temporaries(path)
            self.reload(now)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the in-process mutex and the cache file's lock."""
        with self.mutex, locked(self.path):
            yield

    def reload(self, now: datetime) -> None:
        """Reload the cache file if another process (or nobody yet) wrote a new version.

        A file of ours opens with its generation, raised by every save under the
        lock, so an unchanged generation and stamp mean an unchanged file (the
        stamp alone does not: an inode and a modification time can repeat). A
        file without one (the Go kit's) is judged by its stamp.
        """
        generation = read_generation(self.path)
        stamp = stamp_of(self.path)
        if stamp is not None and stamp == self.stamp and generation == self.generation:
            return
        loaded = load_cache_file(self.path, now=now)
        cache = loaded.cache
        # A cache the Go kit wrote has no first-seen times: count its schedules
        # as first seen when it last fetched them, or now if it never did.
        seen_at = cache.last_fetched_at or now
        for row in cache.schedules:
            cache.first_seen_at.setdefault(row.id, seen_at)
        clamped = clamp_future(cache, now=now, source=str(self.path))
        self.cache = cache
        self.generation = loaded.generation
        self.stamp = stamp_of(self.path)
        self._follow_rows()
        if loaded.dropped or clamped:
            self._rewrite_salvaged(loaded.dropped + clamped)

    def _rewrite_salvaged(self, dropped: list[str]) -> None:
        """Write the cache without the parts load dropped, so they are reported once.

        Best effort: if the write fails the loaded cache still fires, and the
        next save writes it.
        """
        try:
            self.save()
        except OSError as exc:
            log.error(
                "could not rewrite cache file %s without its invalid parts: %r", self.path, exc,
                extra={"path": str(self.path), "dropped": dropped, "error": repr(exc)},
            )
            return
        log.warning(
            "rewrote cache file %s without its invalid parts: %s",
            self.path, ", ".join(dropped),
            extra={"path": str(self.path), "dropped": dropped},
        )

    def _follow_rows(self) -> None:
        """Forget the rows' JSON if the schedule list changed."""
        if self._dumped != self.cache.schedules:
            self._dumped = list(self.cache.schedules)
            self._rows_json = None

    def save(self) -> None:
        """Write the cache in memory with the next generation; the caller holds the lock."""
        if self._rows_json is None:
            self._rows_json = dump_rows(self.cache.schedules)
        generation = (self.generation or 0) + 1
        save_cache(self.path, self.cache, self._rows_json, generation)
        self.generation = generation
        self.stamp = stamp_of(self.path)

    def adopt(self, cache: Cache) -> None:
        """Save cache, then make it the cache in memory; the caller holds the lock.

        Nothing is adopted that cannot be written: if encoding or writing
        fails, memory and file stay as they were and the failure is a PullError.
        """
        same_rows = cache.schedules == self._dumped and self._rows_json is not None
        generation = (self.generation or 0) + 1
        try:
            rows_json = self._rows_json if same_rows else dump_rows(cache.schedules)
            save_cache(self.path, cache, rows_json, generation)
        except Exception as exc:
            raise PullError(
                f"could not save the cache file {self.path}, so the pull is not accepted: "
                f"{exc!r}"
            ) from exc
        self.cache = cache
        self.generation = generation
        self.stamp = stamp_of(self.path)
        self._follow_rows()
        self._rows_json = rows_json
