"""The start guard's shell: when Prefect first tried the run, and the kit's locked decision.

1. Read when Prefect first tried to start this run (its state history): a run
   that then waited for a job slot is not late.
2. :meth:`sched_core.Scheduler.start_window` decides from the node's cache
   under its lock and stamps the window in the same step, so two runs of one
   window can never both pass.
3. The re-run of a chain stage's interrupted job (no window) runs while its
   row is still a schedule of that stage (:func:`stage_rerun`).
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from prefect.client.orchestration import get_client

from flows.dispatch import build_scheduler
from flows.registry import first_try
from flows.settings import AgentSettings
from sched_core import ConfigError, LocalSchedule
from sched_core.chain import FOLLOW_WINDOW
from sched_core.plan import StartDecision, Verdict, stage_retry_allowed


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
) -> tuple[StartDecision, LocalSchedule | None]:
    """Decide whether the run of schedule_id's window runs; stamp the window when it does."""
    scheduler = build_scheduler(settings, now=now, pulls=False)
    return scheduler.start_window(schedule_id, window, first_try=tried, now=now, retry=retry)


def cached_row(settings: AgentSettings, schedule_id: str, *, now: datetime) -> LocalSchedule:
    """Return the cached row with schedule_id (a chain or ad hoc run), or raise ConfigError."""
    rows = cached_rows(settings, now=now)
    for row in rows:
        if row.id == schedule_id:
            return row
    known = ", ".join(sorted(row.id for row in rows)) or "none"
    raise ConfigError(
        f"no schedule {schedule_id!r} in the cache {settings.cache_path} (known: {known})"
    )


def stage_rerun(
    settings: AgentSettings,
    row: LocalSchedule | None,
    *,
    schedule_id: str,
    trigger_key: str,
    stopped_at: datetime | None,
    now: datetime,
) -> StartDecision:
    """Return whether the interrupted job of a chain stage (trigger_key) runs once more now."""
    stage = settings.stage(trigger_key)
    if stage is None:
        return StartDecision(
            Verdict.SKIP, f"its trigger {trigger_key} is no chain stage of this node")
    return stage_retry_allowed(
        row, schedule_id=schedule_id, stage=stage.name, action=stage.action, on=stage.on,
        stopped_at=stopped_at, now=now, follow=FOLLOW_WINDOW, tz=settings.tz,
    )


def cached_rows(settings: AgentSettings, *, now: datetime) -> list[LocalSchedule]:
    """Return the node's cached rows (read under the cache's lock, no pull)."""
    return build_scheduler(settings, now=now, pulls=False).schedules()
