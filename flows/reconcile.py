"""The ``reconcile`` flow: pull the schedule list, then run the missed-run check.

1. Pull in a task with retries and exponential backoff (``pull_retries``,
   ``pull_retry_delay``). A pull that still fails changes nothing: the cache
   and its schedules keep firing, and the run ends Failed so it shows. The
   pull does not hold the node lock, so its retries never hold up a tick.
2. Run the missed-run check whether or not the pull succeeded: the miss
   policy works from the cache, not from the controller.
3. Publish a markdown artifact of what changed (added, removed, changed,
   rejected rows with reasons) and emit ``sched.schedules.changed`` when the
   list changed.
"""

from __future__ import annotations

from datetime import datetime

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.agent import (
    EVENT_SCHEDULES_CHANGED,
    RECONCILE,
    Dispatcher,
    agent_settings,
    build_scheduler,
    deployment_name,
    emit,
    logical_now,
    node_lock,
    run_name,
    slug,
)
from sched_core import PullError, PullResult, Scheduler, TickReport


@task(name="pull-schedules", cache_policy=NO_CACHE)
def pull_schedules(scheduler: Scheduler, now: datetime) -> PullResult:
    """Pull the schedule list once (retried by the flow's options on PullError)."""
    return scheduler.pull(now)


def change_markdown(
    node: str,
    result: PullResult | None,
    error: str | None,
    recovered: TickReport,
    scheduler: Scheduler,
) -> str:
    """Return the reconcile artifact: the pull's changes and the missed-run check's fires."""
    names = {row.id: row.name for row in scheduler.schedules()}
    lines = [f"### Reconcile on {node}", ""]
    if result is None:
        lines += [f"**Pull failed; the last good list is kept and keeps firing.** {error}", ""]
    else:
        lines += [
            f"{len(names)} schedules; {len(result.added)} added, {len(result.removed)} removed, "
            f"{len(result.changed)} changed, {len(result.rejected)} rejected.",
            "",
            "| change | schedule | name / reason |",
            "|---|---|---|",
        ]
        lines += [f"| added | `{rid}` | {names.get(rid, '')} |" for rid in result.added]
        lines += [f"| removed | `{rid}` | |" for rid in result.removed]
        lines += [f"| changed | `{rid}` | {names.get(rid, '')} |" for rid in result.changed]
        lines += [
            f"| rejected{' (last good kept)' if rid in result.kept_last_good else ''} "
            f"| `{rid}` | {reason} |"
            for rid, reason in result.rejected
        ]
        lines.append("")
    lines.append(f"Missed-run check: {len(recovered.fired)} recovered, "
                 f"{len(recovered.failed)} failed.")
    for fire in recovered.fired:
        window = fire.window.isoformat() if fire.window else "none"
        lines.append(f"- recovered `{fire.schedule.id}` window {window}")
    for fire, reason in recovered.failed:
        lines.append(f"- could not recover `{fire.schedule.id}`: {reason}")
    return "\n".join(lines)


@flow(name=RECONCILE, flow_run_name=run_name("reconcile"))
def reconcile(now: datetime | None = None) -> dict[str, int]:
    """Pull the schedule list and apply the miss policy; return the counts of what changed."""
    logger = get_run_logger()
    settings = agent_settings()
    at = logical_now(now)
    dispatcher = Dispatcher(node=settings.node_name, deployment=deployment_name(settings))
    pull = pull_schedules.with_options(
        retries=settings.pull_retries,
        retry_delay_seconds=exponential_backoff(
            backoff_factor=max(settings.pull_retry_delay.total_seconds(), 0.001)
        )(settings.pull_retries),
    )
    result: PullResult | None = None
    error: str | None = None
    scheduler = build_scheduler(settings, dispatcher, now=at)
    # The pull runs outside the node lock: its retries and timeouts (a minute
    # and more against an unreachable controller) must never hold up a tick.
    # Its merge holds the cache file's lock, which ticks take too.
    try:
        result = pull(scheduler, at)
    except PullError as exc:
        error = str(exc)
        logger.error("pull failed after %d retries: %s", settings.pull_retries, exc)
    with node_lock(settings):
        recovered = scheduler.missed_run_report(at)
    markdown = change_markdown(settings.node_name, result, error, recovered, scheduler)
    create_markdown_artifact(
        key=f"reconcile-{slug(settings.node_name)}",
        markdown=markdown,
        description=f"Reconcile at {at.isoformat()} on {settings.node_name}",
    )
    counts = {
        "schedules": len(scheduler.schedules()),
        "added": len(result.added) if result else 0,
        "removed": len(result.removed) if result else 0,
        "changed": len(result.changed) if result else 0,
        "rejected": len(result.rejected) if result else 0,
        "recovered": len(recovered.fired),
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
    logger.info("reconcile: %s", counts)
    if error is not None:
        raise PullError(error)
    if recovered.failed:
        raise RuntimeError(f"{len(recovered.failed)} recovery fire(s) failed; retried next time")
    return counts

