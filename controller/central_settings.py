"""The central scheduler's settings: ``CentralSettings``, read from flags and the environment.

Every field is checked on construction (a bad value is a :class:`ConfigError`
naming it); ``SCHED_RETRY_DELAY`` sets the first reconnect delay.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import dataclass, fields, replace
from typing import Any

from controller.defaults import DEFAULT_DISPATCH_RETENTION, DEFAULT_MAX_ATTEMPTS
from sched_core.errors import ConfigError

RETRY_DELAY_ENV = "SCHED_RETRY_DELAY"
"""Seconds before the first reconnect (or retry) after a failure; doubles up to a cap."""

DEFAULT_RETRY_DELAY = 1.0
PRUNE_BATCH = 10_000
"""Dispatch records deleted per transaction when pruning."""


def retry_delay_from_env(default: float = DEFAULT_RETRY_DELAY) -> float:
    """Return ``SCHED_RETRY_DELAY`` in seconds (default when unset); ConfigError if invalid."""
    text = os.environ.get(RETRY_DELAY_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{RETRY_DELAY_ENV}={text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{RETRY_DELAY_ENV}={text!r} must be a positive number of seconds")
    return value


def default_worker_id() -> str:
    """Return a worker id unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


_POSITIVE_SECONDS = (
    "poll_interval", "lease", "retry_delay", "max_retry_delay", "dispatch_retry_delay",
    "max_dispatch_retry_delay", "listen_timeout", "health_interval", "prune_interval",
)


@dataclass(frozen=True, slots=True)
class CentralSettings:
    """How a central scheduler behaves; validated when made (ConfigError naming the field).

    Times are seconds.

    :param poll_interval: the longest wait between passes.
    :param lease: how long a claim is held before another instance may claim it; renewed
        every ``heartbeat_interval`` while its dispatch is in flight, so a killed instance's
        claims are taken over about ``lease`` seconds after its last renewal.
    :param batch_size: tasks claimed per pass.
    :param retry_delay: backoff base of reconnects and failed passes (``SCHED_RETRY_DELAY``
        in :meth:`from_env`), doubling up to ``max_retry_delay``.
    :param max_retry_delay: the cap of that backoff.
    :param dispatch_retry_delay: backoff base after a failed dispatch, doubling up to
        ``max_dispatch_retry_delay``.
    :param max_dispatch_retry_delay: the cap of that backoff.
    :param stale_after: when a dispatch record left "dispatching" is taken over: once
        neither its start nor its worker's last renewal is that recent.
    :param heartbeat_interval: how often leases in flight are renewed (None: a third
        of the lease, at most ``stale_after`` / 2 when that is shorter).
    :param listen_timeout: how long the listener waits for a notification at a time
        (and so how long it takes to stop).
    :param health_interval: how often the listener checks its connection.
    :param wake_on_local_saves: wake the loop on a save in this process (SQLite's NOTIFY).
    :param claim_on_notify: the listener claims on its own connection as soon as a
        notification arrives, instead of waking the loop.
    :param durable_claims: claims wait for the WAL flush (see the module docstring for
        why the default does not).
    :param max_attempts: failed dispatches of one (task, scheduled time) before giving up
        on it (:func:`controller.claims.give_up`: a recurring task moves on to its next
        run, a one-shot task is disabled, the failed record stays); 0 retries forever.
    :param dispatch_retention: how long finished dispatch records are kept (None: forever).
    :param prune_interval: how often the loop prunes them.
    """

    poll_interval: float = 5.0
    lease: float = 10.0
    batch_size: int = 100
    retry_delay: float = DEFAULT_RETRY_DELAY
    max_retry_delay: float = 30.0
    dispatch_retry_delay: float = 10.0
    max_dispatch_retry_delay: float = 600.0
    stale_after: float = 10.0
    heartbeat_interval: float | None = None
    listen_timeout: float = 0.25
    health_interval: float = 30.0
    wake_on_local_saves: bool = True
    claim_on_notify: bool = True
    durable_claims: bool = False
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    dispatch_retention: float | None = DEFAULT_DISPATCH_RETENTION
    prune_interval: float = 3600.0

    def __post_init__(self) -> None:
        for name in _POSITIVE_SECONDS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
        if not (isinstance(self.stale_after, int | float) and self.stale_after >= 0
                and math.isfinite(self.stale_after)):
            raise ConfigError(
                f"stale_after={self.stale_after!r} must be 0 or more seconds"
            )
        heartbeat = self.heartbeat_interval
        if heartbeat is not None and not (
            isinstance(heartbeat, int | float) and heartbeat > 0 and math.isfinite(heartbeat)
        ):
            raise ConfigError(f"heartbeat_interval={heartbeat!r} must be a positive number "
                              "of seconds (or None: a third of the lease)")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be 1 or more")
        if self.max_attempts < 0:
            raise ConfigError(f"max_attempts={self.max_attempts} must be 0 (no limit) or more")
        if self.dispatch_retention is not None and not self.dispatch_retention > 0:
            raise ConfigError(
                f"dispatch_retention={self.dispatch_retention} must be a positive number "
                "of seconds"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> CentralSettings:
        """Return the defaults with ``SCHED_RETRY_DELAY`` read, then overrides applied.

        ConfigError for an invalid environment value or override, or an unknown name.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
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
        return replace(self, **changes)
