"""What a node reports of itself (``POST /api/nodes/{node}/report``): the wire models, checked.

Rules: unknown fields are refused at every level; every time carries a UTC offset and is
written back in UTC with ``Z``; free text is held to the kit's one text rule
(:func:`sched_core.values.check_text`: bounded, no control or bidi character; a message
may have several lines); a report lists at most :data:`MAX_JOBS` job records. What is
stored of it is :func:`report_data` (:mod:`controller.nodes` stores it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_serializer,
    model_validator,
)

from controller.contracts import NodeContractIn
from controller.models import (
    KEY_MAX_LENGTH,
)
from sched_core.values import (
    _UNSAFE_TEXT,
    TEXT_MAX_LENGTH,
    check_identifier,
    check_text,
    check_zone_name,
    format_go_time,
)


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


parse_instant = _instant
"""The one parser of times from outside (reports, job records, queries): a time without
an offset, or one outside years 1 to 9999 once in UTC, is refused."""
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


JOB_STATES = ("Running", "Completed", "Failed", "Crashed", "Cancelled", "Skipped")
"""The states a job record may have."""
JobState = Literal["Running", "Completed", "Failed", "Crashed", "Cancelled", "Skipped"]
MAX_JOBS = 1000
"""The most job records one report may carry."""
DEFAULT_HEARTBEAT_S = 300.0
"""The heartbeat of a node that announced none (an older agent)."""


LINE_MAX = 1000
"""The longest error or reason kept (its first line, cut with an ellipsis)."""


def _first_line(value: object) -> object:
    """Return the first non-empty line of an error or reason, at most LINE_MAX characters,
    each control or bidi character replaced by U+FFFD (the kit's text rule, check_text).

    Cut and cleaned rather than refused: a node re-sends a refused report, so one
    odd error line (a command's output) would hold back every later record of it.
    """
    if not isinstance(value, str):
        return value  # the type check names it
    for line in value.splitlines():
        if line.strip():
            line = line.strip()
            line = line if len(line) <= LINE_MAX else line[: LINE_MAX - 1] + "\u2026"
            return _UNSAFE_TEXT.sub("\ufffd", line)
    return None


def _schedule_id(value: str) -> str:
    return check_identifier(value, "schedule_id")


class JobRecordIn(_Strict):
    """One job the node started or ended as its report carries it.

    ``key`` is the window's key (``<schedule id>@<local date>T<HH:MM><offset>``,
    :func:`sched_core.matcher.window_key`), a chain stage's (``<id>@<stage>@<day>``)
    or an ad hoc run's (``<id>@manual@<run id>``); it starts with ``schedule_id@``.
    ``seq`` increases per node: a record with a later seq replaces the stored one
    of its key, an older or equal one changes nothing (a re-send).
    """

    key: Annotated[str, Field(min_length=3, max_length=KEY_MAX_LENGTH)]
    schedule_id: Annotated[str, AfterValidator(_schedule_id)]
    window: AwareInstant | None = None
    trigger_key: Annotated[str, Field(min_length=1, max_length=100)]
    state: JobState
    started_at: AwareInstant | None = None
    ended_at: AwareInstant | None = None
    error: Annotated[str | None, BeforeValidator(_first_line)] = None
    reason: Annotated[str | None, BeforeValidator(_first_line)] = None
    offline: bool = False
    flow_run_id: Name | None = None
    seq: Annotated[int, Field(ge=0, le=2**63 - 1)]

    @model_validator(mode="after")
    def _consistent(self) -> JobRecordIn:
        if not self.key.startswith(self.schedule_id + "@"):
            raise ValueError(f"key {self.key[:80]!r} does not start with its schedule_id "
                             f"{self.schedule_id!r} and '@'")
        if self.state == "Running" and self.ended_at is not None:
            raise ValueError("a Running job has no ended_at (it has not ended)")
        if (self.started_at is not None and self.ended_at is not None
                and self.ended_at < self.started_at):
            raise ValueError("ended_at is before started_at")
        return self


class NodeReportIn(_Strict):
    """A node's report of itself (the fleet contract's point 1); every field checked.

    ``heartbeat_s`` is the node's promise of a request to the controller (a pull
    or a report, with its own token) at least that often; ``jobs`` are the job
    records it has not yet had accepted, oldest first.
    """

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
    heartbeat_s: Annotated[float, Field(ge=10, le=3600)] | None = None
    jobs: Annotated[list[JobRecordIn], Field(max_length=MAX_JOBS)] = Field(
        default_factory=list)
    contract_hash: Annotated[str, Field(pattern=r"^[0-9a-f]{16,64}$")] | None = None
    """The hash of the node's action table (every report; :mod:`controller.contracts`)."""
    contract: NodeContractIn | None = None
    """The node's action table itself (its first report after a start, or when wanted)."""
    start_error: Text | None = None
    """Why the node's agent cannot start on its settings (:mod:`sched_node.start_failure`):
    such a report keeps the node's latest one and adds this, and is no sign of life."""

    @property
    def failing(self) -> list[str]:
        """Return the ids of the schedules whose latest job failed or crashed."""
        return [item.id for item in self.schedules
                if item.latest_job is not None and item.latest_job.state in FAILING_STATES]


def report_data(report: NodeReportIn) -> dict[str, Any]:
    """Return the report as the JSON data that is stored (times in UTC, ``Z``).

    Its job records are left out: they are stored one per key (:mod:`controller.jobs`); so
    is its action table (:mod:`controller.contracts`).
    """
    data: dict[str, Any] = report.model_dump(mode="json", exclude={"jobs", "contract"})
    return data
