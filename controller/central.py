"""The central scheduler: claims due tasks from the store and dispatches each exactly once.

Rule: the database is the only shared state. Any number of instances may run
against one Postgres; the claim protocol (see :mod:`controller.claims`)
decides who dispatches each (task, scheduled time), and the database's clock
decides when something is due.

Each instance runs two threads:

- the loop: claim a batch, dispatch each claim, complete or fail it, then wait
  for the earliest ``next_run_at``, a wake-up, or the poll interval, whichever
  comes first;
- on Postgres, the listener (:mod:`controller.listener`): its own psycopg
  connection doing ``LISTEN sched_task``, kept up whatever happens to it. On a
  notification it runs a pass itself, claiming on that connection (its
  backend is awake already), then wakes the loop; if the loop is mid-pass it
  only wakes it. After a reconnect it wakes the loop, so tasks saved while it
  was away are picked up at once.

SQLite has no notifications: the loop polls, and a save in the same process
wakes it (:func:`controller.wakeups.subscribe_saves`).

What a finished claim's task becomes is decided here, by the pure
:func:`controller.timing.plan_after_dispatch`; the store only writes it.

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
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

import psycopg
from sqlalchemy.engine import URL, Engine
from sqlmodel import Session

from controller import claims
from controller.central_settings import (
    PRUNE_BATCH,
    CentralSettings,
    default_worker_id,
    retry_delay_from_env,
)
from controller.claims import Claim, DispatchOutcome
from controller.db import (
    connection_options,
    database_url,
    db_now,
    libpq_conninfo,
    make_engine,
)
from controller.dispatch import PrefectDispatcher, TaskDispatcher
from controller.listener import Listener, backoff
from controller.timing import (
    Completion,
    plan_after_dispatch,
    plan_after_give_up,
    plan_catch_up,
)
from controller.wakeups import subscribe_saves, unsubscribe_saves
from sched_core.errors import ConfigError

log = logging.getLogger(__name__)

_MIN_WAIT = 0.005  # never spin: a due task someone else holds frees up later

__all__ = [
    "CentralScheduler", "CentralSettings", "backoff", "emit_gave_up", "retry_delay_from_env",
]

EVENT_GAVE_UP = "sched.task.gave-up"
"""The Prefect event sent when the scheduler stops retrying a (task, scheduled time)."""
_GAVE_UP_NAMESPACE = uuid.UUID("0b6e3c1e-7f5e-4a59-9d3a-2f4b8c1d5e60")


def emit_gave_up(claim: Claim, message: str, attempts: int) -> None:
    """Send ``sched.task.gave-up`` about claim's task to Prefect; log, never raise, on failure.

    Resource ``sched.task.<name>``; payload: the task, the scheduled time, the
    attempts, the error and what became of the task. The event id comes from
    the claim's idempotency key, so two instances giving up on the same time
    send one event. Best effort: when Prefect is what failed, the event fails
    too, and the ERROR log line (and the task's ``last_error``) remain.
    """
    from controller.dispatch import prefect_api_url

    try:
        prefect_api_url()
    except ConfigError as exc:
        log.warning("the gave-up event was not sent", extra={
            "task_name": claim.name, "scheduled_at": claim.scheduled_at, "error": str(exc)})
        return
    try:
        from prefect.client.orchestration import get_client
        from prefect.events import Event

        event = Event(
            event=EVENT_GAVE_UP,
            resource={"prefect.resource.id": f"sched.task.{claim.name}",
                      "prefect.resource.name": claim.name},
            payload={
                "task": claim.name, "scheduled_at": claim.scheduled_at.isoformat(),
                "attempts": attempts, "error": message,
                "next": "moves on to its next run" if claim.is_recurring else "disabled",
                "idempotency_key": claim.idempotency_key,
            },
            id=uuid.uuid5(_GAVE_UP_NAMESPACE, claim.idempotency_key),
        )
        with get_client(sync_client=True) as client:
            client.request("POST", "/events", json=[event.model_dump(mode="json")])
    except Exception as exc:
        log.error("the gave-up event was not sent", extra={
            "task_name": claim.name, "scheduled_at": claim.scheduled_at,
            "error": f"{type(exc).__name__}: {exc}"})



class CentralScheduler:
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
        self.dispatcher: TaskDispatcher = dispatcher or PrefectDispatcher()
        self.on_give_up = on_give_up
        """Called with (claim, message, attempts) after giving up (default: the Prefect event)."""
        self.is_postgres = self.url.get_backend_name() == "postgresql"
        self.gave_up = 0
        """How many (task, scheduled time) this instance gave up on."""
        self.dispatched = 0
        """How many dispatches this instance made."""
        self.waiting = threading.Event()
        """Set while the loop is idle, waiting for work (benchmarks wait on it)."""
        self.listener = Listener(
            self._open_listen_connection,
            on_notify=self._on_notify,
            on_connect=self.wake,
            retry_delay=self.settings.retry_delay,
            max_retry_delay=self.settings.max_retry_delay,
            listen_timeout=self.settings.listen_timeout,
            health_interval=self.settings.health_interval,
            log_extra={"worker_id": self.worker_id},
        )

        self._engine: Engine | None = None
        self._claimer: Engine | None = None
        self._autocommit: Engine | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pass_lock = threading.Lock()
        self._in_flight: dict[int, Claim] = {}
        """The claims of the pass under way whose leases the heartbeat renews."""
        # (task id, scheduled time) this instance dispatched whose completion has not
        # committed (its statement failed): the next pass completes them, never
        # dispatches them again. Only the loop's and the listener's passes touch it,
        # and those never overlap.
        self._uncompleted: set[tuple[int, datetime]] = set()
        self._in_flight_lock = threading.Lock()
        self.renewals = 0
        """How many lease renewals this instance wrote (tests wait on it)."""
        self.skipped = 0
        """How many claims this instance skipped under the catch-up rule."""

    # ------------------------------------------------------------ lifecycle

    @property
    def listening(self) -> threading.Event:
        """Set while a LISTEN connection is up (tests wait on it)."""
        return self.listener.listening

    @property
    def listen_connects(self) -> int:
        """How many times the listener connected (1 + reconnects)."""
        return self.listener.connects

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
                    # The pass's session, its completion, and the heartbeat's renewal.
                    pool_size=2,
                    max_overflow=2,
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
                if self.settings.wake_on_local_saves:
                    subscribe_saves(self._engine, self._wake)
            return self._engine

    @property
    def _claim_options(self) -> str | None:
        """Server settings of the connections that claim (see the module docstring)."""
        return None if self.settings.durable_claims else "-c synchronous_commit=off"

    def _open_listen_connection(self) -> psycopg.Connection[Any]:
        settings: dict[str, Any] = {
            "application_name": self.listen_application_name,
            "connect_timeout": 10,
            "keepalives": 1,
            "keepalives_idle": 30,
            # It claims too, after each notification: the claim connections' settings.
            "options": connection_options(self._claim_options),
        }
        return psycopg.connect(libpq_conninfo(self.url), autocommit=True, **settings)

    def start(self) -> None:
        """Start the loop (and, on Postgres, the listener) in background threads."""
        if self._threads:
            raise RuntimeError("scheduler already started")
        self._stopping.clear()
        self.listener.reset()
        self._ensure_engine()
        targets = [("loop", self._run_loop), ("heartbeat", self._run_heartbeat)]
        if self.is_postgres:
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
        with self._lock:
            engine, self._engine = self._engine, None
            claimer, self._claimer = self._claimer, None
            self._autocommit = None
        if claimer is not None:
            claimer.dispose()
        if engine is not None:
            if self.settings.wake_on_local_saves:
                unsubscribe_saves(engine, self._wake)
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
        with Session(self._ensure_engine()) as session:
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
        engine = self._ensure_engine()
        poll = self.settings.poll_interval
        with Session(self._claimer or engine) as session:
            earliest = claims.earliest_next_run_at(session)
            if earliest is None:
                return poll
            now = db_now(session)
        return min(poll, max(_MIN_WAIT, (earliest - now).total_seconds()))

    def run_once(self, *, now: datetime | None = None) -> int:
        """Claim one batch and handle every claim; return how many were claimed.

        1. Claim due tasks and record their dispatches (one statement on Postgres).
        2. Skip each recurring claim already followed by another due window (the
           catch-up rule, :func:`controller.timing.plan_catch_up`); dispatch each
           other claim this worker owns; on failure record the error and hold the
           task for a backoff delay. A claim another worker is still dispatching
           is left alone; one already dispatched is only completed.
        3. Plan each finished claim (:func:`controller.timing.plan_after_dispatch`)
           and complete the batch: reschedule recurring tasks, stop one-shot ones.
           When that statement fails, the next pass completes what this instance
           dispatched without dispatching it again.

        A batch that skipped claims is followed at once by another, which
        claims the latest windows they moved to. ``now`` pins the time
        authority (tests); None reads the database's clock. Passes of one
        instance never overlap (the loop's and the listener's).
        """
        engine = self._ensure_engine()
        settings = self.settings
        claimed = 0
        with self._pass_lock:
            while True:
                # The claim is one statement: autocommit saves a BEGIN and a COMMIT round trip.
                with Session(self._claimer or engine) as session:
                    pairs = claims.claim_for_dispatch(
                        session, worker_id=self.worker_id, now=now, lease=settings.lease,
                        limit=settings.batch_size, stale_after=settings.stale_after,
                    )
                claimed += len(pairs)
                if not self._process(pairs, now=now) or self._stopping.is_set():
                    return claimed

    def _process(
        self, pairs: list[tuple[Claim, DispatchOutcome]], *, now: datetime | None
    ) -> int:
        """Dispatch the claims this worker owns and complete the batch (steps 2 and 3).

        Returns how many claims were skipped under the catch-up rule.
        """
        if not pairs:
            return 0
        engine = self._ensure_engine()
        finished: list[Claim] = []
        skipped = 0
        self._hold([c for c, outcome in pairs if outcome is not DispatchOutcome.BUSY])
        try:
            with Session(engine) as session:
                try:
                    for index, (claim, outcome) in enumerate(pairs):
                        if self._stopping.is_set():
                            rest = [c for c, _ in pairs[index:]]
                            released = claims.release(session, rest)
                            log.info("released claims on stop",
                                     extra=self._log_extra(count=released))
                            break
                        if outcome is DispatchOutcome.OWNED and self._skip(session, claim, now):
                            skipped += 1
                            continue
                        if self._handle(session, claim, outcome, now=now):
                            finished.append(claim)
                finally:
                    # One statement on Postgres, committed durably (the pool's
                    # connections), which also makes the batch's claim durable.
                    with Session(self._autocommit or engine) as completer:
                        claims.complete_many(
                            completer, self._plan(completer, finished, now), now=now
                        )
                    self._uncompleted.difference_update(
                        (claim.task_id, claim.scheduled_at) for claim in finished
                    )
        finally:
            self._release_hold(pairs)
        return skipped

    def _skip(self, session: Session, claim: Claim, now: datetime | None) -> bool:
        """Skip claim under the catch-up rule if a later window is already due; True if so."""
        if not claim.is_recurring:
            return False
        # The database's clock when the claim was made: its lease ends lease seconds later.
        at = now or claim.locked_until - timedelta(seconds=self.settings.lease)
        catch_up = plan_catch_up(claim, at)
        if catch_up is None:
            return False
        if claims.skip(session, catch_up, now=now):
            self.skipped += 1
        return True

    def _hold(self, held: list[Claim]) -> None:
        with self._in_flight_lock:
            for claim in held:
                self._in_flight[claim.task_id] = claim

    def _release_hold(self, pairs: list[tuple[Claim, DispatchOutcome]]) -> None:
        with self._in_flight_lock:
            for claim, _ in pairs:
                if self._in_flight.get(claim.task_id) is claim:
                    del self._in_flight[claim.task_id]

    def renew_leases(self) -> int:
        """Renew the leases (and records) of the claims in flight now; return how many."""
        with self._in_flight_lock:
            held = list(self._in_flight.values())
        if not held:
            return 0
        with Session(self._ensure_engine()) as session:
            renewed = claims.renew(session, held, lease=self.settings.lease)
        self.renewals += 1
        return renewed

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

    @staticmethod
    def _plan(session: Session, finished: list[Claim], now: datetime | None) -> list[Completion]:
        """Return each finished claim's completion, reading the clock only if one needs it."""
        if now is None and any(claim.is_recurring for claim in finished):
            now = db_now(session)
        return [plan_after_dispatch(claim, now) for claim in finished]

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
        if not self._pass_lock.acquire(blocking=False):
            self._wake.set()
            return
        settings = self.settings
        try:
            pairs = claims.claim_for_dispatch_on(
                conn, worker_id=self.worker_id, lease=settings.lease,
                limit=settings.batch_size, stale_after=settings.stale_after,
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
        if (claim.task_id, claim.scheduled_at) in self._uncompleted:
            log.info("dispatched by this instance before its completion failed; "
                     "completing only", extra=extra)
            return True
        try:
            self.dispatcher(claim)
        except Exception as exc:
            self._failed(session, claim, f"{type(exc).__name__}: {exc}", now, extra)
            return False
        self._uncompleted.add((claim.task_id, claim.scheduled_at))
        self.dispatched += 1
        return True

    def _failed(
        self,
        session: Session,
        claim: Claim,
        error: str,
        now: datetime | None,
        extra: dict[str, Any],
    ) -> None:
        """Record a failed dispatch: hold it for a retry, or give up after max_attempts."""
        settings = self.settings
        attempts = claim.attempts + 1
        if settings.max_attempts and attempts >= settings.max_attempts:
            now = now or db_now(session)
            completion, message = plan_after_give_up(
                claim, now, attempts=attempts, error=error
            )
            claims.give_up(session, completion, message, now=now)
            self.gave_up += 1
            log.error(
                "dispatch failed %d times; gave up on this scheduled time (%s)",
                attempts,
                "the task moves on to its next run" if claim.is_recurring
                else "the one-shot task is now disabled",
                extra={**extra, "error": error, "attempts": attempts},
            )
            if self.on_give_up is not None:
                self.on_give_up(claim, message, attempts)
            return
        delay = backoff(
            attempts, base=settings.dispatch_retry_delay, cap=settings.max_dispatch_retry_delay,
        )
        claims.fail(session, claim, error, retry_delay=delay, now=now)
        log.warning(
            "dispatch failed; will retry",
            extra={**extra, "error": error, "retry_in": delay, "attempts": attempts},
        )
