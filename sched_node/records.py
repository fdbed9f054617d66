"""What a job's record says in Prefect, pure: its event, its artifact, its action's resource."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from sched_core.values import format_go_time
from sched_node.outbox import Attempt, JobSpec, JobView, utc_text

if TYPE_CHECKING:
    from sched_node.prefect_api import PrefectApi
    from sched_node.registration import Deployments

EVENT_JOB_COMPLETED = "sched.job.completed"
EVENT_JOB_FAILED = "sched.job.failed"
JOB_EVENT_NAMESPACE = uuid.UUID("7d3c1f0e-5a7b-4c1e-9a52-2f1d3b6c8e40")
"""Namespace of the job events' ids: one id per run, so the server keeps one event per run."""
ACTION_ROLE = "sched-action"


class RecordParts(Protocol):
    """What a job's record steps (:mod:`sched_node.record_steps`, a chain day's too) read of
    the recorder that runs them (:class:`sched_node.recorder.Recorder` is one): the planned
    run of a window's key, the task run a job's run belongs under (a chain stage's), whether
    a chain day has records under way, the flow of a job and its run's parameters."""

    api: PrefectApi
    deployments: Deployments
    node: str
    clock: Callable[[], datetime]
    planned: Callable[[str], str | None]
    parent_task_run: Callable[[JobSpec], str | None]
    chain_pending: Callable[[str], bool]

    @property
    def command_task(self) -> Any:
        """The flow's ``run-command`` task: each try's task run is one of it."""

    def flow_of(self, spec: JobSpec, /) -> str: ...

    def parameters_of(self, spec: JobSpec, /) -> dict[str, Any]: ...


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
