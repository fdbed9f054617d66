"""What a :class:`~sched_core.scheduler.Scheduler` is given and what it hands back.

``Config`` (how it pulls, where its cache is, what it calls to fire; checked
on construction, a bad field is a :class:`ConfigError` naming it), ``Fire``
(one fire handed to the agent's callback) and ``TickReport`` (what one tick
or missed-run check did). The trigger keys are the planner's
(:mod:`sched_core.plan`), defined once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

from sched_core.errors import ConfigError
from sched_core.matcher import DEFAULT_TZ, zone
from sched_core.model import LocalSchedule
from sched_core.pull import redact_url

if TYPE_CHECKING:
    import httpx



@dataclass(frozen=True)
class Fire:
    """One fire handed to the agent's callback."""

    schedule: LocalSchedule
    trigger_key: str
    missed_recovery: bool
    window: datetime | None
    key: str


FireFunc = Callable[[Fire], object]


@dataclass
class Config:
    """How a scheduler pulls, where it keeps its cache and what it calls to fire.

    ``pull_url``, ``node_name``, ``cache_path`` and ``fire`` are required; a
    missing or invalid field raises :class:`ConfigError` naming it.
    """

    pull_url: str = ""
    node_name: str = ""
    cache_path: str | Path = ""
    fire: FireFunc | None = None
    http_client: httpx.Client | None = None
    timezone: ZoneInfo | str = field(default_factory=lambda: DEFAULT_TZ)
    fire_interval: timedelta = timedelta(seconds=60)
    pull_interval: timedelta = timedelta(seconds=300)
    fire_grace: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        for name in ("pull_url", "node_name", "cache_path"):
            if not getattr(self, name):
                raise ConfigError(f"Config.{name} is required")
        if self.fire is None or not callable(self.fire):
            raise ConfigError("Config.fire is required and must be callable")
        scheme = urlsplit(self.pull_url).scheme
        if scheme not in ("http", "https", "file"):
            raise ConfigError(
                f"Config.pull_url {redact_url(self.pull_url)!r} must be http(s):// or file://"
            )
        if isinstance(self.timezone, str):
            try:
                self.timezone = zone(self.timezone)
            except ValueError as exc:
                raise ConfigError(f"Config.timezone {self.timezone!r} is unknown") from exc
        for name in ("fire_interval", "pull_interval", "fire_grace"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ConfigError(f"Config.{name} must be a positive timedelta, got {value!r}")
        self.cache_path = Path(self.cache_path)
        if not self.cache_path.parent.is_dir():
            raise ConfigError(f"Config.cache_path folder {self.cache_path.parent} does not exist")

    @property
    def tz(self) -> ZoneInfo:
        """The timezone as a ZoneInfo."""
        assert isinstance(self.timezone, ZoneInfo)
        return self.timezone

    @property
    def path(self) -> Path:
        """The cache path as a Path."""
        return Path(self.cache_path)


@dataclass(frozen=True)
class TickReport:
    """What one tick fired, coalesced and failed, for logs and artifacts."""

    fired: list[Fire]
    failed: list[tuple[Fire, str]]
    coalesced: dict[str, int]
    held: dict[str, str] = field(default_factory=dict)
    """Schedules whose due window the row's policies hold back, with the guard's reason."""
