"""The error hierarchy: one root, each subclass also the built-in it resembles.

Rule: every error the kit raises on purpose is a :class:`SchedError`, and its
docstring is its default message (procrastinate's pattern)::

    SchedError (Exception)
    ├── ConfigError (ValueError)     a bad Config, Spec or setting: fix it and restart
    ├── ScheduleError (ValueError)   a bad identifier or row field (check_identifier,
    │                                the LocalSchedule validators raise it inside pydantic)
    ├── WireError (ValueError)       JSON from outside breaks the wire rules (jsonwire);
    │                                carries where (loc), which rule (rule: syntax,
    │                                number, constant, surrogate, depth, nul), the
    │                                controller's error type (kind) and the reason
    └── PullError (RuntimeError)     a refused pull: the last good list is kept

A pull turns every failure (transport, :class:`WireError`, a refused list, a
cache that cannot be written) into a ``PullError``, so that is the only error
``Scheduler.pull`` raises for bad input.
"""

from __future__ import annotations


class SchedError(Exception):
    """A scheduling error occurred."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(SchedError, ValueError):
    """The scheduler configuration is invalid."""


class PullError(SchedError, RuntimeError):
    """The schedule list could not be pulled; the last good list is kept."""


class ScheduleError(SchedError, ValueError):
    """A schedule row, or an identifier in one, is invalid."""


class WireError(SchedError, ValueError):
    """JSON from outside breaks the wire rules."""

    def __init__(
        self,
        reason: str,
        *,
        loc: tuple[str | int, ...] = (),
        kind: str = "json_invalid",
        rule: str = "syntax",
    ) -> None:
        self.reason = reason
        self.loc = loc
        self.kind = kind
        self.rule = rule
        where = format_loc(loc)
        super().__init__(f"{where}: {reason}" if where else reason)


def format_loc(loc: tuple[str | int, ...]) -> str:
    """Return a location in a JSON document as text: ``schedules[3].params.x``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text
