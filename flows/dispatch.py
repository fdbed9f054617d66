"""Runs of ``run-job``: what identifies one (:class:`JobRef`), and creating and deleting them.

A run carries the job's identity, never its row: ``schedule_id``, ``window``,
``key``, ``trigger_key`` (and ``retry_of`` for the one re-run of an
interrupted job). ``run-job`` reads the row from the node's cache when it
starts, so a row edited after planning runs in its new version.

Every run has an idempotency key (``<node>:<window key>`` for a window, with
``:retry`` for the re-run of an interrupted one; ``<node>:<id>@<stage>@<day>``
for a chain stage), so creating it twice, from two processes, or again after
a crash returns the run that exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus
from prefect.exceptions import ObjectNotFound
from prefect.states import Completed, Scheduled

from flows.actions import window_stamp
from flows.registry import SKIPPED
from flows.runtime import RUN_JOB, deployment_name
from flows.settings import AgentSettings
from sched_core import Config, ConfigError, Fire, Scheduler
from sched_core.plan import PlannedRun

log = logging.getLogger(__name__)

BULK_MAX = 100
"""The most runs Prefect's bulk create endpoint takes per request."""
BULK_ATTEMPTS = 6
"""Bulk requests per chunk before its still-failed entries are given up (and reported)."""
BULK_RETRY_DELAYS = (0.2, 0.5, 1.0, 3.0, 8.0)
"""Seconds to wait before each retry of a chunk's failed entries: 12.7 s in all, because a
busy SQLite server (a node starting with a backlog of runs) was measured refusing 52
creates in a row with "database is locked" over 1.6 s of retries."""
BULK_PAUSE = 0.5
"""Seconds between bulk requests once one lost the write race: the server writes its events."""

RETRY_TAG = "retry"


@dataclass(frozen=True)
class JobRef:
    """The identity of one run-job run: node, action, schedule, trigger, window and key."""

    node: str
    action: str
    schedule_id: str
    trigger_key: str
    window: datetime | None
    key: str
    retry_of: str | None = None

    @property
    def name(self) -> str:
        """Return the run's name: ``backup-s-1-20261202T0730Z`` (``...-retry`` for a re-run)."""
        name = job_run_name(self.action, self.schedule_id, self.window)
        return f"{name}-retry" if self.retry_of else name

    @property
    def idempotency_key(self) -> str:
        """Return the idempotency key: node and the kit's key (``:retry`` for a re-run)."""
        base = f"{self.node}:{self.key}"
        return f"{base}:retry" if self.retry_of else base

    def tags(self) -> list[str]:
        """Return the run's tags; the job registry filters on node and action."""
        tags = job_tags(self.node, self.action, self.schedule_id, self.trigger_key)
        return [*tags, RETRY_TAG] if self.retry_of else tags

    def parameters(self) -> dict[str, Any]:
        """Return run-job's parameters: identity only, never the row."""
        params: dict[str, Any] = {
            "schedule_id": self.schedule_id,
            "trigger_key": self.trigger_key,
            "window": self.window.isoformat() if self.window else None,
            "key": self.key,
        }
        if self.retry_of:
            params["retry_of"] = self.retry_of
        return params

    @classmethod
    def of_fire(cls, node: str, fire: Fire) -> JobRef:
        """Return the run a kit fire (a chain stage's) becomes."""
        return cls(node=node, action=fire.schedule.action, schedule_id=fire.schedule.id,
                   trigger_key=fire.trigger_key, window=fire.window, key=fire.key)


def job_tags(node: str, action: str, schedule_id: str, trigger_key: str) -> list[str]:
    """Return the tags a run-job run carries; the job registry filters on the first two."""
    return [f"node:{node}", f"action:{action}", f"schedule:{schedule_id}", f"trigger:{trigger_key}"]


def job_run_name(action: str, schedule_id: str, window: datetime | None) -> str:
    """Return a run-job run's name: action, schedule and window (``backup-s-1-20261202T0730Z``)."""
    return f"{action}-{schedule_id}-{window_stamp(window)}"


@dataclass(frozen=True)
class Planned:
    """A run to create: its identity and when it is scheduled to start."""

    ref: JobRef
    start: datetime


@dataclass
class Created:
    """What a batch of creates gave: run ids by idempotency key, and the entries that failed."""

    runs: dict[str, str] = field(default_factory=dict)
    failed: list[tuple[Planned, str]] = field(default_factory=list)


class Runs:
    """Create and delete this node's run-job runs through one Prefect client.

    Creation goes through Prefect's bulk endpoint, 100 runs per request, with
    the server's JSON-schema check off (the parameters are built here, and
    run-job checks them when it runs: ~35% faster in bench_dispatch).
    """

    def __init__(self, client: SyncPrefectClient, deployment: str) -> None:
        self.client = client
        self.deployment = deployment
        self._deployment_id: UUID | None = None

    @property
    def target(self) -> str:
        """Return the run-job deployment these runs belong to (``run-job/<node>``)."""
        return f"{RUN_JOB}/{self.deployment}"

    def deployment_id(self) -> UUID:
        """Return the run-job deployment's id (read once)."""
        if self._deployment_id is None:
            try:
                self._deployment_id = self.client.read_deployment_by_name(self.target).id
            except ObjectNotFound:
                raise ConfigError(
                    f"no deployment {self.target} on the Prefect server at "
                    f"{self.client.api_url}: deploy this node's flows first "
                    "(`make run`, `python -m deployments.serve`, or `prefect deploy`)"
                ) from None
        return self._deployment_id

    def create(self, planned: Sequence[Planned]) -> Created:
        """Create the runs (or get the existing ones by key); never raises for one bad entry."""
        created = Created()
        paced = False
        for start in range(0, len(planned), BULK_MAX):
            if paced:
                # Each created run is an event the server writes after the
                # request commits; on SQLite a request sent meanwhile lost the
                # write race 9 times in 10. Once one has lost, waiting first costs less.
                time.sleep(BULK_PAUSE)
            chunk = planned[start:start + BULK_MAX]
            paced = self._create_chunk(chunk, created) > 1 or paced
        return created

    def _create_chunk(self, chunk: Sequence[Planned], created: Created) -> int:
        """Create up to 100 runs, retrying what the server reports failed; return the tries.

        On SQLite the server creates a request's runs in one deferred
        transaction; when another writer commits between its first read and
        its first insert, every entry comes back FAILED ("database is
        locked") and nothing is created. Retrying is safe: the idempotency key
        turns an entry that was created after all into the same run.
        """
        pending = list(chunk)
        errors: dict[str, str] = {}
        for attempt in range(BULK_ATTEMPTS):
            if attempt:
                log.info(
                    "bulk create retried",
                    extra={"deployment": self.target, "runs": len(pending),
                           "attempt": attempt + 1, "errors": sorted(set(errors.values()))[:3]},
                )
                time.sleep(BULK_RETRY_DELAYS[attempt - 1])
            body = [
                {
                    "name": item.ref.name,
                    "parameters": item.ref.parameters(),
                    "tags": item.ref.tags(),
                    "idempotency_key": item.ref.idempotency_key,
                    "state": {"type": "SCHEDULED",
                              "state_details": {"scheduled_time": item.start.isoformat()}},
                    "enforce_parameter_schema": False,
                }
                for item in pending
            ]
            try:
                response = self.client.request(
                    "POST",
                    "/deployments/{id}/create_flow_run/bulk",  # type: ignore[arg-type]
                    path_params={"id": self.deployment_id()},
                    json=body,
                )
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code < 500:
                    raise
                errors.update({item.ref.idempotency_key: repr(exc)[:200] for item in pending})
                continue
            except httpx.TransportError as exc:
                errors.update({item.ref.idempotency_key: repr(exc)[:200] for item in pending})
                continue
            failed: list[Planned] = []
            for item, result in zip(pending, response.json()["results"], strict=True):
                if result.get("status") == "CREATED" and result.get("flow_run_id"):
                    created.runs[item.ref.idempotency_key] = str(result["flow_run_id"])
                else:
                    failed.append(item)
                    errors[item.ref.idempotency_key] = str(result.get("error"))[:200]
            pending = failed
            if not pending:
                return attempt + 1
        created.failed += [(item, errors.get(item.ref.idempotency_key, "")) for item in pending]
        log.warning(
            "bulk create gave up on %d runs", len(pending),
            extra={"deployment": self.target, "runs": len(pending),
                   "errors": sorted(set(errors.values()))[:3]},
        )
        return BULK_ATTEMPTS

    def reschedule(self, runs: Iterable[tuple[PlannedRun, datetime]]) -> list[tuple[str, str]]:
        """Move untried runs to a new scheduled start (their row's jitter changed).

        Return (id, error) for each that could not be moved; a run already gone
        counts as moved (there is nothing left to start early or late).
        """
        failed: list[tuple[str, str]] = []
        for run, start in runs:
            try:
                self.client.set_flow_run_state(
                    UUID(run.run_id), Scheduled(scheduled_time=start), force=True
                )
            except ObjectNotFound:
                continue
            except Exception as exc:
                failed.append((run.run_id, repr(exc)[:200]))
        return failed

    def skip(
        self, runs: Iterable[tuple[PlannedRun, str]]
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """End untried runs without running: Completed named Skipped, with the guard's reason.

        Proposed, not forced: a run the node's runner took meanwhile keeps its
        state and its own start guard decides (the same answer). Return the ids
        ended and (id, error) for each that could not be; a run already gone or
        taken counts as neither.
        """
        ended: list[str] = []
        failed: list[tuple[str, str]] = []
        for run, reason in runs:
            try:
                result: OrchestrationResult[Any] = self.client.set_flow_run_state(
                    UUID(run.run_id), Completed(name=SKIPPED, message=reason), force=False
                )
            except ObjectNotFound:
                continue
            except Exception as exc:
                failed.append((run.run_id, repr(exc)[:200]))
                continue
            if result.status == SetStateStatus.ACCEPT:
                ended.append(run.run_id)
        return ended, failed

    def delete(self, run_ids: Iterable[str]) -> list[tuple[str, str]]:
        """Delete runs by id; return (id, error) for each that could not be deleted.

        A run already gone counts as deleted.
        """
        failed: list[tuple[str, str]] = []
        for run_id in run_ids:
            try:
                self.client.delete_flow_run(UUID(run_id))
            except ObjectNotFound:
                continue
            except Exception as exc:
                failed.append((run_id, repr(exc)[:200]))
        return failed


@contextmanager
def runs_of(deployment: str) -> Iterator[Runs]:
    """Yield a :class:`Runs` for the node's run-job deployment, with its own client."""
    with get_client(sync_client=True) as client:
        yield Runs(client, deployment)


@dataclass
class ChainDispatcher:
    """The kit's fire callback for chain stages: one run-job run per fire, started now.

    Raising means the fire did not happen (the kit leaves it unstamped and the
    chain retries it).
    """

    node: str
    deployment: str
    now: datetime
    dispatched: list[tuple[Fire, str, str]] = field(default_factory=list)
    """(fire, flow run id, flow run name) for each fire that became a run."""

    def __call__(self, fire: Fire) -> None:
        ref = JobRef.of_fire(self.node, fire)
        with runs_of(self.deployment) as runs:
            created = runs.create([Planned(ref=ref, start=self.now)])
        if ref.idempotency_key not in created.runs:
            error = created.failed[0][1] if created.failed else "no run was created"
            raise RuntimeError(f"could not create the {ref.name} run on {runs.target}: {error}")
        self.dispatched.append((fire, created.runs[ref.idempotency_key], ref.name))


def run_parameters(run: FlowRun) -> dict[str, Any]:
    """Return a run's parameters as a plain dict."""
    return dict(run.parameters or {})


@contextmanager
def pulling_scheduler(settings: AgentSettings, *, now: datetime) -> Iterator[Scheduler]:
    """Yield :func:`build_scheduler`'s Scheduler, and close its HTTP client after the block.

    The client (an HTTP pull's keep-alive connection to the controller) is the
    caller's to close: the kit only borrows an injected client.
    """
    scheduler = build_scheduler(settings, now=now)
    try:
        yield scheduler
    finally:
        client = scheduler._config.http_client  # built just above: ours to close
        if client is not None:
            client.close()


def build_scheduler(
    settings: AgentSettings,
    *,
    now: datetime,
    dispatcher: ChainDispatcher | None = None,
    pulls: bool = True,
) -> Scheduler:
    """Return a Scheduler over this node's cache: it pulls, and fires chain stages.

    ``pulls=False`` for a caller that only reads or stamps the cache (run-job):
    no HTTP client, no token looked up.
    """
    client: httpx.Client | None = None
    if pulls and settings.pull_url.startswith(("http://", "https://")):
        token = settings.bearer_token()
        client = httpx.Client(
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=settings.pull_timeout.total_seconds(),
            follow_redirects=True,
        )
    fire = dispatcher or ChainDispatcher(
        node=settings.node_name, deployment=deployment_name(settings), now=now
    )
    config = Config(
        pull_url=settings.pull_url,
        node_name=settings.node_name,
        cache_path=settings.cache_path,
        fire=fire,
        http_client=client,
        timezone=settings.tz,
        fire_grace=settings.grace,
    )
    return Scheduler(config, now=now)
