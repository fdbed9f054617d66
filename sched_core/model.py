"""The wire format: schedule rows and the cache file, byte-for-byte the Go kit's JSON.

Rule: ``model_dump_json()`` of every model here is what Go's ``encoding/json``
writes for the same value: the same field order, ``omitempty`` fields left out
when empty, map keys sorted, ``<``, ``>`` and ``&`` escaped, times in RFC 3339
with trailing fractional zeros trimmed and ``0001-01-01T00:00:00Z`` for "never".
Parsing accepts what Go writes (up to 9 fractional digits, any UTC offset,
fields it does not know).
"""

from __future__ import annotations

import copy
from datetime import datetime
from enum import StrEnum
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from sched_core.values import (
    STORED_BEFORE_RULES,
    check_identifier,
    check_zone_name,
    format_go_time,
    go_escape,
    hh_mm_minutes,
    parse_go_time,
)

DAY_NAMES: tuple[str, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
"""Go's three-letter lowercase weekday names, indexed like ``datetime.weekday()``."""


def omit_empty(model: BaseModel, data: Any, names: tuple[str, ...]) -> Any:
    """Return a model's dumped ``data`` without the named fields the model leaves empty.

    The wire leaves out what Go's ``omitempty`` leaves out: a field that is unset,
    ``None``, ``""`` or empty.
    """
    if isinstance(data, dict):
        for name in names:
            if not getattr(model, name):
                data.pop(name, None)
    return data

class _WireModel(BaseModel):
    """A model whose JSON escapes HTML characters as Go's encoder does."""

    def model_dump_json(self, **kwargs: Any) -> str:
        return go_escape(super().model_dump_json(**kwargs))


class MissPolicy(StrEnum):
    """What to do about windows that passed while the agent was down."""

    SKIP = "skip"
    RUN_ONCE_WITHIN_24H = "run-once-within-24h"
    RUN_ALL = "run-all"


def _check_number(value: str, low: int, high: int, what: str) -> None:
    ok = 0 < len(value) <= 2 and value.isascii() and value.isdigit()
    if not ok or not low <= int(value) <= high:
        raise ValueError(f"{what} {value!r} is not a number from {low} to {high}")


class Overlap(StrEnum):
    """What a run does when a job of its schedule is still active on this node."""

    SKIP = "skip"
    ALLOW = "allow"
    BUFFER_ONE = "buffer-one"
    CANCEL_OTHER = "cancel-other"


JITTER_MAX = 3600
"""The largest ``jitter`` (seconds)."""
CATCHUP_MIN, CATCHUP_MAX = 60, 7 * 86_400
"""The range of ``catchup_window`` (seconds): a minute to a week (the matcher looks 8 days)."""
MIN_INTERVAL_MAX = 366 * 86_400
"""The largest ``min_interval`` (seconds): a year."""
NOTE_MAX_LENGTH = 1000
"""The longest pause note (characters)."""

def _check_days(days: list[str]) -> None:
    if not days:
        raise ValueError("no days (expected mon..sun or *)")
    for day in days:
        if day != "*" and day not in DAY_NAMES:
            raise ValueError(f"unknown day name {day!r} (expected mon..sun or *)")


def _unset(value: object) -> bool:
    """Return whether a policy value is left out of the JSON: unset, empty, zero or false."""
    return not value


class Paused(_WireModel):
    """A pause: no window fires before ``until`` (forever when it is None)."""

    model_config = ConfigDict(extra="forbid")

    note: str = Field(default="", max_length=NOTE_MAX_LENGTH)
    until: datetime | None = None

    @field_validator("until", mode="before")
    @classmethod
    def _parse_until(cls, value: object) -> datetime | None:
        return parse_go_time(value)

    @field_serializer("until")
    def _dump_until(self, value: datetime | None) -> str:
        return format_go_time(value)

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        return omit_empty(self, handler(self), ("note", "until"))


class Blackout(_WireModel):
    """Local times on some days when the row's windows are skipped: ``[from, to)``.

    ``to`` before ``from`` crosses midnight: the blackout starts on each of
    ``days`` and ends the next day.
    """

    model_config = ConfigDict(
        extra="forbid", serialize_by_alias=True, validate_by_alias=True, validate_by_name=True
    )

    days: list[str]
    start: str = Field(alias="from")
    to: str

    @field_validator("days")
    @classmethod
    def _days(cls, value: list[str]) -> list[str]:
        _check_days(value)
        return value

    @field_validator("start")
    @classmethod
    def _start(cls, value: str) -> str:
        if value == "24:00":
            raise ValueError("'24:00' is only a 'to' (the end of the day)")
        hh_mm_minutes(value)
        return value

    @field_validator("to")
    @classmethod
    def _to(cls, value: str) -> str:
        hh_mm_minutes(value)
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> Self:
        if hh_mm_minutes(self.start) == hh_mm_minutes(self.to) % 1440:
            raise ValueError(
                f"from {self.start!r} equals to {self.to!r}: a blackout must not be empty "
                "(a whole day is from 00:00 to 24:00)"
            )
        return self

    @property
    def start_minute(self) -> int:
        """``from`` as minutes since local midnight."""
        return hh_mm_minutes(self.start)

    @property
    def end_minute(self) -> int:
        """``to`` as minutes since local midnight (1440 for ``24:00``)."""
        return hh_mm_minutes(self.to)


class Schedule(_WireModel):
    """The cron-like shape of a schedule: days, hours and minute, an interval, or an event."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    days: list[str] | None = None
    hours: list[str] | None = None
    minute: str = ""
    interval_minutes: int | None = None
    on: str = ""

    @property
    def is_event(self) -> bool:
        """True when the schedule never fires on the clock (``on`` is set)."""
        return self.on != ""

    @property
    def is_interval(self) -> bool:
        """True when ``interval_minutes`` overrides days, hours and minute."""
        return not self.is_event and self.interval_minutes is not None

    @property
    def has_wildcard_hours(self) -> bool:
        """True when hours contains ``*``: it fires in both copies of a repeated hour."""
        return self.hours is not None and "*" in self.hours

    @model_validator(mode="after")
    def _check_shape(self) -> Self:
        if self.is_event:
            return self
        if self.interval_minutes is not None:
            if self.interval_minutes < 1:
                raise ValueError(f"interval_minutes {self.interval_minutes} is below 1")
            return self
        if not self.days:
            raise ValueError("days is empty or null on a clock schedule")
        if not self.hours:
            raise ValueError("hours is empty or null on a clock schedule")
        for day in self.days:
            if day != "*" and day not in DAY_NAMES:
                raise ValueError(f"unknown day name {day!r} (expected mon..sun or *)")
        for hour in self.hours:
            if hour != "*":
                _check_number(hour, 0, 23, "hour")
        _check_number(self.minute, 0, 59, "minute")
        return self

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            if self.interval_minutes is None:
                data.pop("interval_minutes", None)
            if not self.on:
                data.pop("on", None)
        return data


class LocalSchedule(_WireModel):
    """One schedule row as the controller serves it and the cache stores it."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)
    name: str
    repo_id: str = ""
    action: str = Field(min_length=1)
    storage: str = ""
    schedule: Schedule
    miss_policy: MissPolicy
    enabled: bool
    params: dict[str, Any] | None = None
    version: int = 0
    # Policies. Every one is left out of the JSON when unset, so a row
    # without them is byte for byte the Go kit's, which ignores them.
    timezone: str = Field(default="", exclude_if=_unset)
    overlap: Overlap | None = Field(default=None, exclude_if=_unset)
    jitter: int = Field(default=0, ge=0, le=JITTER_MAX, strict=True, exclude_if=_unset)
    catchup_window: int | None = Field(
        default=None, ge=CATCHUP_MIN, le=CATCHUP_MAX, strict=True, exclude_if=_unset
    )
    paused: Paused | None = Field(default=None, exclude_if=_unset)
    not_before: datetime | None = Field(default=None, exclude_if=_unset)
    not_after: datetime | None = Field(default=None, exclude_if=_unset)
    blackouts: list[Blackout] | None = Field(default=None, exclude_if=_unset)
    min_interval: int = Field(
        default=0, ge=0, le=MIN_INTERVAL_MAX, strict=True, exclude_if=_unset
    )
    repo_lock: bool = Field(default=False, strict=True, exclude_if=_unset)

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        return check_zone_name(value) if value else value

    @field_validator("not_before", "not_after", mode="before")
    @classmethod
    def _parse_bound(cls, value: object) -> datetime | None:
        return parse_go_time(value)

    @field_serializer("not_before", "not_after")
    def _dump_bound(self, value: datetime | None) -> str:
        return format_go_time(value)

    @field_validator("blackouts")
    @classmethod
    def _empty_blackouts_are_none(cls, value: list[Blackout] | None) -> list[Blackout] | None:
        return value or None

    # Field validators, not a model validator: they run only for rows that set
    # the field, so rows without policies validate as fast as before.
    @field_validator("not_after")
    @classmethod
    def _after_not_before(cls, value: datetime | None, info: ValidationInfo) -> datetime | None:
        before = info.data.get("not_before")
        if value is not None and before is not None and value < before:
            raise ValueError(
                f"not_after {format_go_time(value)} is before not_before {format_go_time(before)}"
            )
        return value

    @field_validator("repo_lock")
    @classmethod
    def _lock_needs_a_repo(cls, value: bool, info: ValidationInfo) -> bool:
        if value and not info.data.get("repo_id"):
            raise ValueError("repo_lock is true but repo_id is empty: the lock is per repository")
        return value

    @field_validator("params")
    @classmethod
    def _empty_params_are_none(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Written as absent (omitempty), so read as absent: the copy in memory then
        # equals what the file loads back as.
        return value or None

    @field_validator("id", "action", "repo_id")
    @classmethod
    def _identifier(cls, value: str, info: ValidationInfo) -> str:
        if info.context is not None and info.context.get(STORED_BEFORE_RULES):
            return value
        if info.field_name == "repo_id" and not value:
            return value  # repo_id is optional
        return check_identifier(value, info.field_name or "identifier")

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        return omit_empty(self, handler(self), ("storage", "params"))


def copy_row(row: LocalSchedule) -> LocalSchedule:
    """Return a copy of row an agent's callback may change without touching the cache."""
    return row.model_copy(
        update={
            "schedule": row.schedule.model_copy(deep=True),
            "params": copy.deepcopy(row.params) if row.params else row.params,
            "paused": row.paused.model_copy() if row.paused else None,
            "blackouts": [item.model_copy(deep=True) for item in row.blackouts]
            if row.blackouts else row.blackouts,
        }
    )


class Cache(_WireModel):
    """The on-disk cache: the Go kit's three fields plus one Go ignores.

    ``first_seen_at`` records when this agent first saw each schedule (no
    window before that minute ever fires); ``etag`` is the controller's ETag
    for the list at ``etag_url``, sent back as ``If-None-Match`` so an unchanged
    list costs a 304. Invalid rows in a cache file are
    dropped on load by :mod:`sched_core.cache`.
    """

    model_config = ConfigDict(extra="ignore")

    schedules: list[LocalSchedule] = Field(default_factory=list)
    last_fired_at: dict[str, datetime] = Field(default_factory=dict)
    last_fetched_at: datetime | None = None
    first_seen_at: dict[str, datetime] = Field(default_factory=dict)
    etag: str | None = None
    etag_url: str | None = None

    @field_validator("schedules", mode="before")
    @classmethod
    def _null_schedules(cls, value: object) -> object:
        return [] if value is None else value

    @field_validator("last_fired_at", "first_seen_at", mode="before")
    @classmethod
    def _parse_time_map(cls, value: object) -> dict[str, datetime]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("expected an object of schedule id to time")
        parsed = {str(key): parse_go_time(item) for key, item in value.items()}
        return {key: item for key, item in parsed.items() if item is not None}

    @field_validator("last_fetched_at", mode="before")
    @classmethod
    def _parse_time(cls, value: object) -> datetime | None:
        return parse_go_time(value)

    @field_serializer("last_fired_at", "first_seen_at")
    def _dump_time_map(self, value: dict[str, datetime]) -> dict[str, str]:
        return {key: format_go_time(value[key]) for key in sorted(value)}

    @field_serializer("last_fetched_at")
    def _dump_time(self, value: datetime | None) -> str:
        return format_go_time(value)

    @model_serializer(mode="wrap")
    def _omit_first_seen_when_empty(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            if not self.first_seen_at:
                data.pop("first_seen_at", None)
            if self.etag is None:
                data.pop("etag", None)
                data.pop("etag_url", None)
        return data
