"""What a :class:`~sched_core.scheduler.Scheduler` is given and what it hands back.

``Config`` (how it pulls, where its cache and its record of decided windows are, what it
calls; checked on construction, a bad field is a :class:`ConfigError` naming it), ``Fire``
(one window or on-demand fire handed to the agent's callbacks) and ``TurnReport`` (what one
turn of the firing loop did). The trigger keys are the planner's (:mod:`sched_core.plan`),
defined once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

from sched_core.clock import utcnow
from sched_core.errors import ConfigError
from sched_core.matcher import DEFAULT_TZ, zone
from sched_core.model import LocalSchedule
from sched_core.plan import Missed
from sched_core.pull import redact_url
from sched_core.view import NodeView

if TYPE_CHECKING:
    import httpx



@dataclass(frozen=True)
class Fire:
    """One window (or on-demand fire) handed to the agent's callbacks.

    ``schedule`` is a copy of the row (the callback may change it); ``key`` the
    window's stable idempotency key (``window_key``: a crash between a start and its
    record is deduplicated downstream), or ``<id>@<key>`` for a fire on demand.
    """

    schedule: LocalSchedule
    trigger_key: str
    missed_recovery: bool
    window: datetime | None
    key: str
    start: datetime | None = None
    """When the window's run was to start: the window plus the row's jitter (None on demand)."""
    reason: str = ""
    """Why: the start guard's reason for a window that runs; for one that does not (``skip``,
    ``fail``), why not."""


FireFunc = Callable[[Fire], object]
"""Start the work of a fire; raise when it did not start (the window is tried again)."""
MissedFunc = Callable[[list[Missed], NodeView], object]
"""Report the windows missed while the loop was not running (``view``: copies of the rows)."""


@dataclass
class Config:
    """How a scheduler pulls, where it keeps its cache and what it calls.

    ``pull_url``, ``node_name``, ``cache_path`` and ``fire`` are required; a
    missing or invalid field raises :class:`ConfigError` naming it.

    The callbacks (each called from the firing loop's threads, several at once):
    ``fire`` starts a window's work (or a fire on demand); ``skip`` hears of a
    window the start guard does not run, or one coalesced into a later one;
    ``missed`` of the windows missed while the loop was not running (its recovery,
    if any, comes to ``fire``); ``fail`` of a window that could not start within its
    grace. Without ``skip``, ``missed`` or ``fail`` the kit logs them. ``ahead(n)``,
    when given, hears before the loop's last sleep ahead of a start (at most 30 s) how
    many windows start then, so an agent can have that many workers ready.
    ``decided_path`` (default ``<cache stem>.decided.json`` beside the cache) keeps
    the windows the loop decided, so a restart neither decides one twice nor loses
    one. ``clock`` is the loop's clock (the wall clock, :func:`~sched_core.clock.utcnow`).
    """

    pull_url: str = ""
    node_name: str = ""
    cache_path: str | Path = ""
    fire: FireFunc | None = None
    skip: FireFunc | None = None
    missed: MissedFunc | None = None
    fail: FireFunc | None = None
    ahead: Callable[[int], None] | None = None
    decided_path: str | Path = ""
    http_client: httpx.Client | None = None
    timezone: ZoneInfo | str = field(default_factory=lambda: DEFAULT_TZ)
    pull_interval: timedelta = timedelta(seconds=300)
    fire_grace: timedelta = timedelta(minutes=5)
    clock: Callable[[], datetime] = utcnow

    def __post_init__(self) -> None:
        for name in ("pull_url", "node_name", "cache_path"):
            if not getattr(self, name):
                raise ConfigError(f"Config.{name} is required")
        if self.fire is None or not callable(self.fire):
            raise ConfigError("Config.fire is required and must be callable")
        for name in ("skip", "missed", "fail", "ahead", "clock"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"Config.{name} must be callable")
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
        for name in ("pull_interval", "fire_grace"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ConfigError(f"Config.{name} must be a positive timedelta, got {value!r}")
        self.cache_path = Path(self.cache_path)
        if not self.cache_path.parent.is_dir():
            raise ConfigError(f"Config.cache_path folder {self.cache_path.parent} does not exist")
        if not self.decided_path:
            self.decided_path = self.cache_path.with_name(f"{self.cache_path.stem}.decided.json")
        self.decided_path = Path(self.decided_path)
        if not self.decided_path.parent.is_dir():
            raise ConfigError(
                f"Config.decided_path folder {self.decided_path.parent} does not exist")

    @property
    def tz(self) -> ZoneInfo:
        """The timezone as a ZoneInfo."""
        assert isinstance(self.timezone, ZoneInfo)
        return self.timezone

    @property
    def path(self) -> Path:
        """The cache path as a Path."""
        return Path(self.cache_path)

    @property
    def decided(self) -> Path:
        """The record of decided windows as a Path."""
        return Path(self.decided_path)


@dataclass(frozen=True)
class TurnReport:
    """What one turn of the firing loop did, for logs, artifacts and tests."""

    fired: list[Fire]
    """Windows started: ``fire`` returned (recoveries included)."""
    skipped: list[Fire]
    """Windows that do not run, each with its reason (the start guard's, or coalesced)."""
    failed: list[tuple[Fire, str]]
    """Windows whose start failed this turn, and why: tried again while within the grace."""
    ended: list[Fire]
    """Windows that could not start within their grace, handed to ``fail`` with the reason."""
    missed: list[Missed]
    """Windows missed while the loop was not running, per schedule (the miss policy's)."""
    coalesced: dict[str, int]
    """Per schedule, how many older due windows were coalesced into its latest."""
    upcoming: datetime | None
    """When the loop looks again (the next start, or a retry), or None."""
    starting: int = 0
    """How many windows start at ``upcoming`` (0 for a retry, or none)."""
