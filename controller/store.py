"""The central tasks' repository: task CRUD, and the claim protocol the scheduler runs.

Rule: on Postgres the database's clock is the time authority. Every function
that takes ``now`` reads ``now()`` in the database when it is None (SQLite has
no separate server, so it reads this host's clock). Every write commits its
own transaction; reads do not commit.

The claim protocol, for one (task, scheduled time) and any number of instances:

1. :func:`claim_due` leases due tasks to one worker: ``FOR UPDATE SKIP LOCKED``
   on Postgres, a single compare-and-set ``UPDATE`` on SQLite. A lease is held
   while ``now <= locked_until``; it can be claimed again once
   ``now > locked_until``. Losing the race returns ``[]``.
2. :func:`begin_dispatch` inserts the dispatch record, unique per (task name,
   scheduled time). Only the worker whose insert wins dispatches, so an
   expired lease (a second worker claiming the same row) cannot dispatch twice.
3. The worker dispatches, then :func:`complete` moves a recurring task to its
   next run (from the later of the database's now and the scheduled time) or
   marks a one-shot task done; or :func:`fail` records the error and holds the
   task until a retry delay has passed. Both are fenced on ``next_run_at``
   still being the scheduled time, so a late worker changes nothing.

The scheduler runs the same steps batched: :func:`claim_for_dispatch` (steps 1
and 2 in one statement on Postgres, ``sql/claim_for_dispatch.sql``) and
:func:`complete_many` (step 3 for a batch, ``sql/complete_many.sql``).

Crash window: a worker that dies after recording a dispatch and before
completing it leaves the record "dispatching"; after ``stale_after`` another
worker takes it over and dispatches again with the same idempotency key (a
deployment run with that key is not created twice; an event carries an id
derived from it). A worker still dispatching within ``stale_after`` is never
doubled, whatever its lease says.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, cast

import psycopg
from sqlalchemy import (
    String,
    Table,
    and_,
    bindparam,
    case,
    delete,
    func,
    literal,
    or_,
    select,
    text,
    type_coerce,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult, Engine
from sqlmodel import Session

from controller.models import (
    DispatchStatus,
    ScheduledTask,
    TaskDispatch,
    TaskIn,
    TaskStatus,
    UtcDateTime,
    utc_now,
)
from controller.timing import next_run
from sched_core.model import Schedule

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "sched_task"
"""The Postgres channel a task save notifies (payload: the task name)."""

_TASKS: Table = ScheduledTask.__table__  # type: ignore[attr-defined]
_DISPATCHES: Table = TaskDispatch.__table__  # type: ignore[attr-defined]
_T = _TASKS.c
_D = _DISPATCHES.c
_SQL_DIR = Path(__file__).resolve().parent / "sql"


def _load_sql(name: str) -> str:
    """Return sql/<name>.sql without its comment lines (psycopg placeholders, %(x)s)."""
    lines = (_SQL_DIR / f"{name}.sql").read_text("utf-8").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("--"))


_CLAIM_DUE_SQL = _load_sql("claim_due")
_CLAIM_FOR_DISPATCH_SQL = _load_sql("claim_for_dispatch")
_COMPLETE_MANY_SQL = _load_sql("complete_many")

# In-process wake-ups: a save wakes the schedulers of this process on the same
# database at once (SQLite has no NOTIFY). Keyed by the full URL, never logged.
_local_wakers: dict[str, set[threading.Event]] = {}
_wakers_lock = threading.Lock()


def _url_key(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def subscribe_saves(engine: Engine, waker: threading.Event) -> None:
    """Set waker whenever a task is saved through any engine of this process on that database."""
    with _wakers_lock:
        _local_wakers.setdefault(_url_key(engine), set()).add(waker)


def unsubscribe_saves(engine: Engine, waker: threading.Event) -> None:
    """Undo :func:`subscribe_saves`."""
    with _wakers_lock:
        wakers = _local_wakers.get(_url_key(engine))
        if wakers is not None:
            wakers.discard(waker)
            if not wakers:
                del _local_wakers[_url_key(engine)]


def _wake_local(session: Session) -> None:
    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    with _wakers_lock:
        wakers = list(_local_wakers.get(_url_key(engine), ()))
    for waker in wakers:
        waker.set()


def _driver_rows(session: Session, sql: str, params: dict[str, Any]) -> list[Any]:
    """Run one statement on the session's own psycopg connection, commit, return the rows.

    The claim statements are hot: going straight to the driver skips the SQL
    expression layer, which costs more than the statement's round trip. On an
    autocommit session the statement has committed itself and the session keeps
    its connection for the next call; otherwise the session commits.
    """
    driver = session.connection().connection.driver_connection
    assert driver is not None
    try:
        with driver.cursor() as cursor:  # plain tuples: the cheapest rows psycopg builds
            cursor.execute(sql, params)
            rows = list(cursor.fetchall())
        if not driver.autocommit:
            session.commit()
    except BaseException:
        session.rollback()
        raise
    return rows


def _is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _insert(session: Session, table: Table) -> Any:
    return pg_insert(table) if _is_postgres(session) else sqlite_insert(table)


def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def db_now(session: Session) -> datetime:
    """Return the time authority's now: Postgres ``now()``, or this host's clock on SQLite."""
    if _is_postgres(session):
        value = session.execute(select(type_coerce(func.now(), UtcDateTime))).scalar_one()
        assert isinstance(value, datetime)
        return value
    return utc_now()


# ---------------------------------------------------------------- task CRUD


def _task_from_row(row: Any) -> ScheduledTask:
    data = dict(row._mapping)
    data.pop("_notified", None)
    return ScheduledTask.model_validate(data)


def first_run_at(task: TaskIn, *, now: datetime) -> datetime | None:
    """Return when task first runs, given the time authority's now; None if never."""
    if task.status == TaskStatus.DONE:
        return None
    if task.run_at is not None:
        return task.run_at
    return next_run(cron=task.cron, schedule=task.schedule, timezone=task.timezone, after=now)


def _upsert_task(session: Session, task: TaskIn, now: datetime | None) -> Any:
    """Upsert task in the open transaction (and NOTIFY on Postgres); return the stored row."""
    # A one-shot task needs no clock; the database stamps it on Postgres.
    needs_clock = task.run_at is None and task.status != TaskStatus.DONE
    current = now or (db_now(session) if needs_clock or not _is_postgres(session) else None)
    stamp: Any = literal(current, UtcDateTime) if current else type_coerce(func.now(), UtcDateTime)
    values: dict[str, Any] = {
        "name": task.name,
        "cron": task.cron,
        "schedule": task.schedule.model_dump(mode="json") if task.schedule else None,
        "timezone": task.timezone,
        "run_at": task.run_at,
        "event": task.event,
        "deployment": task.deployment,
        "payload": task.payload,
        "status": task.status.value,
        "next_run_at": first_run_at(task, now=current or utc_now()),
        "locked_by": None,
        "locked_until": None,
        "attempts": 0,
        "last_error": None,
        "updated_at": stamp,
    }
    stmt = _insert(session, _TASKS).values(created_at=stamp, **values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_T.name],
        set_={key: stmt.excluded[key] for key in values if key != "name"},
    ).returning(*_T)
    if not _is_postgres(session):
        return session.execute(stmt).one()
    # The NOTIFY rides in the same statement: one round trip, same transaction.
    saved = stmt.cte("saved")
    return session.execute(
        select(*saved.c, func.pg_notify(NOTIFY_CHANNEL, saved.c.name).label("_notified"))
    ).one()


def save_task(session: Session, task: TaskIn, *, now: datetime | None = None) -> ScheduledTask:
    """Insert or replace the task named ``task.name`` and return the stored row; commits.

    ``next_run_at`` is computed from the database's now (or ``now``): a one-shot
    task runs at ``run_at`` (at once if that has passed); a cron or schedule task
    at its first time after now. Saving clears the lease, attempts and last error.
    On Postgres the same transaction sends ``NOTIFY sched_task, '<name>'``; after
    the commit the schedulers of this process on this database are woken too.
    Raises ValueError (from :class:`TaskIn`) for an invalid task.
    """
    return save_tasks(session, [task], now=now)[0]


def save_tasks(
    session: Session, tasks: list[TaskIn], *, now: datetime | None = None
) -> list[ScheduledTask]:
    """Save every task as :func:`save_task` does, all in one transaction; commits."""
    try:
        rows = [_upsert_task(session, task, now) for task in tasks]
        session.commit()
    except BaseException:
        session.rollback()
        raise
    _wake_local(session)
    for row in rows:
        log.info("saved task", extra={"task_name": row.name, "next_run_at": row.next_run_at})
    return [_task_from_row(row) for row in rows]


def get_task(session: Session, name: str) -> ScheduledTask | None:
    """Return the task called name, or None."""
    row = session.execute(select(_TASKS).where(_T.name == name)).first()
    return _task_from_row(row) if row else None


def list_tasks(session: Session) -> list[ScheduledTask]:
    """Return every task, sorted by name."""
    return [_task_from_row(row) for row in session.execute(select(_TASKS).order_by(_T.name))]


def delete_task(session: Session, name: str) -> bool:
    """Delete the task called name; False when there was none. Commits.

    Its dispatch records stay: they are the history of what was dispatched,
    and they keep a re-created task of the same name from re-dispatching a
    (name, scheduled time) that already went out.
    """
    try:
        deleted = session.execute(
            delete(_TASKS).where(_T.name == name).returning(_T.id)
        ).first()
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return deleted is not None


# ---------------------------------------------------------------- claim protocol


@dataclass(slots=True)
class Claim:
    """One due (task, scheduled time) leased to one worker; read-only by convention.

    Not frozen: a frozen dataclass costs three times as much to build, and a
    claim batch builds one per row on the hot path.
    """

    task_id: int
    name: str
    scheduled_at: datetime
    worker_id: str
    locked_until: datetime
    event: str | None
    deployment: str | None
    payload: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None
    schedule: dict[str, Any] | None = None
    timezone: str = "UTC"
    attempts: int = 0

    @property
    def is_recurring(self) -> bool:
        """True for a cron or schedule-shape task; False for a one-shot one."""
        return self.cron is not None or self.schedule is not None

    @property
    def idempotency_key(self) -> str:
        """Return the key of this dispatch: ``"<task>:<scheduled time, ISO UTC>"``."""
        return f"{self.name}:{self.scheduled_at.isoformat()}"

    def next_after(self, after: datetime) -> datetime | None:
        """Return this task's next run after ``after``; None for a one-shot task."""
        shape = Schedule.model_validate(self.schedule) if self.schedule is not None else None
        return next_run(cron=self.cron, schedule=shape, timezone=self.timezone, after=after)


def _utc(value: datetime) -> datetime:
    if value.tzinfo is UTC:  # the controller's connections are in UTC (db.connection_options)
        return value
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


def _claim_from_row(row: Any) -> Claim:
    """Build a Claim from a row whose first columns are ``_CLAIM_COLUMNS``, in that order.

    Positional: a claim batch builds one per row on the hot path, and plain
    tuples are the cheapest rows the driver makes (SQLAlchemy rows index too).
    """
    return Claim(
        row[0], row[1], _utc(row[2]), row[3], _utc(row[4]), row[5], row[6], row[7] or {},
        row[8], row[9], row[10], row[11],
    )


def _due_time() -> Any:
    """Return the SQL time an active task becomes claimable: next_run_at or its hold's end."""
    return case(
        (and_(_T.locked_until.is_not(None), _T.locked_until > _T.next_run_at), _T.locked_until),
        else_=_T.next_run_at,
    )


def earliest_next_run_at(session: Session) -> datetime | None:
    """Return the earliest time an active task becomes claimable; None when none will.

    That is its ``next_run_at``, or the end of its lease or retry hold when later.
    """
    value = session.execute(
        select(type_coerce(func.min(_due_time()), UtcDateTime)).where(
            _T.status == TaskStatus.ACTIVE.value, _T.next_run_at.is_not(None)
        )
    ).scalar_one_or_none()
    return value if isinstance(value, datetime) else None


_CLAIM_COLUMNS = (
    _T.id, _T.name, _T.next_run_at, _T.locked_by, _T.locked_until, _T.event,
    _T.deployment, _T.payload, _T.cron, _T.schedule, _T.timezone, _T.attempts,
)


def claim_due(
    session: Session,
    *,
    worker_id: str,
    now: datetime | None = None,
    lease: timedelta | float = 30.0,
    limit: int = 100,
) -> list[Claim]:
    """Lease up to limit due active tasks to worker_id and return them; commits.

    Due means ``next_run_at <= now`` and no live lease (``locked_until`` is null
    or ``< now``). The lease runs to ``now + lease`` (seconds or a timedelta).
    ``now=None`` means the database's ``now()`` on Postgres. Claims of
    concurrent workers are disjoint; a worker that finds nothing gets ``[]``.
    Ordered by scheduled time, then name.
    """
    lease_for = timedelta(seconds=_seconds(lease))
    if _is_postgres(session):
        params: dict[str, Any] = {
            "now": now, "worker_id": worker_id, "lease": lease_for.total_seconds(),
            "limit": limit,
        }
        rows = _driver_rows(session, _CLAIM_DUE_SQL, params)
    else:
        at = literal(now or utc_now(), UtcDateTime)
        until = literal((now or utc_now()) + lease_for, UtcDateTime)
        due = and_(
            _T.status == TaskStatus.ACTIVE.value,
            _T.next_run_at <= at,
            or_(_T.locked_until.is_(None), _T.locked_until < at),
        )
        pick = select(_T.id).where(due).order_by(_T.next_run_at, _T.id).limit(limit)
        # One UPDATE statement runs under SQLite's write lock: the re-checked
        # condition makes it a compare-and-set against a concurrent claimer.
        stmt = (
            update(_TASKS)
            .where(_T.id.in_(pick.scalar_subquery()), due)
            .values(locked_by=worker_id, locked_until=until)
            .returning(*_CLAIM_COLUMNS)
        )
        try:
            rows = list(session.execute(stmt).all())
            session.commit()
        except BaseException:
            session.rollback()
            raise
    claims = sorted((_claim_from_row(r) for r in rows), key=lambda c: (c.scheduled_at, c.name))
    if claims:
        log.debug("claimed tasks", extra={"worker_id": worker_id, "count": len(claims)})
    return claims


class DispatchOutcome(StrEnum):
    """What :func:`begin_dispatch` found for a claim."""

    OWNED = "owned"
    """This worker holds the dispatch record: dispatch, then complete or fail."""
    DONE = "done"
    """Another worker already dispatched it: complete the task, do not dispatch."""
    BUSY = "busy"
    """Another worker is dispatching it right now: leave it alone."""


def begin_dispatch(
    session: Session,
    claim: Claim,
    *,
    now: datetime | None = None,
    stale_after: timedelta | float = 600.0,
) -> DispatchOutcome:
    """Record that claim's worker is dispatching (task, scheduled time); commits.

    1. Insert the record, unique per (task name, scheduled time).
    2. On conflict, take the record over only if its dispatch failed, or if it
       has been "dispatching" for longer than stale_after (its worker died
       between recording and finishing; the dispatch carries the same
       idempotency key, so Prefect drops a repeat).
    3. If neither, report DONE (already dispatched) or BUSY (in flight elsewhere).
    """
    current = now or db_now(session)
    stale_before = current - timedelta(seconds=_seconds(stale_after))
    stmt = _insert(session, _DISPATCHES).values(
        task_name=claim.name,
        scheduled_at=claim.scheduled_at,
        worker_id=claim.worker_id,
        status=DispatchStatus.DISPATCHING.value,
        started_at=current,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[_D.task_name, _D.scheduled_at],
        set_={
            "worker_id": stmt.excluded.worker_id,
            "status": DispatchStatus.DISPATCHING.value,
            "started_at": stmt.excluded.started_at,
            "finished_at": None,
            "error": None,
        },
        where=or_(
            _D.status == DispatchStatus.FAILED.value,
            and_(
                _D.status == DispatchStatus.DISPATCHING.value,
                _D.started_at < literal(stale_before, UtcDateTime),
            ),
        ),
    ).returning(_D.id)
    try:
        owned = session.execute(stmt).first()
        status = None
        if owned is None:
            status = session.execute(
                select(_D.status).where(
                    _D.task_name == claim.name, _D.scheduled_at == claim.scheduled_at
                )
            ).scalar_one_or_none()
        session.commit()
    except BaseException:
        session.rollback()
        raise
    if owned is not None:
        return DispatchOutcome.OWNED
    if status == DispatchStatus.DISPATCHED.value:
        return DispatchOutcome.DONE
    return DispatchOutcome.BUSY


def _moved_on(claim: Claim, current: datetime) -> tuple[datetime | None, TaskStatus, str | None]:
    """Return a finished claim's next run, status and error: after the later of now and its time.

    A late dispatch never replays the times it missed; a one-shot task is done.
    A recurring task whose next run cannot be computed (e.g. a row stored before
    its cron expression was checked, or a timezone gone from the tz database)
    never raises: it stays at its scheduled time, becomes ``disabled`` with the
    reason as its error (saving it again resumes it), and an ERROR log names it,
    so it cannot hold up the other claims of its batch.
    """
    if not claim.is_recurring:
        return None, TaskStatus.DONE, None
    try:
        following = claim.next_after(max(current, claim.scheduled_at))
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        log.error(
            "cannot compute a task's next run; disabled it (save it again to resume)",
            extra={"task_name": claim.name, "scheduled_at": claim.scheduled_at, "error": reason},
        )
        error = f"disabled: cannot compute the run after {claim.scheduled_at.isoformat()}: {reason}"
        return claim.scheduled_at, TaskStatus.DISABLED, error[:2000]
    return following, TaskStatus.ACTIVE if following is not None else TaskStatus.DONE, None


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
    time, so a slow worker whose lease expired changes nothing; returns whether
    it changed.
    """
    record_of = [_D.task_name == claim.name, _D.scheduled_at == claim.scheduled_at]
    if only_dispatching:
        record_of.append(_D.status == DispatchStatus.DISPATCHING.value)
    try:
        moved = session.execute(
            update(_TASKS)
            .where(_T.id == claim.task_id, _T.next_run_at == claim.scheduled_at)
            .values(**task)
            .returning(_T.id)
        ).first()
        session.execute(update(_DISPATCHES).where(*record_of).values(**record))
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return moved is not None


def complete(session: Session, claim: Claim, *, now: datetime | None = None) -> bool:
    """Finish claim after its dispatch; commits. False when the task moved on meanwhile.

    A recurring task's next run is its first time after the later of the
    database's now and the scheduled time (a late dispatch never replays
    the times it missed); a one-shot task becomes ``done``; a recurring task
    whose next run cannot be computed becomes ``disabled`` (see
    :func:`_moved_on`). The dispatch record is marked dispatched. Fenced on
    ``next_run_at`` still being the scheduled time, so a slow worker whose
    lease expired changes nothing.
    """
    current = now or db_now(session)
    return _finish_dispatched(session, claim, current, *_moved_on(claim, current))


def _finish_dispatched(
    session: Session,
    claim: Claim,
    current: datetime,
    following: datetime | None,
    status: TaskStatus,
    error: str | None,
) -> bool:
    """Move claim's task to following with status (and error), mark its record dispatched."""
    return _finish(
        session,
        claim,
        {
            "next_run_at": following,
            "status": status.value,
            "locked_by": None,
            "locked_until": None,
            "last_run_at": claim.scheduled_at,
            "attempts": 0,
            "last_error": error,
            "updated_at": current,
        },
        {"status": DispatchStatus.DISPATCHED.value, "finished_at": current, "error": None},
    )


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
    is marked failed, so the retry may take it over. Fenced like :func:`complete`.
    """
    current = now or db_now(session)
    message = error[:2000]
    return _finish(
        session,
        claim,
        {
            "locked_by": None,
            "locked_until": current + timedelta(seconds=_seconds(retry_delay)),
            "attempts": _T.attempts + 1,
            "last_error": message,
            "updated_at": current,
        },
        {"status": DispatchStatus.FAILED.value, "finished_at": current, "error": message},
        only_dispatching=True,
    )


def give_up(
    session: Session,
    claim: Claim,
    error: str,
    *,
    attempts: int,
    now: datetime | None = None,
) -> bool:
    """Stop retrying claim's dispatch after attempts failures; commits.

    The dispatch record stays ``failed`` with the error, so the missed
    (task, scheduled time) remains on record. A recurring task moves on to its
    first time after the later of now and the scheduled time (attempts back to
    0; it becomes ``disabled`` if that cannot be computed); a one-shot task
    becomes ``disabled`` (saving it again as ``active`` retries it).
    ``last_error`` says it gave up. Fenced like :func:`complete`; False when
    the task moved on meanwhile.
    """
    current = now or db_now(session)
    message = f"gave up after {attempts} failed dispatch attempts: {error}"[:2000]
    task: dict[str, Any] = {
        "locked_by": None,
        "locked_until": None,
        "last_error": message,
        "updated_at": current,
    }
    if claim.is_recurring:
        following, status, broken = _moved_on(claim, current)
        if broken is not None:
            task["last_error"] = f"{message}; {broken}"[:2000]
        task.update(next_run_at=following, status=status.value, attempts=0)
    else:
        task.update(status=TaskStatus.DISABLED.value, attempts=attempts)
    return _finish(
        session,
        claim,
        task,
        {"status": DispatchStatus.FAILED.value, "finished_at": current, "error": message},
    )


def prune_dispatches(
    session: Session, *, before: datetime, batch: int = 10_000, max_batches: int | None = None
) -> int:
    """Delete finished dispatch records scheduled before ``before``; return how many; commits.

    Finished means dispatched or failed: a record still ``dispatching`` is the
    exactly-once guard of a dispatch in flight and is never deleted. Deletes in
    batches of ``batch`` rows, one transaction each, so a large backlog never
    holds one long lock; ``max_batches`` stops after that many (the caller
    comes back for the rest).
    """
    deleted = 0
    batches = 0
    old = and_(
        _D.scheduled_at < literal(before, UtcDateTime),
        _D.status != DispatchStatus.DISPATCHING.value,
    )
    while True:
        pick = select(_D.id).where(old).limit(batch).scalar_subquery()
        try:
            result = session.execute(delete(_DISPATCHES).where(_D.id.in_(pick)))
            count = cast(CursorResult[Any], result).rowcount
            session.commit()
        except BaseException:
            session.rollback()
            raise
        deleted += count or 0
        batches += 1
        if not count or count < batch or (max_batches is not None and batches >= max_batches):
            return deleted


def claim_for_dispatch(
    session: Session,
    *,
    worker_id: str,
    now: datetime | None = None,
    lease: timedelta | float = 30.0,
    limit: int = 100,
    stale_after: timedelta | float = 600.0,
) -> list[tuple[Claim, DispatchOutcome]]:
    """Do :func:`claim_due`, then :func:`begin_dispatch` for each claim; commits.

    On Postgres both happen in one statement (``sql/claim_for_dispatch.sql``),
    so a claim and its dispatch record cost one round trip; on SQLite the two
    functions run in turn. Returns each claim with what the worker should do.
    """
    if not _is_postgres(session):
        claims = claim_due(session, worker_id=worker_id, now=now, lease=lease, limit=limit)
        return [
            (claim, begin_dispatch(session, claim, now=now, stale_after=stale_after))
            for claim in claims
        ]
    params = _claim_for_dispatch_params(worker_id, now, lease, limit, stale_after)
    rows = _driver_rows(session, _CLAIM_FOR_DISPATCH_SQL, params)
    return _outcomes(rows, lambda sql, values: _driver_rows(session, sql, values))


def claim_for_dispatch_on(
    conn: psycopg.Connection[Any],
    *,
    worker_id: str,
    now: datetime | None = None,
    lease: timedelta | float = 30.0,
    limit: int = 100,
    stale_after: timedelta | float = 600.0,
) -> list[tuple[Claim, DispatchOutcome]]:
    """Do :func:`claim_for_dispatch` on a raw autocommit psycopg connection (Postgres only).

    The scheduler's listener runs it on its own connection the moment a
    notification arrives: that backend is awake already, so the claim costs
    no hand-off to another thread or connection.
    """
    if not conn.autocommit:
        raise ValueError("claim_for_dispatch_on needs an autocommit connection")
    params = _claim_for_dispatch_params(worker_id, now, lease, limit, stale_after)
    with conn.cursor() as cursor:
        cursor.execute(_CLAIM_FOR_DISPATCH_SQL, params)
        rows = cursor.fetchall()
    return _outcomes(rows, lambda sql, values: conn.execute(sql, values).fetchall())


def _claim_for_dispatch_params(
    worker_id: str,
    now: datetime | None,
    lease: timedelta | float,
    limit: int,
    stale_after: timedelta | float,
) -> dict[str, Any]:
    return {
        "now": now,
        "worker_id": worker_id,
        "lease": _seconds(lease),
        "limit": limit,
        "stale_after": _seconds(stale_after),
    }


_RECORD_STATUS_SQL = (
    "SELECT task_name, scheduled_at, status FROM task_dispatch WHERE task_name = ANY(%(names)s)"
)


def _outcomes(
    rows: list[Any], query: Callable[[str, dict[str, Any]], list[Any]]
) -> list[tuple[Claim, DispatchOutcome]]:
    """Pair each claimed row (``_CLAIM_COLUMNS``, then owned) with what to do with it.

    A claim whose record another worker holds is DONE if that record says
    dispatched, else BUSY; those records are read with query (one more round
    trip, only when there are any). A record a concurrent claimer has not
    committed yet is not seen: BUSY, which leaves the task alone.
    """
    claims = [(_claim_from_row(row), bool(row[12])) for row in rows]
    others = [claim.name for claim, owned in claims if not owned]
    status: dict[tuple[str, datetime], str] = {}
    if others:
        status = {(r[0], _utc(r[1])): r[2] for r in query(_RECORD_STATUS_SQL, {"names": others})}
    result: list[tuple[Claim, DispatchOutcome]] = []
    for claim, owned in claims:
        if owned:
            outcome = DispatchOutcome.OWNED
        elif status.get((claim.name, claim.scheduled_at)) == DispatchStatus.DISPATCHED.value:
            outcome = DispatchOutcome.DONE
        else:
            outcome = DispatchOutcome.BUSY
        result.append((claim, outcome))
    return result


def complete_many(session: Session, claims: list[Claim], *, now: datetime | None = None) -> None:
    """Do :func:`complete` for every claim in one transaction (one clock read); commits.

    A claim whose next run cannot be computed is left out of that transaction
    and completed on its own afterwards, disabled with the reason (see
    :func:`_moved_on`): one broken task never holds up the rest of its batch.
    """
    if not claims:
        return
    postgres = _is_postgres(session)
    recurring = any(claim.is_recurring for claim in claims)
    # Only a recurring task needs the clock here; on Postgres the statement reads it.
    current = now or (db_now(session) if recurring or not postgres else None)
    tasks: list[dict[str, Any]] = []
    broken: list[tuple[Claim, datetime | None, TaskStatus, str]] = []
    for claim in claims:
        if claim.is_recurring:
            assert current is not None
            following, status, error = _moved_on(claim, current)
            if error is not None:
                broken.append((claim, following, status, error))
                continue
        else:
            following, status = None, TaskStatus.DONE
        tasks.append({
            "b_id": claim.task_id,
            "b_name": claim.name,
            "b_scheduled": claim.scheduled_at,
            "b_next": following,
            "b_status": status.value,
        })
    if tasks and postgres:
        params = {
            "now": current,
            "ids": [t["b_id"] for t in tasks],
            "names": [t["b_name"] for t in tasks],
            "scheduled": [t["b_scheduled"] for t in tasks],
            "following": [t["b_next"] for t in tasks],
            "statuses": [t["b_status"] for t in tasks],
        }
        _driver_rows(session, _COMPLETE_MANY_SQL, params)
    elif tasks:
        _complete_batch_sqlite(session, tasks, current)
    for claim, following, status, error in broken:
        assert current is not None
        _finish_dispatched(session, claim, current, following, status, error)


def _complete_batch_sqlite(
    session: Session, tasks: list[dict[str, Any]], current: datetime | None
) -> None:
    """Complete the batch rows of :func:`complete_many` on SQLite, in one transaction."""
    scheduled = bindparam("b_scheduled", type_=UtcDateTime)
    try:
        session.execute(
            update(_TASKS)
            .where(_T.id == bindparam("b_id"), _T.next_run_at == scheduled)
            .values(
                next_run_at=bindparam("b_next", type_=UtcDateTime),
                status=bindparam("b_status", type_=String),
                locked_by=None,
                locked_until=None,
                last_run_at=scheduled,
                attempts=0,
                last_error=None,
                updated_at=literal(current or utc_now(), UtcDateTime),
            ),
            tasks,
        )
        session.execute(
            update(_DISPATCHES)
            .where(_D.task_name == bindparam("b_name"), _D.scheduled_at == scheduled)
            .values(
                status=DispatchStatus.DISPATCHED.value,
                finished_at=literal(current or utc_now(), UtcDateTime),
                error=None,
            ),
            [{"b_name": t["b_name"], "b_scheduled": t["b_scheduled"]} for t in tasks],
        )
        session.commit()
    except BaseException:
        session.rollback()
        raise


def release(session: Session, claims: list[Claim]) -> int:
    """Give back claims this worker will not process (e.g. on shutdown); commits.

    Only leases still held by the claim's worker on the claim's scheduled time
    are cleared (returns how many were), and the worker's dispatch records
    still "dispatching" for them are deleted: nothing was sent.
    """
    released = 0
    try:
        for claim in claims:
            result = session.execute(
                update(_TASKS)
                .where(
                    _T.id == claim.task_id,
                    _T.next_run_at == claim.scheduled_at,
                    _T.locked_by == claim.worker_id,
                )
                .values(locked_by=None, locked_until=None)
                .returning(_T.id)
            ).first()
            released += result is not None
            session.execute(
                delete(_DISPATCHES).where(
                    _D.task_name == claim.name,
                    _D.scheduled_at == claim.scheduled_at,
                    _D.worker_id == claim.worker_id,
                    _D.status == DispatchStatus.DISPATCHING.value,
                )
            )
        session.commit()
    except BaseException:
        session.rollback()
        raise
    return released


def list_dispatches(
    session: Session, name: str | None = None, *, newest: int | None = None
) -> list[TaskDispatch]:
    """Return the dispatch records (of task name, if given), by scheduled time.

    ``newest=N`` returns only the N most recently scheduled ones, newest first.
    """
    if newest is None:
        query = select(_DISPATCHES).order_by(_D.scheduled_at, _D.task_name)
    else:
        query = select(_DISPATCHES).order_by(_D.scheduled_at.desc(), _D.task_name).limit(newest)
    if name is not None:
        query = query.where(_D.task_name == name)
    return [TaskDispatch.model_validate(dict(r._mapping)) for r in session.execute(query)]


def server_version(session: Session) -> str:
    """Return the database server's version text (for logs and benchmarks)."""
    if _is_postgres(session):
        return str(session.execute(text("SHOW server_version")).scalar_one())
    return "sqlite " + str(session.execute(text("select sqlite_version()")).scalar_one())
