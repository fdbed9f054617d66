"""The central tasks: create or replace, read, delete.

Rule: on Postgres the database's clock is the time authority: a save that
needs a clock reads ``now()`` there when ``now`` is None (SQLite has no
separate server, so it reads this host's clock). Every write commits its own
transaction (:func:`controller.db.transaction`); reads do not commit. A save
wakes the schedulers (:mod:`controller.wakeups`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Table, delete, func, literal, select, type_coerce
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session

from controller.db import db_now, transaction
from controller.models import ScheduledTask, TaskIn, TaskStatus, UtcDateTime, utc_now
from controller.timing import next_run
from controller.wakeups import NOTIFY_CHANNEL, wake_local

log = logging.getLogger(__name__)

TASKS: Table = ScheduledTask.__table__  # type: ignore[attr-defined]
"""The ``scheduled_task`` table."""
_task = TASKS.c


def _task_from_row(row: Row[Any]) -> ScheduledTask:
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


def _upsert_task(session: Session, task: TaskIn, now: datetime | None) -> Row[Any]:
    """Upsert task in the open transaction (and NOTIFY on Postgres); return the stored row."""
    postgres = session.get_bind().dialect.name == "postgresql"
    # A one-shot task needs no clock; the database stamps it on Postgres.
    needs_clock = task.run_at is None and task.status != TaskStatus.DONE
    if now is None and (needs_clock or not postgres):
        now = db_now(session)
    stamp: Any = literal(now, UtcDateTime) if now else type_coerce(func.now(), UtcDateTime)
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
        "next_run_at": first_run_at(task, now=now or utc_now()),
        "locked_by": None,
        "locked_until": None,
        "attempts": 0,
        "last_error": None,
        "updated_at": stamp,
    }
    insert: Any = pg_insert(TASKS) if postgres else sqlite_insert(TASKS)
    insert = insert.values(created_at=stamp, **values)
    stmt = insert.on_conflict_do_update(
        index_elements=[_task.name],
        set_={key: insert.excluded[key] for key in values if key != "name"},
    ).returning(*_task)
    if not postgres:
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
    with transaction(session):
        rows = [_upsert_task(session, task, now) for task in tasks]
    wake_local(session)
    for row in rows:
        log.info("saved task", extra={"task_name": row.name, "next_run_at": row.next_run_at})
    return [_task_from_row(row) for row in rows]


def get_task(session: Session, name: str) -> ScheduledTask | None:
    """Return the task called name, or None."""
    row = session.execute(select(TASKS).where(_task.name == name)).first()
    return _task_from_row(row) if row else None


def list_tasks(session: Session) -> list[ScheduledTask]:
    """Return every task, sorted by name."""
    return [_task_from_row(row) for row in session.execute(select(TASKS).order_by(_task.name))]


def delete_task(session: Session, name: str) -> bool:
    """Delete the task called name; False when there was none. Commits.

    Its dispatch records stay: they are the history of what was dispatched,
    and they keep a re-created task of the same name from re-dispatching a
    (name, scheduled time) that already went out.
    """
    with transaction(session):
        deleted = session.execute(
            delete(TASKS).where(_task.name == name).returning(_task.id)
        ).first()
    return deleted is not None
