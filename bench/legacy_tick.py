"""The old design's fire loop, kept as the benchmarks' baseline: ``fire-tick`` every minute.

A faithful copy of the per-minute tick this project ran before issue 15 (commit
de7110e: ``flows/tick.py``, the ``Dispatcher`` and ``build_scheduler`` of
``flows/agent.py``, the ``reconcile`` flow of ``flows/reconcile.py`` and the
deployments of ``deployments/serve.py``), so that ``bench/bench_idle.py`` and
``bench/bench_plan.py`` measure the old design against the new one in the same
run. Only the imports changed: the helpers the old ``flows.agent`` held now live
in ``flows.runtime`` (settings, names, the clock, the lock, events) and
``flows.dispatch`` (run names and tags), unchanged; the kit's ``Scheduler``
(``tick``, ``due_fires``, ``tick_report``, ``missed_run_report``) is the same.

The runs its dispatcher creates carry the row in their parameters, as the old
ones did. The current ``run-job`` would end them Skipped (the tick has stamped
their window before they start); the benchmarks never execute them.

Not part of the agent: nothing outside ``bench/`` imports this module.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy, FlowRun
from prefect.deployments import run_deployment
from prefect.deployments.runner import RunnerDeployment
from prefect.schedules import Cron, Interval, Schedule
from prefect.tasks import exponential_backoff

from deployments.serve import chain_trigger
from flows.chain import advance_chain
from flows.dispatch import job_run_name, job_tags
from flows.job import run_job
from flows.runtime import (
    EVENT_SCHEDULES_CHANGED,
    RECONCILE,
    RUN_JOB,
    agent_settings,
    deployment_name,
    emit,
    logical_now,
    node_lock,
    run_name,
    slug,
)
from flows.settings import AgentSettings
from sched_core import (
    Config,
    Fire,
    MissPolicy,
    PullError,
    PullResult,
    Scheduler,
    TickReport,
)
from sched_core.misses import floor_minute, plan_recovery

log = logging.getLogger("flows.agent")
"""The old module's logger: its lines reach the run logs as they did (``flows`` is shipped)."""

FIRE_TICK = "fire-tick"

# -- flows/agent.py (de7110e): the dispatcher --------------------------------------

BULK_MIN = 20
"""A tick with at least this many due windows creates their runs in bulk first."""
BULK_MAX = 100
"""The most runs Prefect's bulk create endpoint takes per request."""
BULK_ATTEMPTS = 4
"""Bulk requests per chunk before its still-failed fires fall back to run_deployment."""
BULK_RETRY_DELAYS = (0.1, 0.5, 1.0)
"""Seconds to wait before each retry of a chunk's failed fires."""
BULK_PAUSE = 0.5
"""Seconds between bulk requests once one lost the write race: the server writes its events."""

@dataclass
class Dispatched:
    """One fire the dispatcher handed to Prefect, and the run it got."""

    fire: Fire
    flow_run_id: str
    flow_run_name: str
    new: bool


@dataclass
class Dispatcher:
    """The scheduler's fire callback: one ``run-job`` flow run per fire, keyed by the window.

    ``run_deployment(timeout=0, idempotency_key=...)`` returns the existing run
    for a key it has seen, so a repeated, retried or restarted tick cannot start
    a window twice. Raising means the fire did not happen (the window stays
    unfired).
    """

    node: str
    deployment: str
    dispatched: list[Dispatched] = field(default_factory=list)
    _prefetched: dict[str, str] = field(default_factory=dict)

    @property
    def target(self) -> str:
        """Return the run-job deployment this dispatcher creates runs of."""
        return f"{RUN_JOB}/{self.deployment}"

    def idempotency_key(self, fire: Fire) -> str:
        """Return the Prefect idempotency key of a fire: node and the kit's window key."""
        return f"{self.node}:{fire.key}"

    def _job(self, fire: Fire) -> dict[str, Any]:
        """Return the run-job run a fire creates: parameters, name, tags and key."""
        row = fire.schedule
        return {
            "parameters": {
                "schedule": row.model_dump(mode="json"),
                "trigger_key": fire.trigger_key,
                "window": fire.window.isoformat() if fire.window else None,
                "key": fire.key,
            },
            "name": job_run_name(row.action, row.id, fire.window),
            "tags": job_tags(self.node, row.action, row.id, fire.trigger_key),
            "idempotency_key": self.idempotency_key(fire),
        }

    def prefetch(self, fires: list[Fire]) -> int:
        """Create the runs of many fires in bulk, 100 per request; return how many exist.

        An optimisation for a tick with many due windows: the same runs, with
        the same idempotency keys, that ``__call__`` would create one
        ``run_deployment`` at a time. ``__call__`` then only confirms each fire;
        any fire the bulk requests did not create falls back to run_deployment.
        Never raises: a failed bulk request just leaves the slow path.
        """
        if len(fires) < BULK_MIN:
            return 0
        try:
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name(self.target)
                paced = False
                for start in range(0, len(fires), BULK_MAX):
                    if paced:
                        # Each created run is an event the server writes after the
                        # request commits; on SQLite a request sent meanwhile lost
                        # the write race 9 times in 10 (a ~1 s failed pass, then a
                        # retry). Once it has lost, waiting first costs less.
                        time.sleep(BULK_PAUSE)
                    chunk = fires[start:start + BULK_MAX]
                    paced = self._create_bulk(client, deployment.id, chunk) > 1 or paced
        except Exception as exc:
            log.warning(
                "bulk dispatch failed; falling back to one run_deployment per fire",
                extra={"node": self.node, "fires": len(fires), "error": repr(exc)},
            )
        return len(self._prefetched)

    def _create_bulk(
        self, client: SyncPrefectClient, deployment_id: UUID, fires: list[Fire]
    ) -> int:
        """Create up to 100 fires' runs, retrying what the server reports failed; return the tries.

        On SQLite the server creates a request's runs in one deferred
        transaction. When another writer (its own event persister, usually)
        commits between that transaction's first read and its first insert,
        every entry comes back FAILED ("database is locked") and nothing is
        created. In a 1,000-run tick 9 requests in 10 lost that race, and each
        lost entry then cost a ~100 ms run_deployment; a second bulk request
        almost always wins it. Retrying is safe: the idempotency
        key turns an entry that was created after all into the same run.
        """
        pending = fires
        errors: set[str] = set()
        for attempt in range(BULK_ATTEMPTS):
            if attempt:
                log.info(
                    "bulk create retried",
                    extra={"node": self.node, "fires": len(pending), "attempt": attempt + 1,
                           "errors": sorted(errors)[:3]},
                )
                time.sleep(BULK_RETRY_DELAYS[attempt - 1])
            # The parameters are built here, not typed by a user, and run-job
            # validates them when it runs: skipping the server's JSON-schema
            # check per run made 300 creates ~35% faster (bench_dispatch).
            body = [
                {**self._job(fire), "state": {"type": "SCHEDULED"},
                 "enforce_parameter_schema": False}
                for fire in pending
            ]
            try:
                response = client.request(
                    "POST",
                    "/deployments/{id}/create_flow_run/bulk",  # type: ignore[arg-type]
                    path_params={"id": deployment_id},
                    json=body,
                )
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code < 500:
                    raise
                errors.add(repr(exc)[:200])
                continue
            except httpx.TransportError as exc:
                errors.add(repr(exc)[:200])
                continue
            failed: list[Fire] = []
            for fire, result in zip(pending, response.json()["results"], strict=True):
                if result.get("status") == "CREATED" and result.get("flow_run_id"):
                    self._prefetched[self.idempotency_key(fire)] = str(result["flow_run_id"])
                else:
                    failed.append(fire)
                    errors.add(str(result.get("error"))[:200])
            pending = failed
            if not pending:
                return attempt + 1
        log.warning(
            "bulk create left fires to run_deployment",
            extra={"node": self.node, "fires": len(pending), "errors": sorted(errors)[:3]},
        )
        return BULK_ATTEMPTS

    def __call__(self, fire: Fire) -> None:
        job = self._job(fire)
        prefetched = self._prefetched.pop(job["idempotency_key"], None)
        if prefetched is not None:
            self.dispatched.append(Dispatched(fire, prefetched, job["name"], True))
            return
        created_after = datetime.now(UTC) - timedelta(seconds=1)
        run: FlowRun = run_deployment(  # type: ignore[assignment]  # sync dispatch
            self.target,
            parameters=job["parameters"],
            timeout=0,
            idempotency_key=job["idempotency_key"],
            flow_run_name=job["name"],
            tags=job["tags"],
            as_subflow=False,
        )
        new = run.created is None or run.created >= created_after
        self.dispatched.append(Dispatched(fire, str(run.id), run.name, new))


def build_scheduler(
    settings: AgentSettings, dispatcher: Dispatcher, *, now: datetime
) -> Scheduler:
    """Return a Scheduler over this node's cache that fires through dispatcher."""
    headers: dict[str, str] = {}
    client: httpx.Client | None = None
    if settings.pull_url.startswith(("http://", "https://")):
        token = settings.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        client = httpx.Client(
            headers=headers, timeout=settings.pull_timeout.total_seconds(), follow_redirects=True
        )
    config = Config(
        pull_url=settings.pull_url,
        node_name=settings.node_name,
        cache_path=settings.cache_path,
        fire=dispatcher,
        http_client=client,
        timezone=settings.tz,
        fire_grace=settings.grace,
    )
    return Scheduler(config, now=now)



# -- flows/tick.py (de7110e): the fire-tick flow ------------------------------------

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


# -- flows/reconcile.py (de7110e): pull, then the missed-run check ------------------

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



# -- deployments/serve.py (de7110e): the four deployments ---------------------------

ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
DROP_OVERLAP = ConcurrencyLimitConfig(
    limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW
)


TICK_SCHEDULE = Cron("* * * * *", timezone="UTC")
RECONCILE_SCHEDULE = Interval(300)


def build_deployments(
    settings: AgentSettings,
    *,
    tick: Schedule | None = TICK_SCHEDULE,
    reconcile_every: Schedule | None = RECONCILE_SCHEDULE,
) -> list[RunnerDeployment]:
    """Return fire-tick, reconcile, run-job and advance-chain, named after the node.

    ``tick`` and ``reconcile_every`` default to the old design's cadences (the
    benchmark passes faster ones, or None for no schedule).
    """
    node = settings.node_name
    tags = ["sched-agent"]
    built: list[object] = [
        fire_tick.to_deployment(
            name=node,
            schedules=[tick] if tick is not None else [],
            concurrency_limit=ONE_AT_A_TIME,
            tags=tags,
            description="Fire every schedule due this minute: one run-job run per window.",
        ),
        reconcile.to_deployment(
            name=node,
            schedules=[reconcile_every] if reconcile_every is not None else [],
            concurrency_limit=DROP_OVERLAP,
            tags=tags,
            description="Pull the schedule list, apply the miss policy, report what changed.",
        ),
        run_job.to_deployment(
            name=node,
            # The node's job slots: a limit on run-job only, so eight long
            # backups never keep a tick, a reconcile or the chain from starting.
            concurrency_limit=ConcurrencyLimitConfig(
                limit=settings.job_limit, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE
            ),
            tags=tags,
            description="Run one action of one schedule and window.",
        ),
        advance_chain.to_deployment(
            name=node,
            triggers=[chain_trigger(node)],
            concurrency_limit=ONE_AT_A_TIME,
            tags=tags,
            description="Feed a job completion to the chain: prune after the wave, then check.",
        ),
    ]
    # to_deployment dispatches sync or async by context; here it is always sync.
    assert all(isinstance(item, RunnerDeployment) for item in built)
    return [item for item in built if isinstance(item, RunnerDeployment)]
