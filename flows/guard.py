"""The start guard's shell: decide from the node's cache, and stamp the window, in one step.

1. Read when Prefect first tried to start this run (its state history): a run
   that then waited for a job slot is not late.
2. Under the cache file's lock, reload the cache, find the row, and let
   :func:`sched_core.plan.decide_start` decide.
3. If the window runs, stamp it as the schedule's last fire and save, still
   under the lock: a second run of the same window then finds it stamped, so
   two runs of one window can never both pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from prefect.client.orchestration import get_client

from flows.registry import first_try
from flows.settings import AgentSettings
from sched_core.cache import load_cache_report, locked, save_cache
from sched_core.model import LocalSchedule
from sched_core.plan import StartDecision, decide_start


@dataclass(frozen=True)
class Start:
    """The guard's decision and the row it was made on (None: the row is gone)."""

    decision: StartDecision
    row: LocalSchedule | None
    first_try: datetime


def first_try_of(run_id: UUID | None, fallback: datetime) -> datetime:
    """Return when Prefect first tried to start the run; fallback when unknown (no run, no API)."""
    if run_id is None:
        return fallback
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(run_id)
    return first_try(states) or fallback


def start_window(
    settings: AgentSettings,
    *,
    schedule_id: str,
    window: datetime,
    tried: datetime,
    now: datetime,
    retry: bool,
) -> Start:
    """Decide whether the run of schedule_id's window runs; stamp it when it does (steps 2, 3)."""
    path = settings.cache_path
    with locked(path):
        cache, _dropped = load_cache_report(path, now=now)
        row = next((item for item in cache.schedules if item.id == schedule_id), None)
        # A cache the Go kit wrote has no first-seen times: its schedules count as
        # first seen when it last fetched them, or now if it never did (the kit's rule).
        first_seen = cache.first_seen_at.get(schedule_id) or cache.last_fetched_at or now
        decision = decide_start(
            row,
            schedule_id=schedule_id,
            window=window,
            last_fired=cache.last_fired_at.get(schedule_id),
            first_seen=first_seen,
            first_try=tried,
            now=now,
            grace=settings.grace,
            tz=settings.tz,
            retry=retry,
        )
        if decision.stamp:
            last = cache.last_fired_at.get(schedule_id)
            cache.last_fired_at[schedule_id] = window if last is None else max(last, window)
            if row is not None:
                cache.first_seen_at.setdefault(schedule_id, first_seen)
            save_cache(path, cache)
    return Start(decision=decision, row=row, first_try=tried)


def cached_row(settings: AgentSettings, schedule_id: str, *, now: datetime) -> LocalSchedule:
    """Return the cached row with schedule_id (a chain or ad hoc run), or raise ConfigError."""
    from sched_core import ConfigError
    from sched_core.cache import load_cache

    cache = load_cache(settings.cache_path, now=now)
    for row in cache.schedules:
        if row.id == schedule_id:
            return row
    known = ", ".join(sorted(row.id for row in cache.schedules)) or "none"
    raise ConfigError(
        f"no schedule {schedule_id!r} in the cache {settings.cache_path} (known: {known})"
    )
