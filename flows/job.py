"""The ``run-job`` flow: run one action for one schedule and window.

1. Read the row from the node's cache (a run carries the schedule id, never
   the row). A window run (trigger ``schedule`` or ``schedule-recovery``)
   first passes the start guard (:mod:`flows.guard`): removed, disabled,
   changed, already run, or late beyond what the miss policy allows, it ends
   ``Skipped`` with the reason, runs nothing and emits no job event.
2. Fill the action's argv template; a missing or refused value fails the run
   here, before anything is started.
3. Hold the schedule's slot on this node (the row's ``overlap``:
   :mod:`flows.overlap`; a run it refuses ends ``Skipped`` with the reason)
   and, with ``repo_lock``, the repository's lock across the fleet
   (:mod:`flows.repolock`); then run the command without a shell in a task
   with the action's retries; every output line goes to the run's logs; a
   timeout kills the command's group.
4. Publish the exit code and duration as an artifact, and on the terminal
   state emit exactly one ``sched.job.completed`` or ``sched.job.failed``
   (failed, crashed or cancelled; from state hooks, so the run is already
   terminal in the API when the chain looks).
"""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect import Flow, flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State
from prefect.runtime import flow_run as current_run
from prefect.states import Completed

from flows.actions import CommandResult, job_environment, render_argv, run_command, window_stamp
from flows.dispatch import JobRef, job_run_name
from flows.guard import cached_row, cached_rows, first_try_of, stage_rerun, start_window
from flows.node_report import report_after
from flows.overlap import cancel_run, job_slot, longest_run_s
from flows.registry import SKIPPED, still_interrupted, tag_values
from flows.repolock import repo_lock
from flows.runtime import (
    ADVANCE_CHAIN,
    RUN_JOB,
    agent_settings,
    deployment_name,
    emit_job_event,
    logical_now,
    slug,
    wall_clock,
)
from flows.settings import AgentSettings
from sched_core import ConfigError, LocalSchedule, SchedError
from sched_core.plan import WINDOW_TRIGGERS

log = logging.getLogger(__name__)


class JobFailed(SchedError, RuntimeError):
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


def _parse_window(value: object) -> datetime | None:
    if isinstance(value, str) and value:
        value = datetime.fromisoformat(value)
    return value if isinstance(value, datetime) else None


def _run_name() -> str:
    """Name a run as its creator did (JobRef.name): ``backup-s-1-20261202T0730Z[-retry]``.

    Prefect names every run with this when it starts, planned or ad hoc.
    """
    params: dict[str, Any] = current_run.parameters or {}
    schedule_id = params.get("schedule_id")
    action = _cached_action(schedule_id) or "job"
    suffix = "-retry" if params.get("retry_of") else ""
    try:
        window = _parse_window(params.get("window"))
        return job_run_name(action, str(schedule_id or "unknown"), window) + suffix
    except (ConfigError, ValueError):  # a bad window: the run fails, saying so
        return f"{action}-{schedule_id or 'unknown'}-bad-window"


def _cached_action(schedule_id: object) -> str | None:
    """Return the action of the cached schedule a run names by id; None if unknown."""
    if not isinstance(schedule_id, str) or not schedule_id:
        return None
    try:
        settings = agent_settings()
        return cached_row(settings, schedule_id, now=logical_now(None)).action
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


_emitted: set[str] = set()
"""Runs this process already emitted a terminal job event for (Cancelling, then Crashed)."""


def _emit_terminal(flow: Flow[..., Any], flow_run: FlowRun, state: State) -> None:
    """State hook: emit the run's one job event once its terminal state is recorded.

    A skipped run emits nothing (the chain must not see it). Prefect may call
    several terminal hooks for one run (a stop seen as Cancelling, then
    Crashed); the event's id is derived from the run's id, and this process
    emits it once, so the chain sees one event per run.
    """
    run = flow_run
    if state.name == SKIPPED or str(run.id) in _emitted:
        return
    _emitted.add(str(run.id))
    params: dict[str, Any] = dict(run.parameters or {})
    tags = tag_values(run)
    node = tags.get("node", "")
    schedule_id = str(params.get("schedule_id") or tags.get("schedule", ""))
    action = tags.get("action", "") or _cached_action(schedule_id) or ""
    if not node:
        try:
            node = agent_settings().node_name
        except ConfigError:
            node = "unknown"
    emit_job_event(
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
        completed=state.is_completed(),
    )


def _skip(node: str, schedule_id: str, window: datetime | None, reason: str) -> State:
    """End the run without running: a Completed state named Skipped, with the reason."""
    create_markdown_artifact(
        key=f"job-{slug(node)}-{slug(schedule_id)}",
        markdown=f"### `{schedule_id}`: skipped, nothing ran\n\n{reason}\n\n"
                 f"window: {window.isoformat() if window else 'none'}",
        description=f"{schedule_id}: skipped",
    )
    return Completed(name=SKIPPED, message=reason)


def _feed_chain(settings: AgentSettings, trigger_key: str) -> None:
    """Run advance-chain for a chain stage's re-run that ends without running.

    While the re-run waited, it was an active job of its stage, so the chain
    held the next stage back for it; a run that ends Skipped sends no job
    event, and without this the next stage would wait for the next day's
    wave. Best effort: a failure is logged (the next job completion feeds the
    chain again).
    """
    stage = settings.stage(trigger_key)
    if stage is None:
        return
    try:
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name(
                f"{ADVANCE_CHAIN}/{deployment_name(settings)}")
            client.create_flow_run_from_deployment(deployment.id, parameters={
                "action": stage.action, "node": settings.node_name,
                "completed_run": str(current_run.id or "")})
    except Exception as exc:
        log.warning("could not feed the chain after a skipped re-run of stage %s: %r",
                    stage.name, exc, extra={"node": settings.node_name, "error": repr(exc)})


_reported: set[str] = set()
"""Runs this process already reported to the controller (several terminal hooks per run)."""


def _report_terminal(flow: Flow[..., Any], flow_run: FlowRun, state: State) -> None:
    """State hook: send the node's report once the run's terminal state is recorded.

    Best effort (:mod:`flows.node_report`): it never raises, so it never
    changes the run's outcome; the latest job it reports is Prefect's record.
    """
    if str(flow_run.id) in _reported:
        return
    _reported.add(str(flow_run.id))
    try:
        settings = agent_settings()
        node = tag_values(flow_run).get("node") or settings.node_name
        report_after(settings, now=wall_clock(), deployment=node)
    except Exception as exc:  # settings unreadable: nothing to report with
        log.warning("no node report after the job",
                    extra={"flow_run_id": str(flow_run.id), "error": repr(exc)[:300]})


FLUSH_S = 10.0
"""The longest the last hook waits for the run's queued logs and events to reach the server."""
EXIT_GRACE_S = 60.0
"""How long a run's own process may live after its last hook (then it prints its stacks, exits)."""


def _flush(flow: Flow[..., Any], flow_run: FlowRun, state: State) -> None:
    """State hook, the last one: send the run's queued logs and events to the server now.

    Seen in the e2e test (1 run in 3 under load, then about 1 CI run in 4): a
    run-job process whose run was already Completed never reached Prefect's
    own end (its "Finished in state" line was never printed), and what its
    background workers still held was lost with it: the command's last output
    lines never reached the run's log. Draining here, before the engine's
    teardown, sends them while the process is still sound. The drain runs in a
    thread of its own, waited for at most twice FLUSH_S, so this hook cannot
    hang on Prefect's internals whatever they wait on. Best effort: a failure
    is logged, never raised.

    In the run's own process (a worker's or serve's subprocess), a watchdog
    then makes sure the process ends: EXIT_GRACE_S after this hook it prints
    every thread's stack (each line with the run's name, so the hang can be
    found in the worker's output) and exits with the run's outcome. The run's
    state is final by then; nothing is lost but the wait.
    """
    import os
    import threading

    run_id = str(flow_run.id)
    if os.environ.get("PREFECT__FLOW_RUN_ID") == run_id:  # not a run called in-process
        threading.Thread(target=_exit_watchdog, args=(flow_run.name, state.is_completed()),
                         name="run-job-exit-watchdog", daemon=True).start()
    done = threading.Event()
    errors: list[str] = []

    def drain() -> None:
        import inspect

        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for service in (APILogWorker, EventsWorker):
            try:
                pending = service.drain_all(timeout=FLUSH_S)
                if inspect.isawaitable(pending):  # inside an event loop: cannot block here
                    pending.close()
            except Exception as exc:
                errors.append(f"{service.__name__}: {exc!r}"[:300])
        done.set()

    threading.Thread(target=drain, name="run-job-flush", daemon=True).start()
    if not done.wait(2 * FLUSH_S + 1):
        errors.append(f"the drain did not return in {2 * FLUSH_S + 1:g} s")
    for error in errors:
        log.warning("could not send the run's queued logs and events: %s", error,
                    extra={"flow_run_id": run_id, "error": error})


def _exit_watchdog(run_name: str, completed: bool) -> None:
    """End a run-job process still alive EXIT_GRACE_S after its last hook; print where it hung."""
    import os
    import sys
    import threading
    import time
    import traceback

    time.sleep(EXIT_GRACE_S)
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = [f"run-job {run_name}: the process is still alive {EXIT_GRACE_S:g} s after the "
             f"run's final state; its threads:"]
    for ident, frame in sys._current_frames().items():
        lines.append(f"run-job {run_name}: thread {names.get(ident, ident)}:")
        lines += [f"run-job {run_name}:   {line}" for entry in traceback.format_stack(frame)
                  for line in entry.rstrip().splitlines()]
    print("\n".join(lines), file=sys.stderr, flush=True)
    os._exit(0 if completed else 1)


@flow(
    name=RUN_JOB,
    flow_run_name=_run_name,
    on_completion=[_emit_terminal, _report_terminal, _flush],
    on_failure=[_emit_terminal, _report_terminal, _flush],
    on_crashed=[_emit_terminal, _report_terminal, _flush],
    on_cancellation=[_emit_terminal, _report_terminal, _flush],
)
def run_job(
    schedule_id: str | None = None,
    trigger_key: str = "manual",
    window: datetime | None = None,
    key: str = "",
    retry_of: str | None = None,
    schedule: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> Any:
    """Run the cached schedule's action for its window (or ad hoc, ``trigger_key`` manual).

    ``now`` replaces the clock, and the time Prefect first tried the run, for
    the start guard (tests and replays); planned runs never pass it.
    """
    logger = get_run_logger()
    window_stamp(window)  # a window without a UTC offset fails here, before anything runs
    settings = agent_settings()
    at = logical_now(now)
    if schedule is not None:
        if not settings.allow_row_parameter:
            raise ConfigError(
                "run-job takes a schedule_id, not a whole schedule row: only the node's "
                "cache decides what runs (set allow_row_parameter = true on this node to "
                "accept rows from whoever can create runs)"
            )
        row = LocalSchedule.model_validate(schedule)
    elif not schedule_id:
        raise ConfigError("run-job needs a schedule_id (the cached schedule to run)")
    elif trigger_key in WINDOW_TRIGGERS:
        if window is None:
            raise ConfigError(f"a {trigger_key} run needs the window it runs")
        if retry_of:
            with get_client(sync_client=True) as client:
                reason = still_interrupted(client, retry_of)
            if reason is not None:
                logger.info("skipped: %s", reason)
                return _skip(settings.node_name, schedule_id, window, reason)
        tried = at if now is not None else first_try_of(current_run.id, fallback=at)
        decision, found = start_window(settings, schedule_id=schedule_id, window=window,
                                       tried=tried, now=at, retry=bool(retry_of))
        if not decision.runs or found is None:
            logger.info("skipped: %s", decision.reason)
            return _skip(settings.node_name, schedule_id, window, decision.reason)
        logger.info("start guard: %s", decision.reason)
        row = found
    elif retry_of:  # the one re-run of a chain stage's interrupted job
        with get_client(sync_client=True) as client:
            reason = still_interrupted(client, retry_of)
        found = next((item for item in cached_rows(settings, now=at) if item.id == schedule_id),
                     None)
        if reason is None:
            decision = stage_rerun(settings, found, schedule_id=schedule_id,
                                   trigger_key=trigger_key, stopped_at=None, now=at)
            reason = None if decision.runs else decision.reason
        if reason is not None or found is None:
            reason = reason or f"schedule {schedule_id} was removed from this node's list"
            logger.info("skipped: %s", reason)
            _feed_chain(settings, trigger_key)
            return _skip(settings.node_name, schedule_id, window, reason)
        row = found
    else:
        row = cached_row(settings, schedule_id, now=at)
    ref = JobRef(node=settings.node_name, action=row.action, schedule_id=row.id,
                 trigger_key=trigger_key, window=window, key=key, retry_of=retry_of)
    _ensure_tags(ref.tags())
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
        "job %s of schedule %s (%s), window %s, trigger %s, key %s%s",
        row.action, row.id, row.name, window.isoformat() if window else "none",
        trigger_key, key or "none", f", re-run of {retry_of}" if retry_of else "",
    )
    attempts: list[CommandResult] = []
    attempt = run_attempt.with_options(
        retries=spec.retries, retry_delay_seconds=spec.retry_delay.total_seconds()
    )
    error: BaseException | None = None
    longest = longest_run_s(spec.timeout.total_seconds(), spec.retries,
                            spec.retry_delay.total_seconds())
    with job_slot(settings.state_dir / "jobs", row, run_id=str(current_run.id or ""),
                  run_name=current_run.name or ref.name, now=at, wait_s=longest,
                  info=logger.info, cancel=cancel_run) as refused:
        if refused is not None:
            logger.info("skipped: %s", refused)
            return _skip(settings.node_name, row.id, window, refused)
        try:
            with repo_lock(row, wait_s=spec.timeout.total_seconds(), info=logger.info,
                           warn=logger.warning):
                attempt(
                    argv,
                    spec.timeout.total_seconds(),
                    job_environment(spec.env, tz=row.timezone),
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
            f"key: `{key or 'none'}`" + (f"; re-run of `{retry_of}`" if retry_of else ""),
        ]),
        description=f"{row.action} {row.id}: exit code and duration",
    )
    if error is not None:
        raise error
    return summary
