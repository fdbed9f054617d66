"""The ``fire-tick`` flow: one ``Scheduler.tick`` per minute, each fire a ``run-job`` run.

Deployed on a UTC cron every minute. The logical time is the later of the wall
clock and the run's scheduled start (or ``now`` when given, as tests do), so an
early or late worker still ticks the minute it was meant for, and a backlog of
missed tick runs after downtime, run in any order, fires each window once.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.agent import (
    FIRE_TICK,
    Dispatcher,
    agent_settings,
    build_scheduler,
    deployment_name,
    logical_now,
    node_lock,
    run_name,
    slug,
)
from sched_core import MissPolicy, PullError, Scheduler, TickReport
from sched_core.misses import floor_minute, plan_recovery


def missed_rows(
    scheduler: Scheduler, *, now: datetime, grace: timedelta
) -> list[dict[str, str]]:
    """Return a row per enabled clock schedule whose window left the grace unfired this minute.

    Only windows that crossed the grace since the previous tick are shown, so a
    missed window is reported once, not every minute until the miss policy acts.
    """
    cache = scheduler.cache()
    crossed_after = floor_minute(now) - grace - timedelta(minutes=1)
    rows: list[dict[str, str]] = []
    for row in cache.schedules:
        if not row.enabled or row.schedule.is_event:
            continue
        missed = plan_recovery(
            row.schedule,
            MissPolicy.RUN_ONCE_WITHIN_24H,
            last_fired=cache.last_fired_at.get(row.id),
            first_seen=cache.first_seen_at.get(row.id),
            now=now,
            grace=grace,
            tz=scheduler.timezone,
        )
        if missed is None or missed.window < crossed_after:
            continue
        what = "dropped (skip)" if row.miss_policy is MissPolicy.SKIP else (
            "recovered by the next reconcile's missed-run check"
        )
        rows.append({
            "outcome": f"missed: {row.miss_policy.value}",
            "schedule": row.id,
            "name": row.name,
            "action": row.action,
            "window": missed.window.astimezone(scheduler.timezone).isoformat(),
            "flow run": what,
        })
    return rows


def report_rows(
    report: TickReport,
    dispatcher: Dispatcher,
    scheduler: Scheduler,
    *,
    now: datetime,
    grace: timedelta,
) -> list[dict[str, str]]:
    """Return the tick's table: fired (on time or late), failed, and left to the miss policy."""
    runs = {item.fire.key: item for item in dispatcher.dispatched}
    minute = floor_minute(now)
    rows: list[dict[str, str]] = []
    for fire in report.fired:
        window = fire.window or minute
        late = window < minute
        outcome = "fired late" if late else "fired"
        if fire.schedule.id in report.coalesced:
            outcome += f" (coalesced {report.coalesced[fire.schedule.id]} older)"
        run = runs.get(fire.key)
        if run is not None and not run.new:
            outcome += " (run already existed)"
        rows.append({
            "outcome": outcome,
            "schedule": fire.schedule.id,
            "name": fire.schedule.name,
            "action": fire.schedule.action,
            "window": window.astimezone(scheduler.timezone).isoformat(),
            "flow run": run.flow_run_name if run else "",
        })
    for fire, error in report.failed:
        rows.append({
            "outcome": f"failed: {error}",
            "schedule": fire.schedule.id,
            "name": fire.schedule.name,
            "action": fire.schedule.action,
            "window": (fire.window or minute).astimezone(scheduler.timezone).isoformat(),
            "flow run": "",
        })
    return rows + missed_rows(scheduler, now=now, grace=grace)


@flow(name=FIRE_TICK, flow_run_name=run_name("tick"))
def fire_tick(now: datetime | None = None) -> int:
    """Fire every schedule due at now (default: the run's logical time); return the count."""
    logger = get_run_logger()
    settings = agent_settings()
    at = logical_now(now)
    dispatcher = Dispatcher(node=settings.node_name, deployment=deployment_name(settings))
    with node_lock(settings):
        scheduler = build_scheduler(settings, dispatcher, now=at)
        if scheduler.cache().last_fetched_at is None:
            # A node that never pulled (fresh state folder) pulls once here
            # instead of idling until the first reconcile.
            try:
                scheduler.pull(at)
            except PullError as exc:
                logger.warning("first pull failed; the reconcile flow retries it: %s", exc)
        # Many due windows: create their runs in bulk first (same keys); the
        # tick's per-fire callback then only confirms them.
        dispatcher.prefetch(scheduler.due_fires(at))
        report = scheduler.tick_report(at)
        rows = report_rows(report, dispatcher, scheduler, now=at, grace=settings.grace)
    logger.info(
        "tick at %s: %d fired, %d failed, %d rows in the report",
        at.isoformat(), len(report.fired), len(report.failed), len(rows),
    )
    if rows:
        create_table_artifact(
            key=f"fire-tick-{slug(settings.node_name)}",
            table=rows,
            description=f"Tick at {at.isoformat()} on {settings.node_name}",
        )
    if report.failed:
        raise RuntimeError(
            f"{len(report.failed)} fire(s) failed; their windows stay unfired and are retried"
        )
    return len(report.fired)
