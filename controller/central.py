"""The central scheduler: claims due tasks from the store and dispatches each exactly once.

Rule: the database is the only shared state. Any number of instances may run against one
Postgres; the claim protocol (:mod:`controller.claims`) decides who dispatches each (task,
scheduled time), and the database's clock decides when something is due.

Each instance runs two threads:

- the loop: claim a batch, dispatch each claim, complete or fail it, then wait for the
  earliest ``next_run_at``, a wake-up, or the poll interval;
- on Postgres, the listener (:mod:`controller.listener`): ``LISTEN sched_task`` on its own
  connection; on a notification it runs a pass itself (its backend is awake), then wakes
  the loop; after a reconnect it wakes the loop. SQLite polls, and a save in the same
  process wakes it (:func:`controller.wakeups.subscribe_saves`).

What a finished claim's task becomes is the pure
:func:`controller.timing.plan_after_dispatch`'s answer; the store only writes it. On
Postgres a claim commits with ``synchronous_commit = off`` and its completion durably (which
flushes the claim too); a claim lost in a database crash is claimed again and dispatched
with the same idempotency key, which Prefect deduplicates. ``durable_claims=True`` makes the
claim wait for the flush.

:class:`CentralScheduler` is a thin facade (threads, the loop, start and stop) over
:class:`controller.central_db.SchedulerConnections`, :class:`controller.central_pass.DispatchPass`
(one pass) with its :class:`~controller.central_pass.InFlight` leases, and the
:class:`controller.listener.Listener`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy.engine import URL, Engine
from sqlmodel import Session

from controller import claims
from controller.central_db import SchedulerConnections
from controller.central_pass import DispatchPass
from controller.central_settings import (
    PRUNE_BATCH,
    CentralSettings,
    default_worker_id,
    retry_delay_from_env,
)
from controller.claims import Claim
from controller.db import database_url, db_now
from controller.dispatch import EVENT_GAVE_UP, PrefectDispatcher, TaskDispatcher, emit_gave_up
from controller.listener import Listener, backoff
from sched_core.worker import Running

log = logging.getLogger(__name__)

_MIN_WAIT = 0.005  # never spin: a due task someone else holds frees up later

__all__ = [
    "EVENT_GAVE_UP", "CentralScheduler", "CentralSettings", "backoff", "emit_gave_up",
    "retry_delay_from_env",
]


class CentralScheduler(Running):
    """Claim and dispatch due tasks until stopped; see the module docstring.

    ``database`` is an engine (only its URL is used: the scheduler opens and
    disposes its own), a URL, or None for ``SCHED_DATABASE_URL`` / the SQLite
    default. ``settings`` default to :meth:`CentralSettings.from_env`;
    ``worker_id`` to one unique to this process; ``dispatcher`` to
    :class:`controller.dispatch.PrefectDispatcher`; ``on_give_up`` to
    :func:`emit_gave_up` (the ``sched.task.gave-up`` event; None sends nothing).

    ``start()`` runs it in background threads, ``stop()`` ends them and closes
    every connection it opened; it is also a context manager. ``run_once()``
    runs a single pass in the calling thread (tests).
    """

    def __init__(
        self,
        database: Engine | str | URL | None = None,
        settings: CentralSettings | None = None,
        *,
        worker_id: str | None = None,
        dispatcher: TaskDispatcher | None = None,
        on_give_up: Callable[[Claim, str, int], None] | None = emit_gave_up,
    ) -> None:
        self.settings = settings if settings is not None else CentralSettings.from_env()
        self.url: URL = database.url if isinstance(database, Engine) else database_url(database)
        self.worker_id = worker_id or default_worker_id()
        self.waiting = threading.Event()
        """Set while the loop is idle, waiting for work (benchmarks wait on it)."""
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.db = SchedulerConnections(self.url, self.settings, self.worker_id, self._wake)
        self.passes = DispatchPass(
            self.db, self.settings, self.worker_id, dispatcher=dispatcher or PrefectDispatcher(),
            on_give_up=on_give_up, stopping=self._stopping,
        )
        self.listener = Listener(
            self.db.open_listen_connection, self.settings, on_notify=self._on_notify,
            on_connect=self.wake, log_extra={"worker_id": self.worker_id},
        )

    # ------------------------------------------------------------ what it shows

    @property
    def dispatcher(self) -> TaskDispatcher:
        return self.passes.dispatcher

    @dispatcher.setter
    def dispatcher(self, value: TaskDispatcher) -> None:
        self.passes.dispatcher = value

    def _log_extra(self, **more: Any) -> dict[str, Any]:
        return {"worker_id": self.worker_id, **more}

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the loop (and, on Postgres, the listener) in background threads."""
        if self._threads:
            raise RuntimeError("scheduler already started")
        self._stopping.clear()
        self.listener.reset()
        self.db.engine()
        targets = [("loop", self._run_loop), ("heartbeat", self._run_heartbeat)]
        if self.db.is_postgres:
            targets.insert(0, ("listen", self.listener.run))
        for role, target in targets:
            thread = threading.Thread(
                target=target, name=f"sched-{role}-{self.worker_id}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        log.info("central scheduler started", extra=self._log_extra())

    def wake(self) -> None:
        """Make the loop run a pass now (e.g. after a save in this process)."""
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the threads and close every connection this instance opened."""
        self._stopping.set()
        self.listener.stop()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():  # pragma: no cover - a dispatcher that never returns
                log.error("scheduler thread did not stop", extra=self._log_extra(
                    scheduler_thread=thread.name))
        self._threads = []
        self.listener.close()
        self.db.close()
        log.info("central scheduler stopped", extra=self._log_extra())

    # ------------------------------------------------------------ the loop

    def run_once(self, *, now: datetime | None = None) -> int:
        """Claim one batch and handle every claim; return how many were claimed.

        The steps are :mod:`controller.central_pass`'s. A batch that skipped claims
        is followed at once by another, which claims the latest windows they moved
        to. ``now`` pins the time authority (tests); None reads the database's
        clock. Passes of one instance never overlap (the loop's and the listener's).
        """
        return self.passes.run(now)

    def _run_loop(self) -> None:
        failures = 0
        next_prune = time.monotonic()
        settings = self.settings
        while not self._stopping.is_set():
            # Cleared before claiming: a save during the pass wakes the next wait.
            self._wake.clear()
            try:
                count = self.run_once()
                wait = 0.0 if count >= settings.batch_size else self.seconds_to_next_due()
                failures = 0
                if time.monotonic() >= next_prune:
                    # One batch per pass, after the pass: a backlog of old records
                    # is worked off between passes, never ahead of a due task.
                    if self.prune_dispatches(max_batches=1) < PRUNE_BATCH:
                        next_prune = time.monotonic() + settings.prune_interval
                    else:
                        wait = 0.0
            except Exception as exc:
                failures += 1
                wait = backoff(failures, base=settings.retry_delay, cap=settings.max_retry_delay)
                error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "scheduler pass failed (%s); retrying in %.1f s", error, wait,
                    extra=self._log_extra(error=error, retry_in=wait),
                )
            if wait > 0:
                self.waiting.set()
                self._wake.wait(wait)
                self.waiting.clear()

    def prune_dispatches(
        self, *, now: datetime | None = None, max_batches: int | None = None
    ) -> int:
        """Delete finished dispatch records older than the retention; return how many.

        In batches of ``PRUNE_BATCH``, at most ``max_batches`` of them. ``now``
        pins the clock (tests); None reads the database's. Several instances
        may prune at once: a record is deleted once either way.
        """
        retention = self.settings.dispatch_retention
        if retention is None:
            return 0
        with Session(self.db.engine()) as session:
            before = (now or db_now(session)) - timedelta(seconds=retention)
            deleted = claims.prune_dispatches(
                session, before=before, batch=PRUNE_BATCH, max_batches=max_batches
            )
        if deleted:
            log.info("pruned old dispatch records", extra=self._log_extra(
                count=deleted, scheduled_before=before.isoformat()))
        return deleted

    def seconds_to_next_due(self) -> float:
        """Return how long to wait for the earliest due task, at most the poll interval."""
        engine = self.db.engine()
        poll = self.settings.poll_interval
        with Session(self.db.claimer or engine) as session:
            earliest = claims.earliest_next_run_at(session)
            if earliest is None:
                return poll
            now = db_now(session)
        return min(poll, max(_MIN_WAIT, (earliest - now).total_seconds()))

    def renew_leases(self) -> int:
        """Renew the leases (and records) of the claims in flight now; return how many."""
        return self.passes.in_flight.renew(lambda: Session(self.db.engine()),
                                           self.settings.lease)

    def _run_heartbeat(self) -> None:
        """Renew the leases of the claims in flight every ``renew_every`` seconds, until stopped.

        A killed instance stops renewing, so its claims are taken over about a
        lease after its last renewal; a failure here is logged and retried at
        the next beat (the lease has three beats of slack).
        """
        every = self.settings.renew_every
        while not self._stopping.wait(every):
            try:
                self.renew_leases()
            except Exception as exc:
                log.warning("renewing the leases in flight failed; retrying",
                            extra=self._log_extra(error=f"{type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------ the listener's side

    def _on_notify(self, conn: psycopg.Connection[Any]) -> None:
        """Handle a notification: claim on the listening connection, or wake the loop."""
        if self.settings.claim_on_notify:
            self._pass_on_listener(conn)
        else:
            self._wake.set()

    def _pass_on_listener(self, conn: psycopg.Connection[Any]) -> None:
        """Claim on the listening connection itself and dispatch, right after a notification.

        That backend has just delivered the notification and is awake, and this
        thread is running: no hand-off before the claim. If the loop is busy
        with a pass, it is only woken. Afterwards the loop is woken anyway, to
        pick up anything left and recompute its wait. A lost connection raises
        (the listener reconnects); any other failure is logged, and the loop's
        next pass retries.
        """
        try:
            self.passes.run_on(conn)
        except psycopg.OperationalError:
            if conn.broken or conn.closed:
                raise
            log.warning("scheduler pass after a notification failed", exc_info=True,
                        extra=self._log_extra())
        except Exception as exc:
            log.warning(
                "scheduler pass after a notification failed",
                extra=self._log_extra(error=f"{type(exc).__name__}: {exc}"),
            )
        finally:
            self._wake.set()
