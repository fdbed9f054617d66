"""The start guard: what a run of a window decides when it starts, and when a job may run again.

Pure: no clock reads, no I/O; every function takes ``now``. Rule 3 of
:mod:`sched_core.plan` (plan, prune, guard, recover) lives here, beside the
planner it answers to:

- :func:`decide_start`: the row must still have the window, the window must
  not have run, the row's policies must let it fire, and a run first tried
  more than ``grace`` after its start is late and left to the miss policy.
  The caller stamps the window in the same locked step. The kit's firing loop
  (the node's) decides through it, by ``Scheduler.start_windows``.
- :func:`retry_allowed`, :func:`stage_retry_allowed`: whether an interrupted
  job or chain stage runs once more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo

from sched_core.clock import floor_minute
from sched_core.misses import LOOKBACK
from sched_core.model import LocalSchedule, MissPolicy
from sched_core.plan import gone_reason
from sched_core.policies import catchup, latest_window, policy_block, row_zone, run_start
from sched_core.values import TICK
from sched_core.view import NodeView


class Verdict(StrEnum):
    """What a starting run does."""

    RUN = "run"
    SKIP = "skip"


@dataclass(frozen=True)
class StartDecision:
    """The guard's answer for one starting run.

    ``stamp`` is True when the caller must record the window as the
    schedule's last fire in the same locked step (every window run does).
    ``late`` says the run was late and ran under the miss policy.
    """

    verdict: Verdict
    reason: str
    stamp: bool = False
    late: bool = False
    coalesced_into: datetime | None = None

    @property
    def runs(self) -> bool:
        """True when the job runs."""
        return self.verdict is Verdict.RUN


def _minutes(delta: timedelta) -> str:
    """Return a duration for people: ``5 min 1 s``, ``3 h``, ``1 h 30 min``, ``45 s``."""
    seconds = int(delta.total_seconds())
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    parts = [f"{hours} h"] if hours else []
    if minutes:
        parts.append(f"{minutes} min")
    if seconds and not hours:
        parts.append(f"{seconds} s")
    return " ".join(parts) or "0 s"


def _local(instant: datetime, tz: ZoneInfo) -> str:
    return instant.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def decide_start(
    row: LocalSchedule | None,
    view: NodeView,
    *,
    schedule_id: str,
    window: datetime,
    first_try: datetime,
    now: datetime,
    retry: bool = False,
    lookback: timedelta = LOOKBACK,
) -> StartDecision:
    """Return whether the run of window runs now (rule 3 of the module).

    ``row`` is the schedule's row now (None when it is gone); ``view`` gives the
    schedule's last fire and first-seen time, the node's zone, name (the row's
    jitter offset) and grace. ``first_try`` is when the run was first tried (a
    run that then waited for a job slot is not late); ``now`` is when it decides.
    ``retry`` marks the one re-run of a job interrupted by the node's own
    shutdown or crash: its window may already be stamped (by the interrupted
    run), and it runs while the miss policy would still run that window.
    ``lookback`` is the catch-up window of a row that sets none.

    1. The row must still have the window (:func:`gone_reason`).
    2. A window already stamped, or older than a stamped one, does not run
       again (except the retry of the stamped window itself).
    3. No window before the minute the schedule was first seen runs.
    4. The row's policies must let the window fire
       (:func:`sched_core.policies.policy_block`).
    5. Tried within ``grace`` of its start (the window plus the row's
       jitter): it runs.
    6. Late: ``skip`` never runs it; the other policies run it only if it is
       the latest window at now (of those the policies let fire) and within
       the row's catch-up window, and coalesce it into that latest window
       otherwise.
    """
    last_fired, first_seen = view.last_fired.get(schedule_id), view.first_seen.get(schedule_id)
    grace, tz, node = view.grace, view.tz, view.node
    gone = gone_reason(row, schedule_id, window, tz)
    if gone is not None or row is None:
        return StartDecision(Verdict.SKIP, gone or f"schedule {schedule_id} was removed")
    tz = row_zone(row, tz)
    lookback = catchup(row, lookback)
    shown = _local(window, tz)
    held = _held_back(row, window, shown, last_fired=last_fired, first_seen=first_seen,
                      tz=tz, retry=retry)
    if held is not None:
        return held
    start = run_start(row, window, node=node, tz=tz)
    lateness = (now if retry else first_try) - start
    if lateness <= grace:
        why = "re-run of an interrupted job" if retry else "on time"
        return StartDecision(Verdict.RUN, f"window {shown}: {why}", stamp=True)
    return _late_start(row, window, shown, lateness, now=now, grace=grace, tz=tz, retry=retry,
                       lookback=lookback, node=node)


def _held_back(row: LocalSchedule, window: datetime, shown: str, *,
               last_fired: datetime | None, first_seen: datetime | None, tz: ZoneInfo,
               retry: bool) -> StartDecision | None:
    """Return :func:`decide_start`'s skip by its steps 2-4, or None when they let it run."""
    if last_fired is not None and last_fired >= window:
        if not (retry and last_fired == window):
            if last_fired == window:
                return StartDecision(Verdict.SKIP, f"window {shown} already ran")
            return StartDecision(
                Verdict.SKIP,
                f"window {shown} is older than the last fire: coalesced into "
                f"{_local(last_fired, tz)}, which already ran",
                coalesced_into=last_fired,
            )
    if first_seen is not None and window < floor_minute(first_seen):
        return StartDecision(
            Verdict.SKIP,
            f"window {shown} is before the schedule was first seen ({_local(first_seen, tz)})",
        )
    block = policy_block(row, window, last_fired=last_fired, tz=tz, retry=retry)
    if block is not None:
        return StartDecision(Verdict.SKIP, f"window {shown} skipped: {block}")
    return None


def _late_start(row: LocalSchedule, window: datetime, shown: str, lateness: timedelta, *,
                now: datetime, grace: timedelta, tz: ZoneInfo, retry: bool,
                lookback: timedelta, node: str) -> StartDecision:
    """Return :func:`decide_start`'s answer for a late start (its step 6)."""
    policy = row.miss_policy
    late = f"{_minutes(lateness)} late (grace {_minutes(grace)})"
    if retry:
        late = f"interrupted and {_minutes(lateness)} after its window (grace {_minutes(grace)})"
    if policy is MissPolicy.SKIP:
        return StartDecision(Verdict.SKIP, f"window {shown} missed: {late}; miss policy skip")
    found = latest_window(row, now, since=now - lookback + TICK, node=node, tz=tz)
    if found is None or found[0] < window:
        return StartDecision(
            Verdict.SKIP,
            f"window {shown} missed: {late}; older than the {_minutes(lookback)} catch-up window",
        )
    latest, latest_start = found
    if latest != window:
        where = "which runs on time" if now - latest_start <= grace else "the latest missed window"
        return StartDecision(
            Verdict.SKIP,
            f"window {shown} missed: {late}; coalesced into {_local(latest, tz)} ({where})",
            coalesced_into=latest,
        )
    return StartDecision(
        Verdict.RUN,
        f"window {shown}: {late}; run as the latest missed window (miss policy {policy.value})",
        stamp=True,
        late=True,
    )


def retry_allowed(
    row: LocalSchedule | None,
    view: NodeView,
    *,
    schedule_id: str,
    window: datetime,
    now: datetime,
    lookback: timedelta = LOOKBACK,
) -> StartDecision:
    """Return whether an interrupted job of window may be run again now.

    The same rule as a retry's start guard (:func:`decide_start` with
    ``retry=True``; the first-seen time does not apply), checked before creating
    the retry run so that a window the policy no longer allows is reported
    instead of becoming a run that only skips.
    """
    return decide_start(row, replace(view, first_seen={}), schedule_id=schedule_id,
                        window=window, first_try=now, now=now, retry=True, lookback=lookback)


def stage_retry_allowed(
    row: LocalSchedule | None,
    *,
    schedule_id: str,
    stage: str,
    action: str,
    on: str,
    stopped_at: datetime | None,
    now: datetime,
    follow: timedelta,
    tz: ZoneInfo,
) -> StartDecision:
    """Return whether an interrupted job of a chain stage may be run again now.

    A chain stage's job has no window: the chain fired it after the wave.
    Its one re-run runs while the row is still a schedule of that stage
    (enabled, same action, same ``on``), the row's policies let it fire now,
    and the stop was within ``follow`` (the chain's follow window, after
    which the chain has moved on to the next day).
    """
    def skip(reason: str) -> StartDecision:
        return StartDecision(Verdict.SKIP, reason)

    if row is None:
        return skip(f"schedule {schedule_id} was removed from this node's list")
    if not row.enabled:
        return skip(f"schedule {schedule_id} is disabled")
    if row.action != action or row.schedule.on != on:
        return skip(f"schedule {schedule_id} is no longer a {on!r} {action} schedule of the "
                    f"chain stage {stage}")
    held = policy_block(row, now, last_fired=None, tz=tz, retry=True)
    if held is not None:
        return skip(held)
    if stopped_at is not None and now - stopped_at > follow:
        return skip(f"interrupted at {_local(stopped_at, tz)}, more than {_minutes(follow)} ago: "
                    f"the chain has moved on")
    return StartDecision(Verdict.RUN, f"interrupted job of the chain stage {stage}: run once more")
