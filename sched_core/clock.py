"""The kit's clock: the one clock read, and conversions that never read it.

Rule: :func:`utcnow` is the only function of the kit that reads the wall
clock. Everything else takes the instant it reasons about as an argument; a
caller with no instant of its own calls ``utcnow()`` itself, visibly.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Return the wall clock as an aware UTC datetime: the one clock read of the kit."""
    return datetime.now(UTC)


def as_utc(value: datetime, name: str = "now") -> datetime:
    """Return value as a plain ``datetime`` in UTC.

    Subclasses such as Prefect's pendulum-style ``DateTime`` are turned into the
    standard type, whose arithmetic and comparisons the kit relies on; a naive
    value is a ``ValueError`` naming it. There is no default: pass ``utcnow()``.
    """
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} {value!r} is naive; pass a timezone-aware datetime")
    utc = value.astimezone(UTC)
    return datetime(
        utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond,
        tzinfo=UTC,
    )


def now_or_clock(value: datetime | None, name: str = "now") -> datetime:
    """Return :func:`as_utc` of value, or of the wall clock when value is None.

    For the public methods whose ``now`` is optional: the clock read is here,
    named, not hidden in a converter.
    """
    return as_utc(utcnow() if value is None else value, name)


def floor_minute(instant: datetime) -> datetime:
    """Return instant with seconds and microseconds dropped."""
    return instant.replace(second=0, microsecond=0)
