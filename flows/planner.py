"""The planner's shell: carry :mod:`sched_core.plan`'s answers to Prefect.

At every reconcile, under the node lock, from the cache as it is (whether the
pull succeeded or not):

1. Read the node's window runs from Prefect: one query, every run whose
   window is at most the grace old (Prefect is the record of what exists).
2. Plan (:func:`sched_core.plan.plan_windows`) and create, in bulk, the
   runs of planned windows that have none, each scheduled at its window plus
   the row's jitter; delete the untried runs whose window is no longer one
   of its row's or that its policies now skip (a new pause, dates, blackout
   or min_interval: :func:`sched_core.plan.obsolete`), and move those whose
   jitter changed (:func:`sched_core.plan.moved`).
3. Windows older than the grace that never had a run
   (:func:`sched_core.plan.missed`): the latest gets a recovery run when
   the miss policy says so; every one is reported and sent as
   ``sched.window.missed``.
4. Jobs interrupted by the node's own shutdown or a crash get their one re-run
   (:func:`sched_core.plan.retry_allowed`).
5. Record, per schedule, the latest window handled (``plan.json`` in the state
   folder), so a window is reported missed once.

Every step is idempotent: a run's idempotency key is its window's, so planning
twice, from two processes, or after a crash between 2 and 5 never makes a
second run of a window.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from flows.dispatch import JobRef, Planned, Runs
from flows.guard import stage_rerun
from flows.registry import Interrupted, list_interrupted, list_waiting, list_window_runs
from flows.settings import AgentSettings
from sched_core.misses import LOOKBACK
from sched_core.model import Cache, format_go_time, parse_go_time
from sched_core.plan import (
    TRIGGER_RECOVERY,
    TRIGGER_SCHEDULE,
    Missed,
    PlannedRun,
    Window,
    late_skips,
    missed,
    moved,
    obsolete,
    plan_windows,
    retry_allowed,
)
from sched_core.policies import catchup
from sched_core.statefile import locked, read_json_file, write_atomic

log = logging.getLogger(__name__)

LIST_SLACK = timedelta(minutes=1)
"""How much older than the grace a run may be and still be listed (clock skew)."""


@dataclass
class PlanReport:
    """What one planning pass did, for the reconcile artifact and its events."""

    planned: int = 0
    """Windows the plan holds (within the horizon, or a schedule's next few)."""
    created: list[tuple[JobRef, datetime, str]] = field(default_factory=list)
    """(run, scheduled start, flow run id) created now."""
    existing: int = 0
    deleted: list[tuple[PlannedRun, str]] = field(default_factory=list)
    moved: list[tuple[PlannedRun, datetime]] = field(default_factory=list)
    """(run, new scheduled start) for each untried run whose row's jitter changed."""
    skipped: list[tuple[PlannedRun, str]] = field(default_factory=list)
    """(run, reason) for each untried late run ended Skipped as its guard would have."""
    held_back: int = 0
    missed: list[Missed] = field(default_factory=list)
    recovered: list[tuple[JobRef, str]] = field(default_factory=list)
    retried: list[tuple[JobRef, str]] = field(default_factory=list)
    interrupted: list[Interrupted] = field(default_factory=list)
    """Interrupted jobs found this pass (each handled once: its event, its re-run)."""
    not_retried: list[tuple[Interrupted, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(run name or id, error) for each create or delete that failed."""


INTERRUPTED_KEPT = timedelta(days=2)
"""How long the record remembers an interrupted run it handled (its events and re-run)."""


@dataclass
class PlanState:
    """The planner's record in ``<state_dir>/plan.json``.

    ``planned_through``: per schedule, the latest window handled (given a run,
    or reported missed). ``interrupted``: the interrupted runs already
    handled (their job event sent, their re-run created or refused), by id.
    """

    planned_through: dict[str, datetime] = field(default_factory=dict)
    interrupted: dict[str, datetime] = field(default_factory=dict)


def _times(raw: object) -> dict[str, datetime]:
    found: dict[str, datetime] = {}
    for key, value in raw.items() if isinstance(raw, dict) else ():
        try:
            parsed = parse_go_time(value)
        except ValueError:
            continue
        if isinstance(key, str) and parsed is not None:
            found[key] = parsed
    return found


def load_plan_state(path: Path, *, now: datetime) -> PlanState:
    """Return the record; a missing file is empty, an unreadable one is moved aside (empty).

    Losing it is safe: windows are then checked against the runs Prefect has,
    and re-sent events and re-runs keep their ids and idempotency keys.
    """
    data = read_json_file(path, now=now, max_depth=4)
    if not isinstance(data, dict):
        return PlanState()
    return PlanState(planned_through=_times(data.get("planned_through")),
                     interrupted=_times(data.get("interrupted")))


def save_plan_state(path: Path, state: PlanState) -> None:
    """Write the record atomically, under the file's lock."""
    body = {name: {key: format_go_time(times[key]) for key in sorted(times)}
            for name, times in (("planned_through", state.planned_through),
                                ("interrupted", state.interrupted))}
    with locked(path):
        write_atomic(path, json.dumps(body, separators=(",", ":")).encode())


def plan_node(
    settings: AgentSettings, cache: Cache, runs: Runs, *, now: datetime,
    record: PlanState | None = None,
) -> PlanReport:
    """Run one planning pass (the module's steps 1 to 5) and return what it did."""
    node, tz, grace = settings.node_name, settings.tz, settings.grace
    report = PlanReport()
    rows = cache.schedules
    deployment_id = runs.deployment_id()
    record_path = settings.plan_path
    if record is None:
        record = load_plan_state(record_path, now=now)
    planned_through = record.planned_through
    # List back to the oldest window not yet handled (after downtime), at most
    # the longest catch-up window: those runs are the guard's, not missed.
    reach = max([LOOKBACK, *(catchup(row) for row in rows)])
    since = max(now - reach, min([now - grace, *planned_through.values()])) - LIST_SLACK
    existing = list_window_runs(runs.client, deployment_id, node, since=since)
    have = {(run.schedule_id, run.window) for run in existing}
    report.existing = sum(1 for run in existing if run.window >= now - grace)

    plan = plan_windows(
        rows,
        last_fired=cache.last_fired_at,
        first_seen=cache.first_seen_at,
        now=now,
        grace=grace,
        horizon=settings.plan_horizon,
        min_windows=settings.plan_min_windows,
        max_runs=settings.plan_max_runs,
        tz=tz,
        node=node,
    )
    report.planned, report.held_back = len(plan.windows), plan.held_back
    to_create = [
        Planned(ref=_ref(node, window, TRIGGER_SCHEDULE), start=window.start)
        for window in plan.windows
        if (window.schedule_id, window.window) not in have
    ]

    report.missed = missed(
        rows,
        last_fired=cache.last_fired_at,
        first_seen=cache.first_seen_at,
        planned_through=planned_through,
        now=now,
        grace=grace,
        tz=tz,
        have=have,
        node=node,
    )
    recoveries = [
        Planned(ref=_ref(node, item.recover, TRIGGER_RECOVERY), start=now)
        for item in report.missed
        if item.recover is not None
    ]

    by_id = {row.id: row for row in rows}
    retries: list[Planned] = []
    for stopped in list_interrupted(runs.client, deployment_id, node, since=now - reach):
        if stopped.run_id in record.interrupted:
            continue
        report.interrupted.append(stopped)
        row = by_id.get(stopped.schedule_id)
        if stopped.window is None:
            decision = stage_rerun(settings, row, schedule_id=stopped.schedule_id,
                                   trigger_key=stopped.trigger_key,
                                   stopped_at=stopped.stopped_at, now=now)
        else:
            decision = retry_allowed(
                row, schedule_id=stopped.schedule_id, window=stopped.window,
                last_fired=cache.last_fired_at.get(stopped.schedule_id), now=now, grace=grace,
                tz=tz, node=node,
            )
        if not decision.runs or row is None:
            report.not_retried.append((stopped, decision.reason))
            continue
        ref = JobRef(node=node, action=row.action, schedule_id=row.id,
                     trigger_key=stopped.trigger_key, window=stopped.window, key=stopped.key,
                     retry_of=stopped.run_id)
        retries.append(Planned(ref=ref, start=now))

    created = runs.create(to_create + recoveries + retries)
    for item, error in created.failed:
        report.failed.append((item.ref.name, error))
    done = {key for key in created.runs}
    for item in to_create:
        if item.ref.idempotency_key in done:
            report.created.append((item.ref, item.start, created.runs[item.ref.idempotency_key]))
    for item in recoveries:
        if item.ref.idempotency_key in done:
            report.recovered.append((item.ref, created.runs[item.ref.idempotency_key]))
    for item in retries:
        if item.ref.idempotency_key in done:
            report.retried.append((item.ref, created.runs[item.ref.idempotency_key]))

    stale = obsolete(existing, rows, tz=tz, last_fired=cache.last_fired_at)
    failed_deletes = dict(runs.delete(run.run_id for run, _ in stale))
    report.deleted = [(run, why) for run, why in stale if run.run_id not in failed_deletes]
    report.failed += [(run_id, error) for run_id, error in failed_deletes.items()]
    shifted = moved(existing, rows, node=node, tz=tz)
    failed_moves = dict(runs.reschedule(shifted))
    report.moved = [(run, start) for run, start in shifted if run.run_id not in failed_moves]
    report.failed += [(run_id, error) for run_id, error in failed_moves.items()]
    # Late untried runs the guard would skip end now, instead of each starting
    # a process to say so (after a long downtime, hundreds of them).
    gone = {run.run_id for run, _ in stale}
    waiting, first_tries = list_waiting(
        runs.client, deployment_id, node, since=now - reach, before=now - grace)
    late = late_skips(
        (run for run in waiting if run.run_id not in gone), rows,
        last_fired=cache.last_fired_at, first_seen=cache.first_seen_at, now=now, grace=grace,
        tz=tz, node=node, first_tries=first_tries,
    )
    ended, failed_skips = runs.skip(late)
    done_skips = set(ended)
    report.skipped = [(run, why) for run, why in late if run.run_id in done_skips]
    report.failed += failed_skips

    _log(report, node)
    # A window is handled once it has a run or has been reported missed. A
    # create that failed leaves its schedule's record where it was, so the
    # window is planned (or reported) again at the next reconcile.
    failed_ids = {item.ref.schedule_id for item, _ in created.failed}
    handled = dict(planned_through)
    for row in rows:
        if row.id in failed_ids:
            continue
        mark = now - grace
        handled[row.id] = max(handled.get(row.id, mark), mark)
    for window in plan.windows:
        if window.schedule_id not in failed_ids and window.window > handled.get(
            window.schedule_id, window.window
        ):
            handled[window.schedule_id] = window.window
    record.planned_through = {key: value for key, value in handled.items() if key in by_id}
    retried_failed = {item.ref.retry_of for item, _ in created.failed if item.ref.retry_of}
    for stopped in report.interrupted:
        if stopped.run_id not in retried_failed:
            record.interrupted[stopped.run_id] = now
    record.interrupted = {key: value for key, value in record.interrupted.items()
                          if value > now - INTERRUPTED_KEPT}
    save_plan_state(record_path, record)
    return report


def _ref(node: str, window: Window, trigger_key: str) -> JobRef:
    return JobRef(node=node, action=window.action, schedule_id=window.schedule_id,
                  trigger_key=trigger_key, window=window.window, key=window.key)


def _log(report: PlanReport, node: str) -> None:
    log.info(
        "planned %d windows: %d created, %d existed, %d deleted, %d moved, %d late ones ended "
        "Skipped, %d held back by the cap, %d recovered, %d interrupted jobs re-run, %d failed",
        report.planned, len(report.created), report.existing, len(report.deleted),
        len(report.moved), len(report.skipped), report.held_back, len(report.recovered),
        len(report.retried), len(report.failed),
        extra={"node": node, "planned": report.planned, "runs_created": len(report.created),
               "deleted": len(report.deleted), "moved": len(report.moved),
               "skipped_late": len(report.skipped),
               "held_back": report.held_back,
               "recovered": len(report.recovered), "retried": len(report.retried),
               "failed": len(report.failed)},
    )
    for item in report.missed:
        log.warning(
            "schedule %s missed %d window(s) that never had a run (%s .. %s); %s",
            item.schedule_id, item.count, item.windows[0].isoformat(),
            item.windows[-1].isoformat(),
            "the latest is recovered" if item.recover else "none is recovered (miss policy)",
            extra={"node": node, "schedule_id": item.schedule_id, "missed": item.count},
        )
