"""What every flow of the agent shares: settings, names, the dispatcher and the job registry.

Rule: this is the imperative shell around :mod:`sched_core`. The flows read the
clock here (:func:`logical_now`), talk to the Prefect API here (dispatch with
``run_deployment``, the job registry, events), and keep ``sched_core`` pure.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterEndTime,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.events import emit_event

from flows.actions import window_stamp
from flows.settings import AgentSettings, load_settings
from sched_core import Config, Fire, Scheduler

log = logging.getLogger(__name__)

RUN_JOB = "run-job"
FIRE_TICK = "fire-tick"
RECONCILE = "reconcile"
ADVANCE_CHAIN = "advance-chain"

EVENT_JOB_COMPLETED = "sched.job.completed"
EVENT_JOB_FAILED = "sched.job.failed"
EVENT_SCHEDULES_CHANGED = "sched.schedules.changed"

ACTIVE_STATES = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
FINISHED_STATES = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED]

_SLUG = re.compile(r"[^a-z0-9]+")


def slug(text: str) -> str:
    """Return text as an artifact-key-safe slug: lowercase letters, digits and dashes."""
    return _SLUG.sub("-", text.lower()).strip("-") or "x"


def setup_logging() -> None:
    """Let the library loggers' INFO lines through to the run logs (``SCHED_LOG_LEVEL``)."""
    level = os.environ.get("SCHED_LOG_LEVEL", "INFO").upper()
    for name in ("sched_core", "flows"):
        logging.getLogger(name).setLevel(level)


def agent_settings() -> AgentSettings:
    """Return the settings for this run (``$SCHED_CONFIG`` plus ``SCHED_*``)."""
    setup_logging()
    return load_settings()


def deployment_name(settings: AgentSettings) -> str:
    """Return this node's deployment name: the running deployment's, else the node name.

    Every flow of a node is deployed under the node's name (``run-job/node-a``),
    so a flow finds its siblings by its own deployment name.
    """
    from prefect.runtime import deployment

    name = deployment.name
    if isinstance(name, str) and name:
        if name != settings.node_name:
            log.warning(
                "deployment name differs from node_name; using the deployment name",
                extra={"deployment": name, "node": settings.node_name},
            )
        return name
    return settings.node_name


def logical_now(now: datetime | None = None) -> datetime:
    """Return now if given, else the later of the wall clock and this run's scheduled start.

    A worker may start a scheduled run up to half a second early; the
    scheduled start keeps the tick in the minute it was meant for.
    """
    if now is not None:
        if now.tzinfo is None:
            raise ValueError(f"now {now!r} has no timezone")
        return now.astimezone(UTC)
    from prefect.runtime import flow_run

    wall = datetime.now(UTC)
    scheduled = flow_run.scheduled_start_time
    if isinstance(scheduled, datetime) and scheduled.tzinfo is not None:
        return max(wall, scheduled.astimezone(UTC))
    return wall


@contextmanager
def node_lock(settings: AgentSettings) -> Iterator[None]:
    """Hold this node's agent lock: ticks and reconciles of one node never overlap."""
    fd = os.open(settings.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def job_tags(node: str, action: str, schedule_id: str, trigger_key: str) -> list[str]:
    """Return the tags a run-job run carries; the job registry filters on the first two."""
    return [f"node:{node}", f"action:{action}", f"schedule:{schedule_id}", f"trigger:{trigger_key}"]


def job_run_name(action: str, schedule_id: str, window: datetime | None) -> str:
    """Return a run-job run's name: action, schedule and window (``backup-s-1-20261202T0730Z``)."""
    return f"{action}-{schedule_id}-{window_stamp(window)}"


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

    @property
    def target(self) -> str:
        """Return the run-job deployment this dispatcher creates runs of."""
        return f"{RUN_JOB}/{self.deployment}"

    def idempotency_key(self, fire: Fire) -> str:
        """Return the Prefect idempotency key of a fire: node and the kit's window key."""
        return f"{self.node}:{fire.key}"

    def __call__(self, fire: Fire) -> None:
        row = fire.schedule
        created_after = datetime.now(UTC) - timedelta(seconds=1)
        run: FlowRun = run_deployment(  # type: ignore[assignment]  # sync dispatch
            self.target,
            parameters={
                "schedule": row.model_dump(mode="json"),
                "trigger_key": fire.trigger_key,
                "window": fire.window.isoformat() if fire.window else None,
                "key": fire.key,
            },
            timeout=0,
            idempotency_key=self.idempotency_key(fire),
            flow_run_name=job_run_name(row.action, row.id, fire.window),
            tags=job_tags(self.node, row.action, row.id, fire.trigger_key),
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


# -- the job registry: the Prefect API ------------------------------------------------


def count_jobs(
    node: str,
    actions: list[str],
    states: list[StateType],
    *,
    exclude: tuple[str, ...] = (),
    ended_after: datetime | None = None,
) -> int:
    """Return how many run-job runs of node with one of actions are in one of states.

    A run is recognised by its tags (``node:<node>``, ``action:<action>``),
    which the dispatcher sets and run-job adds to ad hoc runs.
    """
    total = 0
    with get_client(sync_client=True) as client:
        for action in actions:
            flt = FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"node:{node}", f"action:{action}"]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states)),
            )
            if exclude:
                flt.id = FlowRunFilterId(not_any_=[UUID(item) for item in exclude])
            if ended_after is not None:
                flt.end_time = FlowRunFilterEndTime(after_=ended_after)
            total += client.count_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[RUN_JOB])),
                flow_run_filter=flt,
            )
    return total


def deployment_filter(name: str) -> DeploymentFilter:
    """Return a filter for the deployments called name."""
    return DeploymentFilter(name=DeploymentFilterName(any_=[name]))


def emit(event: str, node: str, payload: dict[str, Any]) -> None:
    """Emit a ``sched.*`` event about this node (resource ``sched.agent.<node>``)."""
    emit_event(
        event=event,
        resource={"prefect.resource.id": f"sched.agent.{node}", "prefect.resource.name": node},
        payload=payload,
    )
