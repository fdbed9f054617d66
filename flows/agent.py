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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
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
from sched_core.scheduler import as_utc

log = logging.getLogger(__name__)

RUN_JOB = "run-job"
FIRE_TICK = "fire-tick"
RECONCILE = "reconcile"
ADVANCE_CHAIN = "advance-chain"

EVENT_JOB_COMPLETED = "sched.job.completed"
EVENT_JOB_FAILED = "sched.job.failed"
EVENT_SCHEDULES_CHANGED = "sched.schedules.changed"

ACTIVE_STATES = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
FINISHED_STATES = [
    StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED,
]

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
        return as_utc(now)
    from prefect.runtime import flow_run

    wall = datetime.now(UTC)
    scheduled = flow_run.scheduled_start_time
    if isinstance(scheduled, datetime) and scheduled.tzinfo is not None:
        # Prefect's DateTime is a pendulum-style subclass whose arithmetic can
        # drop the zone: hand the kit a plain datetime.
        return max(wall, as_utc(scheduled))
    return wall


def run_name(prefix: str) -> Callable[[], str]:
    """Return a flow-run namer: prefix and the run's logical minute (``tick-20261202T0730Z``)."""

    def name() -> str:
        from prefect.runtime import flow_run

        now = flow_run.parameters.get("now") if flow_run.parameters else None
        if isinstance(now, str):
            now = datetime.fromisoformat(now)
        return f"{prefix}-{window_stamp(logical_now(now if isinstance(now, datetime) else None))}"

    return name


@contextmanager
def node_lock(settings: AgentSettings) -> Iterator[None]:
    """Hold this node's agent lock: ticks and missed-run checks of one node never overlap."""
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
