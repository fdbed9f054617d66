"""The claim protocol: who dispatches each (task, scheduled time), exactly once.

Rule: this module only reads and writes. What a finished claim's task becomes
is decided before it is written, by :func:`controller.timing.plan_after_dispatch`
(the policy); every function here takes ``now`` or reads the database's clock
(Postgres ``now()``; this host's clock on SQLite), and commits its own
transaction.

The protocol, for one (task, scheduled time) and any number of instances:

1. :func:`claim_for_dispatch` leases due tasks to one worker (``FOR UPDATE SKIP
   LOCKED`` on Postgres, a single compare-and-set ``UPDATE`` on SQLite) and
   inserts each one's dispatch record, unique per (task name, scheduled time).
   A lease is held while ``now <= locked_until``; the task can be claimed again
   once ``now > locked_until``; a worker renews the leases of the claims it
   is still dispatching (:func:`renew`). Only the worker whose record insert wins
   dispatches (:attr:`DispatchOutcome.OWNED`), so an expired lease (a second
   worker claiming the same row) cannot dispatch twice. Losing the race
   returns ``[]``. A single claim is a batch of one.
2. The worker dispatches, then :func:`complete_many` writes each task's
   :class:`~controller.timing.Completion` and marks its record dispatched;
   or :func:`fail` records the error and holds the task until a retry delay
   has passed; or :func:`give_up` stops retrying that time. All are fenced on
   ``next_run_at`` still being the scheduled time, so a late worker changes
   nothing. A recurring claim whose time is already followed by another due
   window is not dispatched: :func:`skip` moves it to the latest one (the
   catch-up rule, :func:`controller.timing.plan_catch_up`).

The two databases differ in how steps 1 and 2 run, and only there: a
:class:`ClaimBackend` per dialect (:class:`PostgresClaims`, one statement from
``sql/queries.sql`` each; :class:`SqliteClaims`, SQLAlchemy Core under the
write lock), chosen once per dialect by :func:`backend_for`; they, and what a
claim is, live in :mod:`controller.claim_store`.

Crash window: a worker that dies mid-dispatch stops renewing its record; once neither its
start nor its last renewal is within ``stale_after``, another worker takes it over and
dispatches again under the same idempotency key. A worker still renewing is never doubled.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, cast

import psycopg
from sqlalchemy import (
    and_,
    bindparam,
    case,
    delete,
    func,
    literal,
    select,
    type_coerce,
    update,
)
from sqlalchemy.engine import CursorResult
from sqlmodel import Session

from controller import sql
from controller.claim_store import (
    DISPATCHES,
    ClaimBackend,
    ClaimedBatch,
    DispatchOutcome,
    PostgresClaims,
    SqliteClaims,
    _named_rows,
    _outcomes,
    _record,
    _task,
    backend_for,
)
from controller.db import db_now, transaction
from controller.models import DispatchStatus, TaskDispatch, TaskStatus, UtcDateTime
from controller.tasks import TASKS
from controller.timing import Claim, Completion

log = logging.getLogger(__name__)

__all__ = [
    "DISPATCHES", "Claim", "ClaimBackend", "ClaimedBatch", "DispatchOutcome", "PostgresClaims",
    "SqliteClaims", "backend_for",
]

def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _log_disabled(completion: Completion) -> None:
    claim = completion.claim
    log.error(
        "cannot compute a task's next run; disabled it (save it again to resume)",
        extra={"task_name": claim.name, "scheduled_at": claim.scheduled_at,
               "error": completion.error},
    )


def _log_skipped(completion: Completion, why: str) -> None:
    claim = completion.claim
    first, last = completion.first_skipped, completion.last_skipped
    log.warning(
        "skipped %d missed window(s) of task %s (%s to %s): %s; next run %s",
        completion.skipped, claim.name, first.isoformat() if first else "-",
        last.isoformat() if last else "-", why,
        completion.next_run_at.isoformat() if completion.next_run_at else "none",
        extra={"task_name": claim.name, "skipped": completion.skipped,
               "first_skipped": first, "last_skipped": last,
               "next_run_at": completion.next_run_at},
    )


def _is_broken(completion: Completion) -> bool:
    return completion.claim.is_recurring and completion.status == TaskStatus.DISABLED


# ---------------------------------------------------------------- step 1: claim


def claim_for_dispatch(
    db: Session | psycopg.Connection[Any],
    *,
    worker_id: str,
    now: datetime | None = None,
    lease: timedelta | float = 30.0,
    limit: int = 100,
    stale_after: timedelta | float = 600.0,
) -> ClaimedBatch:
    """Lease up to limit due active tasks to worker_id and record their dispatches; commits.

    Due means active, ``next_run_at <= now`` and no live lease (``locked_until``
    is null or ``< now``). The lease runs to ``now + lease`` (seconds or a
    timedelta). Each claim's dispatch record is taken over only if it failed
    or has been "dispatching" for longer than ``stale_after``. ``now=None``
    means the database's ``now()``. Claims of concurrent workers are disjoint;
    a worker that finds nothing gets ``[]``. Ordered by scheduled time, then
    name; each claim comes with what its worker should do.

    ``db`` is a session (either database) or a raw autocommit psycopg connection
    (Postgres only): the scheduler's listener claims on its own connection the
    moment a notification arrives, as that backend is awake already and the claim
    then costs no hand-off to another thread or connection.
    """
    params = {
        "now": now,
        "worker_id": worker_id,
        "lease": _seconds(lease),
        "limit": limit,
        "stale_after": _seconds(stale_after),
    }
    if isinstance(db, psycopg.Connection):
        pairs = _claim_on_connection(db, params)
    else:
        pairs = backend_for(db).claim_for_dispatch(db, params)
    if pairs:
        log.debug("claimed tasks", extra={"worker_id": worker_id, "count": len(pairs)})
    return pairs


def _claim_on_connection(conn: psycopg.Connection[Any], params: dict[str, Any]) -> ClaimedBatch:
    if not conn.autocommit:
        raise ValueError("claim_for_dispatch on a psycopg connection needs it in autocommit")
    with conn.cursor() as cursor:
        cursor.execute(sql.query("claim_for_dispatch"), params)
        columns = [column.name for column in cursor.description or ()]
        rows = cursor.fetchall()

    def read_status(names: list[str]) -> list[Any]:
        with conn.cursor(row_factory=_named_rows) as cursor:
            cursor.execute(sql.query("record_status"), {"names": names})
            return list(cursor.fetchall())

    return _outcomes(columns, rows, read_status)


def _due_time() -> Any:
    """Return the SQL time an active task becomes claimable: next_run_at or its hold's end."""
    return case(
        (and_(_task.locked_until.is_not(None), _task.locked_until > _task.next_run_at),
         _task.locked_until),
        else_=_task.next_run_at,
    )


def earliest_next_run_at(session: Session) -> datetime | None:
    """Return the earliest time an active task becomes claimable; None when none will.

    That is its ``next_run_at``, or the end of its lease or retry hold when later.
    """
    value = session.execute(
        select(type_coerce(func.min(_due_time()), UtcDateTime)).where(
            _task.status == TaskStatus.ACTIVE.value, _task.next_run_at.is_not(None)
        )
    ).scalar_one_or_none()
    return value if isinstance(value, datetime) else None


# ---------------------------------------------------------------- step 2: finish


def complete_many(
    session: Session, completions: list[Completion], *, now: datetime | None = None
) -> int:
    """Write each claim's completion and mark its dispatch record dispatched; commits.

    One transaction (one statement on Postgres) for the batch; ``now`` stamps
    ``updated_at`` and ``finished_at`` (None: the database's clock). Each task
    changes only while ``next_run_at`` is still its claim's scheduled time, so
    a slow worker whose lease expired changes nothing. Returns how many tasks
    moved. A recurring task the plan disabled (no computable next run) is
    logged at ERROR, naming it.
    """
    if not completions:
        return 0
    moved = backend_for(session).complete_many(session, completions, now)
    for completion in completions:
        if _is_broken(completion):
            _log_disabled(completion)
        if completion.skipped:
            _log_skipped(completion, "passed over while the dispatch was late")
    return moved


def _finish(
    session: Session,
    claim: Claim,
    task: dict[str, Any],
    record: dict[str, Any],
    *,
    only_dispatching: bool = False,
) -> bool:
    """Update claim's task (fenced) and dispatch record in one transaction; commits.

    The task changes only while ``next_run_at`` is still the claim's scheduled
    time; returns whether it changed.
    """
    record_of = [_record.task_name == claim.name, _record.scheduled_at == claim.scheduled_at]
    if only_dispatching:
        record_of.append(_record.status == DispatchStatus.DISPATCHING.value)
    with transaction(session):
        moved = session.execute(
            update(TASKS)
            .where(_task.id == claim.task_id, _task.next_run_at == claim.scheduled_at)
            .values(**task)
            .returning(_task.id)
        ).first()
        session.execute(update(DISPATCHES).where(*record_of).values(**record))
    return moved is not None


def fail(
    session: Session,
    claim: Claim,
    error: str,
    *,
    retry_delay: timedelta | float,
    now: datetime | None = None,
) -> bool:
    """Record that claim's dispatch failed and hold the task for retry_delay; commits.

    ``attempts`` goes up by one and ``last_error`` keeps the message; the task
    keeps its scheduled time (so the retry has the same idempotency key) and is
    claimable again once ``now + retry_delay`` has passed. The dispatch record
    is marked failed, so the retry may take it over. Fenced like
    :func:`complete_many`; False when the task moved on meanwhile.
    """
    now = now or db_now(session)
    message = error[:2000]
    return _finish(
        session,
        claim,
        {
            "locked_by": None,
            "locked_until": now + timedelta(seconds=_seconds(retry_delay)),
            "attempts": _task.attempts + 1,
            "last_error": message,
            "updated_at": now,
        },
        {"status": DispatchStatus.FAILED.value, "finished_at": now, "error": message},
        only_dispatching=True,
    )


def give_up(
    session: Session, completion: Completion, error: str, *, now: datetime | None = None
) -> bool:
    """Stop retrying a claim's dispatch: write its completion, keep its record failed; commits.

    The completion comes from :func:`controller.timing.plan_after_give_up`; the
    dispatch record stays ``failed`` with error, so the missed (task, scheduled
    time) remains on record. Fenced like :func:`complete_many`; False when the
    task moved on meanwhile.
    """
    now = now or db_now(session)
    if _is_broken(completion):
        _log_disabled(completion)
    return _finish(
        session,
        completion.claim,
        {
            "next_run_at": completion.next_run_at,
            "status": completion.status.value,
            "attempts": completion.attempts,
            "locked_by": None,
            "locked_until": None,
            "last_error": completion.error,
            "updated_at": now,
        },
        {"status": DispatchStatus.FAILED.value, "finished_at": now, "error": error},
    )


def skip(session: Session, catch_up: Completion, *, now: datetime | None = None) -> bool:
    """Skip a claim under the catch-up rule: move its task to a later window; commits.

    The completion comes from :func:`controller.timing.plan_catch_up`: the task
    moves to ``catch_up.next_run_at`` (the latest missed window, due at once;
    its lease is released so any instance claims it), ``skipped_windows`` grows
    by ``catch_up.skipped``, and the claim's dispatch record becomes
    ``skipped``, naming the windows. Logged at WARNING. Fenced like
    :func:`complete_many`; False when the task moved on meanwhile.
    """
    now = now or db_now(session)
    claim = catch_up.claim
    first, last = catch_up.first_skipped, catch_up.last_skipped
    message = (
        f"skipped: {catch_up.skipped} missed window(s) from "
        f"{first.isoformat() if first else '-'} to {last.isoformat() if last else '-'}; "
        "only the latest missed window "
        f"({catch_up.next_run_at.isoformat() if catch_up.next_run_at else '-'}) is dispatched"
    )
    moved = _finish(
        session,
        claim,
        {
            "next_run_at": catch_up.next_run_at,
            "locked_by": None,
            "locked_until": None,
            "skipped_windows": _task.skipped_windows + catch_up.skipped,
            "updated_at": now,
        },
        {"status": DispatchStatus.SKIPPED.value, "finished_at": now, "error": message},
        only_dispatching=True,
    )
    if moved:
        _log_skipped(catch_up, "only the latest missed window is dispatched")
    return moved


def renew(
    session: Session,
    held: list[Claim],
    *,
    lease: timedelta | float,
    now: datetime | None = None,
) -> int:
    """Extend the leases of claims still being dispatched, and stamp their records; commits.

    Each task's ``locked_until`` becomes ``now + lease`` while the claim's
    worker still holds it on the claim's time; each of the worker's records
    still "dispatching" gets ``renewed_at = now``, so no other instance takes
    it over (see ``stale_after``). Returns how many leases were renewed.
    """
    if not held:
        return 0
    now = now or db_now(session)
    until = now + timedelta(seconds=_seconds(lease))
    claimed_time = bindparam("claimed_time", type_=UtcDateTime)
    rows = [
        {"claimed_id": c.task_id, "claimed_name": c.name, "claimed_time": c.scheduled_at,
         "claimed_by": c.worker_id}
        for c in held
    ]
    with transaction(session):
        renewed = session.execute(
            update(TASKS)
            .where(_task.id == bindparam("claimed_id"), _task.next_run_at == claimed_time,
                   _task.locked_by == bindparam("claimed_by"))
            .values(locked_until=literal(until, UtcDateTime)),
            rows,
        )
        session.execute(
            update(DISPATCHES)
            .where(_record.task_name == bindparam("claimed_name"),
                   _record.scheduled_at == claimed_time,
                   _record.worker_id == bindparam("claimed_by"),
                   _record.status == DispatchStatus.DISPATCHING.value)
            .values(renewed_at=literal(now, UtcDateTime)),
            rows,
        )
    return int(cast(CursorResult[Any], renewed).rowcount or 0)


def release(session: Session, claims: list[Claim]) -> int:
    """Give back claims this worker will not process (e.g. on shutdown); commits.

    Only leases still held by the claim's worker on the claim's scheduled time
    are cleared (returns how many were), and the worker's dispatch records
    still "dispatching" for them are deleted: nothing was sent.
    """
    released = 0
    with transaction(session):
        for claim in claims:
            result = session.execute(
                update(TASKS)
                .where(
                    _task.id == claim.task_id,
                    _task.next_run_at == claim.scheduled_at,
                    _task.locked_by == claim.worker_id,
                )
                .values(locked_by=None, locked_until=None)
                .returning(_task.id)
            ).first()
            released += result is not None
            session.execute(
                delete(DISPATCHES).where(
                    _record.task_name == claim.name,
                    _record.scheduled_at == claim.scheduled_at,
                    _record.worker_id == claim.worker_id,
                    _record.status == DispatchStatus.DISPATCHING.value,
                )
            )
    return released


# ---------------------------------------------------------------- dispatch records


def list_dispatches(
    session: Session, name: str | None = None, *, newest: int | None = None
) -> list[TaskDispatch]:
    """Return the dispatch records (of task name, if given), by scheduled time.

    ``newest=N`` returns only the N most recently scheduled ones, newest first.
    """
    if newest is None:
        query = select(DISPATCHES).order_by(_record.scheduled_at, _record.task_name)
    else:
        query = (
            select(DISPATCHES)
            .order_by(_record.scheduled_at.desc(), _record.task_name)
            .limit(newest)
        )
    if name is not None:
        query = query.where(_record.task_name == name)
    return [TaskDispatch.model_validate(dict(r._mapping)) for r in session.execute(query)]


def prune_dispatches(
    session: Session, *, before: datetime, batch: int = 10_000, max_batches: int | None = None
) -> int:
    """Delete finished dispatch records scheduled before ``before``; return how many; commits.

    Finished means dispatched, failed or skipped: a record still ``dispatching`` is the
    exactly-once guard of a dispatch in flight and is never deleted. Deletes in
    batches of ``batch`` rows, one transaction each, so a large backlog never
    holds one long lock; ``max_batches`` stops after that many (the caller
    comes back for the rest).
    """
    deleted = 0
    batches = 0
    old = and_(
        _record.scheduled_at < literal(before, UtcDateTime),
        _record.status != DispatchStatus.DISPATCHING.value,
    )
    while True:
        pick = select(_record.id).where(old).limit(batch).scalar_subquery()
        with transaction(session):
            result = session.execute(delete(DISPATCHES).where(_record.id.in_(pick)))
            count = cast(CursorResult[Any], result).rowcount
        deleted += count or 0
        batches += 1
        if not count or count < batch or (max_batches is not None and batches >= max_batches):
            return deleted
