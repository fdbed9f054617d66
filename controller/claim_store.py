"""What a claim is, and how each database claims and completes (steps 1 and 2 of
:mod:`controller.claims`, whose docstring is the protocol).

A :class:`ClaimBackend` per dialect: :class:`PostgresClaims` (one statement from
``sql/queries.sql`` each, run on the driver's own connection: the claim is hot) and
:class:`SqliteClaims` (SQLAlchemy Core under SQLite's write lock, where one ``UPDATE``
is the compare-and-set), chosen once per dialect by :func:`backend_for`. Both give
the same :data:`ClaimedBatch`: each claim with what its worker should do
(:class:`DispatchOutcome`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol, cast

from sqlalchemy import (
    String,
    Table,
    and_,
    bindparam,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult
from sqlmodel import Session

from controller import sql
from controller.db import transaction
from controller.models import DispatchStatus, TaskDispatch, TaskStatus, UtcDateTime, utc_now
from controller.tasks import TASKS
from controller.timing import Claim, Completion

log = logging.getLogger(__name__)

DISPATCHES: Table = TaskDispatch.__table__  # type: ignore[attr-defined]
"""The ``task_dispatch`` table."""
_task = TASKS.c
_record = DISPATCHES.c


class DispatchOutcome(StrEnum):
    """What a worker found for its claim when it recorded the dispatch."""

    OWNED = "owned"
    """This worker holds the dispatch record: dispatch, then complete or fail."""
    DONE = "done"
    """Another worker already dispatched it: complete the task, do not dispatch."""
    BUSY = "busy"
    """Another worker is dispatching it right now: leave it alone."""


ClaimedBatch = list[tuple[Claim, DispatchOutcome]]
"""Claims with what their worker should do, by scheduled time, then name."""


def _utc(value: datetime) -> datetime:
    if value.tzinfo is UTC:  # the controller's connections are in UTC (db.connection_options)
        return value
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


_CLAIM_COLUMNS = (
    _task.id, _task.name, _task.next_run_at, _task.locked_by, _task.locked_until, _task.event,
    _task.deployment, _task.payload, _task.cron, _task.schedule, _task.timezone, _task.attempts,
)


def _claim_reader(columns: Sequence[str]) -> Callable[[Sequence[Any]], Claim]:
    """Return a builder of Claims from rows whose columns are named columns (in any order).

    The positions are looked up by name once per batch; building a claim then
    indexes a plain tuple, the cheapest row the driver makes.
    """
    at = {name: index for index, name in enumerate(columns)}
    i_id, i_name, i_next, i_by, i_until = (
        at["id"], at["name"], at["next_run_at"], at["locked_by"], at["locked_until"]
    )
    i_event, i_deployment, i_payload, i_cron, i_schedule, i_zone, i_attempts = (
        at["event"], at["deployment"], at["payload"], at["cron"], at["schedule"],
        at["timezone"], at["attempts"],
    )

    def read(row: Sequence[Any]) -> Claim:
        return Claim(
            row[i_id], row[i_name], _utc(row[i_next]), row[i_by], _utc(row[i_until]),
            row[i_event], row[i_deployment], row[i_payload] or {}, row[i_cron],
            row[i_schedule], row[i_zone], row[i_attempts],
        )

    return read


class ClaimBackend(Protocol):
    """How one database runs the claim (step 1) and the batch completion (step 2)."""

    def claim_for_dispatch(self, session: Session, params: dict[str, Any]) -> ClaimedBatch:
        """Claim and record per params (see :func:`claim_for_dispatch`); commits."""
        ...

    def complete_many(
        self, session: Session, completions: list[Completion], now: datetime | None
    ) -> int:
        """Write completions and mark their records dispatched; return tasks moved; commits."""
        ...


def _driver_rows(
    session: Session, query: str, params: dict[str, Any]
) -> tuple[list[str], list[Any]]:
    """Run one statement on the session's own psycopg connection, commit; return (columns, rows).

    The claim statements are hot: going straight to the driver skips the SQL
    expression layer, which costs more than the statement's round trip. On an
    autocommit session the statement has committed itself and the session keeps
    its connection for the next call; otherwise the session commits.
    """
    driver = session.connection().connection.driver_connection
    assert driver is not None
    # Plain tuples: the cheapest rows psycopg builds.
    with transaction(session, commit=not driver.autocommit), driver.cursor() as cursor:
        cursor.execute(query, params)
        columns = [column.name for column in cursor.description or ()]
        rows = list(cursor.fetchall())
    return columns, rows


def _outcomes(
    columns: list[str], rows: list[Any], read_status: Callable[[list[str]], list[Any]]
) -> ClaimedBatch:
    """Pair each claimed row (claim columns and ``owned``) with what to do with it.

    A claim whose record another worker holds is DONE if that record says
    dispatched, else BUSY; those records are read with read_status (one more
    round trip, only when there are any). A record a concurrent claimer has
    not committed yet is not seen: BUSY, which leaves the task alone.
    """
    read = _claim_reader(columns)
    i_owned = columns.index("owned")
    claims = [(read(row), bool(row[i_owned])) for row in rows]
    others = [claim.name for claim, owned in claims if not owned]
    status: dict[tuple[str, datetime], str] = {}
    if others:
        status = {
            (r.task_name, _utc(r.scheduled_at)): r.status for r in read_status(others)
        }
    result: ClaimedBatch = []
    for claim, owned in claims:
        if owned:
            outcome = DispatchOutcome.OWNED
        elif status.get((claim.name, claim.scheduled_at)) == DispatchStatus.DISPATCHED.value:
            outcome = DispatchOutcome.DONE
        else:
            outcome = DispatchOutcome.BUSY
        result.append((claim, outcome))
    return result


class PostgresClaims:
    """Each step is one statement of ``sql/queries.sql``, run on the driver's connection."""

    def claim_for_dispatch(self, session: Session, params: dict[str, Any]) -> ClaimedBatch:
        columns, rows = _driver_rows(session, sql.query("claim_for_dispatch"), params)

        def read_status(names: list[str]) -> list[Any]:
            driver = session.connection().connection.driver_connection
            assert driver is not None
            with (
                transaction(session, commit=not driver.autocommit),
                driver.cursor(row_factory=_named_rows) as cursor,
            ):
                cursor.execute(sql.query("record_status"), {"names": names})
                return list(cursor.fetchall())

        return _outcomes(columns, rows, read_status)

    def complete_many(
        self, session: Session, completions: list[Completion], now: datetime | None
    ) -> int:
        params = {
            "now": now,
            "ids": [c.claim.task_id for c in completions],
            "names": [c.claim.name for c in completions],
            "scheduled": [c.claim.scheduled_at for c in completions],
            "following": [c.next_run_at for c in completions],
            "statuses": [c.status.value for c in completions],
            "errors": [c.error for c in completions],
            "skipped": [c.skipped for c in completions],
        }
        _, rows = _driver_rows(session, sql.query("complete_many"), params)
        return len(rows)


def _named_rows(cursor: Any) -> Any:
    from psycopg.rows import namedtuple_row

    return namedtuple_row(cursor)


class SqliteClaims:
    """SQLAlchemy Core statements, each step in one transaction under SQLite's write lock."""

    def claim_for_dispatch(self, session: Session, params: dict[str, Any]) -> ClaimedBatch:
        now = params["now"] or utc_now()
        at = literal(now, UtcDateTime)
        until = literal(now + timedelta(seconds=params["lease"]), UtcDateTime)
        due = and_(
            _task.status == TaskStatus.ACTIVE.value,
            _task.next_run_at <= at,
            or_(_task.locked_until.is_(None), _task.locked_until < at),
        )
        pick = (
            select(_task.id).where(due).order_by(_task.next_run_at, _task.id)
            .limit(params["limit"])
        )
        # One UPDATE statement runs under SQLite's write lock: the re-checked
        # condition makes it a compare-and-set against a concurrent claimer.
        stmt = (
            update(TASKS)
            .where(_task.id.in_(pick.scalar_subquery()), due)
            .values(locked_by=params["worker_id"], locked_until=until)
            .returning(*_CLAIM_COLUMNS)
        )
        with transaction(session):
            result = session.execute(stmt)
            read = _claim_reader(list(result.keys()))
            claims = sorted((read(row) for row in result.all()),
                            key=lambda c: (c.scheduled_at, c.name))
            outcomes = [
                self._record(session, claim, now, params["stale_after"]) for claim in claims
            ]
        return list(zip(claims, outcomes, strict=True))

    @staticmethod
    def _record(
        session: Session, claim: Claim, now: datetime, stale_after: float
    ) -> DispatchOutcome:
        """Record claim's dispatch in the open transaction; return the outcome.

        1. Insert the record, unique per (task name, scheduled time).
        2. On conflict, take the record over only if its dispatch failed or was
           skipped, or if it has been "dispatching" with neither its start nor
           its worker's last renewal within stale_after.
        3. If neither, report DONE (already dispatched) or BUSY (in flight elsewhere).
        """
        stale_before = now - timedelta(seconds=stale_after)
        insert = sqlite_insert(DISPATCHES).values(
            task_name=claim.name,
            scheduled_at=claim.scheduled_at,
            worker_id=claim.worker_id,
            status=DispatchStatus.DISPATCHING.value,
            started_at=now,
        )
        stmt = insert.on_conflict_do_update(
            index_elements=[_record.task_name, _record.scheduled_at],
            set_={
                "worker_id": insert.excluded.worker_id,
                "status": DispatchStatus.DISPATCHING.value,
                "started_at": insert.excluded.started_at,
                "finished_at": None,
                "error": None,
            },
            where=or_(
                _record.status.in_(
                    [DispatchStatus.FAILED.value, DispatchStatus.SKIPPED.value]
                ),
                and_(
                    _record.status == DispatchStatus.DISPATCHING.value,
                    func.coalesce(_record.renewed_at, _record.started_at)
                    < literal(stale_before, UtcDateTime),
                ),
            ),
        ).returning(_record.id)
        if session.execute(stmt).first() is not None:
            return DispatchOutcome.OWNED
        status = session.execute(
            select(_record.status).where(
                _record.task_name == claim.name, _record.scheduled_at == claim.scheduled_at
            )
        ).scalar_one_or_none()
        if status == DispatchStatus.DISPATCHED.value:
            return DispatchOutcome.DONE
        return DispatchOutcome.BUSY

    def complete_many(
        self, session: Session, completions: list[Completion], now: datetime | None
    ) -> int:
        # Bind names differ from the column names, which SQLAlchemy reserves in SET.
        scheduled = bindparam("claimed_time", type_=UtcDateTime)
        stamp = literal(now or utc_now(), UtcDateTime)
        rows = [
            {
                "claimed_id": c.claim.task_id,
                "claimed_name": c.claim.name,
                "claimed_time": c.claim.scheduled_at,
                "new_next_run": c.next_run_at,
                "new_status": c.status.value,
                "new_error": c.error,
                "new_skipped": c.skipped,
            }
            for c in completions
        ]
        with transaction(session):
            moved = session.execute(
                update(TASKS)
                .where(_task.id == bindparam("claimed_id"), _task.next_run_at == scheduled)
                .values(
                    next_run_at=bindparam("new_next_run", type_=UtcDateTime),
                    status=bindparam("new_status", type_=String),
                    locked_by=None,
                    locked_until=None,
                    last_run_at=scheduled,
                    attempts=0,
                    last_error=bindparam("new_error", type_=String),
                    skipped_windows=_task.skipped_windows + bindparam("new_skipped"),
                    updated_at=stamp,
                ),
                rows,
            )
            session.execute(
                update(DISPATCHES)
                .where(_record.task_name == bindparam("claimed_name"),
                       _record.scheduled_at == scheduled)
                .values(status=DispatchStatus.DISPATCHED.value, finished_at=stamp, error=None),
                [{"claimed_name": r["claimed_name"], "claimed_time": r["claimed_time"]}
                 for r in rows],
            )
        return int(cast(CursorResult[Any], moved).rowcount or 0)


_BACKENDS: dict[str, ClaimBackend] = {"postgresql": PostgresClaims(), "sqlite": SqliteClaims()}


def backend_for(session: Session) -> ClaimBackend:
    """Return the claim backend of session's database; ValueError naming an unsupported one."""
    dialect = session.get_bind().dialect.name
    try:
        return _BACKENDS[dialect]
    except KeyError:
        raise ValueError(f"the controller does not support the {dialect!r} database") from None
