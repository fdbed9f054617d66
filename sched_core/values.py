"""The wire's values and their rules: Go times, identifiers, free text, zone names, local times.

One rule each, used by every part that reads a value from outside (the kit's rows, the
controller's paths and bodies, a node's report, the operator's tables):

- a time is RFC 3339 as Go writes it (:func:`format_go_time`, :func:`parse_go_time`;
  ``0001-01-01T00:00:00Z`` is "never"), and an API time carries its offset
  (:func:`parse_api_time`);
- an identifier (a schedule id, a node's name) is :data:`IDENTIFIER_RULE`
  (:func:`check_identifier`);
- free text is bounded and has no control or bidi character (:func:`text_problem`,
  :func:`check_text`, :data:`TEXT_RULE`);
- a zone is an IANA name, never ``localtime`` (:func:`check_zone_name`), read as UTC
  where it cannot be (:func:`zone_or_utc`), and shown with :func:`local_text`.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sched_core.errors import ScheduleError

GO_ZERO_TIME = "0001-01-01T00:00:00Z"

TICK = timedelta(microseconds=1)
"""The smallest step of a datetime: ``until + TICK`` makes a search's end inclusive, and
``at - TICK`` starts one just before an instant."""
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


def utc_text(value: datetime | None) -> str | None:
    """Return an instant as RFC 3339 in UTC (``2026-12-03T07:30:00Z``), or None."""
    return None if value is None else format_go_time(value)


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


def retry_after_seconds(header: str | None, *, most: float) -> float | None:
    """Return a ``Retry-After`` header's delay in seconds, at most ``most``; None when there is
    none, or it is an HTTP date or anything else than whole seconds (read as not said)."""
    text = (header or "").strip()
    if not text.isdigit():
        return None
    return min(float(text), most)


def hh_mm_minutes(value: str) -> int:
    """Return ``HH:MM`` (``24:00`` allowed) as minutes since midnight."""
    if value == "24:00":
        return 1440
    match = _HH_MM.fullmatch(value)
    if match is None:
        raise ValueError(f"{value!r} is not a time HH:MM from 00:00 to 23:59")
    return int(match.group(1)) * 60 + int(match.group(2))
