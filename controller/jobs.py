"""The job records nodes report: one per (node, window key), the newest ``seq`` kept.

Rules:

1. A node re-sends a record until a report carrying it is accepted, so a record
   arrives more than once: the stored record of a key is replaced only by one
   with a later ``seq``; an older or equal seq changes nothing (idempotent).
   Within one report the highest seq of a key counts.
2. The history is bounded per node: records received more than ``keep.days``
   ago go, and of the rest the newest ``keep.count`` (by receipt) stay; both
   prunes run in the report's own transaction.
3. A record is filed under its window, else its start, else its end, else when
   it was received (``filed_at``): the instant a report over a time range
   looks it up by.

Times are UTC; ``received_at`` is the controller's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import Table, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import CursorResult
from sqlmodel import Session

from controller.models import NodeJob
from sched_core.values import utc_text

if TYPE_CHECKING:
    from controller.report_in import JobRecordIn

@dataclass(frozen=True)
class JobKeep:
    """How many job records the controller keeps: per node at most ``count`` (the newest
    received), and none received more than ``days`` ago."""

    days: float = 14.0
    count: int = 50_000


JOBS: Table = NodeJob.__table__  # type: ignore[attr-defined]
_C = JOBS.c
FAILED_STATES = frozenset({"Failed", "Crashed"})
"""Job states that count as a failed window."""


@dataclass(frozen=True)
class JobRecord:
    """A stored job record (see :class:`controller.report_in.JobRecordIn` for the fields)."""

    node: str
    key: str
    schedule_id: str
    window: datetime | None
    trigger_key: str
    state: str
    started_at: datetime | None
    ended_at: datetime | None
    error: str | None
    reason: str | None
    offline: bool
    flow_run_id: str | None
    seq: int
    filed_at: datetime
    received_at: datetime

    @property
    def duration(self) -> timedelta | None:
        """Return how long the job ran (None while running or when not started)."""
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at

    def as_json(self) -> dict[str, Any]:
        """Return the record as JSON data (times RFC 3339 UTC)."""
        duration = self.duration
        return {
            "key": self.key, "schedule_id": self.schedule_id, "window": utc_text(self.window),
            "trigger_key": self.trigger_key, "state": self.state,
            "started_at": utc_text(self.started_at), "ended_at": utc_text(self.ended_at),
            "duration_s": None if duration is None else duration.total_seconds(),
            "error": self.error, "reason": self.reason, "offline": self.offline,
            "flow_run_id": self.flow_run_id, "seq": self.seq,
            "received_at": utc_text(self.received_at),
        }


def _insert(session: Session) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(JOBS)
    return sqlite_insert(JOBS)


def _newest_per_key(jobs: Sequence[JobRecordIn]) -> list[JobRecordIn]:
    """Return one record per key: the highest seq (the first of equals), in report order."""
    best: dict[str, JobRecordIn] = {}
    for job in jobs:
        held = best.get(job.key)
        if held is None or job.seq > held.seq:
            best[job.key] = job
    return list(best.values())


def store_jobs(
    session: Session, node: str, jobs: Sequence[JobRecordIn], *, received_at: datetime,
    keep: JobKeep,
) -> int:
    """Store node's job records (rule 1) and prune its history (rule 2), in the open
    transaction; return how many records were inserted or replaced."""
    changed = 0
    rows = [{
        "node": node, "key": job.key, "schedule_id": job.schedule_id, "window_at": job.window,
        "trigger_key": job.trigger_key, "state": job.state, "started_at": job.started_at,
        "ended_at": job.ended_at, "error": job.error, "reason": job.reason,
        "offline": job.offline, "flow_run_id": job.flow_run_id, "seq": job.seq,
        "filed_at": job.window or job.started_at or job.ended_at or received_at,
        "received_at": received_at,
    } for job in _newest_per_key(jobs)]
    if rows:
        # One statement with the rows as its parameter sets: compiled once and cached, and
        # sent in batches of VALUES (SQLAlchemy's "insertmanyvalues"). A statement with the
        # rows in its VALUES was compiled anew for each report: 60% of a 1,000-job report.
        stmt = _insert(session)
        stmt = stmt.on_conflict_do_update(
            index_elements=[_C.node, _C.key],
            set_={name: stmt.excluded[name] for name in rows[0] if name not in ("node", "key")},
            where=_C.seq < stmt.excluded.seq,
        ).returning(_C.key)
        changed = len(session.execute(stmt, rows).all())
    if rows:
        prune_node(session, node, now=received_at, keep=keep)
    return changed


def prune_node(session: Session, node: str, *, now: datetime, keep: JobKeep) -> None:
    """Delete node's records received more than keep.days before now, and all but the
    newest keep.count (in the open transaction)."""
    session.execute(delete(JOBS).where(
        _C.node == node, _C.received_at < now - timedelta(days=keep.days)))
    oldest_kept = (
        select(_C.received_at).where(_C.node == node)
        .order_by(_C.received_at.desc()).limit(1).offset(max(keep.count, 1) - 1)
        .scalar_subquery()
    )
    session.execute(delete(JOBS).where(_C.node == node, _C.received_at < oldest_kept))


def prune_all(session: Session, *, now: datetime, keep: JobKeep) -> int:
    """Delete every node's records received more than keep.days before now; return how many.

    Reports prune their own node; this catches nodes that stopped reporting.
    """
    result = session.execute(delete(JOBS).where(
        _C.received_at < now - timedelta(days=keep.days)))
    return int(cast(CursorResult[Any], result).rowcount or 0)


def _record(row: Any) -> JobRecord:
    return JobRecord(
        node=row.node, key=row.key, schedule_id=row.schedule_id, window=row.window_at,
        trigger_key=row.trigger_key, state=row.state, started_at=row.started_at,
        ended_at=row.ended_at, error=row.error, reason=row.reason, offline=bool(row.offline),
        flow_run_id=row.flow_run_id, seq=int(row.seq), filed_at=row.filed_at,
        received_at=row.received_at)


def jobs_between(
    session: Session, since: datetime, until: datetime, *, nodes: Iterable[str] | None = None,
) -> dict[str, list[JobRecord]]:
    """Return each node's records filed in ``[since, until)`` (rule 3), oldest first."""
    query = select(JOBS).where(_C.filed_at >= since, _C.filed_at < until)
    if nodes is not None:
        query = query.where(_C.node.in_(list(nodes)))
    found: dict[str, list[JobRecord]] = {}
    for row in session.execute(query.order_by(_C.node, _C.filed_at, _C.key)).all():
        found.setdefault(row.node, []).append(_record(row))
    return found


def job(session: Session, node: str, key: str) -> JobRecord | None:
    """Return node's record of key, or None."""
    row = session.execute(select(JOBS).where(_C.node == node, _C.key == key)).first()
    return None if row is None else _record(row)


def latest_jobs(session: Session, node: str | None = None) -> dict[str, dict[str, JobRecord]]:
    """Return, per node and schedule, the record filed last (only node's, when given).

    One record, so its window (or start) and its outcome belong together (the
    ``LAST`` column).
    """
    newest = (select(_C.node, _C.schedule_id, func.max(_C.filed_at).label("filed"))
              .group_by(_C.node, _C.schedule_id))
    if node is not None:
        newest = newest.where(_C.node == node)
    sub = newest.subquery()
    query = select(JOBS).join(
        sub, (_C.node == sub.c.node) & (_C.schedule_id == sub.c.schedule_id)
        & (_C.filed_at == sub.c.filed))
    found: dict[str, dict[str, JobRecord]] = {}
    for row in session.execute(query.order_by(_C.node, _C.schedule_id, _C.key)).all():
        # Two records filed at one instant (a window and a manual run): the later seq wins.
        record = _record(row)
        held = found.setdefault(row.node, {}).get(row.schedule_id)
        if held is None or record.seq > held.seq:
            found[row.node][row.schedule_id] = record
    return found


def last_windows_before(
    session: Session, before: datetime, *, nodes: Iterable[str] | None = None,
) -> dict[str, dict[str, datetime]]:
    """Return, per node and schedule, the latest window before ``before`` whose job started
    (not Skipped): where min_interval counts from."""
    query = (select(_C.node, _C.schedule_id, func.max(_C.window_at))
             .where(_C.window_at < before, _C.state != "Skipped")
             .group_by(_C.node, _C.schedule_id))
    if nodes is not None:
        query = query.where(_C.node.in_(list(nodes)))
    found: dict[str, dict[str, datetime]] = {}
    for node, schedule_id, window in session.execute(query).all():
        if window is not None:
            found.setdefault(node, {})[schedule_id] = window
    return found
