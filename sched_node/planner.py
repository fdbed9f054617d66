"""The plan in Prefect: each coming window as a named Scheduled run, so the Upcoming tab is true.

The node fires its windows itself (the kit's loop, :mod:`sched_core.loop`); these runs are what it
will do, shown ahead, and the runs its jobs are recorded into (by the same
idempotency key). Nobody starts them: they wait in the pool's paused queue ``planned``
(:mod:`sched_node.registration`), which no worker polls; each carries its action's retries
(its run's retry policy), and its parameters name the schedule only.

1. **Plan.** Every window :func:`sched_core.plan.plan_windows` gives whose run
   starts after now gets a Scheduled run at its start (the window plus the
   row's jitter), created in bulk, 100 per request; a window already in the
   record (``<state_dir>/plan.json``: idempotency key to run id) costs nothing,
   so a reconcile that changed nothing sends no request.
2. **Prune.** A planned run whose window is no longer one of its row's, or
   that its row's policies now skip, is deleted; one whose start moved (a new
   jitter) is deleted and made again at its new start in the same pass
   (:func:`sched_core.plan.planned_fate`): Prefect 3.9.1 keeps a run's
   ``expected_start_time`` through a new Scheduled state, and the Upcoming
   list sorts and shows by it.
3. A record that is lost is rebuilt from the server's Scheduled runs of the
   node's deployment the next time the server answers; a window planned twice
   is one run (its idempotency key). So is the record of a deployment the node
   registered again (:meth:`Planner.rebase`: deleting a deployment deletes its
   runs), and a bulk create answered 404 (the deployment is gone) registers it
   again (:meth:`sched_node.registration.Deployments.forget`) and plans on the new one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sched_core.firing import NodeView
from sched_core.jsonwire import MAX_DEPTH
from sched_core.plan import TRIGGER_SCHEDULE, Window, plan_windows, planned_fate
from sched_core.statefile import locked, read_json_file, write_atomic
from sched_core.values import format_go_time
from sched_node.identity import JobRef
from sched_node.prefect_api import PAGE, PrefectApi, PrefectRefused, new_state
from sched_node.registration import PLANNED_QUEUE, RUN_JOB, Deployments

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRunPolicy

log = logging.getLogger(__name__)

BULK_MAX = 100
BULK_RETRY_DELAYS = (0.2, 0.5, 1.0, 3.0, 8.0)
"""Seconds before each retry of a chunk's failed entries (12.7 s in all): a busy SQLite
server was measured refusing 52 creates in a row with "database is locked" over 1.6 s."""
KEEP_FOR = timedelta(days=2)
"""How long the record keeps a planned window after its start (the firing loop reads it)."""


@dataclass(frozen=True)
class PlannedEntry:
    """One planned run: its id, schedule, window and scheduled start."""

    run_id: str
    schedule_id: str
    window: datetime
    start: datetime


@dataclass
class PlanReport:
    """What one planning pass did (the reconcile's artifact shows it)."""

    planned: int = 0
    held_back: int = 0
    created: list[tuple[str, datetime]] = field(default_factory=list)
    """(run name, start) of each run created now."""
    deleted: list[tuple[str, str]] = field(default_factory=list)
    """(run name or key, why) of each run deleted."""
    moved: list[tuple[str, datetime]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the pass created, deleted or moved a run."""
        return bool(self.created or self.deleted or self.moved)


def _time(value: object) -> datetime | None:
    from sched_node.outbox import parse_time

    return parse_time(value)


class Planner:
    """The node's planned runs in Prefect (the module's rules) and their record on disk."""

    def __init__(self, api: PrefectApi, deployments: Deployments, path: Path, *,
                 horizon: timedelta, min_windows: int, max_runs: int, now: datetime,
                 retries_of: Callable[[str], tuple[int, float]] = lambda action: (0, 0.0)
                 ) -> None:
        self.api = api
        self._retries_of = retries_of
        """An action's retries and their delay (its run's retry policy, shown by Prefect)."""
        self.deployments = deployments
        self.path = path
        self.horizon = horizon
        self.min_windows = min_windows
        self.max_runs = max_runs
        self._lock = threading.Lock()
        self._entries: dict[str, PlannedEntry] = {}
        self._loaded = self._load(now)

    def _load(self, now: datetime) -> bool:
        data = read_json_file(self.path, now=now, max_depth=MAX_DEPTH)
        if not isinstance(data, dict) or not isinstance(data.get("planned"), dict):
            return False
        for key, raw in data["planned"].items():
            if not isinstance(raw, dict):
                continue
            window, start = _time(raw.get("window")), _time(raw.get("start"))
            if window and start and isinstance(raw.get("run"), str):
                self._entries[key] = PlannedEntry(str(raw["run"]), str(raw.get("schedule_id")),
                                                  window, start)
        return True

    def _save(self) -> None:
        body = {"planned": {key: {"run": item.run_id, "schedule_id": item.schedule_id,
                                  "window": format_go_time(item.window),
                                  "start": format_go_time(item.start)}
                            for key, item in sorted(self._entries.items())}}
        with locked(self.path):
            write_atomic(self.path, json.dumps(body, separators=(",", ":")).encode())

    def planned_run(self, idempotency_key: str) -> str | None:
        """Return the run planned for a window's key, or None."""
        with self._lock:
            entry = self._entries.get(idempotency_key)
        return None if entry is None else entry.run_id

    def plan(self, view: NodeView, *, now: datetime) -> PlanReport:
        """Run one planning pass (rules 1-3); raise PrefectUnavailable when the server is away."""
        with self._lock:
            report = PlanReport()
            deployment = self.deployments.get()[RUN_JOB]
            if not self._loaded:
                self._rebuild(deployment, view.node, now=now)
            # Pruned first: a moved run is deleted here and made again below at its start.
            self._prune(view, report, now=now)
            plan = plan_windows(view, now=now, horizon=self.horizon,
                                min_windows=self.min_windows, max_runs=self.max_runs)
            report.planned, report.held_back = len(plan.windows), plan.held_back
            wanted = [(self._ref(view.node, item), item) for item in plan.windows
                      if item.start > now]
            try:
                missing = self._create_missing(deployment, wanted, report, now=now)
            except PrefectRefused as exc:
                if exc.status != 404:
                    raise
                log.warning("the plan found run-job/%s gone (%s): registering it again",
                            view.node, exc, extra={"node": view.node})
                self.deployments.forget()
                deployment = self.deployments.get()[RUN_JOB]
                self._entries = {}
                report.created = []
                self._rebuild(deployment, view.node, now=now)
                missing = self._create_missing(deployment, wanted, report, now=now)
            cutoff = now - KEEP_FOR
            self._entries = {key: item for key, item in self._entries.items()
                             if item.start >= cutoff}
            if report.changed or not self._loaded or missing:
                self._save()
            self._loaded = True
        return report

    def _create_missing(self, deployment: str, wanted: list[tuple[JobRef, Window]],
                        report: PlanReport, *, now: datetime) -> bool:
        """Create the runs of wanted windows the record lacks, BULK_MAX to a request; return
        whether any was lacking."""
        missing = [(ref, item) for ref, item in wanted
                   if ref.idempotency_key not in self._entries]
        for offset in range(0, len(missing), BULK_MAX):
            self._create(deployment, missing[offset:offset + BULK_MAX], report, now=now)
        return bool(missing)

    def rebase(self) -> None:
        """Forget the record: the node registered its deployment again, so the runs it holds
        are another deployment's (or gone); the next plan rebuilds it from the server (rule 3)."""
        with self._lock:
            self._entries = {}
            self._loaded = False

    def _policy(self, action: str) -> FlowRunPolicy:
        from prefect.client.schemas.objects import FlowRunPolicy

        retries, delay = self._retries_of(action)
        return FlowRunPolicy(retries=retries, retry_delay=int(delay) if retries else None)

    @staticmethod
    def _ref(node: str, window: Window) -> JobRef:
        return JobRef(node=node, action=window.action, schedule_id=window.schedule_id,
                      trigger_key=TRIGGER_SCHEDULE, window=window.window, key=window.key)

    def _create(self, deployment: str, chunk: list[tuple[JobRef, Window]], report: PlanReport,
                *, now: datetime) -> None:
        """Create up to 100 runs, retrying the entries the server reports failed.

        On SQLite the server creates a request's runs in one transaction; when
        another writer (the node's own recorder, another node) commits between
        its first read and its first insert, every entry comes back FAILED
        ("database is locked") and nothing is created. Retrying is safe: the
        idempotency key turns an entry created after all into the same run.
        """
        from prefect.client.schemas.actions import DeploymentFlowRunCreate
        from prefect.states import to_state_create

        pending = list(chunk)
        errors: dict[str, str] = {}
        for attempt in range(len(BULK_RETRY_DELAYS) + 1):
            if attempt:
                time.sleep(BULK_RETRY_DELAYS[attempt - 1])
            body = [DeploymentFlowRunCreate(
                name=ref.name(), parameters=ref.parameters(), tags=ref.tags(),
                idempotency_key=ref.idempotency_key,
                state=to_state_create(new_state("SCHEDULED", scheduled_time=item.start)),
                enforce_parameter_schema=False, work_queue_name=PLANNED_QUEUE,
                empirical_policy=self._policy(item.action))
                for ref, item in pending]
            results = self.api.create_runs(deployment, body)
            failed: list[tuple[JobRef, Window]] = []
            for (ref, item), result in zip(pending, results, strict=True):
                if result.get("status") == "CREATED" and result.get("flow_run_id"):
                    self._entries[ref.idempotency_key] = PlannedEntry(
                        str(result["flow_run_id"]), item.schedule_id, item.window, item.start)
                    report.created.append((ref.name(), item.start))
                else:
                    failed.append((ref, item))
                    errors[ref.idempotency_key] = str(result.get("error"))[:200]
            pending = failed
            if not pending:
                return
        report.failed += [(ref.name(), errors.get(ref.idempotency_key, ""))
                          for ref, _ in pending]

    def _prune(self, view: NodeView, report: PlanReport, *, now: datetime) -> None:
        rows = {row.id: row for row in view.rows}
        for key, item in list(self._entries.items()):
            if item.start <= now:
                continue  # its window is the firing loop's now: it records the run's end
            fate = planned_fate(rows.get(item.schedule_id), item.schedule_id, item.window,
                                item.start, last_fired=view.last_fired.get(item.schedule_id),
                                tz=view.tz, node=view.node)
            if fate.delete is None and fate.move_to is None:
                continue
            try:
                self.api.delete_run(item.run_id)
            except PrefectRefused as exc:
                report.failed.append((key, str(exc)[:200]))
                continue
            del self._entries[key]
            if fate.delete is not None:
                report.deleted.append((key, fate.delete))
            elif fate.move_to is not None:
                report.moved.append((key, fate.move_to))

    def _rebuild(self, deployment: str, node: str, *, now: datetime) -> None:
        """Fill a lost record from the server's Scheduled runs of the deployment (rule 3)."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterExpectedStartTime,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        offset = 0
        wanted = FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[uuid.UUID(deployment)]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
            expected_start_time=FlowRunFilterExpectedStartTime(after_=now))
        while True:
            runs = self.api.filter_runs(wanted, sort="EXPECTED_START_TIME_ASC", limit=PAGE,
                                        offset=offset)
            for run in runs:
                self._adopt(run, node)
            if len(runs) < PAGE:
                break
            offset += PAGE
        log.info("rebuilt the plan record from the server: %d planned runs", len(self._entries),
                 extra={"node": node})

    def _adopt(self, run: dict[str, Any], node: str) -> None:
        """Take a Scheduled run of the node's plan into the record: its window is in its
        idempotency key (``<node>:<id>@<local time and offset>``, never a parameter)."""
        key = run.get("idempotency_key")
        params = run.get("parameters") or {}
        start = _time(run.get("expected_start_time") or run.get("next_scheduled_start_time"))
        if not (isinstance(key, str) and key.startswith(f"{node}:") and start
                and isinstance(params.get("schedule_id"), str)):
            return
        try:
            window = datetime.fromisoformat(key.rpartition("@")[2])
        except ValueError:
            return
        if window.tzinfo is not None:
            self._entries[key] = PlannedEntry(str(run["id"]), params["schedule_id"],
                                              window.astimezone(UTC), start)
