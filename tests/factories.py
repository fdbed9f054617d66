"""Builders of the tests' data (schedule rows, tasks, claims) and a clock they set by hand.

T0 = 2026-12-02 12:00 UTC (no DST nearby). The step helpers go through the
store's batch API, as the scheduler does: a single claim is a batch of one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, TypeVar

from sqlmodel import Session

from controller import claims
from controller.api import create_app
from controller.auth import Tokens
from controller.claims import Claim
from controller.db import make_engine, migrate
from controller.models import TaskIn
from controller.testing import serve_in_thread
from controller.timing import plan_after_dispatch
from sched_core.model import LocalSchedule
from sched_node.reconcile import Reconciler

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


class Clock:
    """A now that the test sets (``clock.now = ...``) and the code under test calls."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def nightly(schedule_id: str, **changes: Any) -> dict[str, Any]:
    """Return a nightly backup row (Mon and Tue 02:30) as a JSON object, with changes applied."""
    data: dict[str, Any] = {
        "id": schedule_id,
        "name": f"nightly {schedule_id}",
        "repo_id": "r-9",
        "action": "backup",
        "schedule": {"days": ["mon", "tue"], "hours": ["2"], "minute": "30"},
        "miss_policy": "run-once-within-24h",
        "enabled": True,
        "params": {"threads": 4},
    }
    data.update(changes)
    return data


def schedule_row(schedule_id: str, **changes: object) -> LocalSchedule:
    """Return an agent schedule row (a nightly backup, version 99) with changes applied."""
    return LocalSchedule.model_validate(nightly(schedule_id, **{"version": 99, **changes}))


def job(sid: str, schedule: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """Return a backup row at version 1 as a JSON object (by default hourly at :00)."""
    if schedule is None:
        schedule = {"days": ["*"], "hours": ["*"], "minute": "0"}
    base: dict[str, Any] = {
        "id": sid,
        "name": f"job {sid}",
        "repo_id": "r-1",
        "action": "backup",
        "schedule": schedule,
        "miss_policy": "run-once-within-24h",
        "enabled": True,
        "version": 1,
    }
    base.update(overrides)
    return base


def at(hours: list[str], minute: str, days: list[str] | None = None) -> dict[str, Any]:
    """Return a clock schedule: hours at minute, on days (default every day)."""
    return {"days": days or ["*"], "hours": hours, "minute": minute}


def every(minutes: int) -> dict[str, Any]:
    """Return an interval schedule: every so many wall minutes since local midnight."""
    return {"days": None, "hours": None, "minute": "", "interval_minutes": minutes}


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


@contextmanager
def served_controller(url: str, tokens: Tokens) -> Iterator[str]:
    """A controller's API on url's database (migrated first), served on loopback in a thread
    for the block; yields its base URL."""
    migrate(url)
    engine = make_engine(url)
    try:
        with serve_in_thread(create_app(engine, tokens)) as base:
            yield base
    finally:
        engine.dispose()


R = TypeVar("R", bound=Reconciler)


def bare_reconciler(cls: type[R], interval: timedelta) -> R:
    """Return a reconciler (cls: a test's subclass whose ``reconcile`` notes its calls) with
    the given interval and no parts: only its thread and pace run."""
    settings: Any = SimpleNamespace(node_name="n", reconcile_interval=interval)
    part: Any = None
    return cls(settings, clock=part, scheduler=part, view=part, planner=part,
               deployments=part, control=part, outbox=part, reporter=part, recorded=part,
               start_checked=part)
