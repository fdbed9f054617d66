"""What the controller knows of each node: its reports, and the pulls it answered.

Rules:

- a report (``POST /api/nodes/{node}/report``) is validated on the way in
  (:class:`NodeReportIn`: unknown fields refused, every time with a UTC
  offset) and stored as that model's JSON data: the node's latest report
  (replaced), and one more entry of its history, of which only the newest
  ``keep`` are kept (pruned in the same transaction);
- a pull is recorded by the API process that answered it, in memory, and
  written behind (:class:`PullRecorder`): at most every ``delay`` seconds,
  all pending nodes in one transaction, so the pull stays a key lookup and a
  thousand nodes cost one write per interval. A recorded pull only ever
  replaces an older one, whichever API instance wrote first.

Times are the controller's clock (when it received the report, answered the
pull), never the node's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
)
from sqlalchemy import Table, delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller.db import transaction
from controller.models import AgentSchedule, NodePull, NodeReport, NodeReportHistory, NodeRevision
from sched_core.model import TEXT_MAX_LENGTH, check_text, check_zone_name, format_go_time

log = logging.getLogger(__name__)

REPORT_HISTORY = 50
"""How many reports of each node the controller keeps by default (the newest)."""

_REPORT: Table = NodeReport.__table__  # type: ignore[attr-defined]
_HISTORY: Table = NodeReportHistory.__table__  # type: ignore[attr-defined]
_PULL: Table = NodePull.__table__  # type: ignore[attr-defined]
_SCHEDULE: Table = AgentSchedule.__table__  # type: ignore[attr-defined]
_REVISION: Table = NodeRevision.__table__  # type: ignore[attr-defined]


def utc_text(value: datetime | None) -> str | None:
    """Return an instant as RFC 3339 in UTC (``2026-12-03T07:30:00Z``), or None."""
    return None if value is None else format_go_time(value)


# -- the report --------------------------------------------------------------------------


def _zone_name(value: str) -> str:
    return check_zone_name(value)


class _Strict(BaseModel):
    """A part of a report: unknown fields are refused; times are written in UTC with Z."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_serializer("*", when_used="json")
    def _times_in_utc(self, value: Any) -> Any:
        return format_go_time(value) if isinstance(value, datetime) else value


def _plain(value: str, info: ValidationInfo) -> str:
    return check_text(value, info.field_name or "text", max_length=TEXT_MAX_LENGTH)


def _lines(value: str, info: ValidationInfo) -> str:
    return check_text(value, info.field_name or "text", max_length=TEXT_MAX_LENGTH,
                      multiline=True)


# Free text a node reports is held to the kit's one text rule (check_text): bounded, no
# control or bidi character (a message may have several lines).
Text = Annotated[str, Field(max_length=2000), AfterValidator(_lines)]
Name = Annotated[str, Field(min_length=1, max_length=300), AfterValidator(_plain)]
def _instant(value: object) -> datetime:
    """Return an RFC 3339 time with a UTC offset as an aware UTC datetime; else ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"expected an RFC 3339 time string, got {type(value).__name__}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value[:60]!r} is not an RFC 3339 time") from None
    if parsed.tzinfo is None:
        raise ValueError(f"time {value[:60]!r} has no UTC offset")
    try:
        return parsed.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:59:59-14:00 is past year 9999 in UTC
        raise ValueError(
            f"time {value[:60]!r} is out of range in UTC (years 1 to 9999)") from None


AwareInstant = Annotated[datetime, BeforeValidator(_instant)]
"""An RFC 3339 time string with a UTC offset (``Z`` or ``+01:00``), read as UTC."""


class LatestJob(_Strict):
    """A schedule's latest job on the node: its Prefect state, window and end."""

    state: Name
    window: AwareInstant | None = None
    ended_at: AwareInstant | None = None
    flow_run_id: Name | None = None
    flow_run_name: Name | None = None


class ScheduleReport(_Strict):
    """One schedule as the node sees it."""

    id: Name
    last_fired: AwareInstant | None = None
    next_planned: AwareInstant | None = None
    latest_job: LatestJob | None = None


class LastPull(_Strict):
    """The node's latest pull: when, whether it was accepted, and why not."""

    at: AwareInstant | None = None
    ok: bool
    error: Text | None = None
    status: Annotated[str, Field(max_length=20), AfterValidator(_plain)] | None = None


class Counts(_Strict):
    """Windows the node skipped (a run that ended Skipped) or missed (never had a run)."""

    skipped: int = Field(default=0, ge=0)
    missed: int = Field(default=0, ge=0)


FAILING_STATES = frozenset({"Failed", "Crashed", "TimedOut"})
"""Latest-job states that make a node ``failing``."""


class NodeReportIn(_Strict):
    """A node's report of itself (the fleet contract's point 1); every field checked."""

    node: Name
    agent_version: Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_plain)]
    timezone: Annotated[str, AfterValidator(_zone_name)]
    grace_s: Annotated[float, Field(ge=0, le=86_400)]
    reported_at: AwareInstant
    last_pull: LastPull | None = None
    schedules: Annotated[list[ScheduleReport], Field(max_length=10_000)] = Field(
        default_factory=list
    )
    counts: Counts = Field(default_factory=Counts)

    @property
    def failing(self) -> list[str]:
        """Return the ids of the schedules whose latest job failed or crashed."""
        return [item.id for item in self.schedules
                if item.latest_job is not None and item.latest_job.state in FAILING_STATES]


def report_data(report: NodeReportIn) -> dict[str, Any]:
    """Return the report as the JSON data that is stored (times in UTC, ``Z``)."""
    data: dict[str, Any] = report.model_dump(mode="json")
    return data


def _insert(session: Session, table: Table) -> Any:
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(table)
    return sqlite_insert(table)


def record_report(
    session: Session, node: str, report: dict[str, Any], *, received_at: datetime,
    keep: int = REPORT_HISTORY,
) -> None:
    """Store report as node's latest and add it to its history, keeping the newest keep; commits."""
    stmt = _insert(session, _REPORT).values(node=node, received_at=received_at, report=report)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_REPORT.c.node],
        set_={"received_at": stmt.excluded.received_at, "report": stmt.excluded.report},
    )
    with transaction(session):
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
    """Store each pull as its node's latest, unless a later one is stored already; commits."""
    rows = [{"node": p.node, "pulled_at": p.at, "status": p.status,
             "list_version": p.list_version} for p in pulls]
    if not rows:
        return
    stmt = _insert(session, _PULL).values(rows)
    stmt = stmt.on_conflict_do_update(
        index_elements=[_PULL.c.node],
        set_={"pulled_at": stmt.excluded.pulled_at, "status": stmt.excluded.status,
              "list_version": stmt.excluded.list_version},
        where=_PULL.c.pulled_at < stmt.excluded.pulled_at,
    )
    with transaction(session):
        session.execute(stmt)


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
