"""What the controller knows of each node: its reports, and the pulls it answered.

Rules:

- a report (``POST /api/nodes/{node}/report``) is validated on the way in
  (:class:`controller.report_in.NodeReportIn`: unknown fields refused, every time
  with a UTC offset) and stored as that model's JSON data: the node's latest report
  (replaced), and one more entry of its history, of which only the newest
  ``keep`` are kept (pruned in the same transaction);
- a report's job records (``jobs``) are stored one per (node, key), in the
  report's transaction (:mod:`controller.jobs`);
- a pull is recorded by the API process that answered it, in memory, and
  written behind (:class:`PullRecorder`): at most every ``delay`` seconds,
  all pending nodes in one transaction, so the pull stays a key lookup and a
  thousand nodes cost one write per interval. A recorded pull only ever
  replaces an older one, whichever API instance wrote first. Only a node's
  own pulls are recorded (its token; an admin reading its list is not it);
- liveness (``node_seen``) is the node's latest own request, a pull or a
  report, and the heartbeat its latest own report announced
  (:func:`mark_seen`): a report the admin posts for a node is stored, but is
  no sign of the node's life.

Times are the controller's clock (when it received the report, answered the
pull), never the node's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, case, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller import jobs as job_store
from controller.db import transaction
from controller.jobs import JobKeep
from controller.models import (
    AgentSchedule,
    NodePull,
    NodeReport,
    NodeReportHistory,
    NodeRevision,
    NodeSeen,
)
from controller.report_in import JobRecordIn
from sched_core.values import utc_text

log = logging.getLogger(__name__)

REPORT_HISTORY = 50
"""How many reports of each node the controller keeps by default (the newest)."""

_REPORT: Table = NodeReport.__table__  # type: ignore[attr-defined]
_HISTORY: Table = NodeReportHistory.__table__  # type: ignore[attr-defined]
_PULL: Table = NodePull.__table__  # type: ignore[attr-defined]
_SCHEDULE: Table = AgentSchedule.__table__  # type: ignore[attr-defined]
_REVISION: Table = NodeRevision.__table__  # type: ignore[attr-defined]
_SEEN: Table = NodeSeen.__table__  # type: ignore[attr-defined]


def _insert(session: Session, table: Table) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(table)
    return sqlite_insert(table)


def mark_seen(
    session: Session, node: str, *, at: datetime, via: str,
    heartbeat_s: float | None = None, announced: bool = True,
) -> None:
    """Record a request node made with its own token at ``at`` (in the open transaction).

    The stored time only ever moves forward; a report also sets the heartbeat it
    announced (None: it announced none), a pull (or a refused report, ``announced``
    False) leaves it as it was.
    """
    values: dict[str, Any] = {"node": node, "seen_at": at, "via": via, "first_seen_at": at,
                              "heartbeat_s": heartbeat_s}
    session.execute(_seen_upsert(session, heartbeat=via == "report" and announced), values)


def _seen_upsert(session: Session, *, heartbeat: bool) -> Any:
    """Return node_seen's upsert (parameters given when executed, so one statement serves
    one node or a batch, compiled once): the stored time only moves forward; ``heartbeat``
    also sets the heartbeat."""
    stmt = _insert(session, _SEEN)
    later = _SEEN.c.seen_at < stmt.excluded.seen_at
    update: dict[str, Any] = {
        "seen_at": case((later, stmt.excluded.seen_at), else_=_SEEN.c.seen_at),
        "via": case((later, stmt.excluded.via), else_=_SEEN.c.via),
    }
    if heartbeat:
        update["heartbeat_s"] = stmt.excluded.heartbeat_s
    return stmt.on_conflict_do_update(index_elements=[_SEEN.c.node], set_=update)


@dataclass(frozen=True)
class Seen:
    """A node's latest own request: when, how (pull or report), its heartbeat, its first."""

    node: str
    at: datetime
    via: str
    heartbeat_s: float | None
    first_at: datetime


def latest_seen(session: Session, node: str | None = None) -> dict[str, Seen]:
    """Return each node's latest own request (only node's, when given)."""
    query = select(_SEEN)
    if node is not None:
        query = query.where(_SEEN.c.node == node)
    return {row.node: Seen(row.node, row.seen_at, row.via, row.heartbeat_s, row.first_seen_at)
            for row in session.execute(query).all()}


def record_refused_report(session: Session, node: str, *, at: datetime) -> None:
    """Record that a node already seen sent a report the controller refused (422): it is
    still a sign of life. Commits.

    A node whose outbox holds a record the controller refuses re-sends it; its
    requests prove it is alive all the same. A refused report creates nothing: a
    node never seen stays unknown.
    """
    with transaction(session):
        session.execute(
            _SEEN.update().where(_SEEN.c.node == node, _SEEN.c.seen_at < at)
            .values(seen_at=at, via="report"))


def record_report(
    session: Session, node: str, report: dict[str, Any], *, received_at: datetime,
    keep: int = REPORT_HISTORY, own: bool = True, heartbeat_s: float | None = None,
    jobs: Iterable[JobRecordIn] = (), job_keep: JobKeep | None = None,
) -> int:
    """Store report as node's latest, add it to its history (the newest keep), its job
    records and, when ``own`` (sent with the node's own token), the node's liveness:
    all in one transaction, which commits. Return how many job records changed.
    """

    stmt = _insert(session, _REPORT).values(node=node, received_at=received_at, report=report)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_REPORT.c.node],
        set_={"received_at": stmt.excluded.received_at, "report": stmt.excluded.report},
    )
    with transaction(session):
        changed = job_store.store_jobs(session, node, list(jobs), received_at=received_at,
                                       keep=job_keep or JobKeep())
        if own:
            mark_seen(session, node, at=received_at, via="report", heartbeat_s=heartbeat_s)
        session.execute(stmt)
        session.execute(_HISTORY.insert().values(node=node, received_at=received_at,
                                                 report=report))
        # The oldest entry to keep's id; everything of node's below it goes.
        oldest_kept = (
            select(_HISTORY.c.id).where(_HISTORY.c.node == node)
            .order_by(_HISTORY.c.id.desc()).limit(1).offset(max(keep, 1) - 1)
            .scalar_subquery()
        )
        session.execute(delete(_HISTORY).where(_HISTORY.c.node == node,
                                               _HISTORY.c.id < oldest_kept))
    return changed


def record_start_error(session: Session, node: str, error: str, *, at: datetime) -> None:
    """Add to node's latest report that its agent cannot start, and why (its next report
    replaces it). Commits."""
    with transaction(session):
        found = session.execute(select(_REPORT.c.received_at, _REPORT.c.report)
                                .where(_REPORT.c.node == node)).first()
        data = {**(found.report if found is not None else {"node": node}),
                "start_error": error, "start_error_at": utc_text(at)}
        stmt = _insert(session, _REPORT).values(
            node=node, received_at=found.received_at if found is not None else at, report=data)
        session.execute(stmt.on_conflict_do_update(
            index_elements=[_REPORT.c.node], set_={"report": stmt.excluded.report}))


@dataclass(frozen=True)
class StoredReport:
    """A report as stored: when it was received, and its data."""

    received_at: datetime
    report: dict[str, Any]


def latest_reports(session: Session, node: str | None = None) -> dict[str, StoredReport]:
    """Return each node's latest report (only node's, when given)."""
    query = select(_REPORT.c.node, _REPORT.c.received_at, _REPORT.c.report)
    if node is not None:
        query = query.where(_REPORT.c.node == node)
    return {row.node: StoredReport(row.received_at, row.report)
            for row in session.execute(query).all()}


def report_history(session: Session, node: str, *, limit: int) -> list[StoredReport]:
    """Return node's newest reports, newest first, at most limit."""
    rows = session.execute(
        select(_HISTORY.c.received_at, _HISTORY.c.report)
        .where(_HISTORY.c.node == node).order_by(_HISTORY.c.id.desc()).limit(limit)
    ).all()
    return [StoredReport(row.received_at, row.report) for row in rows]


# -- pulls -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pull:
    """One pull the controller answered: node, when, ``"200"`` or ``"304"``, version served."""

    node: str
    at: datetime
    status: str
    list_version: str


def record_pulls(session: Session, pulls: Iterable[Pull]) -> None:
    """Store each pull as its node's latest, unless a later one is stored already, and as
    the node's latest own request (pulls are recorded only when the node made them); commits.
    """
    pulls = list(pulls)
    rows = [{"node": p.node, "pulled_at": p.at, "status": p.status,
             "list_version": p.list_version} for p in pulls]
    if not rows:
        return
    # Each statement is compiled once and run for the whole batch (its rows as parameters):
    # a batch of the fleet's heartbeats is two statements, whatever its size.
    stmt = _insert(session, _PULL)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_PULL.c.node],
        set_={"pulled_at": stmt.excluded.pulled_at, "status": stmt.excluded.status,
              "list_version": stmt.excluded.list_version},
        where=_PULL.c.pulled_at < stmt.excluded.pulled_at,
    )
    seen = [{"node": p.node, "seen_at": p.at, "via": "pull", "first_seen_at": p.at,
             "heartbeat_s": None} for p in pulls]
    with transaction(session):
        session.execute(stmt, rows)
        session.execute(_seen_upsert(session, heartbeat=False), seen)


def latest_pulls(session: Session, node: str | None = None) -> dict[str, Pull]:
    """Return each node's latest recorded pull (only node's, when given)."""
    query = select(_PULL)
    if node is not None:
        query = query.where(_PULL.c.node == node)
    return {row.node: Pull(row.node, row.pulled_at, row.status, row.list_version)
            for row in session.execute(query).all()}


def list_versions(session: Session, node: str | None = None) -> dict[str, str]:
    """Return each node's current list version: its ETag without quotes (``epoch-revision``)."""
    query = select(_REVISION.c.node, _REVISION.c.epoch, _REVISION.c.revision)
    if node is not None:
        query = query.where(_REVISION.c.node == node)
    return {row.node: f"{row.epoch}-{row.revision}" for row in session.execute(query).all()}


def schedule_ids(session: Session, node: str | None = None) -> dict[str, list[str]]:
    """Return each node's schedule ids, sorted (only node's, when given): no row is decoded."""
    query = select(_SCHEDULE.c.node, _SCHEDULE.c.id).order_by(_SCHEDULE.c.node, _SCHEDULE.c.id)
    if node is not None:
        query = query.where(_SCHEDULE.c.node == node)
    found: dict[str, list[str]] = {}
    for name, schedule_id in session.execute(query).all():
        found.setdefault(name, []).append(schedule_id)
    return found


def schedule_counts(session: Session) -> dict[str, int]:
    """Return how many schedule rows each node has (nodes without rows left out)."""
    rows = session.execute(
        select(_SCHEDULE.c.node, func.count()).group_by(_SCHEDULE.c.node)
    ).all()
    return {node: int(count) for node, count in rows}


class PullRecorder:
    """Pulls answered by this process, written behind: the latest per node, in batches.

    :meth:`record` only updates a dict (the pull's answer does not wait for a
    disk); the first pending pull starts a timer that writes them all after
    ``delay`` seconds in one transaction. A failed write keeps the pulls
    pending (a newer pull of the same node replaces its entry) and is retried
    after ``retry_delay`` seconds. :meth:`flush` writes now (a status read
    calls it, so this process's pulls are never missing from its own answer);
    :meth:`close` writes what is pending and stops the timer.
    """

    def __init__(
        self, engine: Engine, *, delay: float = 0.5, retry_delay: float = 5.0,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        from controller.models import utc_now

        self._engine = engine
        self.delay = delay
        self.retry_delay = retry_delay
        self._clock = clock or utc_now
        self._pending: dict[str, Pull] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False

    def record(self, node: str, status: str, list_version: str) -> None:
        """Remember that node was answered status with list_version now."""
        pull = Pull(node, self._clock(), status, list_version)
        with self._lock:
            self._pending[node] = pull
            self._arm(self.delay)

    def _arm(self, delay: float) -> None:
        """Start the write timer if none runs (called under the lock)."""
        if self._timer is None and not self._closed:
            self._timer = threading.Timer(delay, self._on_timer)
            self._timer.daemon = True
            self._timer.name = "pull-recorder"
            self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()

    def flush(self) -> bool:
        """Write every pending pull now; return False (and keep them) if the write failed."""
        with self._write_lock:
            with self._lock:
                batch, self._pending = self._pending, {}
            if not batch:
                return True
            try:
                with Session(self._engine) as session:
                    record_pulls(session, batch.values())
            except Exception as exc:
                log.warning(
                    "could not record pulls; retrying",
                    extra={"nodes": len(batch), "error": type(exc).__name__,
                           "retry_in_s": self.retry_delay},
                )
                with self._lock:
                    for node, pull in batch.items():
                        self._pending.setdefault(node, pull)  # a newer pull wins
                    self._arm(self.retry_delay)
                return False
            return True

    def close(self) -> None:
        """Write what is pending and stop: later pulls are not recorded."""
        with self._lock:
            self._closed = True
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.flush()
