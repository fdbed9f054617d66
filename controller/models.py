"""The controller's tables (SQLModel) and the task input model.

Rule: every time column is a :class:`UtcDateTime`: it stores UTC (naive text
on SQLite, ``timestamptz`` on Postgres) and always gives back an aware UTC
datetime, so code never compares naive and aware times.

Tables: one class each below; its docstring says what one row is.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import ValidationInfo, field_validator, model_validator
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Float,
    Index,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

from controller.cron import check_cron
from sched_core.matcher import DEFAULT_TZ, zone
from sched_core.model import Schedule
from sched_core.values import NAME_MAX_LENGTH, check_text, check_zone_name

DEFAULT_TIMEZONE = DEFAULT_TZ.key
"""The timezone a task's cron or schedule shape is matched in unless it says otherwise."""

TIMEZONE_MAX_LENGTH = 64
"""The longest timezone name a task stores (its column); real IANA names are under 40."""

TASK_EVENT_PREFIX = "sched.task."
"""Every event a task emits is in this domain."""


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware datetime stored as UTC; naive values are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r} given for a UTC column")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utc_now() -> datetime:
    """Return the wall clock as an aware UTC datetime."""
    return datetime.now(UTC)


NAME_TYPE = String(200).with_variant(String(200, collation="C"), "postgresql")
"""Names (nodes, schedule ids, task names) sort by code point on Postgres as on SQLite."""
KEY_MAX_LENGTH = 400
"""The longest window key or alert subject stored (``<id>@manual@<uuid>`` is under 180)."""
KEY_TYPE = String(KEY_MAX_LENGTH).with_variant(String(KEY_MAX_LENGTH, collation="C"),
                                               "postgresql")


class TaskStatus(StrEnum):
    """Whether the central scheduler fires a task."""

    ACTIVE = "active"
    DISABLED = "disabled"
    DONE = "done"


class DispatchStatus(StrEnum):
    """Where one (task, scheduled time) dispatch stands."""

    DISPATCHING = "dispatching"
    DISPATCHED = "dispatched"
    FAILED = "failed"
    SKIPPED = "skipped"
    """Not dispatched: a later window of the task came due first (the catch-up rule)."""


class AgentSchedule(SQLModel, table=True):
    """One wire-format schedule row of one node; (node, id) is the key."""

    __tablename__ = "agent_schedule"

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    id: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    name: str = Field(sa_type=Text)
    repo_id: str = Field(default="", sa_type=Text)
    action: str = Field(sa_type=Text)
    storage: str = Field(default="", sa_type=Text)
    schedule: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    miss_policy: str = Field(max_length=40)
    enabled: bool = True
    params: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    policies: dict[str, Any] | None = Field(
        default=None, sa_column=Column(JSON(none_as_null=True), nullable=True)
    )
    """The row's policy fields (``timezone``, ``overlap``, ``paused``, ...) that
    are set, as their JSON; None when the row has none (a row as the Go kit writes it)."""
    version: int = 1
    wire: str = Field(sa_type=Text)
    """The row's ``LocalSchedule.model_dump_json()``, version included: the pull answer
    splices these strings together instead of validating and serializing every row."""
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UtcDateTime, nullable=False)
    )


class NodeRevision(SQLModel, table=True):
    """A node's schedule-list revision: bumped in the same transaction as any change."""

    __tablename__ = "node_revision"

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    epoch: str = Field(max_length=40)
    revision: int = 1


class ScheduledTask(SQLModel, table=True):
    """A centrally fired task: exactly one of cron, schedule (shape) or run_at says when."""

    __tablename__ = "scheduled_task"
    __table_args__ = (Index("ix_scheduled_task_due", "status", "next_run_at"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=200, unique=True, sa_type=NAME_TYPE)
    cron: str | None = Field(default=None, sa_type=Text)
    schedule: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    timezone: str = Field(default=DEFAULT_TIMEZONE, max_length=TIMEZONE_MAX_LENGTH)
    run_at: datetime | None = Field(default=None, sa_column=Column(UtcDateTime, nullable=True))
    event: str | None = Field(default=None, sa_type=Text)
    deployment: str | None = Field(default=None, sa_type=Text)
    payload: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False)
    )
    status: str = Field(default=TaskStatus.ACTIVE.value, max_length=16)
    next_run_at: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True)
    )
    locked_by: str | None = Field(default=None, max_length=200)
    locked_until: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True)
    )
    last_run_at: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True)
    )
    attempts: int = 0
    last_error: str | None = Field(default=None, sa_type=Text)
    skipped_windows: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Windows of a recurring task skipped under the catch-up rule, never dispatched."""
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UtcDateTime, nullable=False)
    )
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UtcDateTime, nullable=False)
    )


class TaskDispatch(SQLModel, table=True):
    """One (task name, scheduled time) handed to the dispatcher; the pair is unique."""

    __tablename__ = "task_dispatch"
    __table_args__ = (
        UniqueConstraint("task_name", "scheduled_at", name="uq_task_dispatch_task_time"),
        Index("ix_task_dispatch_scheduled_at", "scheduled_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    task_name: str = Field(max_length=200, sa_type=NAME_TYPE)
    scheduled_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    worker_id: str = Field(max_length=200)
    status: str = Field(default=DispatchStatus.DISPATCHING.value, max_length=16)
    started_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UtcDateTime, nullable=False)
    )
    finished_at: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True)
    )
    renewed_at: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True)
    )
    """When its worker last renewed the lease while dispatching (None: never)."""
    error: str | None = Field(default=None, sa_type=Text)


class NodeReport(SQLModel, table=True):
    """A node's latest report (``POST /api/nodes/{node}/report``): one row per node."""

    __tablename__ = "node_report"

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    received_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    """When the controller received it (its own clock, not the node's)."""
    report: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    """The report as validated (:class:`controller.report_in.NodeReportIn`), as JSON data."""


class NodeReportHistory(SQLModel, table=True):
    """Every report a node sent, its newest ones only (bounded per node)."""

    __tablename__ = "node_report_history"
    __table_args__ = (Index("ix_node_report_history_node_id", "node", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    node: str = Field(max_length=200, sa_type=NAME_TYPE)
    received_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    report: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))


class NodePull(SQLModel, table=True):
    """The latest pull the controller answered for each node: when, 200 or 304, which list."""

    __tablename__ = "node_pull"

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    pulled_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    status: str = Field(max_length=3)
    """``"200"`` (the list sent) or ``"304"`` (the node had it)."""
    list_version: str = Field(sa_type=Text)
    """The list version served: the list's ETag without its quotes (``3f2a9c0b1d4e5f60-12``)."""


class NodeSeen(SQLModel, table=True):
    """A node's latest request made with its own token: the controller's proof it is alive."""

    __tablename__ = "node_seen"

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    seen_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    """When the controller answered it (its own clock)."""
    via: str = Field(max_length=8)
    """``"pull"`` or ``"report"``."""
    heartbeat_s: float | None = Field(default=None, sa_column=Column(Float, nullable=True))
    """The interval the node promised a request within (its latest own report's), or None."""
    first_seen_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))


class NodeContract(SQLModel, table=True):
    """The action table a node published in its reports (never its ``env``): what the
    controller checks written rows of that node against."""

    __tablename__ = "node_contract"

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    contract_hash: str = Field(max_length=64)
    contract: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    received_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))


class NodeJob(SQLModel, table=True):
    """One job record a node reported: the newest ``seq`` per (node, window key)."""

    __tablename__ = "node_job"
    __table_args__ = (
        Index("ix_node_job_node_filed", "node", "filed_at"),
        Index("ix_node_job_node_received", "node", "received_at"),
    )

    node: str = Field(primary_key=True, max_length=200, sa_type=NAME_TYPE)
    key: str = Field(primary_key=True, max_length=KEY_MAX_LENGTH, sa_type=KEY_TYPE)
    schedule_id: str = Field(max_length=200, sa_type=NAME_TYPE)
    window_at: datetime | None = Field(default=None,
                                       sa_column=Column(UtcDateTime, nullable=True))
    trigger_key: str = Field(sa_type=Text)
    state: str = Field(max_length=16)
    started_at: datetime | None = Field(default=None,
                                        sa_column=Column(UtcDateTime, nullable=True))
    ended_at: datetime | None = Field(default=None, sa_column=Column(UtcDateTime, nullable=True))
    error: str | None = Field(default=None, sa_type=Text)
    reason: str | None = Field(default=None, sa_type=Text)
    offline: bool = False
    flow_run_id: str | None = Field(default=None, sa_type=Text)
    seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    filed_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    """The instant the record is listed under: its window, else its start, else its end,
    else when it was received."""
    received_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    """When the controller stored this seq of it (its own clock)."""


class ScheduleVersion(SQLModel, table=True):
    """One version of one node's row, and the span it was in force on the controller."""

    __tablename__ = "schedule_version"
    __table_args__ = (Index("ix_schedule_version_row", "node", "id", "valid_from"),)

    seq: int | None = Field(default=None, primary_key=True)
    """Versions restart at 1 when a deleted row is created again: this tells them apart."""
    node: str = Field(max_length=200, sa_type=NAME_TYPE)
    id: str = Field(max_length=200, sa_type=NAME_TYPE)
    version: int
    wire: str = Field(sa_type=Text)
    """The row's wire JSON at that version (as ``agent_schedule.wire``)."""
    valid_from: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    valid_until: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True))
    """When the next version replaced it or the row was deleted; None while in force."""


class FleetAlert(SQLModel, table=True):
    """An alert the controller raised; (node, kind, subject) is inserted once, fleet-wide."""

    __tablename__ = "fleet_alert"
    __table_args__ = (
        UniqueConstraint("node", "kind", "subject", name="uq_fleet_alert_subject"),
        Index("ix_fleet_alert_node_open", "node", "resolved_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    node: str = Field(max_length=200, sa_type=NAME_TYPE)
    kind: str = Field(max_length=40)
    """``node-silent``, ``node-recovered``, ``window-missed``, ``window-failed``,
    ``window-recovered``."""
    subject: str = Field(max_length=KEY_MAX_LENGTH, sa_type=KEY_TYPE)
    """What it is about: a window key, or the silence it names (``silent@<last seen>``)."""
    schedule_id: str | None = Field(default=None, max_length=200, sa_type=NAME_TYPE)
    window_at: datetime | None = Field(default=None,
                                       sa_column=Column(UtcDateTime, nullable=True))
    reason: str = Field(sa_type=Text)
    payload: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    """The event's payload, as sent."""
    detected_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    sent_at: datetime | None = Field(default=None, sa_column=Column(UtcDateTime, nullable=True))
    lease_until: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True))
    """An instance sending its event holds it until then (a compare-and-set claim)."""
    attempts: int = 0
    resolved_at: datetime | None = Field(
        default=None, sa_column=Column(UtcDateTime, nullable=True))
    """When a later success (or the node's return) resolved it."""


class WatchTurn(SQLModel, table=True):
    """Whose turn the fleet watch's pass is: taken by one instance per interval."""

    __tablename__ = "watch_turn"

    name: str = Field(primary_key=True, max_length=40)
    taken_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    """When an instance last took the turn (the database's clock)."""
    holder: str = Field(max_length=200, sa_type=NAME_TYPE)
    """The instance that took it (host, process), for the log."""


class RevokedSession(SQLModel, table=True):
    """A fleet page session ended by Log out before its expiry: every instance refuses it."""

    __tablename__ = "revoked_session"

    digest: str = Field(primary_key=True, max_length=64)
    """The SHA-256 (hex) of the session cookie's signature; never the cookie itself."""
    expires_at: datetime = Field(sa_column=Column(UtcDateTime, nullable=False))
    """When the cookie expires anyway: the row is pruned after it."""


class LoginFailure(SQLModel, table=True):
    """One failed fleet page login: the client's key and when (pruned after the window)."""

    __tablename__ = "login_failure"
    __table_args__ = (Index("ix_login_failure_at", "failed_at"),)

    client: str = Field(primary_key=True, max_length=100)
    failed_at: datetime = Field(sa_column=Column(UtcDateTime, primary_key=True))


class TaskIn(SQLModel):
    """What a client sends to create or replace a task (validated, never stored as is).

    - ``name``: unique; saving an existing name replaces that task.
    - When: exactly one of ``cron`` (five fields, e.g. ``"30 2 * * mon-fri"``),
      ``schedule`` (a :class:`sched_core.Schedule` shape; not an event one) or
      ``run_at`` (a one-shot time with a UTC offset). ``cron`` and ``schedule``
      are matched in ``timezone`` (an IANA name, default America/New_York).
    - Target: exactly one of ``event`` (a name in the ``sched.task.*`` domain;
      ``"backup.done"`` is read as ``"sched.task.backup.done"``) or
      ``deployment`` (``"flow-name/deployment-name"``).
    - ``payload``: a JSON object sent with the event, or the deployment's parameters.
    - ``status``: ``active`` (default), ``disabled`` or ``done``.
    """

    name: str = Field(min_length=1, max_length=200)
    cron: str | None = None
    schedule: Schedule | None = None
    timezone: str = DEFAULT_TIMEZONE
    run_at: datetime | None = None
    event: str | None = None
    deployment: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)
    status: TaskStatus = TaskStatus.ACTIVE

    @field_validator("name", "cron", "event", "deployment")
    @classmethod
    def _plain_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        # The one rule for text people read (sched_core.values.check_text).
        if value is not None:
            check_text(value, info.field_name or "text", max_length=NAME_MAX_LENGTH)
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        shown = value if len(value) <= 60 else value[:45] + "..." + value[-10:]
        if len(value) > TIMEZONE_MAX_LENGTH:
            raise ValueError(
                f"timezone {shown!r} is {len(value)} characters long; the most is "
                f"{TIMEZONE_MAX_LENGTH}"
            )
        try:
            zone(value)  # an unknown name is a ValueError naming it
        except (ValueError, OSError):
            # OSError: a folder of the zone database ("Europe"), a name too long
            # for a file name: not zones either.
            raise ValueError(
                f"unknown timezone {shown!r} (expected an IANA name such as Europe/Paris)"
            ) from None
        # A file of the zone database that is no IANA name ("localtime", the
        # machine's own zone; "posix/..."): refused as a row's timezone is.
        return check_zone_name(value)

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str | None) -> str | None:
        if value is not None:
            check_cron(value)  # a ValueError naming the expression and what is wrong
        return value

    @field_validator("run_at")
    @classmethod
    def _aware_run_at(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("run_at has no UTC offset")
        try:
            return value.astimezone(UTC)
        except OverflowError:  # 0001-01-01T00:00:00+01:00 is before year 1 in UTC
            raise ValueError(
                f"run_at {value.isoformat()} is out of range in UTC (years 1 to 9999)"
            ) from None

    @field_validator("event")
    @classmethod
    def _event_domain(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value or value == TASK_EVENT_PREFIX.rstrip("."):
            raise ValueError("event name is empty")
        if not value.startswith(TASK_EVENT_PREFIX):
            if value.startswith("sched."):
                raise ValueError(f"event {value!r} is outside the sched.task.* domain")
            value = TASK_EVENT_PREFIX + value
        return value

    @model_validator(mode="after")
    def _one_when_one_target(self) -> TaskIn:
        whens = [n for n in ("cron", "schedule", "run_at") if getattr(self, n) is not None]
        if len(whens) != 1:
            raise ValueError(
                "exactly one of cron, schedule or run_at is required"
                + (f" (got {', '.join(whens)})" if whens else "")
            )
        targets = [n for n in ("event", "deployment") if getattr(self, n)]
        if len(targets) != 1:
            raise ValueError("exactly one of event or deployment is required")
        if self.schedule is not None and self.schedule.is_event:
            raise ValueError("schedule.on marks an event schedule; a task needs a clock one")
        return self
