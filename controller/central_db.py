"""The central scheduler's database connections: opened on first use, all closed by one call.

Three on Postgres, one engine on SQLite:

- the pool (``engine``): a pass's session, its completion and the heartbeat's renewal;
  ``autocommit`` is the same pool without transactions, for one-statement completions;
- the claimer: one autocommit connection for the loop's claims and wake-up lookups (each
  claim is one statement);
- the listener's own connection (:meth:`open_listen_connection`), which claims too after
  a notification.

The connections that claim commit asynchronously unless ``durable_claims`` (see
:mod:`controller.central`'s docstring for why that is safe).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
from sqlalchemy.engine import URL, Engine

from controller.central_settings import CentralSettings
from controller.db import connection_options, libpq_conninfo, make_engine
from controller.wakeups import subscribe_saves, unsubscribe_saves


class SchedulerConnections:
    """One central scheduler instance's connections (the module's rules)."""

    def __init__(self, url: URL, settings: CentralSettings, worker_id: str,
                 wake: threading.Event) -> None:
        self.url = url
        self.settings = settings
        self.worker_id = worker_id
        self.is_postgres = url.get_backend_name() == "postgresql"
        self.claimer: Engine | None = None
        """The claiming connection's engine (Postgres only; else None: use ``engine()``)."""
        self.autocommit: Engine | None = None
        """The pool without transactions (Postgres only)."""
        self._engine: Engine | None = None
        self._wake = wake
        self._lock = threading.Lock()

    @property
    def application_name(self) -> str:
        """The Postgres application_name of this instance's pooled connections."""
        return f"sched-central:{self.worker_id}"[:63]

    @property
    def listen_application_name(self) -> str:
        """The Postgres application_name of this instance's LISTEN connection."""
        return f"sched-listen:{self.worker_id}"[:63]

    @property
    def claim_options(self) -> str | None:
        """Server settings of the connections that claim (see the module docstring)."""
        return None if self.settings.durable_claims else "-c synchronous_commit=off"

    def engine(self) -> Engine:
        """Return the pool, opening it (and the claimer, on Postgres) on first use."""
        with self._lock:
            if self._engine is None:
                self._engine = make_engine(
                    self.url, application_name=self.application_name,
                    pool_size=2, max_overflow=2, pool_pre_ping=False,
                )
                if self.is_postgres:
                    self.autocommit = self._engine.execution_options(isolation_level="AUTOCOMMIT")
                    self.claimer = make_engine(
                        self.url, application_name=self.application_name,
                        pool_size=1, max_overflow=0, pool_pre_ping=False,
                        options=self.claim_options, isolation_level="AUTOCOMMIT",
                    )
                if self.settings.wake_on_local_saves:
                    subscribe_saves(self._engine, self._wake)
            return self._engine

    def open_listen_connection(self) -> psycopg.Connection[Any]:
        """Return a new autocommit connection for LISTEN (it claims too: the claim settings)."""
        settings: dict[str, Any] = {
            "application_name": self.listen_application_name,
            "connect_timeout": 10,
            "keepalives": 1,
            "keepalives_idle": 30,
            "options": connection_options(self.claim_options),
        }
        return psycopg.connect(libpq_conninfo(self.url), autocommit=True, **settings)

    def close(self) -> None:
        """Dispose of every engine opened (the listener closes its own connection)."""
        with self._lock:
            engine, self._engine = self._engine, None
            claimer, self.claimer = self.claimer, None
            self.autocommit = None
        if claimer is not None:
            claimer.dispose()
        if engine is not None:
            if self.settings.wake_on_local_saves:
                unsubscribe_saves(engine, self._wake)
            engine.dispose()
