"""What a job's record says in Prefect, pure: its events, its task run, its artifact."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from flows.outbox import Attempt, JobView, utc_text
from sched_core.values import format_go_time

EVENT_JOB_COMPLETED = "sched.job.completed"
EVENT_JOB_FAILED = "sched.job.failed"
JOB_EVENT_NAMESPACE = uuid.UUID("7d3c1f0e-5a7b-4c1e-9a52-2f1d3b6c8e40")
"""Namespace of the job events' ids: one id per run, so the server keeps one event per run."""
ACTION_ROLE = "sched-action"
TASK_RUN_NAMESPACE = uuid.UUID("0b6f3a52-9c1d-4e7a-8f25-6d4c2e9b1a73")
"""Namespace of the command's task run id (one per flow run) and of its states' event ids."""
TASK_KEY = "run-command"


def action_related(action: str) -> list[dict[str, str]]:
    """Return the related resource naming a job's action (what the fleet's alerts match)."""
    if not action:
        return []
    return [{"prefect.resource.id": f"sched.action.{action}",
             "prefect.resource.role": ACTION_ROLE, "prefect.resource.name": action}]


def job_event(node: str, payload: dict[str, Any], *, completed: bool,
              occurred: datetime) -> dict[str, Any]:
    """Return a job's one ``sched.job.completed`` or ``sched.job.failed`` event (pure).

    Its id is derived from the run's (``payload["flow_run_id"]``), so however many
    times it is sent the server keeps one; the action is also a related resource
    (:func:`action_related`), which the fleet's alerts match.
    """
    run = str(payload["flow_run_id"])
    action = str(payload.get("action") or "")
    return {
        "id": str(uuid.uuid5(JOB_EVENT_NAMESPACE, run)),
        "occurred": format_go_time(occurred),
        "event": EVENT_JOB_COMPLETED if completed else EVENT_JOB_FAILED,
        "resource": {"prefect.resource.id": f"sched.agent.{node}",
                     "prefect.resource.name": node},
        "related": [{"prefect.resource.id": f"prefect.flow-run.{run}",
                     "prefect.resource.role": "flow-run",
                     "prefect.resource.name": str(payload.get("flow_run_name") or "")},
                    *action_related(action)],
        "payload": payload,
    }


def job_markdown(view: JobView, node: str) -> str:
    """Return a job's artifact: outcome, tries with real times and exit codes, identity."""
    spec = view.spec
    outcome = (view.end_state or "running").lower()
    if view.message:
        outcome += f": {view.message}"
    lines = [f"### {spec.action} of `{spec.schedule_id}` on {node}: {outcome}", ""]
    if view.attempts:
        lines += ["| try | started (UTC) | ended (UTC) | exit code | timed out | output lines |",
                  "|---|---|---|---|---|---|"]
        for attempt in view.attempts:
            lines.append(_attempt_row(attempt))
        lines.append("")
    if spec.argv:
        lines.append(f"argv: `{' '.join(spec.argv)}`  ")
    window = spec.window.isoformat() if spec.window else "none"
    lines.append(f"window: {window}; trigger: {spec.trigger_key}; key: `{spec.key}`  ")
    lines.append(f"accepted by the node at {utc_text(spec.accepted_at)}: {spec.reason}")
    return "\n".join(lines)


def _attempt_row(attempt: Attempt) -> str:
    exit_info = attempt.exit or {}
    started = utc_text(attempt.started_at) if attempt.started_at else "-"
    ended = utc_text(attempt.ended_at) if attempt.ended_at else "-"
    code = exit_info.get("exit_code", "-") if not attempt.interrupted else "interrupted"
    return (f"| {attempt.number} | {started} | {ended} | {code} | "
            f"{bool(exit_info.get('timed_out'))} | {exit_info.get('lines', '-')} |")


@dataclass(frozen=True)
class TaskState:
    """One state of the command's task run, at the time it really happened."""

    type: str
    name: str
    message: str
    at: datetime
    details: dict[str, Any] = field(default_factory=dict)


def task_run_id_for(flow_run_id: str) -> str:
    """Return the id of a flow run's ``run-command`` task run (the same on every try)."""
    return str(uuid.uuid5(TASK_RUN_NAMESPACE, flow_run_id))


def task_run_events(task_run_id: str, flow_run_id: str, flow_run_name: str,
                    states: list[TaskState], *, first: int, policy: dict[str, Any],
                    ) -> list[dict[str, Any]]:
    """Return the events of states[first:] of the command's task run (pure).

    The server's task-run recorder makes the task run and its states from them, as it
    does for Prefect's own engine (``prefect.orchestration: client``): each state keeps
    its own time, and the task run's start, end, run count and run time are the ones
    Prefect's rules would give states at those times. Each event's id is derived from
    the task run's and the state's place, so a state sent twice is kept once.
    """
    events: list[dict[str, Any]] = []
    stamps = _increasing([state.at for state in states])
    for index in range(first, len(states)):
        state, at = states[index], stamps[index]
        previous = states[index - 1] if index else None
        fields = _task_run_fields(states[:index + 1], stamps[:index + 1], policy)
        events.append({
            "id": str(uuid.uuid5(uuid.UUID(task_run_id), f"state-{index}")),
            "occurred": format_go_time(at),
            "event": f"prefect.task-run.{state.name}",
            "resource": {
                "prefect.resource.id": f"prefect.task-run.{task_run_id}",
                "prefect.resource.name": TASK_KEY,
                "prefect.run-count": str(fields["run_count"]),
                "prefect.state-message": state.message,
                "prefect.state-name": state.name,
                "prefect.state-timestamp": format_go_time(at),
                "prefect.state-type": state.type,
                "prefect.orchestration": "client",
            },
            "related": [{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                         "prefect.resource.role": "flow-run",
                         "prefect.resource.name": flow_run_name}],
            "payload": {
                "intended": {"from": previous.type if previous else None, "to": state.type},
                "initial_state": None if previous is None else {
                    "type": previous.type, "name": previous.name, "message": previous.message},
                "validated_state": {"type": state.type, "name": state.name,
                                    "message": state.message, "state_details": state.details},
                "task_run": fields,
            },
        })
    return events


def _increasing(stamps: list[datetime]) -> list[datetime]:
    """Return the times, each at least a microsecond after the one before.

    The server keeps a task run's latest state by its time: two states at the
    same instant would leave the earlier one shown.
    """
    out: list[datetime] = []
    for stamp in stamps:
        if out and stamp <= out[-1]:
            stamp = out[-1] + timedelta(microseconds=1)
        out.append(stamp)
    return out


def _task_run_fields(states: list[TaskState], stamps: list[datetime],
                     policy: dict[str, Any]) -> dict[str, Any]:
    """Return the task run as Prefect's state rules leave it after the last of states.

    Start time: the first Running; end time: a final state's; run count: the
    Running states; total run time: the time spent Running; expected start: the
    first state's; next scheduled start: an AwaitingRetry's scheduled time.
    """
    running = [index for index, state in enumerate(states) if state.type == "RUNNING"]
    total = sum((stamps[index + 1] - stamps[index]).total_seconds()
                for index in running if index + 1 < len(states))
    last = states[-1]
    fields: dict[str, Any] = {
        "name": TASK_KEY, "task_key": TASK_KEY, "dynamic_key": "0",
        "empirical_policy": policy, "tags": [], "task_inputs": {},
        "run_count": len(running), "flow_run_run_count": 1,
        "expected_start_time": format_go_time(stamps[0]),
        "total_run_time": total,
    }
    if running:
        fields["start_time"] = format_go_time(stamps[running[0]])
    if last.type in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED"):
        fields["end_time"] = format_go_time(stamps[-1])
    if last.type == "SCHEDULED" and last.details.get("scheduled_time"):
        fields["next_scheduled_start_time"] = last.details["scheduled_time"]
    return fields
