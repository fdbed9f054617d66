"""One pass of the central scheduler: claim a batch, dispatch what this worker owns, complete.

The steps (the claim protocol of :mod:`controller.claims`, from one worker's side):

1. Claim due tasks and record their dispatches (one statement on Postgres).
2. Skip each recurring claim already followed by another due window (the catch-up
   rule, :func:`controller.timing.plan_catch_up`); dispatch each other claim this
   worker owns; on failure record the error and hold the task for a backoff delay,
   or give up after ``max_attempts``. A claim another worker is still dispatching is
   left alone; one already dispatched is only completed.
3. Plan each finished claim (:func:`controller.timing.plan_after_dispatch`) and
   complete the batch: reschedule recurring tasks, stop one-shot ones. When that
   statement fails, the next pass completes what this instance dispatched without
   dispatching it again.

The leases of the claims in flight are renewed by the instance's heartbeat
(:class:`InFlight`), so a slow dispatch is never taken over while its worker lives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
from sqlmodel import Session

from controller import claims
from controller.central_db import SchedulerConnections
from controller.central_settings import CentralSettings
from controller.claims import Claim, DispatchOutcome
from controller.db import db_now
from controller.dispatch import TaskDispatcher
from controller.listener import backoff
from controller.timing import Completion, plan_after_dispatch, plan_after_give_up, plan_catch_up

log = logging.getLogger("controller.central")

Pairs = list[tuple[Claim, DispatchOutcome]]


class InFlight:
    """The claims of the pass under way, whose leases the heartbeat renews."""

    def __init__(self) -> None:
        self._held: dict[int, Claim] = {}
        self._lock = threading.Lock()
        self.renewals = 0
        """How many lease renewals this instance wrote (tests wait on it)."""

    def hold(self, held: list[Claim]) -> None:
        with self._lock:
            for claim in held:
                self._held[claim.task_id] = claim

    def release(self, pairs: Pairs) -> None:
        with self._lock:
            for claim, _ in pairs:
                if self._held.get(claim.task_id) is claim:
                    del self._held[claim.task_id]

    def renew(self, session_of: Callable[[], Session], lease: float) -> int:
        """Renew the leases (and records) of the claims held now; return how many."""
        with self._lock:
            held = list(self._held.values())
        if not held:
            return 0
        with session_of() as session:
            renewed = claims.renew(session, held, lease=lease)
        self.renewals += 1
        return renewed


class DispatchPass:
    """Runs the module's steps for one instance; the loop and the listener share it.

    Passes never overlap (``lock``): the listener's pass only wakes the loop when the
    loop is mid-pass.
    """

    def __init__(self, db: SchedulerConnections, settings: CentralSettings, worker_id: str, *,
                 dispatcher: TaskDispatcher, on_give_up: Callable[[Claim, str, int], None] | None,
                 stopping: threading.Event) -> None:
        self.db = db
        self.settings = settings
        self.worker_id = worker_id
        self.dispatcher = dispatcher
        self.on_give_up = on_give_up
        self.stopping = stopping
        self.in_flight = InFlight()
        self.lock = threading.Lock()
        self.dispatched = 0
        self.gave_up = 0
        self.skipped = 0
        # (task id, scheduled time) this instance dispatched whose completion has not
        # committed (its statement failed): the next pass completes them, never
        # dispatches them again. Only passes touch it, and those never overlap.
        self._uncompleted: set[tuple[int, datetime]] = set()

    def _extra(self, **more: Any) -> dict[str, Any]:
        return {"worker_id": self.worker_id, **more}

    def run(self, now: datetime | None) -> int:
        """Claim batches and handle them until one skips nothing; return how many were claimed."""
        engine = self.db.engine()
        settings = self.settings
        claimed = 0
        with self.lock:
            while True:
                # The claim is one statement: autocommit saves a BEGIN and a COMMIT round trip.
                with Session(self.db.claimer or engine) as session:
                    pairs = claims.claim_for_dispatch(
                        session, worker_id=self.worker_id, now=now, lease=settings.lease,
                        limit=settings.batch_size, stale_after=settings.stale_after,
                    )
                claimed += len(pairs)
                if not self.process(pairs, now=now) or self.stopping.is_set():
                    return claimed

    def run_on(self, conn: psycopg.Connection[Any]) -> bool:
        """Claim one batch on conn and handle it, unless a pass is under way; True if it ran."""
        if not self.lock.acquire(blocking=False):
            return False
        settings = self.settings
        try:
            pairs = claims.claim_for_dispatch(
                conn, worker_id=self.worker_id, lease=settings.lease,
                limit=settings.batch_size, stale_after=settings.stale_after,
            )
            self.process(pairs, now=None)
        finally:
            self.lock.release()
        return True

    def process(self, pairs: Pairs, *, now: datetime | None) -> int:
        """Dispatch the claims this worker owns and complete the batch (steps 2 and 3).

        Returns how many claims were skipped under the catch-up rule.
        """
        if not pairs:
            return 0
        engine = self.db.engine()
        finished: list[Claim] = []
        skipped = 0
        self.in_flight.hold([c for c, outcome in pairs if outcome is not DispatchOutcome.BUSY])
        try:
            with Session(engine) as session:
                try:
                    for index, (claim, outcome) in enumerate(pairs):
                        if self.stopping.is_set():
                            released = claims.release(session, [c for c, _ in pairs[index:]])
                            log.info("released claims on stop", extra=self._extra(count=released))
                            break
                        if outcome is DispatchOutcome.OWNED and self._skip(session, claim, now):
                            skipped += 1
                            continue
                        if self._handle(session, claim, outcome, now=now):
                            finished.append(claim)
                finally:
                    self._complete(finished, now)
        finally:
            self.in_flight.release(pairs)
        return skipped

    def _complete(self, finished: list[Claim], now: datetime | None) -> None:
        # One statement on Postgres, committed durably (the pool's connections), which
        # also makes the batch's claim durable.
        with Session(self.db.autocommit or self.db.engine()) as completer:
            claims.complete_many(completer, _plan(completer, finished, now), now=now)
        self._uncompleted.difference_update(
            (claim.task_id, claim.scheduled_at) for claim in finished
        )

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

    def _handle(
        self, session: Session, claim: Claim, outcome: DispatchOutcome, *, now: datetime | None
    ) -> bool:
        """Dispatch one claim if this worker owns it; return True if it is to be completed."""
        extra = self._extra(task_name=claim.name, scheduled_at=claim.scheduled_at)
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

    def _failed(self, session: Session, claim: Claim, error: str, now: datetime | None,
                extra: dict[str, Any]) -> None:
        """Record a failed dispatch: hold it for a retry, or give up after max_attempts."""
        settings = self.settings
        attempts = claim.attempts + 1
        if settings.max_attempts and attempts >= settings.max_attempts:
            now = now or db_now(session)
            completion, message = plan_after_give_up(claim, now, attempts=attempts, error=error)
            claims.give_up(session, completion, message, now=now)
            self.gave_up += 1
            log.error(
                "dispatch failed %d times; gave up on this scheduled time (%s)", attempts,
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
        log.warning("dispatch failed; will retry",
                    extra={**extra, "error": error, "retry_in": delay, "attempts": attempts})


def _plan(session: Session, finished: list[Claim], now: datetime | None) -> list[Completion]:
    """Return each finished claim's completion, reading the clock only if one needs it."""
    if now is None and any(claim.is_recurring for claim in finished):
        now = db_now(session)
    return [plan_after_dispatch(claim, now) for claim in finished]
