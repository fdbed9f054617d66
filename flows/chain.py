"""The ``advance-chain`` flow: feed one job completion to ``sched_core.Chain``.

Triggered by the deployment trigger on ``sched.job.completed`` and
``sched.job.failed``. The Prefect API is the job registry:

- a stage is active while ``run-job`` runs of its action on this node are
  scheduled, pending, running or cancelling;
- the wave is complete when no wave job (``wave`` actions) is, and at least
  one finished within ``wave_lookback``.

The run that triggered this one is left out of the active counts (its event is
emitted once its terminal state is recorded, so this only guards replays). An
event without an action (an ad hoc run started by schedule id) takes it from
that run's ``action:`` tag.
Stage fires become run-job runs started now, keyed per schedule,
stage and chain day, so a replayed event cannot start a stage twice.
"""

from __future__ import annotations

import logging
from datetime import datetime
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.states import Scheduled

from flows.dispatch import ChainDispatcher, build_scheduler
from flows.planner import PlanState
from flows.registry import (
    ACTIVE_STATES,
    FINISHED_STATES,
    count_jobs,
    interrupted_runs,
)
from flows.runtime import ADVANCE_CHAIN, agent_settings, deployment_name, logical_now, slug
from flows.settings import AgentSettings, StageSpec
from sched_core import Chain, LocalSchedule, Spec, Stage
from sched_core.chain import FOLLOW_WINDOW

log = logging.getLogger(__name__)


def completed_action(completed_run: str) -> str:
    """Return the action a run-job run was tagged with (``action:backup``), or ""."""
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(completed_run))
    except Exception as exc:  # an unknown id or an unreachable API: nothing to feed
        log.warning(
            "cannot read the completed run", extra={"flow_run_id": completed_run,
                                                    "error": repr(exc)},
        )
        return ""
    tags = [tag.split(":", 1)[1] for tag in run.tags if tag.startswith("action:")]
    return tags[0] if tags else ""


def build_spec(settings: AgentSettings, *, now: datetime, exclude: tuple[str, ...]) -> Spec:
    """Return the chain spec of this node: stages, wave and registry callbacks."""
    node = settings.node_name

    def stage(spec: StageSpec) -> Stage:
        def match(row: LocalSchedule) -> bool:
            return row.schedule.on == spec.on and row.action == spec.action

        def active() -> bool:
            return count_jobs(node, [spec.action], ACTIVE_STATES, now=now, exclude=exclude) > 0

        return Stage(name=spec.name, trigger_key=spec.key(), match=match, active=active)

    def wave_complete() -> bool:
        if count_jobs(node, settings.wave, ACTIVE_STATES, now=now, exclude=exclude):
            return False
        since = now - settings.wave_lookback
        return count_jobs(node, settings.wave, FINISHED_STATES, now=now, ended_after=since) > 0

    return Spec(
        stages=[stage(item) for item in settings.stages],
        is_wave_job=lambda action: action in settings.wave,
        wave_complete=wave_complete,
        marker_path=settings.marker_path,
        timezone=settings.tz,
    )


CHAIN_RETRIES = 3
"""Retries of an advance-chain run that left a stage's fires failed (each retries them)."""
CHAIN_RETRY_DELAY_S = 30


@flow(
    name=ADVANCE_CHAIN,
    flow_run_name="chain-after-{action}",
    retries=CHAIN_RETRIES,
    retry_delay_seconds=CHAIN_RETRY_DELAY_S,
)
def advance_chain(
    action: str,
    node: str = "",
    completed_run: str = "",
    now: datetime | None = None,
) -> list[str]:
    """Feed the completion of a job of action to the chain; return the stages it fired."""
    logger = get_run_logger()
    settings = agent_settings()
    if node and node != settings.node_name:
        logger.info("completion on node %s is not ours (%s); ignored", node, settings.node_name)
        return []
    if not action and completed_run:
        action = completed_action(completed_run)
        logger.info("the event named no action; run %s was a %s job", completed_run,
                    action or "(untagged)")
    at = logical_now(now)
    dispatcher = ChainDispatcher(
        node=settings.node_name, deployment=deployment_name(settings), now=at
    )
    scheduler = build_scheduler(settings, now=at, dispatcher=dispatcher)
    exclude = (completed_run,) if completed_run else ()
    chain = Chain(scheduler, build_spec(settings, now=at, exclude=exclude))
    fired = chain.on_job_complete(action, now=at)
    # Only stages this run fired or retried: another stage left incomplete
    # waits for its own conditions (its predecessor draining) without failing
    # every run until then.
    incomplete = {name: mark for name, mark in chain.incomplete(now=at).items() if name in fired}
    logger.info("job of %s completed; chain fired stages %s", action, fired or "none")
    if fired:
        lines = [f"### Chain on {settings.node_name}: fired {', '.join(fired)}", ""]
        lines += [
            f"- `{fire.schedule.id}` ({fire.schedule.action}, {fire.trigger_key}): run `{name}`"
            for fire, _run_id, name in dispatcher.dispatched
        ]
        create_markdown_artifact(
            key=f"advance-chain-{slug(settings.node_name)}",
            markdown="\n".join(lines),
            description=f"Chain stages fired after a {action} job",
        )
    if incomplete:
        # Fail visibly: the run's own retries (and any later job completion)
        # fire the failed schedules again, under the same keys.
        names = ", ".join(
            f"{name} ({mark.day.isoformat()}, {len(mark.fired)} fired so far)"
            for name, mark in sorted(incomplete.items())
        )
        raise RuntimeError(
            f"chain stage(s) {names} could not fire every schedule; they are retried by this "
            "run's retries and on the next job completion (see the log above for the errors)"
        )
    return fired


def resume_interrupted(
    client: SyncPrefectClient, settings: AgentSettings, record: PlanState, *, now: datetime
) -> list[tuple[str, str]]:
    """Run again each advance-chain run the node's own stop interrupted; return (old, new) ids.

    A chain run killed with its node (Pending or Running) never fed its job's
    completion to the chain, and no later event brings it back: without this,
    the day's prune would wait for the next wave. The re-run has the same
    parameters, so it feeds the same completion; the chain's day markers and
    its stage keys make a completion fed twice fire nothing twice. Each
    interrupted run is handled once (noted in the plan record, which the
    caller saves: the reconcile's :func:`~flows.planner.plan_node`), and its
    re-run is created under an idempotency key of its own, so a record lost
    in a crash makes no second re-run. Called by the reconcile under the
    node lock.
    """
    deployment = client.read_deployment_by_name(
        f"{ADVANCE_CHAIN}/{deployment_name(settings)}")
    resumed: list[tuple[str, str]] = []
    for run in interrupted_runs(client, deployment.id, since=now - FOLLOW_WINDOW):
        if str(run.id) in record.interrupted:
            continue
        rerun = client.create_flow_run_from_deployment(
            deployment.id,
            parameters=dict(run.parameters or {}),
            state=Scheduled(),
            tags=["retry"],
            idempotency_key=f"{settings.node_name}:chain:{run.id}:retry",
        )
        log.warning(
            "advance-chain run %s was interrupted (%s): running it again as %s",
            run.name, run.state.name if run.state else "no state", rerun.id,
            extra={"node": settings.node_name, "flow_run_id": str(run.id),
                   "rerun_id": str(rerun.id)},
        )
        record.interrupted[str(run.id)] = now
        resumed.append((str(run.id), str(rerun.id)))
    return resumed
