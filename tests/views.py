"""The rows and node view the planner's and the guard's tests build (test_plan, test_policies).

Both read a New York node with a 5-minute grace unless a test says otherwise.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from sched_core.model import LocalSchedule
from sched_core.view import NodeView
from tests.factories import job

NY = ZoneInfo("America/New_York")
GRACE = timedelta(minutes=5)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def row(sid: str, schedule: dict[str, Any], **overrides: Any) -> LocalSchedule:
    """Return a backup row at version 1 with that schedule (tests.factories.at or every)."""
    return LocalSchedule.model_validate(job(sid, schedule, **overrides))


def view_of(rows: list[LocalSchedule], options: dict[str, Any]) -> NodeView:
    """Take the node's facts out of options, as the view the planner and guard read."""
    return NodeView(rows=rows, last_fired=options.pop("last_fired", {}),
                    first_seen=options.pop("first_seen", {}), tz=options.pop("tz", NY),
                    node=options.pop("node", ""), grace=options.pop("grace", GRACE))


def guard_view(r: LocalSchedule | None, options: dict[str, Any]) -> NodeView:
    """The view of one row's guard: its last fire and first-seen time, keyed by its id."""
    sid = options["schedule_id"]
    fired, seen = options.pop("last_fired", None), options.pop("first_seen", None)
    return view_of([r] if r else [], {**{k: options.pop(k) for k in ("tz", "node", "grace")
                                         if k in options},
                                      "last_fired": {sid: fired} if fired else {},
                                      "first_seen": {sid: seen} if seen else {}})
