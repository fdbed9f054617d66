"""The job registry: the Prefect API, read for this node's run-job runs.

A run-job run is recognised by its tags (``node:<node>``, ``action:<action>``,
``schedule:<id>``, ``trigger:<key>``) and its parameters (``schedule_id``,
``window``, ``key``). Planned runs wait in Scheduled for hours: they are not
active jobs until their start time has come. A run the start guard ended
without running (state name ``Skipped``) is neither active nor finished.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterEndTime,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateName,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort

from flows.runtime import RUN_JOB
from sched_core.plan import AWAITING_SLOT, WINDOW_TRIGGERS, PlannedRun
from sched_core.scheduler import as_utc

log = logging.getLogger(__name__)

SKIPPED = "Skipped"
"""The state name of a run the start guard ended without running."""

ACTIVE_STATES = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
"""States of a job that is active; a Scheduled one only once its start time has come."""
FINISHED_STATES = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]

PAGE = 200
"""Runs per page when listing (the server's default limit)."""


def tag_values(run: FlowRun) -> dict[str, str]:
    """Return a run's ``name:value`` tags as a dict (``{"node": "node-a", ...}``)."""
    return {tag.split(":", 1)[0]: tag.split(":", 1)[1] for tag in run.tags if ":" in tag}


def run_window(run: FlowRun) -> datetime | None:
    """Return the window a run-job run was created for, from its parameters (None: no window)."""
    value = (run.parameters or {}).get("window")
    if isinstance(value, str) and value:
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, datetime) and value.tzinfo is not None:
        return as_utc(value)
    return None


def _job_filter(
    tags: list[str],
    *,
    types: Sequence[StateType],
    exclude: tuple[str, ...] = (),
    ended_after: datetime | None = None,
    started_before: datetime | None = None,
) -> FlowRunFilter:
    """Return a filter for runs with all of tags in one of types, never Skipped ones."""
    flt = FlowRunFilter(
        tags=FlowRunFilterTags(all_=tags),
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=types),
            name=FlowRunFilterStateName(not_any_=[SKIPPED]),
        ),
    )
    if exclude:
        flt.id = FlowRunFilterId(not_any_=[UUID(item) for item in exclude])
    if ended_after is not None:
        flt.end_time = FlowRunFilterEndTime(after_=ended_after)
    if started_before is not None:
        flt.expected_start_time = FlowRunFilterExpectedStartTime(before_=started_before)
    return flt


def count_jobs(
    node: str,
    actions: list[str],
    states: list[StateType],
    *,
    now: datetime,
    exclude: tuple[str, ...] = (),
    ended_after: datetime | None = None,
) -> int:
    """Return how many run-job runs of node with one of actions are in one of states.

    A Scheduled run counts only once its start time has come (``now``): a
    planned run hours ahead is not an active job. Skipped runs never count.
    """
    flows = FlowFilter(name=FlowFilterName(any_=[RUN_JOB]))
    others = [state for state in states if state is not StateType.SCHEDULED]
    total = 0
    with get_client(sync_client=True) as client:
        for action in actions:
            tags = [f"node:{node}", f"action:{action}"]
            queries = []
            if others:
                queries.append(_job_filter(tags, types=others, exclude=exclude,
                                           ended_after=ended_after))
            if StateType.SCHEDULED in states:
                queries.append(_job_filter(tags, types=[StateType.SCHEDULED], exclude=exclude,
                                           ended_after=ended_after, started_before=now))
            for flt in queries:
                total += client.count_flow_runs(flow_filter=flows, flow_run_filter=flt)
    return total


def _pages(client: SyncPrefectClient, flt: FlowRunFilter, sort: FlowRunSort) -> Iterator[FlowRun]:
    offset = 0
    while True:
        page = client.read_flow_runs(flow_run_filter=flt, sort=sort, limit=PAGE, offset=offset)
        yield from page
        if len(page) < PAGE:
            return
        offset += PAGE


def list_window_runs(
    client: SyncPrefectClient, deployment_id: UUID, node: str, *, since: datetime,
    before: datetime | None = None, states: Sequence[str] | None = None,
) -> list[PlannedRun]:
    """Return this node's window runs whose scheduled start is in [since, before).

    ``states``: only runs in those state names (any state when None).
    """
    flt = FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
        tags=FlowRunFilterTags(all_=[f"node:{node}"]),
        expected_start_time=FlowRunFilterExpectedStartTime(after_=since, before_=before),
        state=None if states is None else FlowRunFilterState(
            name=FlowRunFilterStateName(any_=list(states))),
    )
    found: list[PlannedRun] = []
    for run in _pages(client, flt, FlowRunSort.EXPECTED_START_TIME_ASC):
        item = planned_run(run)
        if item is not None:
            found.append(item)
    return found


def list_waiting(
    client: SyncPrefectClient, deployment_id: UUID, node: str, *, since: datetime,
    before: datetime,
) -> tuple[list[PlannedRun], dict[str, datetime]]:
    """Return this node's window runs not started yet that were due in [since, before).

    Those nobody tried (Scheduled, Late) and those waiting for a job slot
    (AwaitingConcurrencySlot), with, for the latter, when Prefect first tried
    to start each (one state history read per waiting run).
    """
    found = list_window_runs(client, deployment_id, node, since=since, before=before,
                             states=["Scheduled", "Late", AWAITING_SLOT])
    tries: dict[str, datetime] = {}
    for item in found:
        if item.state_name == AWAITING_SLOT:
            tried = first_try(client.read_flow_run_states(UUID(item.run_id)))
            if tried is not None:
                tries[item.run_id] = tried
    return found, tries


def planned_run(run: FlowRun) -> PlannedRun | None:
    """Return a run-job run as the kit's :class:`PlannedRun`, or None if it has no window."""
    tags = tag_values(run)
    trigger = tags.get("trigger", "")
    window = run_window(run)
    schedule_id = (run.parameters or {}).get("schedule_id") or tags.get("schedule")
    if trigger not in WINDOW_TRIGGERS or window is None or not isinstance(schedule_id, str):
        return None
    return PlannedRun(
        run_id=str(run.id),
        schedule_id=schedule_id,
        window=window,
        trigger_key=trigger,
        state_name=(run.state.name or "") if run.state is not None else "",
        start=_start(run),
        retry="retry" in run.tags,
    )


def _start(run: FlowRun) -> datetime | None:
    """Return a run's scheduled start: its Scheduled state's time while untried.

    Prefect sets ``expected_start_time`` once, from the first state, so a run
    moved since (a row's jitter changed) keeps its old one there; the state's
    ``scheduled_time`` is where the runner will start it. A run waiting for a
    job slot has a retry time in its state instead: its planned start is then
    the expected one.
    """
    state = run.state
    if (state is not None and state.name in ("Scheduled", "Late")
            and state.state_details.scheduled_time is not None):
        return as_utc(state.state_details.scheduled_time)
    return as_utc(run.expected_start_time) if run.expected_start_time else None


@dataclass(frozen=True)
class Interrupted:
    """A job the node's own shutdown or a crash stopped, to be run once more.

    ``window`` is None for a chain stage's job (its trigger is the stage's,
    its key ``<id>@<stage>@<day>``).
    """

    run_id: str
    run_name: str
    action: str
    schedule_id: str
    window: datetime | None
    key: str
    trigger_key: str
    state_name: str
    stopped_at: datetime | None = None


def interrupted_runs(
    client: SyncPrefectClient, deployment_id: UUID, *, since: datetime, node: str | None = None
) -> list[FlowRun]:
    """Return a deployment's runs, ended since ``since``, that their node's own stop interrupted.

    Crashed, or Cancelled by the node's shutdown (:func:`interrupted_by_the_node`);
    ``node`` keeps the runs tagged ``node:<node>`` only (run-job's; an
    advance-chain run has the deployment's tags only, and the deployment is
    the node's). A run an operator cancelled stays cancelled; a re-run (tag
    ``retry``) is never run again; a run marked Crashed that still sent
    heartbeats afterwards (a Prefect outage, not a stop) is left out.
    """
    flt = FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType.CRASHED, StateType.CANCELLED])
        ),
        end_time=FlowRunFilterEndTime(after_=since),
    )
    if node is not None:
        flt.tags = FlowRunFilterTags(all_=[f"node:{node}"])
    found: list[FlowRun] = []
    for run in _pages(client, flt, FlowRunSort.EXPECTED_START_TIME_ASC):
        if "retry" in run.tags or not interrupted_by_the_node(client, run):
            continue
        stopped = run.state.timestamp if run.state is not None else None
        if stopped is not None and alive_after(client, str(run.id), stopped):
            continue
        found.append(run)
    return found


def list_interrupted(
    client: SyncPrefectClient, deployment_id: UUID, node: str, *, since: datetime
) -> list[Interrupted]:
    """Return this node's jobs that ended Crashed, or Cancelled by its own shutdown.

    Window jobs, and the jobs chain stages fired (no window, a key and a
    trigger of their own). An ad hoc run (no key) is not re-run: whoever
    started it sees how it ended.
    """
    found: list[Interrupted] = []
    for run in interrupted_runs(client, deployment_id, since=since, node=node):
        params = run.parameters or {}
        key, schedule_id = params.get("key"), params.get("schedule_id")
        tags = tag_values(run)
        trigger = tags.get("trigger", "")
        if not isinstance(key, str) or not key or not isinstance(schedule_id, str):
            continue
        item = planned_run(run)
        if item is None and trigger in WINDOW_TRIGGERS:
            continue  # a window trigger without a window: not one of ours
        stopped = run.state.timestamp if run.state is not None else None
        found.append(Interrupted(
            run_id=str(run.id), run_name=run.name, action=tags.get("action", ""),
            schedule_id=schedule_id,
            window=item.window if item is not None else None, key=key, trigger_key=trigger,
            state_name=(run.state.name or "") if run.state is not None else "",
            stopped_at=None if stopped is None else as_utc(stopped),
        ))
    return found


def still_interrupted(client: SyncPrefectClient, run_id: str) -> str | None:
    """Return why a re-run must not run because its interrupted run was not, or None.

    Checked when the re-run starts: the interrupted run may have ended after
    all (a Crashed run can still complete), or still be alive.
    """
    run = client.read_flow_run(UUID(run_id))
    state = run.state
    if state is None or state.type not in (StateType.CRASHED, StateType.CANCELLED):
        name = state.name if state is not None else "no state"
        return f"the interrupted run {run.name} is {name} now, not interrupted"
    if state.timestamp is not None and alive_after(client, run_id, state.timestamp):
        return f"the interrupted run {run.name} is still alive (heartbeats after {state.name})"
    return None


RUNNER_SHUTDOWN = "Runner is shutting down."
"""The message of the Cancelled state serve writes for its runs when it is stopped (SIGTERM)."""


def interrupted_by_the_node(client: SyncPrefectClient, run: FlowRun) -> bool:
    """Return whether a Crashed or Cancelled run was stopped by its node, not by an operator.

    From the run's state history (checked against Prefect 3.9.1):

    - Crashed: its process died (``Process exited with status code ...``), or
      the agent's automations found it without a process: the node's.
    - Cancelled straight from Running with ``Runner is shutting down.``: serve
      was stopped (SIGTERM): the node's.
    - Cancelling, then Cancelled: an operator cancelled it; it stays cancelled.
    - Cancelled in any other way (while Scheduled, say): not interrupted.
    """
    state = run.state
    if state is None:
        return False
    if state.type is StateType.CRASHED:
        return True
    if state.type is not StateType.CANCELLED or state.message != RUNNER_SHUTDOWN:
        return False
    history = sorted(client.read_flow_run_states(run.id), key=lambda item: item.timestamp)
    return not any(item.type is StateType.CANCELLING for item in history)


def alive_after(client: SyncPrefectClient, run_id: str, since: datetime) -> bool:
    """Return whether the run sent a heartbeat or changed state after since.

    A run the automations marked Crashed during a Prefect outage may still be
    running: its heartbeats (or a later Completed) say so, and it must not run
    twice.
    """
    response = client.request(
        "POST",
        "/events/filter",
        json={"filter": {
            "occurred": {"since": since.isoformat()},
            "resource": {"id": [f"prefect.flow-run.{run_id}"]},
            "event": {"prefix": ["prefect.flow-run."]},
        }, "limit": 5},
    )
    events = response.json().get("events", [])
    return any(
        event.get("event") in ("prefect.flow-run.heartbeat", "prefect.flow-run.Running",
                               "prefect.flow-run.Completed", "prefect.flow-run.Failed")
        for event in events
    )


def first_try(states: list[Any]) -> datetime | None:
    """Return when Prefect first tried to start a run, from its state history.

    The first Pending state, or the first AwaitingConcurrencySlot (the
    deployment's job slots were taken when the runner tried): Late is the
    server's mark of an untried run, not a try. None while untried.
    """
    tried = [
        state.timestamp for state in states
        if state.timestamp is not None and (
            state.type is StateType.PENDING or state.name == "AwaitingConcurrencySlot"
            or state.type is StateType.RUNNING)
    ]
    return as_utc(min(tried)) if tried else None
