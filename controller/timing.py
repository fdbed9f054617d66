"""When a central task runs next, and what a dispatch leaves it.

Pure: no clock reads, no I/O; every function takes the instant to start after. A cron
expression goes through :mod:`controller.cron`; a :class:`sched_core.Schedule` shape through
the agents' matcher, with the same DST rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from controller.cron import next_cron
from controller.models import TaskStatus
from sched_core.matcher import next_fire
from sched_core.model import Schedule
from sched_core.values import TICK


@dataclass(slots=True)
class Claim:
    """One due (task, scheduled time) leased to one worker; read-only by convention.

    Not frozen: a frozen dataclass costs three times as much to build, and a
    claim batch builds one per row on the hot path.
    """

    task_id: int
    name: str
    scheduled_at: datetime
    worker_id: str
    locked_until: datetime
    event: str | None
    deployment: str | None
    payload: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None
    schedule: dict[str, Any] | None = None
    timezone: str = "UTC"
    attempts: int = 0

    @property
    def is_recurring(self) -> bool:
        """True for a cron or schedule-shape task; False for a one-shot one."""
        return self.cron is not None or self.schedule is not None

    @property
    def idempotency_key(self) -> str:
        """Return the key of this dispatch: ``"<task>:<scheduled time, ISO UTC>"``."""
        return f"{self.name}:{self.scheduled_at.isoformat()}"

    def next_after(self, after: datetime) -> datetime | None:
        """Return this task's next run after ``after``; None for a one-shot task."""
        shape = Schedule.model_validate(self.schedule) if self.schedule is not None else None
        return next_run(cron=self.cron, schedule=shape, timezone=self.timezone, after=after)


def next_shape(schedule: Schedule, timezone: str, *, after: datetime) -> datetime | None:
    """Return the first window after ``after`` of a schedule shape in timezone, in UTC.

    The agents' own matcher decides (:func:`sched_core.matcher.next_fire`), so a
    central task and an agent schedule of the same shape fire at the same
    instants. None for an event schedule (``on`` set), which never fires on the
    clock.
    """
    if schedule.is_event:
        return None
    return next_fire(schedule, after, ZoneInfo(timezone))


def next_run(
    *,
    cron: str | None,
    schedule: Schedule | None,
    timezone: str,
    after: datetime,
) -> datetime | None:
    """Return a recurring task's next run after ``after`` in UTC; None if it has no clock."""
    if cron is not None:
        return next_cron(cron, timezone, after=after)
    if schedule is not None:
        return next_shape(schedule, timezone, after=after)
    return None



MAX_ERROR_LENGTH = 2000
"""The longest ``last_error`` (and dispatch record error) the controller stores."""


MAX_CATCH_UP_SCAN = 100_000
"""The most missed windows counted for one task at once (69 days of a per-minute cron)."""


@dataclass(slots=True)
class Completion:
    """What a claimed task becomes: the store writes it, fenced on the claim's time.

    ``error`` is the task's ``last_error`` (None clears it); ``attempts`` its
    new count of failed dispatches of the next scheduled time. ``skipped``
    windows (``first_skipped`` .. ``last_skipped``) were never dispatched
    under the catch-up rule (see :func:`plan_catch_up`); the store adds them
    to the task's ``skipped_windows`` and logs them.
    """

    claim: Claim
    next_run_at: datetime | None
    status: TaskStatus
    error: str | None = None
    attempts: int = 0
    skipped: int = 0
    first_skipped: datetime | None = None
    last_skipped: datetime | None = None


def _windows_through(claim: Claim, first: datetime, now: datetime) -> tuple[int, datetime]:
    """Return how many of claim's windows from first fall at or before now, and the last one.

    first is a window at or before now; at most MAX_CATCH_UP_SCAN are counted.
    """
    count, last = 1, first
    while count < MAX_CATCH_UP_SCAN:
        following = claim.next_after(last)
        if following is None or following > now:
            break
        count, last = count + 1, following
    return count, last


def plan_catch_up(claim: Claim, now: datetime) -> Completion | None:
    """Return how a recurring claim catches up after missed windows; None if it is current.

    The catch-up rule: of the windows of a recurring task that came due while
    no instance could dispatch it, only the latest is dispatched. A claim whose
    scheduled time is already followed by a later window at or before now is
    not dispatched: its task moves to the latest window at or before now (due
    at once), and every window before that one, the claim's own included, is
    skipped (counted and logged, never silent). A one-shot task, or a task
    whose next window is still ahead, is dispatched as it is (None). A task
    whose next run cannot be computed is left to :func:`plan_after_dispatch`.
    """
    if not claim.is_recurring:
        return None
    try:
        first = claim.next_after(claim.scheduled_at)
        if first is None or first > now:
            return None
        later, latest = _windows_through(claim, first, now)
        before_latest = claim.scheduled_at
        if later > 1:
            # The window just before the latest: step from the one before it.
            _, before_latest = _windows_through(claim, first, latest - TICK)
    except Exception:
        return None
    return Completion(
        claim, latest, TaskStatus.ACTIVE, skipped=later, first_skipped=claim.scheduled_at,
        last_skipped=before_latest,
    )


def plan_after_dispatch(claim: Claim, now: datetime | None) -> Completion:
    """Return what claim's task becomes once its dispatch went out at now.

    A one-shot task is done (now is not needed). A recurring task moves to its
    first time after the later of now and its scheduled time, so a late
    dispatch never replays the times it missed: those it passed over are
    counted as skipped (see :func:`plan_catch_up`). A recurring task whose next
    run cannot be computed (e.g. a row stored before its cron expression was
    checked, or a timezone gone from the tz database) never raises: it stays
    at its scheduled time and becomes ``disabled`` with the reason as its
    error (saving it again resumes it), so it cannot hold up the other claims
    of its batch.
    """
    if not claim.is_recurring:
        return Completion(claim, None, TaskStatus.DONE)
    if now is None:
        raise ValueError(f"planning recurring task {claim.name!r} needs now")
    try:
        first = claim.next_after(claim.scheduled_at)
        if first is None or first > now:
            following = first
        else:
            following = claim.next_after(now)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        error = f"disabled: cannot compute the run after {claim.scheduled_at.isoformat()}: {reason}"
        return Completion(
            claim, claim.scheduled_at, TaskStatus.DISABLED, error[:MAX_ERROR_LENGTH]
        )
    status = TaskStatus.ACTIVE if following is not None else TaskStatus.DONE
    if first is None or first > now:
        return Completion(claim, following, status)
    # Late: the windows from the next one through now were passed over.
    skipped, last = _windows_through(claim, first, now)
    return Completion(
        claim, following, status, skipped=skipped, first_skipped=first, last_skipped=last
    )


def plan_after_give_up(
    claim: Claim, now: datetime | None, *, attempts: int, error: str
) -> tuple[Completion, str]:
    """Return what claim's task becomes after its dispatch failed attempts times, and why.

    The second value is the message the failed dispatch record keeps. A
    recurring task moves on as :func:`plan_after_dispatch` says (attempts back
    to 0; the message, plus the reason if it is disabled, as its error); a
    one-shot task is disabled at its scheduled time (saving it again as
    ``active`` retries it), keeping its attempts.
    """
    message = f"gave up after {attempts} failed dispatch attempts: {error}"[:MAX_ERROR_LENGTH]
    if not claim.is_recurring:
        disabled = Completion(claim, claim.scheduled_at, TaskStatus.DISABLED, message, attempts)
        return disabled, message
    plan = plan_after_dispatch(claim, now)
    task_error = message if plan.error is None else f"{message}; {plan.error}"
    plan.error = task_error[:MAX_ERROR_LENGTH]
    return plan, message
