"""The fleet page's login limit: failed logins per client, shared by every instance.

Rules:

1. A client is its address as :mod:`controller.api.client` finds it (the peer, or
   the address a trusted proxy forwarded), an IPv6 client its /64
   (:func:`controller.api.client.client_key`). Each client is counted alone, so a
   guesser at its own address never makes another address wait (the admin's).
2. Past ``failures`` failed logins within ``window`` seconds, a client's logins are
   answered ``429`` without looking at the token (a guess is not even tried), the
   right token included, until its oldest failure in the window leaves it.
3. The failures are rows of ``login_failure`` in the database every instance
   shares (:class:`LoginLimit`), so a guesser sent round-robin over several
   instances is counted once. Two instances checking the same client at the same
   instant may each let one more guess through: a few, never a window's worth.
4. A login's form is read only after the limit said yes, at most
   :data:`LOGINS_IN_FLIGHT` at once per client (:class:`InFlight`, per instance),
   and within :data:`LOGIN_BODY_S`: a client sending slow forms holds that many
   connections for that long, not one per request for the body deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Table, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session

from controller.models import LoginFailure, utc_now

LOGIN_FAILURES = 10
"""Failed logins one client may make within LOGIN_WINDOW_S before it must wait."""
LOGIN_WINDOW_S = 60.0
"""The sliding window of LOGIN_FAILURES (seconds)."""
MAX_REMEMBERED = 10_000
"""Waiting clients remembered at most (past it, forgotten: the database is asked again)."""
LOGINS_IN_FLIGHT = 2
"""Login forms one client may be sending to one instance at once (rule 4)."""
LOGIN_BODY_S = 5.0
"""Seconds a login form (at most 4 KiB) has to arrive once its headers are in (rule 4)."""

_FAILURES: Table = LoginFailure.__table__  # type: ignore[attr-defined]


class LoginLimit:
    """Failed logins per client in the shared database (the module's rules 1-3)."""

    def __init__(self, in_session: Callable[[Callable[[Session], Any]], Any], *,
                 failures: int = LOGIN_FAILURES, window: float = LOGIN_WINDOW_S,
                 clock: Callable[[], datetime] = utc_now) -> None:
        if failures < 1 or not window > 0:
            raise ValueError(f"a login limit needs failures >= 1 and window > 0, got "
                             f"{failures} and {window!r}")
        self.in_session = in_session
        self.failures = failures
        self.window = timedelta(seconds=window)
        self.clock = clock
        self._until: dict[str, datetime] = {}
        """Clients found waiting, until when: asked again of the database only after."""
        self._lock = threading.Lock()

    def wait_s(self, client: str) -> float:
        """Return how long client must wait before its next login (0: it may try now).

        A wait the database gave is remembered until it ends (its failures stay in the
        window that long whatever another instance adds): a client refused again meanwhile
        costs no query."""
        now = self.clock()
        with self._lock:
            until = self._until.get(client)
            if until is not None and until <= now:
                del self._until[client]
            elif until is not None:
                return (until - now).total_seconds()

        def newest(session: Session) -> list[datetime]:
            return list(session.execute(
                select(_FAILURES.c.failed_at)
                .where(_FAILURES.c.client == client, _FAILURES.c.failed_at > now - self.window)
                .order_by(_FAILURES.c.failed_at.desc()).limit(self.failures)).scalars())

        found: list[datetime] = self.in_session(newest)
        if len(found) < self.failures:
            return 0.0
        until = found[-1] + self.window
        with self._lock:
            if len(self._until) >= MAX_REMEMBERED:
                self._until.clear()
            self._until[client] = until
        return max(0.0, (until - now).total_seconds())

    def failed(self, client: str) -> None:
        """Count one failed login of client; forget every failure older than the window."""
        now = self.clock()

        def store(session: Session) -> None:
            insert: Any = (pg_insert if session.get_bind().dialect.name == "postgresql"
                           else sqlite_insert)(_FAILURES)
            session.execute(insert.values(client=client, failed_at=now).on_conflict_do_nothing(
                index_elements=[_FAILURES.c.client, _FAILURES.c.failed_at]))
            session.execute(delete(_FAILURES).where(_FAILURES.c.failed_at <= now - self.window))

        self.in_session(store)


class InFlight:
    """Logins being read per client in this process: at most ``most`` at once (rule 4)."""

    def __init__(self, most: int = LOGINS_IN_FLIGHT) -> None:
        self.most = most
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def slot(self, client: str) -> Iterator[bool]:
        """Yield whether client may send its form now (False: it has ``most`` under way)."""
        with self._lock:
            taken = self._open.get(client, 0)
            granted = taken < self.most
            if granted:
                self._open[client] = taken + 1
        try:
            yield granted
        finally:
            if granted:
                with self._lock:
                    left = self._open[client] - 1
                    if left:
                        self._open[client] = left
                    else:
                        del self._open[client]

