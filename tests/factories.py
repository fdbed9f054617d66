"""Builders of the controller's test data, shared by its test modules.

T0 = 2026-12-02 12:00 UTC (no DST nearby). The step helpers go through the
store's batch API, as the scheduler does: a single claim is a batch of one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session

from controller import claims
from controller.claims import Claim
from controller.models import TaskIn
from controller.timing import plan_after_dispatch
from sched_core.model import LocalSchedule

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def schedule_row(schedule_id: str, **changes: object) -> LocalSchedule:
    """Return an agent schedule row (a nightly backup) with changes applied."""
    data: dict[str, object] = {
        "id": schedule_id,
        "name": f"nightly {schedule_id}",
        "repo_id": "r-9",
        "action": "backup",
        "schedule": {"days": ["mon", "tue"], "hours": ["2"], "minute": "30"},
        "miss_policy": "run-once-within-24h",
        "enabled": True,
        "params": {"threads": 4},
        "version": 99,
    }
    data.update(changes)
    return LocalSchedule.model_validate(data)


def one_shot(name: str, at: datetime = T0, **kw: object) -> TaskIn:
    """Return a one-shot event task due at at."""
    return TaskIn.model_validate({"name": name, "run_at": at, "event": "job.run", **kw})


def cron_task(name: str, cron: str = "*/5 * * * *", **kw: object) -> TaskIn:
    """Return a cron event task in UTC (every five minutes by default)."""
    return TaskIn.model_validate(
        {"name": name, "cron": cron, "timezone": "UTC", "event": "job.run", **kw}
    )


def claimed(session: Session, **kw: Any) -> list[Claim]:
    """Return the claims of :func:`controller.claims.claim_for_dispatch`, without outcomes."""
    return [found for found, _ in claims.claim_for_dispatch(session, **kw)]


def complete(session: Session, found: Claim, *, now: datetime) -> bool:
    """Complete one claim as the scheduler does (plan, then write); True if its task moved."""
    return claims.complete_many(session, [plan_after_dispatch(found, now)], now=now) == 1


def complete_all(session: Session, batch: list[Claim], *, now: datetime) -> int:
    """Complete a batch of claims as the scheduler does; return how many tasks moved."""
    return claims.complete_many(
        session, [plan_after_dispatch(found, now) for found in batch], now=now
    )
