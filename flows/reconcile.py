"""The ``reconcile`` flow: pull the schedule list, then plan the node's runs.

1. Pull in a task with retries and exponential backoff (``pull_retries``,
   ``pull_retry_delay``). A pull that still fails changes nothing: the cache
   and its planned runs stay, and the run ends Failed so it shows. The pull
   does not hold the node lock, so a slow controller holds up nothing.
2. Plan from the cache whether or not the pull succeeded (:mod:`flows.planner`):
   create the runs of the coming windows, delete those no longer windows of
   their rows, recover and report windows that never had a run, and run again
   jobs interrupted by the node's own stop.
3. Publish a markdown artifact (what the pull changed; per schedule its next
   windows in local time with DST notes; what the planner created and
   deleted), emit ``sched.schedules.changed`` when the list changed, and one
   ``sched.window.missed`` per schedule with windows that never had a run.

Runs every ``reconcile_interval`` (15 minutes by default), on demand, and at
once on the controller's ``sched.schedules.updated`` event.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.automations import ensure_automations
from flows.chain import resume_interrupted
from flows.dispatch import pulling_scheduler, runs_of
from flows.node_report import pull_outcome, report_after
from flows.planner import PlanReport, load_plan_state, plan_node
from flows.reports import plan_lines, pull_lines
from flows.runtime import (
    EVENT_SCHEDULES_CHANGED,
    EVENT_WINDOW_MISSED,
    RECONCILE,
    agent_settings,
    deployment_name,
    emit,
    emit_job_event,
    logical_now,
    node_lock,
    run_name,
    slug,
)
from sched_core import PullError, PullResult, Scheduler
from sched_core.pull import NOT_MODIFIED

MISSED_EVENT_NAMESPACE = uuid.UUID("0b6f5f52-8a46-4d57-bd1e-6a3e0a3f7c11")


@task(name="pull-schedules", cache_policy=NO_CACHE)
def pull_schedules(scheduler: Scheduler, now: datetime) -> PullResult:
    """Pull the schedule list once (retried by the flow's options on PullError)."""
    return scheduler.pull(now)


@flow(name=RECONCILE, flow_run_name=run_name("reconcile"))
def reconcile(now: datetime | None = None) -> dict[str, int]:
    """Pull the schedule list and plan the node's runs; return the counts of what changed."""
    logger = get_run_logger()
    settings = agent_settings()
    at = logical_now(now)
    pull = pull_schedules.with_options(
        retries=settings.pull_retries,
        retry_delay_seconds=exponential_backoff(
            backoff_factor=max(settings.pull_retry_delay.total_seconds(), 0.001)
        )(settings.pull_retries),
    )
    result: PullResult | None = None
    error: str | None = None
    with pulling_scheduler(settings, now=at) as scheduler:
        try:
            result = pull(scheduler, at)
        except PullError as exc:
            error = str(exc)
            logger.error("pull failed after %d retries: %s", settings.pull_retries, exc)
    with node_lock(settings), runs_of(deployment_name(settings)) as runs:
        cache = scheduler.cache()
        record = load_plan_state(settings.plan_path, now=at)
        try:
            resumed = resume_interrupted(runs.client, settings, record, now=at)
        except Exception as exc:  # planning goes on; the next reconcile looks again
            resumed = []
            logger.warning("could not look for interrupted advance-chain runs: %r", exc)
        report = plan_node(settings, cache, runs, now=at, record=record)  # saves the record
        try:
            ensure_automations(runs.client)
        except Exception as exc:  # the plan stands; the next reconcile tries again
            logger.warning("could not ensure the agent's automations: %r", exc)
    names = {row.id: row.name for row in cache.schedules}
    markdown = "\n".join([
        f"### Reconcile on {settings.node_name} at {at.isoformat()}", "",
        *pull_lines(result, error, names),
        *plan_lines(report, cache.schedules, now=at, tz=settings.tz, node=settings.node_name,
                    last_fired=cache.last_fired_at),
    ])
    create_markdown_artifact(
        key=f"reconcile-{slug(settings.node_name)}",
        markdown=markdown,
        description=f"Reconcile at {at.isoformat()} on {settings.node_name}",
    )
    counts = {
        "schedules": len(cache.schedules),
        "added": len(result.added) if result else 0,
        "removed": len(result.removed) if result else 0,
        "changed": len(result.changed) if result else 0,
        "rejected": len(result.rejected) if result else 0,
        "planned": report.planned,
        "created": len(report.created),
        "deleted": len(report.deleted),
        "moved": len(report.moved),
        "skipped_late": len(report.skipped),
        "missed": sum(item.count for item in report.missed),
        "recovered": len(report.recovered),
        "retried": len(report.retried),
        "chains_resumed": len(resumed),
    }
    if result is not None and (result.changed_anything or result.rejected):
        emit(
            EVENT_SCHEDULES_CHANGED,
            settings.node_name,
            {
                "node": settings.node_name,
                **counts,
                "added_ids": result.added,
                "removed_ids": result.removed,
                "changed_ids": result.changed,
                "rejected": [{"id": rid, "reason": reason} for rid, reason in result.rejected],
            },
        )
    emit_missed(settings.node_name, report)
    emit_interrupted(settings.node_name, report)
    logger.info("reconcile: %s", counts)
    # Best effort: a report that fails is logged and never fails the reconcile.
    report_after(
        settings, now=at, deployment=deployment_name(settings), cache=cache,
        last_pull=pull_outcome(at, ok=error is None, error=error,
                               status=None if result is None
                               else "304" if result is NOT_MODIFIED else "200"),
    )
    if error is not None:
        raise PullError(error)
    if report.failed:
        raise RuntimeError(
            f"{len(report.failed)} run(s) could not be created or deleted; the next reconcile "
            f"tries again (first: {report.failed[0][0]}: {report.failed[0][1]})"
        )
    return counts


def emit_missed(node: str, report: PlanReport) -> None:
    """Emit one ``sched.window.missed`` per schedule with windows that never had a run."""
    for item in report.missed:
        emit(
            EVENT_WINDOW_MISSED,
            node,
            {
                "node": node,
                "schedule_id": item.schedule_id,
                "count": item.count,
                "windows": [w.isoformat() for w in item.windows],
                "recovered": item.recover.window.isoformat() if item.recover else None,
                "truncated": item.truncated,
            },
            event_id=uuid.uuid5(
                MISSED_EVENT_NAMESPACE,
                f"{node}:{item.schedule_id}:{item.windows[0].isoformat()}:{item.count}",
            ),
        )


def emit_interrupted(node: str, report: PlanReport) -> None:
    """Send each interrupted job's one ``sched.job.failed``: its process may have had no chance.

    A run killed with its node, or stopped with a worker, runs no state hook;
    the event id is the run's, so a hook that did run is not doubled.
    """
    for item in report.interrupted:
        emit_job_event(
            node,
            {
                "node": node,
                "action": item.action,
                "schedule_id": item.schedule_id,
                "trigger_key": item.trigger_key,
                "window": item.window.isoformat() if item.window else None,
                "flow_run_id": item.run_id,
                "flow_run_name": item.run_name,
                "state": item.state_name,
            },
            completed=False,
        )
