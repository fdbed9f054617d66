"""The central scheduler's settings: ``CentralSettings``, from flags and the environment.

A pydantic model, frozen: every field is checked on construction (a bad value is
a :class:`ConfigError` naming it). :meth:`CentralSettings.from_env` takes the
first reconnect delay from ``SCHED_RETRY_DELAY`` (:class:`ControllerSettings`,
the controller's environment).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core.core_schema import ValidationInfo

from controller.defaults import DEFAULT_DISPATCH_RETENTION, DEFAULT_MAX_ATTEMPTS
from controller.settings import DEFAULT_RETRY_DELAY, ControllerSettings, problems
from sched_core.errors import ConfigError

RETRY_DELAY_ENV = ControllerSettings.env_name("retry_delay")
"""Seconds before the first reconnect (or retry) after a failure; doubles up to a cap."""

PRUNE_BATCH = 10_000
"""Dispatch records deleted per transaction when pruning."""


def retry_delay_from_env() -> float:
    """Return ``SCHED_RETRY_DELAY`` in seconds (1 when unset); ConfigError if invalid."""
    return ControllerSettings.read().retry_delay


def default_worker_id() -> str:
    """Return a worker id unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


_POSITIVE_SECONDS = (
    "poll_interval", "lease", "retry_delay", "max_retry_delay", "dispatch_retry_delay",
    "max_dispatch_retry_delay", "listen_timeout", "health_interval", "prune_interval",
)
_LEAST = {"batch_size": (1, "1 or more"), "max_attempts": (0, "0 (no limit) or more")}
"""The whole-number settings' least values, and how their error says it."""


def _positive_seconds(value: object, name: str) -> object:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    return value


class CentralSettings(BaseModel):
    """How a central scheduler behaves; validated when made (ConfigError naming the field).

    Times are seconds. Frozen: :meth:`but` returns a changed copy.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_interval: float = Field(5.0, description="the longest wait between passes")
    lease: float = Field(10.0, description=(
        "how long a claim is held before another instance may claim it; renewed every "
        "`heartbeat_interval` while its dispatch is in flight, so a killed instance's claims "
        "are taken over about `lease` seconds after its last renewal"))
    batch_size: int = Field(100, description="tasks claimed per pass")
    retry_delay: float = Field(DEFAULT_RETRY_DELAY, description=(
        "backoff base of reconnects and failed passes (`SCHED_RETRY_DELAY` in `from_env`), "
        "doubling up to `max_retry_delay`"))
    max_retry_delay: float = Field(30.0, description="the cap of that backoff")
    dispatch_retry_delay: float = Field(10.0, description=(
        "backoff base after a failed dispatch, doubling up to `max_dispatch_retry_delay`"))
    max_dispatch_retry_delay: float = Field(600.0, description="the cap of that backoff")
    stale_after: float = Field(10.0, description=(
        "when a dispatch record left \"dispatching\" is taken over: once neither its start "
        "nor its worker's last renewal is that recent"))
    heartbeat_interval: float | None = Field(None, description=(
        "how often leases in flight are renewed (None: a third of the lease, at most "
        "`stale_after` / 2 when that is shorter)"))
    listen_timeout: float = Field(0.25, description=(
        "how long the listener waits for a notification at a time (and so how long it takes "
        "to stop)"))
    health_interval: float = Field(30.0, description=(
        "how often the listener checks its connection"))
    wake_on_local_saves: bool = Field(True, description=(
        "wake the loop on a save in this process (SQLite's NOTIFY)"))
    claim_on_notify: bool = Field(True, description=(
        "the listener claims on its own connection as soon as a notification arrives, "
        "instead of waking the loop"))
    durable_claims: bool = Field(False, description=(
        "claims wait for the WAL flush (see the module docstring of `controller.central` for "
        "why the default does not)"))
    max_attempts: int = Field(DEFAULT_MAX_ATTEMPTS, description=(
        "failed dispatches of one (task, scheduled time) before giving up on it "
        "(`controller.claims.give_up`: a recurring task moves on to its next run, a one-shot "
        "task is disabled, the failed record stays); 0 retries forever"))
    dispatch_retention: float | None = Field(DEFAULT_DISPATCH_RETENTION, description=(
        "how long finished dispatch records are kept (None: forever)"))
    prune_interval: float = Field(3600.0, description="how often the loop prunes them")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(problems(exc)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CentralSettings are frozen: use .but({name}=...)")

    @field_validator(*_POSITIVE_SECONDS, mode="before")
    @classmethod
    def _check_seconds(cls, value: object, info: ValidationInfo) -> object:
        return _positive_seconds(value, str(info.field_name))

    @field_validator("stale_after", mode="before")
    @classmethod
    def _check_stale_after(cls, value: object) -> object:
        if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
            raise ValueError(f"stale_after={value!r} must be 0 or more seconds")
        return value

    @field_validator("heartbeat_interval", mode="before")
    @classmethod
    def _check_heartbeat(cls, value: object) -> object:
        if value is not None and not (
            isinstance(value, int | float) and value > 0 and math.isfinite(value)
        ):
            raise ValueError(f"heartbeat_interval={value!r} must be a positive number "
                             "of seconds (or None: a third of the lease)")
        return value

    @field_validator(*_LEAST)
    @classmethod
    def _check_least(cls, value: int, info: ValidationInfo) -> int:
        least, said = _LEAST[str(info.field_name)]
        if value < least:
            raise ValueError(f"{info.field_name}={value} must be {said}")
        return value

    @field_validator("dispatch_retention", mode="before")
    @classmethod
    def _check_retention(cls, value: object) -> object:
        if isinstance(value, int | float) and not value > 0:
            raise ValueError(f"dispatch_retention={value} must be a positive number of seconds")
        return value

    @classmethod
    def from_env(cls, **overrides: Any) -> CentralSettings:
        """Return the defaults with ``SCHED_RETRY_DELAY`` read, then overrides applied.

        ConfigError for an invalid environment value or override, or an unknown name.
        """
        unknown = sorted(set(overrides) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"unknown central scheduler setting(s): {', '.join(unknown)}")
        values: dict[str, Any] = {"retry_delay": retry_delay_from_env()}
        values.update(overrides)
        return cls(**values)

    @property
    def renew_every(self) -> float:
        """Seconds between lease renewals of the claims in flight."""
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        bound = self.lease / 3
        if self.stale_after > 0:
            bound = min(bound, self.stale_after / 2)
        return max(bound, 0.01)

    def but(self, **changes: Any) -> CentralSettings:
        """Return a copy with changes (validated again)."""
        return type(self)(**{**self.model_dump(exclude_unset=True), **changes})
