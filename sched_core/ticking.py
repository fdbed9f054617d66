"""What the kit's loop-based :class:`~sched_core.scheduler.Scheduler` fires: its decisions.

Pure but for :func:`call_fire`, which calls the agent's ``fire`` and logs the outcome.

Rules (one rule for every engine the kit offers: the agent's start guard decides):

1. The candidates of a tick at ``now``: per enabled clock row, the latest eligible
   window in ``[now - grace, now]`` (:func:`sched_core.due.due_windows`, over the
   node zone's index); for a row with its own ``timezone`` or a ``jitter``, the
   latest window in its zone whose start (window plus the node's offset) has come,
   within the grace of that start.
2. A row with policies then goes to the start guard
   (:func:`sched_core.guard.decide_start`, tried now): a pause, a blackout, the
   row's dates or ``min_interval`` hold its window back with the guard's reason.
   A row without any is the Go kit's and fires as it always did (the guard would
   say "on time"). A late window is the miss check's, never the tick's.
3. The miss check is the agent's (:func:`sched_core.plan.missed`: the row's zone, jitter,
   catch-up window and policies); a row whose latest missed window its policies skip is
   reported held, with why (:func:`held_missed`).
4. A fire carries a copy of its row (the callback may change it) and a stable key:
   ``window_key`` of the row and window, so a crash between a fire and its stamp is
   deduplicated downstream.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.config import Config, Fire
from sched_core.due import DueRow, due_windows
from sched_core.guard import decide_start
from sched_core.index import DueIndex
from sched_core.matcher import window_key
from sched_core.misses import eligible_after
from sched_core.model import LocalSchedule, MissPolicy
from sched_core.plan import TRIGGER_RECOVERY, TRIGGER_SCHEDULE
from sched_core.policies import (
    catchup,
    latest_window,
    own_clock,
    plain,
    policy_block,
    row_zone,
    window_starts,
)
from sched_core.view import NodeView

log = logging.getLogger("sched_core.scheduler")


def copy_row(row: LocalSchedule) -> LocalSchedule:
    """Return a copy of row the fire callback may change without touching the cache."""
    return row.model_copy(
        update={
            "schedule": row.schedule.model_copy(deep=True),
            "params": copy.deepcopy(row.params) if row.params else row.params,
            "paused": row.paused.model_copy() if row.paused else None,
            "blackouts": [item.model_copy(deep=True) for item in row.blackouts]
            if row.blackouts else row.blackouts,
        }
    )


def window_fire(row: LocalSchedule, window: datetime, tz: ZoneInfo, *, recovery: bool) -> Fire:
    """Return the fire of row's window (rule 4); its key in the row's zone, as the planner's."""
    return Fire(
        schedule=copy_row(row),
        trigger_key=TRIGGER_RECOVERY if recovery else TRIGGER_SCHEDULE,
        missed_recovery=recovery,
        window=window,
        key=window_key(row.id, window, row_zone(row, tz)),
    )


def _candidates(index: DueIndex, view: NodeView, *, now: datetime) -> list[DueRow]:
    """Return rule 1's candidates, in no particular order."""
    grace = view.grace
    found = [due for due in due_windows(index, view, now=now) if not own_clock(due[0])]
    for row in view.rows:
        if not own_clock(row) or not row.enabled or row.schedule.is_event:
            continue
        latest = latest_window(row, now, since=now - grace - timedelta(seconds=row.jitter),
                               node=view.node, tz=row_zone(row, view.tz))
        floor = eligible_after(view.last_fired.get(row.id), view.first_seen.get(row.id))
        if latest is not None and now - latest[1] <= grace and (
            floor is None or latest[0] >= floor
        ):
            found.append((row, latest[0], 0))
    return found


def decide_due(index: DueIndex, view: NodeView, *,
               now: datetime) -> tuple[list[DueRow], dict[str, str]]:
    """Return the windows due at now (rules 1 and 2), and the rows held back with why."""
    due: list[DueRow] = []
    held: dict[str, str] = {}
    candidates = _candidates(index, view, now=now)
    for row, window, older in sorted(candidates, key=lambda c: (c[1], c[0].id)):
        if plain(row):
            due.append((row, window, older))
            continue
        decision = decide_start(row, view, schedule_id=row.id, window=window, first_try=now,
                                now=now)
        if decision.runs and not decision.late:
            due.append((row, window, older))
        else:
            held[row.id] = decision.reason
    return due, held


def held_missed(view: NodeView, recovering: Collection[str], *,
                now: datetime) -> dict[str, str]:
    """Return the rows whose latest missed window their policies hold back, with why (rule 3).

    The windows are the miss check's (older than the grace, within the row's catch-up
    window, eligible); a row the check recovers, or whose miss policy is ``skip``, is
    not held: it says nothing the recovery or the policy does not.
    """
    held: dict[str, str] = {}
    end = now - view.grace
    for row in view.rows:
        if (row.id in recovering or plain(row) or not row.enabled or row.schedule.is_event
                or row.miss_policy is MissPolicy.SKIP):  # plain: no policy holds it back
            continue
        last = view.last_fired.get(row.id)
        start = now - catchup(row)
        floor = eligible_after(last, view.first_seen.get(row.id))
        if floor is not None:
            start = max(start, floor)
        windows = [window for window, begins in window_starts(row, start, end, node=view.node,
                                                             tz=view.tz) if begins < end]
        if not windows:
            continue
        block = policy_block(row, windows[-1], tz=row_zone(row, view.tz), last_fired=last)
        if block is not None:  # the start guard's rule 4, as on the agent
            held[row.id] = f"missed window {windows[-1].isoformat()} skipped: {block}"
    return held


def call_fire(config: Config, fire: Fire) -> str | None:
    """Call the agent's fire; return None on success or the error text (logged either way)."""
    assert config.fire is not None
    window = fire.window.isoformat() if fire.window else None
    try:
        config.fire(fire)
    except Exception as exc:
        log.error(
            "fire of %s (%s, window %s) failed; it stays unfired and will be retried: %r",
            fire.schedule.id, fire.trigger_key, fire.window, exc,
            extra={"schedule_id": fire.schedule.id, "trigger_key": fire.trigger_key,
                   "window": window, "node": config.node_name, "error": repr(exc)},
        )
        return repr(exc)
    log.info(
        "fired %s (%s, %s, window %s) as %s",
        fire.schedule.id, fire.schedule.action, fire.trigger_key, fire.window, fire.key,
        extra={"schedule_id": fire.schedule.id, "action": fire.schedule.action,
               "trigger_key": fire.trigger_key, "window": window, "key": fire.key,
               "node": config.node_name},
    )
    return None
