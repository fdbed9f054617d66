"""The firing loop tells the agent, before its last sleep ahead of an instant, how many
windows start then (``Config.ahead``): the node has that many keepers ready."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sched_core import Scheduler
from sched_core.config import Config, Fire

INSTANT = datetime(2026, 12, 7, 20, 30, tzinfo=UTC)
"""15:30 in New York (EST), the default zone."""


def _scheduler(tmp_path: Path, clock: datetime, heard: list[int],
               told: threading.Event) -> Scheduler:
    rows = [{"id": f"s-{n}", "name": f"s-{n}", "repo_id": "", "action": "backup",
             "storage": "", "schedule": {"days": ["*"], "hours": ["15"], "minute": "30"},
             "miss_policy": "skip", "enabled": True} for n in range(4)]
    rows.append({**rows[0], "id": "later", "name": "later",
                 "schedule": {"days": ["*"], "hours": ["16"], "minute": "0"}})
    (tmp_path / "s.json").write_text(json.dumps({"schedules": rows}))

    def ahead(count: int) -> None:
        heard.append(count)
        told.set()

    def fire(item: Fire) -> None:
        pass

    scheduler = Scheduler(Config(pull_url=f"file://{tmp_path / 's.json'}", node_name="node-a",
                                 cache_path=tmp_path / "cache.json", fire=fire, ahead=ahead,
                                 clock=lambda: clock), now=clock)
    scheduler.pull(now=clock - timedelta(hours=1))
    return scheduler


def test_a_turn_says_how_many_windows_start_at_the_next_start(tmp_path: Path) -> None:
    now = INSTANT - timedelta(minutes=10)
    scheduler = _scheduler(tmp_path, now, [], threading.Event())
    report = scheduler.turn(now)
    assert report.upcoming == INSTANT and report.starting == 4


@contextmanager
def _running(scheduler: Scheduler) -> Iterator[None]:
    """The scheduler's loop in a thread of its own, for the block."""
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    loop.start()
    try:
        yield
    finally:
        stop.set()
        scheduler.wake()
        loop.join(20)


def test_the_loop_tells_ahead_within_its_last_sleep_before_the_instant(tmp_path: Path) -> None:
    heard: list[int] = []
    told = threading.Event()
    scheduler = _scheduler(tmp_path, INSTANT - timedelta(seconds=10), heard, told)
    with _running(scheduler):
        assert told.wait(20), "ahead was not called"
    assert heard[0] == 4


def test_the_loop_does_not_tell_ahead_of_a_start_past_its_sleep(tmp_path: Path) -> None:
    heard: list[int] = []
    told = threading.Event()
    scheduler = _scheduler(tmp_path, INSTANT - timedelta(minutes=10), heard, told)
    with _running(scheduler):
        assert not told.wait(2), heard  # ten minutes ahead: no keepers held that long
