"""What every flow of the agent needs at run time: settings, names, the clock, the lock, events.

Rule: this is the imperative shell's one place for the clock (:func:`logical_now`)
and for the settings of a run (:func:`agent_settings`); the flows hand both to
the pure kit (:mod:`sched_core.plan`) and carry its answers to Prefect.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from prefect.events import emit_event

from flows.actions import window_stamp
from flows.settings import AgentSettings, load_settings
from sched_core.scheduler import as_utc

log = logging.getLogger(__name__)

RUN_JOB = "run-job"
RECONCILE = "reconcile"
ADVANCE_CHAIN = "advance-chain"

EVENT_JOB_COMPLETED = "sched.job.completed"
EVENT_JOB_FAILED = "sched.job.failed"
EVENT_SCHEDULES_CHANGED = "sched.schedules.changed"
EVENT_SCHEDULES_UPDATED = "sched.schedules.updated"
"""Emitted by the controller on every write of a node's schedules: the node pulls at once."""
EVENT_WINDOW_MISSED = "sched.window.missed"

JOB_EVENT_NAMESPACE = uuid.UUID("7d3c1f0e-5a7b-4c1e-9a52-2f1d3b6c8e40")
"""Namespace of the job events' ids: one id per run, so the server keeps one event per run."""

_SLUG = re.compile(r"[^a-z0-9]+")


def slug(text: str) -> str:
    """Return text as an artifact-key-safe slug: lowercase letters, digits and dashes."""
    return _SLUG.sub("-", text.lower()).strip("-") or "x"


def setup_logging() -> None:
    """Let the library loggers' INFO lines through to the run logs (``SCHED_LOG_LEVEL``)."""
    level = os.environ.get("SCHED_LOG_LEVEL", "INFO").upper()
    for name in ("sched_core", "flows"):
        logging.getLogger(name).setLevel(level)


class _RunlessStaysLocal(logging.Filter):
    """Keep records logged outside any flow or task run out of Prefect's API log handler.

    Prefect's API handler (on the ``flows`` and ``sched_core`` loggers through
    ``PREFECT_LOGGING_EXTRA_LOGGERS``) cannot send them, and warns so once per
    call site. In the serve process (its start, its pull listener thread)
    they are the process's own lines: they go to the console only.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "flow_run_id", None) or getattr(record, "task_run_id", None):
            return True
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            record.send_to_api = False
        return True


def keep_runless_logs_local() -> None:
    """Add :class:`_RunlessStaysLocal` to every Prefect API log handler of this process (once).

    Records logged in a flow or task run are untouched: they still reach the run's log.
    Prefect sets its handlers up when its flow machinery is imported (before this runs
    in serve).
    """
    from prefect.logging.handlers import APILogHandler

    loggers = [logging.getLogger(), *(item for item in logging.Logger.manager.loggerDict.values()
                                      if isinstance(item, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, APILogHandler) and not any(
                    isinstance(item, _RunlessStaysLocal) for item in handler.filters):
                handler.addFilter(_RunlessStaysLocal())


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


def wall_clock() -> datetime:
    """Return the wall clock in UTC: the one clock read of the agent's flows."""
    return datetime.now(UTC)


def logical_now(now: datetime | None = None) -> datetime:
    """Return now if given, else the later of the wall clock and this run's scheduled start.

    A worker may start a scheduled run up to half a second early; the
    scheduled start keeps the run in the minute it was meant for.
    """
    if now is not None:
        return as_utc(now)
    from prefect.runtime import flow_run

    wall = wall_clock()
    scheduled = flow_run.scheduled_start_time
    if isinstance(scheduled, datetime) and scheduled.tzinfo is not None:
        # Prefect's DateTime is a pendulum-style subclass whose arithmetic can
        # drop the zone: hand the kit a plain datetime.
        return max(wall, as_utc(scheduled))
    return wall


def run_name(prefix: str) -> Callable[[], str]:
    """Return a flow-run namer: prefix and the logical minute (``reconcile-20261202T0730Z``)."""

    def name() -> str:
        from prefect.runtime import flow_run

        now = flow_run.parameters.get("now") if flow_run.parameters else None
        if isinstance(now, str):
            now = datetime.fromisoformat(now)
        return f"{prefix}-{window_stamp(logical_now(now if isinstance(now, datetime) else None))}"

    return name


@contextmanager
def node_lock(settings: AgentSettings) -> Iterator[None]:
    """Hold this node's agent lock: plans, recoveries and chain steps of one node never overlap."""
    fd = os.open(settings.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def emit(
    event: str,
    node: str,
    payload: dict[str, Any],
    *,
    event_id: Any = None,
    related: list[dict[str, str]] | None = None,
) -> None:
    """Emit a ``sched.*`` event about this node (resource ``sched.agent.<node>``).

    An explicit ``event_id`` makes the event idempotent: the server keeps one
    event per id. ``related`` adds related resources (the run's own, from the
    run context, are added by Prefect).
    """
    extra: dict[str, Any] = {} if event_id is None else {"id": event_id}
    if related:
        extra["related"] = related
    emit_event(
        event=event,
        resource={"prefect.resource.id": f"sched.agent.{node}", "prefect.resource.name": node},
        payload=payload,
        **extra,
    )


ACTION_ROLE = "sched-action"
"""Role of the related resource ``sched.action.<action>`` on a job event (what alerts match)."""


def emit_job_event(node: str, payload: dict[str, Any], *, completed: bool) -> None:
    """Emit the one ``sched.job.completed`` or ``sched.job.failed`` of a run.

    Its id is derived from the run's id (``payload["flow_run_id"]``), so
    however many times it is sent (two terminal hooks, a hook and the planner
    finding the run interrupted) the server keeps one event per run. The
    action is also a related resource (:func:`action_related`), which the
    fleet's alerts match.
    """
    emit(
        EVENT_JOB_COMPLETED if completed else EVENT_JOB_FAILED,
        node,
        payload,
        event_id=uuid.uuid5(JOB_EVENT_NAMESPACE, str(payload["flow_run_id"])),
        related=action_related(str(payload.get("action") or "")),
    )


def action_related(action: str) -> list[dict[str, str]]:
    """Return the related resource naming a job's action, for triggers (none when unknown).

    A trigger cannot match an event's payload; the run's ``action:<action>``
    tag reaches an event only when it is emitted inside that run, so the
    action is named here explicitly (resource ``sched.action.<action>``,
    role ``sched-action``).
    """
    if not action:
        return []
    return [{"prefect.resource.id": f"sched.action.{action}",
             "prefect.resource.role": ACTION_ROLE, "prefect.resource.name": action}]
