"""The error hierarchy: one root, each subclass also the built-in it resembles."""

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
    """A schedule row is invalid."""
