"""Cron tasks saved inside the repeated fall-back hour get their next run (store level).

The HTTP side (a never-matching cron is a 422) is in ``test_controller_api``.

DST instants used: America/New_York falls back 2026-11-01 02:00 EDT -> 01:00 EST
(06:00 UTC), so 01:00-01:59 happens twice (05:00-05:59 and 06:00-06:59 UTC).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlmodel import Session

from controller import tasks
from controller.db import make_engine, migrate
from controller.models import TaskIn

NY = "America/New_York"


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('cron') / 'controller.db'}"
    migrate(url)
    return url


def _nov(day: int, hour: int, minute: int, second: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, second, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "now", "expected"),
    [
        # In the first copy of 01:xx: the next quarter, 01:00 EST.
        ("*/15 1 * * *", _nov(1, 5, 50), _nov(1, 6, 0)),
        # In the second copy: its next five minutes, EST.
        ("*/5 1 * * *", _nov(1, 6, 7), _nov(1, 6, 10)),
        ("* 1 * * *", _nov(1, 5, 59, 30), _nov(1, 6, 0)),
        # A fixed time already fired in the first copy: tomorrow's.
        ("30 1 * * *", _nov(1, 6, 10), _nov(2, 6, 30)),
    ],
)
def test_saving_a_cron_task_in_the_repeated_hour_gives_its_next_run(
    db_url: str, expr: str, now: datetime, expected: datetime
) -> None:
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            task = TaskIn(name=f"t-fall-{expr}", cron=expr, timezone=NY, event="x")
            assert tasks.save_task(session, task, now=now).next_run_at == expected
    finally:
        engine.dispose()
