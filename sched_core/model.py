"""The wire format: schedule rows and the cache file, byte-for-byte the Go kit's JSON.

Rule: ``model_dump_json()`` of every model here is what Go's ``encoding/json``
writes for the same value: the same field order, ``omitempty`` fields left out
when empty, map keys sorted, ``<``, ``>`` and ``&`` escaped, times in RFC 3339
with trailing fractional zeros trimmed and ``0001-01-01T00:00:00Z`` for "never".
Parsing accepts what Go writes (up to 9 fractional digits, any UTC offset,
fields it does not know).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from functools import lru_cache
from typing import Any, Self
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

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

from sched_core.errors import ScheduleError

DAY_NAMES: tuple[str, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
"""Go's three-letter lowercase weekday names, indexed like ``datetime.weekday()``."""

GO_ZERO_TIME = "0001-01-01T00:00:00Z"
"""How Go writes a ``time.Time`` that was never set."""

IDENTIFIER_MAX_LENGTH = 128
"""The longest identifier: with a prefix and a date it still fits a 255-byte file name."""

IDENTIFIER_RULE = (
    f"1 to {IDENTIFIER_MAX_LENGTH} ASCII letters, digits, '.', '_' or '-', "
    "not starting with '.' or '-'"
)
"""What an identifier (a schedule id, repo_id, action, node name) may be, in words."""

STORED_BEFORE_RULES = "stored_before_rules"
"""A validation context key: ``{STORED_BEFORE_RULES: True}`` reads a row a database stored
before the identifier rule, so it stays readable and deletable. Every row from outside (a
request body, a pull, a cache file) is validated without it, and so checked."""

_IDENTIFIER = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{IDENTIFIER_MAX_LENGTH - 1}}}")

_GO_ESCAPES = {
    "<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029",
}
_GO_ESCAPE_RE = re.compile("[<>&\u2028\u2029]")


@lru_cache(maxsize=4096)  # a cache file repeats the same few instants many times
def format_go_time(value: datetime | None) -> str:
    """Return value as Go's RFC 3339 (nano) text in UTC; the zero time for None."""
    if value is None:
        return GO_ZERO_TIME
    value = value.astimezone(UTC)
    # Not strftime: it writes year 1 as "1", and Go (and fromisoformat) want 4 digits.
    text = (
        f"{value.year:04d}-{value.month:02d}-{value.day:02d}"
        f"T{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
    )
    if value.microsecond:
        text += ("." + f"{value.microsecond:06d}").rstrip("0")
    return text + "Z"


def parse_go_time(value: object) -> datetime | None:
    """Return an aware UTC datetime from Go's RFC 3339 text; None for the zero time."""
    if value is None:
        return None
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        parsed = datetime.fromisoformat(value)
    else:
        raise ValueError(f"expected an RFC 3339 time string, got {type(value).__name__}")
    if parsed.tzinfo is None:
        raise ValueError(f"time {value!r} has no UTC offset")
    try:
        parsed = parsed.astimezone(UTC)
    except OverflowError as exc:  # e.g. 0001-01-01T00:00:00+01:00 is before year 1 in UTC
        raise ValueError(f"time {value!r} is out of range in UTC") from exc
    if parsed.year == 1 and parsed.month == 1 and parsed.day == 1 and parsed.hour == 0:
        return None
    return parsed


def check_identifier(value: str, what: str) -> str:
    """Return value if it is an identifier (see IDENTIFIER_RULE); else raise ScheduleError.

    Identifiers end up in argv elements, file names, ``find -name`` patterns,
    tags and log lines, so they are held to a conservative pattern: no path
    separator, no ``..`` start, no glob or shell character, no option-like
    leading ``-``, nothing invisible. The error names what, the value and the rule.
    """
    if isinstance(value, str) and _IDENTIFIER.fullmatch(value) is not None:
        return value
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:45] + "..." + shown[-10:]
    raise ScheduleError(f"{what} {shown} is not an identifier: {IDENTIFIER_RULE}")


NAME_MAX_LENGTH = 200
"""The longest name a person gives (a schedule's ``name``, a task's name), in characters."""

TEXT_MAX_LENGTH = 2000
"""The longest other free text from outside (a node's error message), in characters."""

_UNSAFE_TEXT = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]"
)
_MULTILINE_OK = frozenset("\n\t")

TEXT_RULE = (
    "free text holds no control character (U+0000-001F, U+007F-009F), no bidi control "
    "(U+061C, U+200E, U+200F, U+202A-202E, U+2066-2069), no line or paragraph separator "
    "(U+2028, U+2029) and no U+FEFF"
)
"""What free text from outside (names, notes, versions, messages) may not hold, in words."""


def _text_kind(char: str) -> str:
    """Return what an unsafe character of free text is, in words."""
    if char in "\u2028\u2029":
        return "a line or paragraph separator"
    if char == "\ufeff":
        return "a byte order mark"
    if char in "\u061c\u200e\u200f" or "\u202a" <= char <= "\u2069":
        return "a bidi control"
    return "a control character"


def text_problem(value: str, *, max_length: int, multiline: bool = False) -> str | None:
    """Return why value is not acceptable free text (too long, a control character), or None.

    Bidi controls reorder what a reader sees (``U+202E`` shows ``exe.txt`` as
    ``txt.exe``) and control characters drive terminals or forge lines, so
    neither may be in text a page, a table or a log line shows. ``multiline``
    allows newlines and tabs (a node's error message).
    """
    if len(value) > max_length:
        return f"is {len(value)} characters long; the most is {max_length}"
    for match in _UNSAFE_TEXT.finditer(value):
        char = match.group(0)
        if multiline and char in _MULTILINE_OK:
            continue
        return (f"holds U+{ord(char):04X} ({_text_kind(char)}) at character "
                f"{match.start() + 1}; {TEXT_RULE}")
    return None


def check_text(value: str, what: str, *, max_length: int, multiline: bool = False) -> str:
    """Return value if it is acceptable free text (see :func:`text_problem`); else ScheduleError.

    The one rule for text a client chooses and people read (a schedule's name,
    a pause note, a node's agent version or error, a task's name): bounded, and
    no control or bidi character. The error names what and why.
    """
    problem = text_problem(value, max_length=max_length, multiline=multiline)
    if problem is not None:
        raise ScheduleError(f"{what} {problem}")
    return value


def go_escape(text: str) -> str:
    """Escape ``<``, ``>``, ``&``, U+2028 and U+2029 in JSON text as Go's encoder does."""
    return _GO_ESCAPE_RE.sub(lambda m: _GO_ESCAPES[m.group(0)], text)


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

_ZONE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_+-]*(?:/[A-Za-z0-9_+-]+){0,3}")
_NOT_ZONES = frozenset({"localtime", "posixrules"})
_HH_MM = re.compile(r"([01][0-9]|2[0-3]):([0-5][0-9])")


def check_zone_name(value: str, what: str = "timezone") -> str:
    """Return value if it names an IANA zone this machine knows; else raise ValueError.

    Only names that look like IANA names (``Europe/Berlin``, ``UTC``, ``Etc/GMT+5``):
    never a path, and never ``localtime`` (the machine's own zone, which a row
    must not depend on).
    """
    shown = repr(value) if len(value) <= 60 else repr(value[:45]) + "..."
    if len(value) > 64 or _ZONE_NAME.fullmatch(value) is None or value in _NOT_ZONES \
            or value.startswith(("posix/", "right/")):
        raise ValueError(f"{what} {shown} is not an IANA zone name such as 'Europe/Berlin'")
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"{what} {shown} is not a zone this machine knows") from exc
    return value


def zone_or_utc(name: object) -> ZoneInfo:
    """Return the zone named (an IANA name from an API or a report), UTC when absent or unknown."""
    if isinstance(name, str) and name:
        try:
            return ZoneInfo(check_zone_name(name))
        except (ValueError, ZoneInfoNotFoundError):
            pass
    return ZoneInfo("UTC")


def parse_api_time(value: object) -> datetime | None:
    """Return an RFC 3339 time from an API as an aware UTC datetime; None if absent or bad."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed.astimezone(UTC) if parsed.tzinfo is not None else None


def local_text(instant: datetime | None, tz: ZoneInfo, fmt: str = "%a %Y-%m-%d %H:%M %Z") -> str:
    """Return an instant in tz (``Wed 2026-12-03 02:30 EST`` by default); ``-`` for None."""
    return "-" if instant is None else instant.astimezone(tz).strftime(fmt)


def _check_days(days: list[str]) -> None:
    if not days:
        raise ValueError("no days (expected mon..sun or *)")
    for day in days:
        if day != "*" and day not in DAY_NAMES:
            raise ValueError(f"unknown day name {day!r} (expected mon..sun or *)")


def hh_mm_minutes(value: str) -> int:
    """Return ``HH:MM`` (``24:00`` allowed) as minutes since midnight."""
    if value == "24:00":
        return 1440
    match = _HH_MM.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a time HH:MM from 00:00 to 23:59")
    return int(match.group(1)) * 60 + int(match.group(2))


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
        data = handler(self)
        if isinstance(data, dict):
            if not self.note:
                data.pop("note", None)
            if self.until is None:
                data.pop("until", None)
        return data


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
        data = handler(self)
        if isinstance(data, dict):
            if not self.storage:
                data.pop("storage", None)
            if not self.params:
                data.pop("params", None)
        return data


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
