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
write lock), chosen once per dialect by :func:`backend_for`.

Crash window: a worker that dies after recording a dispatch and before
completing it leaves the record "dispatching" and stops renewing it; once
neither its start nor its last renewal is within ``stale_after`` (and its
lease has run out), another worker takes it over and dispatches again with the
same idempotency key (a deployment run with that key is not created twice; an
event carries an id derived from it). A worker still renewing is never
doubled, whatever its lease says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol, cast

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
    type_coerce,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult
from sqlmodel import Session

from controller import sql
from controller.db import db_now, transaction
from controller.models import DispatchStatus, TaskDispatch, TaskStatus, UtcDateTime, utc_now
from controller.tasks import TASKS
from controller.timing import Completion, next_run
from sched_core.model import Schedule

log = logging.getLogger(__name__)

DISPATCHES: Table = TaskDispatch.__table__  # type: ignore[attr-defined]
"""The ``task_dispatch`` table."""
_task = TASKS.c
_record = DISPATCHES.c


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


def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


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


# ---------------------------------------------------------------- the two backends


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


# ---------------------------------------------------------------- step 1: claim


def _claim_params(
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


def claim_for_dispatch(
    session: Session,
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
    """
    params = _claim_params(worker_id, now, lease, limit, stale_after)
    pairs = backend_for(session).claim_for_dispatch(session, params)
    if pairs:
        log.debug("claimed tasks", extra={"worker_id": worker_id, "count": len(pairs)})
    return pairs


def claim_for_dispatch_on(
    conn: psycopg.Connection[Any],
    *,
    worker_id: str,
    now: datetime | None = None,
    lease: timedelta | float = 30.0,
    limit: int = 100,
    stale_after: timedelta | float = 600.0,
) -> ClaimedBatch:
    """Do :func:`claim_for_dispatch` on a raw autocommit psycopg connection (Postgres only).

    The scheduler's listener runs it on its own connection the moment a
    notification arrives: that backend is awake already, so the claim costs
    no hand-off to another thread or connection.
    """
    if not conn.autocommit:
        raise ValueError("claim_for_dispatch_on needs an autocommit connection")
    params = _claim_params(worker_id, now, lease, limit, stale_after)
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
