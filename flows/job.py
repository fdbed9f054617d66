"""The ``run-job`` flow: run one action for one schedule and window.

1. Resolve the schedule (passed in by the dispatcher, or looked up in the
   node's cache by id for an ad hoc run) and fill the action's argv template;
   a missing value fails the run here, before anything is started.
2. Run the command without a shell in a task with the action's retries; every
   output line goes to the run's logs; a timeout kills the command's group.
3. Publish the exit code and duration as an artifact, and on the terminal
   state emit ``sched.job.completed`` or ``sched.job.failed`` (failed, crashed
   or cancelled; from state hooks, so the run is already terminal in the API
   when the chain looks).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import Flow, flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State
from prefect.runtime import flow_run as current_run

from flows.actions import CommandResult, render_argv, run_command, window_stamp
from flows.agent import (
    EVENT_JOB_COMPLETED,
    EVENT_JOB_FAILED,
    RUN_JOB,
    agent_settings,
    emit,
    job_run_name,
    job_tags,
    slug,
)
from flows.settings import AgentSettings
from sched_core import ConfigError, LocalSchedule
from sched_core.cache import load_cache


class JobFailed(RuntimeError):
    """The job's command exited non-zero or timed out."""


@task(name="run-command", cache_policy=NO_CACHE, log_prints=False)
def run_attempt(
    argv: list[str],
    timeout_s: float,
    env: dict[str, str],
    cwd: str | None,
    attempts: list[CommandResult],
    umask: int = 0o077,
) -> CommandResult:
    """Run the command once; raise JobFailed on a non-zero exit so the task retries."""
    logger = get_run_logger()
    logger.info("running %s", argv)
    result = run_command(
        argv, timeout_s=timeout_s, env=env, cwd=None if cwd is None else Path(cwd), log=logger.info,
        umask=umask,
    )
    attempts.append(result)
    if result.timed_out:
        raise JobFailed(f"{argv[0]} timed out after {timeout_s:g} s and was killed")
    if result.exit_code != 0:
        raise JobFailed(f"{argv[0]} exited with code {result.exit_code}")
    logger.info("%s exited 0 after %.3f s", argv[0], result.duration_s)
    return result


def resolve_schedule(
    settings: AgentSettings, schedule: LocalSchedule | None, schedule_id: str | None
) -> LocalSchedule:
    """Return the schedule passed in, or the cached one with schedule_id."""
    if schedule is not None:
        return schedule
    if not schedule_id:
        raise ConfigError("run-job needs a schedule or a schedule_id")
    cache = load_cache(settings.cache_path, now=datetime.now(UTC))
    for row in cache.schedules:
        if row.id == schedule_id:
            return row
    known = ", ".join(sorted(row.id for row in cache.schedules)) or "none"
    raise ConfigError(
        f"no schedule {schedule_id!r} in the cache {settings.cache_path} (known: {known})"
    )


def _run_name() -> str:
    params: dict[str, Any] = current_run.parameters or {}
    row = params.get("schedule")
    if isinstance(row, LocalSchedule):
        row = row.model_dump(mode="json")
    if not isinstance(row, dict):
        row = {"action": _cached_action(params.get("schedule_id")) or "job",
               "id": params.get("schedule_id") or "unknown"}
    window = params.get("window")
    if isinstance(window, str):
        window = datetime.fromisoformat(window)
    action, schedule_id = str(row.get("action", "job")), str(row.get("id", "unknown"))
    try:
        return job_run_name(action, schedule_id, window if isinstance(window, datetime) else None)
    except ConfigError:  # a window without an offset: the run fails, saying so
        return f"{action}-{schedule_id}-bad-window"


def _cached_action(schedule_id: object) -> str | None:
    """Return the action of the cached schedule an ad hoc run names by id; None if unknown."""
    if not isinstance(schedule_id, str) or not schedule_id:
        return None
    try:
        return resolve_schedule(agent_settings(), None, schedule_id).action
    except Exception:  # the run itself reports a bad id or configuration, with details
        return None


def _ensure_tags(tags: list[str]) -> None:
    """Add the registry tags to this run if it was started ad hoc without them."""
    run_id = current_run.id
    have = set(current_run.tags or [])
    if run_id is None or set(tags) <= have:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(run_id, tags=sorted(have | set(tags)))


def _emit_terminal(flow: Flow[..., Any], flow_run: FlowRun, state: State) -> None:
    """State hook: emit the job event once the run's terminal state is recorded."""
    run = flow_run
    params: dict[str, Any] = dict(run.parameters or {})
    row = params.get("schedule") or {}
    if isinstance(row, LocalSchedule):
        row = row.model_dump(mode="json")
    action = str(row.get("action", "")) if isinstance(row, dict) else ""
    tags = {tag.split(":", 1)[0]: tag.split(":", 1)[1] for tag in run.tags if ":" in tag}
    node = tags.get("node", "")
    action = action or tags.get("action", "")
    schedule_id = str(row.get("id", "")) if isinstance(row, dict) else ""
    schedule_id = schedule_id or str(params.get("schedule_id") or "")
    if not action and schedule_id:
        # An ad hoc run by id: its action tag was added while it ran, after this
        # copy of the run was read, so look the action up like the run did.
        action = _cached_action(schedule_id) or ""
    if not node:
        try:
            node = agent_settings().node_name
        except ConfigError:
            node = "unknown"
    emit(
        EVENT_JOB_COMPLETED if state.is_completed() else EVENT_JOB_FAILED,
        node,
        {
            "node": node,
            "action": action,
            "schedule_id": schedule_id,
            "trigger_key": str(params.get("trigger_key", "")),
            "window": str(params.get("window") or ""),
            "flow_run_id": str(run.id),
            "flow_run_name": run.name,
            "state": state.name or "",
        },
    )


@flow(
    name=RUN_JOB,
    flow_run_name=_run_name,
    on_completion=[_emit_terminal],
    on_failure=[_emit_terminal],
    on_crashed=[_emit_terminal],
    on_cancellation=[_emit_terminal],
)
def run_job(
    schedule: LocalSchedule | None = None,
    schedule_id: str | None = None,
    trigger_key: str = "manual",
    window: datetime | None = None,
    key: str = "",
) -> dict[str, Any]:
    """Run the schedule's action (the whole row, or a cached schedule_id for ad hoc runs)."""
    logger = get_run_logger()
    window_stamp(window)  # a window without a UTC offset fails here, before anything runs
    settings = agent_settings()
    row = resolve_schedule(settings, schedule, schedule_id)
    _ensure_tags(job_tags(settings.node_name, row.action, row.id, trigger_key))
    spec = settings.action(row.action)
    argv = render_argv(
        spec,
        row,
        state_dir=settings.state_dir,
        node=settings.node_name,
        window=window,
        trigger_key=trigger_key,
    )
    logger.info(
        "job %s of schedule %s (%s), window %s, trigger %s, key %s",
        row.action, row.id, row.name, window.isoformat() if window else "none",
        trigger_key, key or "none",
    )
    attempts: list[CommandResult] = []
    attempt = run_attempt.with_options(
        retries=spec.retries, retry_delay_seconds=spec.retry_delay.total_seconds()
    )
    error: BaseException | None = None
    try:
        attempt(
            argv,
            spec.timeout.total_seconds(),
            spec.env,
            str(spec.cwd) if spec.cwd else None,
            attempts,
            settings.job_umask,
        )
    except Exception as exc:
        error = exc
    last = attempts[-1] if attempts else None
    summary: dict[str, Any] = {
        "node": settings.node_name,
        "schedule_id": row.id,
        "action": row.action,
        "argv": argv,
        "exit_code": last.exit_code if last else None,
        "duration_s": last.duration_s if last else None,
        "timed_out": last.timed_out if last else False,
        "attempts": len(attempts),
    }
    outcome = "completed" if error is None else f"failed: {error}"
    create_markdown_artifact(
        key=f"job-{slug(settings.node_name)}-{slug(row.id)}",
        markdown="\n".join([
            f"### {row.action} of `{row.id}` ({row.name}): {outcome}",
            "",
            "| attempt | exit code | duration (s) | timed out | output lines |",
            "|---|---|---|---|---|",
            *(
                f"| {n} | {a.exit_code} | {a.duration_s} | {a.timed_out} | {a.output_lines} |"
                for n, a in enumerate(attempts, 1)
            ),
            "",
            f"argv: `{' '.join(argv)}`  ",
            f"window: {window.isoformat() if window else 'none'}; trigger: {trigger_key}; "
            f"key: `{key or 'none'}`",
        ]),
        description=f"{row.action} {row.id}: exit code and duration",
    )
    if error is not None:
        raise error
    return summary
