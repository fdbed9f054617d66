"""The LISTEN connection of a central scheduler, kept up whatever happens to it.

Rule: one psycopg connection per instance does ``LISTEN sched_task``; after
any loss it reconnects with capped exponential backoff (base ``retry_delay``
seconds), into a temporary variable that replaces the old connection only once
``LISTEN`` succeeded, closes the old one, and calls ``on_connect`` so the
scheduler looks at once for tasks saved while nobody listened. Every
notification calls ``on_notify(conn)`` on this thread (the scheduler claims on
that connection: its backend is awake already). A silent network loss shows
up at the next health check (``SELECT 1`` every ``health_interval`` seconds)
rather than never. It never leaks a connection: ``close()`` after ``stop()``
closes the one open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg

from controller.wakeups import NOTIFY_CHANNEL

if TYPE_CHECKING:
    from controller.central_settings import CentralSettings

log = logging.getLogger(__name__)


def backoff(failures: int, *, base: float, cap: float) -> float:
    """Return the wait before retry number failures (1, 2, ...): base doubling, at most cap."""
    if failures < 1:
        return 0.0
    return float(min(cap, base * 2 ** min(failures - 1, 32)))


def close_quietly(conn: psycopg.Connection[Any] | None) -> None:
    """Close conn if there is one; a broken connection's close can only fail quietly."""
    if conn is None:
        return
    try:
        conn.close()
    except Exception:  # pragma: no cover - closing a broken connection can only fail quietly
        log.debug("closing a broken listen connection failed", exc_info=True)


class Listener:
    """Keep one LISTEN connection up and report notifications; see the module docstring.

    ``connect()`` opens a connection (already autocommit, with its settings);
    ``run()`` is the thread's body and returns once ``stop()`` was called.
    """

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        settings: CentralSettings,
        *,
        on_notify: Callable[[psycopg.Connection[Any]], None],
        on_connect: Callable[[], None],
        log_extra: dict[str, Any] | None = None,
    ) -> None:
        """Its four timings (``retry_delay``, ``max_retry_delay``, ``listen_timeout`` and
        ``health_interval``) are read from the scheduler's settings, as its other parts' are."""
        self._open = connect
        self.settings = settings
        self.on_notify = on_notify
        self.on_connect = on_connect
        self._extra = dict(log_extra or {})
        self.connects = 0
        """How many times it connected (1 + reconnects)."""
        self.listening = threading.Event()
        """Set while a LISTEN connection is up (tests wait on it)."""
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    def connect(self) -> psycopg.Connection[Any]:
        """Return a new connection already listening; close it and raise on any failure."""
        conn = self._open()
        try:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        except BaseException:
            close_quietly(conn)
            raise
        return conn

    def stop(self) -> None:
        """Make run() return (within ``listen_timeout``); :meth:`close` after joining it."""
        self._stopping.set()

    def close(self) -> None:
        """Close the connection run() left open, if any (after its thread ended)."""
        with self._lock:
            conn, self._conn = self._conn, None
        close_quietly(conn)
        self.listening.clear()

    def reset(self) -> None:
        """Allow run() again after a stop (a scheduler started a second time)."""
        self._stopping.clear()

    def run(self) -> None:
        """Listen until stopped, reconnecting after every loss."""
        failures = 0
        try:
            while not self._stopping.is_set():
                if failures:
                    delay = backoff(failures, base=self.settings.retry_delay,
                                    cap=self.settings.max_retry_delay)
                    if self._stopping.wait(delay):
                        break
                try:
                    fresh = self.connect()
                except Exception as exc:
                    failures += 1
                    log.warning(
                        "listen connection failed; retrying",
                        extra={**self._extra, "error": f"{type(exc).__name__}: {exc}",
                               "failures": failures},
                    )
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        close_quietly(fresh)
                        break
                    old, self._conn = self._conn, fresh
                close_quietly(old)
                self.connects += 1
                if self.connects > 1:
                    log.info("listen connection re-established",
                             extra={**self._extra, "failures": failures})
                failures = 0
                self.listening.set()
                # Tasks saved while we were not listening: look now, not at the next poll.
                self.on_connect()
                try:
                    self._listen(fresh)
                except Exception as exc:
                    failures = 1
                    log.warning(
                        "listen connection lost; reconnecting",
                        extra={**self._extra, "error": f"{type(exc).__name__}: {exc}"},
                    )
                finally:
                    self.listening.clear()
                    with self._lock:
                        if self._conn is fresh:
                            self._conn = None
                    close_quietly(fresh)
        finally:
            self.listening.clear()

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        """Report every notification until stopped; raise when conn is lost."""
        last_check = time.monotonic()
        while not self._stopping.is_set():
            notified = False
            for _notify in conn.notifies(timeout=self.settings.listen_timeout, stop_after=1):
                notified = True
            if notified and not self._stopping.is_set():
                self.on_notify(conn)
            if time.monotonic() - last_check >= self.settings.health_interval:
                conn.execute("SELECT 1")
                last_check = time.monotonic()
            if conn.closed:
                raise psycopg.OperationalError("listen connection closed")
