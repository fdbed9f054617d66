"""Task CRUD (controller.tasks) and the task input model, on SQLite and on a real Postgres.

Time is pinned: every call gets ``now`` (T0 = 2026-12-02 12:00 UTC, no DST nearby).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from sqlmodel import Session

from controller import tasks
from controller.models import TaskIn
from tests.factories import T0, cron_task, one_shot


def test_save_task_upserts_by_name_and_computes_next_run(session: Session) -> None:
    first = tasks.save_task(session, cron_task("t"), now=T0 + timedelta(seconds=30))
    assert first.next_run_at == T0 + timedelta(minutes=5)
    assert first.event == "sched.task.job.run"
    second = tasks.save_task(session, cron_task("t", cron="0 * * * *"), now=T0)
    assert second.id == first.id and second.cron == "0 * * * *"
    assert second.next_run_at == T0 + timedelta(hours=1)
    assert [t.name for t in tasks.list_tasks(session)] == ["t"]
    got = tasks.get_task(session, "t")
    assert got is not None and got.next_run_at == second.next_run_at
    assert tasks.delete_task(session, "t") is True
    assert tasks.delete_task(session, "t") is False
    assert tasks.get_task(session, "t") is None


def test_save_task_with_a_schedule_shape_uses_its_timezone(session: Session) -> None:
    task = TaskIn.model_validate(
        {
            "name": "shape",
            "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
            "timezone": "America/New_York",
            "deployment": "backup/nightly",
            "payload": {"agent": "node-a"},
        }
    )
    saved = tasks.save_task(session, task, now=T0)  # 07:00 EST
    assert saved.next_run_at == datetime(2026, 12, 3, 7, 30, tzinfo=UTC)
    assert saved.deployment == "backup/nightly" and saved.payload == {"agent": "node-a"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"name": "x", "event": "e"}, "exactly one of cron, schedule or run_at"),
        ({"name": "x", "cron": "* * * * *", "run_at": T0, "event": "e"}, "got cron, run_at"),
        ({"name": "x", "cron": "61 * * * *", "event": "e"}, "invalid cron"),
        ({"name": "x", "cron": "* * * * *"}, "exactly one of event or deployment"),
        ({"name": "x", "cron": "* * * * *", "event": "sched.job.x"}, "outside the sched.task"),
        ({"name": "x", "cron": "* * * * *", "event": "e", "timezone": "Mars/Base"}, "Mars"),
        ({"name": "x", "run_at": "2026-12-02T12:00:00", "event": "e"}, "no UTC offset"),
        ({"name": "x", "schedule": {"on": "after_wave"}, "event": "e"}, "event schedule"),
    ],
)
def test_task_in_rejects_bad_input_naming_what_is_wrong(
    body: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValidationError, match=needle):
        TaskIn.model_validate(body)


def test_save_tasks_saves_a_batch_in_one_transaction(session: Session) -> None:
    saved = tasks.save_tasks(session, [one_shot(f"t{i}") for i in range(3)], now=T0)
    assert [t.name for t in saved] == ["t0", "t1", "t2"]
    assert len(tasks.list_tasks(session)) == 3
