"""The central scheduler: claims due tasks from the store and dispatches each exactly once.

Rule: the database is the only shared state. Any number of instances may run
against one Postgres; the store's claim protocol (see :mod:`controller.store`)
decides who dispatches each (task, scheduled time), and the database's clock
decides when something is due.

Each instance runs two threads:

- the loop: claim a batch, dispatch each claim, complete or fail it, then wait
  for the earliest ``next_run_at``, a wake-up, or the poll interval, whichever
  comes first;
- on Postgres, the listener: its own psycopg connection doing
  ``LISTEN sched_task``. On a notification it runs a pass itself, claiming on
  that connection (its backend is awake already), then wakes the loop; if the
  loop is mid-pass it only wakes it. After any loss it
  reconnects with capped exponential backoff (base ``SCHED_RETRY_DELAY``
  seconds), into a temporary variable that replaces the old connection only
  once ``LISTEN`` succeeded, closes the old one, and wakes the loop so tasks
  saved while it was away are picked up at once.

SQLite has no notifications: the loop polls, and a save in the same process
wakes it (:func:`controller.store.subscribe_saves`).

Commits on Postgres: the claim (lease + dispatch record) commits asynchronously
(``synchronous_commit = off`` on the two connections that claim), so a
dispatch starts without waiting for the disk's flush; the completion and a
failure commit durably, and that flush also makes the earlier claim durable
(the WAL is written in order). Only a crash of the database server between a
claim and its completion can lose the claim, and that is safe: the
(task, scheduled time) is claimed again and dispatched with the same
idempotency key, which Prefect deduplicates (one event per id, one flow run
per key), exactly as after a durable claim whose worker died mid-dispatch.
Concurrent instances see an asynchronous commit at once, so it changes
nothing for them. ``durable_claims=True`` makes the claim wait for the flush too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import psycopg
from sqlalchemy.engine import URL, Engine
from sqlmodel import Session

from controller import store
from controller.db import connection_options, database_url, libpq_conninfo, make_engine
from controller.defaults import DEFAULT_DISPATCH_RETENTION, DEFAULT_MAX_ATTEMPTS
from controller.dispatch import Dispatcher, PrefectDispatcher
from controller.store import Claim, DispatchOutcome
from sched_core.errors import ConfigError

log = logging.getLogger(__name__)

RETRY_DELAY_ENV = "SCHED_RETRY_DELAY"
"""Seconds before the first reconnect (or retry) after a failure; doubles up to a cap."""

DEFAULT_RETRY_DELAY = 1.0
PRUNE_BATCH = 10_000
"""Dispatch records deleted per transaction when pruning."""
_MIN_WAIT = 0.005  # never spin: a due task someone else holds frees up later


def retry_delay_from_env(default: float = DEFAULT_RETRY_DELAY) -> float:
    """Return ``SCHED_RETRY_DELAY`` in seconds (default when unset); ConfigError if invalid."""
    text = os.environ.get(RETRY_DELAY_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{RETRY_DELAY_ENV}={text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{RETRY_DELAY_ENV}={text!r} must be a positive number of seconds")
    return value


def backoff(failures: int, *, base: float, cap: float) -> float:
    """Return the wait before retry number failures (1, 2, ...): base doubling, at most cap."""
    if failures < 1:
        return 0.0
    return float(min(cap, base * 2 ** min(failures - 1, 32)))


def default_worker_id() -> str:
    """Return a worker id unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _close_quietly(conn: psycopg.Connection[Any] | None) -> None:
    if conn is None:
        return
    try:
        conn.close()
    except Exception:  # pragma: no cover - closing a broken connection can only fail quietly
        log.debug("closing a broken listen connection failed", exc_info=True)


class CentralScheduler:
    """Claim and dispatch due tasks until stopped; see the module docstring.

    ``database`` is an engine (only its URL is used: the scheduler opens and
    disposes its own), a URL, or None for ``SCHED_DATABASE_URL`` / the SQLite
    default. ``dispatcher`` defaults to :class:`PrefectDispatcher`. Times are
    seconds: ``poll_interval`` (the longest wait between passes), ``lease``
    (how long a claim is held), ``retry_delay`` (reconnect/retry backoff base,
    default ``SCHED_RETRY_DELAY`` or 1 s, capped at ``max_retry_delay``),
    ``dispatch_retry_delay`` (backoff base after a failed dispatch) and
    ``stale_after`` (when a dispatch record left "dispatching" is taken over).
    After ``max_attempts`` failed dispatches of one (task, scheduled time) it
    gives up on that time (:func:`controller.store.give_up`: a recurring task
    moves on to its next run, a one-shot task is disabled, the failed dispatch
    record stays; 0 retries forever). Every ``prune_interval`` seconds the loop
    deletes finished dispatch records scheduled more than ``dispatch_retention``
    seconds ago (None keeps them all).
    With ``claim_on_notify`` (the default) the listener thread claims on its own
    connection as soon as a notification arrives, instead of waking the loop.
    ``durable_claims`` makes claims wait for the WAL flush (see the module
    docstring for why the default does not).

    ``start()`` runs it in background threads, ``stop()`` ends them and closes
    every connection it opened; it is also a context manager. ``run_once()``
    runs a single pass in the calling thread (tests).
    """

    def __init__(
        self,
        database: Engine | str | URL | None = None,
        *,
        worker_id: str | None = None,
        dispatcher: Dispatcher | None = None,
        poll_interval: float = 5.0,
        lease: float = 60.0,
        batch_size: int = 100,
        retry_delay: float | None = None,
        max_retry_delay: float = 30.0,
        dispatch_retry_delay: float = 10.0,
        max_dispatch_retry_delay: float = 600.0,
        stale_after: float = 600.0,
        listen_timeout: float = 0.25,
        health_interval: float = 30.0,
        wake_on_local_saves: bool = True,
        claim_on_notify: bool = True,
        durable_claims: bool = False,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        dispatch_retention: float | None = DEFAULT_DISPATCH_RETENTION,
        prune_interval: float = 3600.0,
    ) -> None:
        if max_attempts < 0:
            raise ConfigError(f"max_attempts={max_attempts} must be 0 (no limit) or more")
        if dispatch_retention is not None and not dispatch_retention > 0:
            raise ConfigError(
                f"dispatch_retention={dispatch_retention} must be a positive number of seconds"
            )
        self.url: URL = database.url if isinstance(database, Engine) else database_url(database)
        self.worker_id = worker_id or default_worker_id()
        self.dispatcher: Dispatcher = dispatcher or PrefectDispatcher()
        self.poll_interval = poll_interval
        self.lease = lease
        self.batch_size = batch_size
        self.retry_delay = retry_delay if retry_delay is not None else retry_delay_from_env()
        self.max_retry_delay = max_retry_delay
        self.dispatch_retry_delay = dispatch_retry_delay
        self.max_dispatch_retry_delay = max_dispatch_retry_delay
        self.stale_after = stale_after
        self.listen_timeout = listen_timeout
        self.health_interval = health_interval
        self.wake_on_local_saves = wake_on_local_saves
        self.claim_on_notify = claim_on_notify
        self.durable_claims = durable_claims
        self.max_attempts = max_attempts
        self.dispatch_retention = dispatch_retention
        self.prune_interval = prune_interval
        self.gave_up = 0
        """How many (task, scheduled time) this instance gave up on."""
        self.is_postgres = self.url.get_backend_name() == "postgresql"

        self.listen_connects = 0
        """How many times the listener connected (1 + reconnects)."""
        self.listening = threading.Event()
        """Set while a LISTEN connection is up (tests wait on it)."""
        self.dispatched = 0
        """How many dispatches this instance made."""
        self.waiting = threading.Event()
        """Set while the loop is idle, waiting for work (benchmarks wait on it)."""

        self._engine: Engine | None = None
        self._claimer: Engine | None = None
        self._autocommit: Engine | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listen_conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._pass_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    @property
    def application_name(self) -> str:
        """The Postgres application_name of this instance's pooled connections."""
        return f"sched-central:{self.worker_id}"[:63]

    @property
    def listen_application_name(self) -> str:
        """The Postgres application_name of this instance's LISTEN connection."""
        return f"sched-listen:{self.worker_id}"[:63]

    def _log_extra(self, **more: Any) -> dict[str, Any]:
        return {"worker_id": self.worker_id, **more}

    def _ensure_engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                self._engine = make_engine(
                    self.url,
                    application_name=self.application_name,
                    pool_size=2,
                    max_overflow=1,
                    pool_pre_ping=False,
                )
                if self.is_postgres:
                    self._autocommit = self._engine.execution_options(
                        isolation_level="AUTOCOMMIT"
                    )
                    # One connection for the loop's claims and wake-up lookups (both
                    # on the loop thread); each claim is one statement, so autocommit.
                    self._claimer = make_engine(
                        self.url,
                        application_name=self.application_name,
                        pool_size=1,
                        max_overflow=0,
                        pool_pre_ping=False,
                        options=self._claim_options,
                        isolation_level="AUTOCOMMIT",
                    )
                if self.wake_on_local_saves:
                    store.subscribe_saves(self._engine, self._wake)
            return self._engine

    @property
    def _claim_options(self) -> str | None:
        """Server settings of the connections that claim (see the module docstring)."""
        return None if self.durable_claims else "-c synchronous_commit=off"

    def start(self) -> None:
        """Start the loop (and, on Postgres, the listener) in background threads."""
        if self._threads:
            raise RuntimeError("scheduler already started")
        self._stopping.clear()
        self._ensure_engine()
        targets = [("loop", self._run_loop)]
        if self.is_postgres:
            targets.insert(0, ("listen", self._run_listener))
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
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():  # pragma: no cover - a dispatcher that never returns
                log.error("scheduler thread did not stop", extra=self._log_extra(
                    scheduler_thread=thread.name))
        self._threads = []
        with self._lock:
            conn, self._listen_conn = self._listen_conn, None
            engine, self._engine = self._engine, None
            claimer, self._claimer = self._claimer, None
            self._autocommit = None
        _close_quietly(conn)
        self.listening.clear()
        if claimer is not None:
            claimer.dispose()
        if engine is not None:
            if self.wake_on_local_saves:
                store.unsubscribe_saves(engine, self._wake)
            engine.dispose()
        log.info("central scheduler stopped", extra=self._log_extra())

    def __enter__(self) -> CentralScheduler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------ the loop

    def _run_loop(self) -> None:
        failures = 0
        next_prune = time.monotonic()
        while not self._stopping.is_set():
            # Cleared before claiming: a save during the pass wakes the next wait.
            self._wake.clear()
            try:
                count = self.run_once()
                wait = 0.0 if count >= self.batch_size else self.seconds_to_next_due()
                failures = 0
                if time.monotonic() >= next_prune:
                    # One batch per pass, after the pass: a backlog of old records
                    # is worked off between passes, never ahead of a due task.
                    if self.prune_dispatches(max_batches=1) < PRUNE_BATCH:
                        next_prune = time.monotonic() + self.prune_interval
                    else:
                        wait = 0.0
            except Exception as exc:
                failures += 1
                wait = backoff(failures, base=self.retry_delay, cap=self.max_retry_delay)
                log.warning(
                    "scheduler pass failed; retrying",
                    extra=self._log_extra(error=f"{type(exc).__name__}: {exc}", retry_in=wait),
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
        if self.dispatch_retention is None:
            return 0
        with Session(self._ensure_engine()) as session:
            current = now or store.db_now(session)
            before = current - timedelta(seconds=self.dispatch_retention)
            deleted = store.prune_dispatches(
                session, before=before, batch=PRUNE_BATCH, max_batches=max_batches
            )
        if deleted:
            log.info("pruned old dispatch records", extra=self._log_extra(
                count=deleted, scheduled_before=before.isoformat()))
        return deleted

    def seconds_to_next_due(self) -> float:
        """Return how long to wait for the earliest due task, at most the poll interval."""
        engine = self._ensure_engine()
        with Session(self._claimer or engine) as session:
            earliest = store.earliest_next_run_at(session)
            if earliest is None:
                return self.poll_interval
            now = store.db_now(session)
        return min(self.poll_interval, max(_MIN_WAIT, (earliest - now).total_seconds()))

    def run_once(self, *, now: datetime | None = None) -> int:
        """Claim one batch and handle every claim; return how many were claimed.

        1. Claim due tasks and record their dispatches (one statement on Postgres).
        2. Dispatch each claim this worker owns; on failure record the error and
           hold the task for a backoff delay. A claim another worker is still
           dispatching is left alone; one already dispatched is only completed.
        3. Complete the batch: reschedule recurring tasks, stop one-shot ones.

        ``now`` pins the time authority (tests); None reads the database's clock.
        Passes of one instance never overlap (the loop's and the listener's).
        """
        engine = self._ensure_engine()
        with self._pass_lock:
            # The claim is one statement: autocommit saves a BEGIN and a COMMIT round trip.
            with Session(self._claimer or engine) as session:
                pairs = store.claim_for_dispatch(
                    session, worker_id=self.worker_id, now=now, lease=self.lease,
                    limit=self.batch_size, stale_after=self.stale_after,
                )
            self._process(pairs, now=now)
        return len(pairs)

    def _process(
        self, pairs: list[tuple[Claim, DispatchOutcome]], *, now: datetime | None
    ) -> None:
        """Dispatch the claims this worker owns and complete the batch (steps 2 and 3)."""
        if not pairs:
            return
        engine = self._ensure_engine()
        finished: list[Claim] = []
        with Session(engine) as session:
            try:
                for index, (claim, outcome) in enumerate(pairs):
                    if self._stopping.is_set():
                        rest = [c for c, _ in pairs[index:]]
                        released = store.release(session, rest)
                        log.info("released claims on stop",
                                 extra=self._log_extra(count=released))
                        break
                    if self._handle(session, claim, outcome, now=now):
                        finished.append(claim)
            finally:
                # One statement on Postgres, committed durably (the pool's
                # connections), which also makes the batch's claim durable.
                with Session(self._autocommit or engine) as completer:
                    store.complete_many(completer, finished, now=now)

    def _pass_on_listener(self, conn: psycopg.Connection[Any]) -> None:
        """Claim on the listening connection itself and dispatch, right after a notification.

        That backend has just delivered the notification and is awake, and this
        thread is running: no hand-off before the claim. If the loop is busy
        with a pass, it is only woken. Afterwards the loop is woken anyway, to
        pick up anything left and recompute its wait. A lost connection raises
        (the listener reconnects); any other failure is logged, and the loop's
        next pass retries.
        """
        if not self._pass_lock.acquire(blocking=False):
            self._wake.set()
            return
        try:
            pairs = store.claim_for_dispatch_on(
                conn, worker_id=self.worker_id, lease=self.lease, limit=self.batch_size,
                stale_after=self.stale_after,
            )
            self._process(pairs, now=None)
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
            self._pass_lock.release()
            self._wake.set()

    def _handle(
        self, session: Session, claim: Claim, outcome: DispatchOutcome, *, now: datetime | None
    ) -> bool:
        """Dispatch one claim if this worker owns it; return True if it is to be completed."""
        extra = self._log_extra(task_name=claim.name, scheduled_at=claim.scheduled_at)
        if outcome is DispatchOutcome.BUSY:
            log.info("dispatch in flight elsewhere; skipped", extra=extra)
            return False
        if outcome is DispatchOutcome.DONE:
            log.info("already dispatched; completing only", extra=extra)
            return True
        try:
            self.dispatcher(claim)
        except Exception as exc:
            attempts = claim.attempts + 1
            error = f"{type(exc).__name__}: {exc}"
            if self.max_attempts and attempts >= self.max_attempts:
                store.give_up(session, claim, error, attempts=attempts, now=now)
                self.gave_up += 1
                log.error(
                    "dispatch failed %d times; gave up on this scheduled time (%s)",
                    attempts,
                    "the task moves on to its next run" if claim.is_recurring
                    else "the one-shot task is now disabled",
                    extra={**extra, "error": error, "attempts": attempts},
                )
                return False
            delay = backoff(
                attempts, base=self.dispatch_retry_delay, cap=self.max_dispatch_retry_delay,
            )
            store.fail(session, claim, error, retry_delay=delay, now=now)
            log.warning(
                "dispatch failed; will retry",
                extra={**extra, "error": error, "retry_in": delay, "attempts": attempts},
            )
            return False
        self.dispatched += 1
        return True

    # ------------------------------------------------------------ the listener

    def _connect_listener(self) -> psycopg.Connection[Any]:
        """Return a new connection already listening; close it and raise on any failure."""
        settings: dict[str, Any] = {
            "application_name": self.listen_application_name,
            "connect_timeout": 10,
            "keepalives": 1,
            "keepalives_idle": 30,
        }
        # It claims too, after each notification: the claim connections' settings.
        settings["options"] = connection_options(self._claim_options)
        conn = psycopg.connect(libpq_conninfo(self.url), autocommit=True, **settings)
        try:
            conn.execute(f"LISTEN {store.NOTIFY_CHANNEL}")
        except BaseException:
            _close_quietly(conn)
            raise
        return conn

    def _run_listener(self) -> None:
        failures = 0
        try:
            while not self._stopping.is_set():
                if failures:
                    delay = backoff(failures, base=self.retry_delay, cap=self.max_retry_delay)
                    if self._stopping.wait(delay):
                        break
                try:
                    fresh = self._connect_listener()
                except Exception as exc:
                    failures += 1
                    log.warning(
                        "listen connection failed; retrying",
                        extra=self._log_extra(error=f"{type(exc).__name__}: {exc}",
                                              failures=failures),
                    )
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        _close_quietly(fresh)
                        break
                    old, self._listen_conn = self._listen_conn, fresh
                _close_quietly(old)
                self.listen_connects += 1
                if self.listen_connects > 1:
                    log.info("listen connection re-established", extra=self._log_extra(
                        failures=failures))
                failures = 0
                self.listening.set()
                # Tasks saved while we were not listening: look now, not at the next poll.
                self._wake.set()
                try:
                    self._listen(fresh)
                except Exception as exc:
                    failures = 1
                    log.warning(
                        "listen connection lost; reconnecting",
                        extra=self._log_extra(error=f"{type(exc).__name__}: {exc}"),
                    )
                finally:
                    self.listening.clear()
                    with self._lock:
                        if self._listen_conn is fresh:
                            self._listen_conn = None
                    _close_quietly(fresh)
        finally:
            self.listening.clear()

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        """Wake the loop on every notification until stopped; raise when conn is lost."""
        last_check = time.monotonic()
        while not self._stopping.is_set():
            notified = False
            for _notify in conn.notifies(timeout=self.listen_timeout, stop_after=1):
                notified = True
            if notified and not self._stopping.is_set():
                if self.claim_on_notify:
                    self._pass_on_listener(conn)
                else:
                    self._wake.set()
            if time.monotonic() - last_check >= self.health_interval:
                # A silent network loss shows up here rather than never.
                conn.execute("SELECT 1")
                last_check = time.monotonic()
            if conn.closed:
                raise psycopg.OperationalError("listen connection closed")

