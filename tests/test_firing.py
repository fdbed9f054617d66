"""What fires now and when to look again (sched_core.firing), and the kit's loop around it
(sched_core.loop).

Pure tests at pinned instants. America/New_York: DST began 2026-03-08 at 02:00
EST (07:00 UTC, the clock jumped to 03:00 EDT) and ends 2026-11-01 at 02:00 EDT
(06:00 UTC, the clock goes back to 01:00 EST).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from sched_core.config import Fire
from sched_core.firing import Due, NodeView, due_now, next_start
from sched_core.guard import StartDecision, Verdict
from sched_core.loop import Decided, FiringLoop, Guarded
from sched_core.model import LocalSchedule
from tests.factories import Clock

NY = ZoneInfo("America/New_York")
GRACE = timedelta(minutes=5)


def _row(sid: str = "s-1", **schedule: object) -> LocalSchedule:
    shape = {"days": ["*"], "hours": ["*"], "minute": "0", **schedule}
    return LocalSchedule.model_validate({
        "id": sid, "name": sid, "repo_id": "r", "action": "backup", "schedule": shape,
        "miss_policy": "skip", "enabled": True, "version": 1})


def _view(*rows: LocalSchedule, fired: dict[str, datetime] | None = None,
          seen: datetime = datetime(2026, 1, 1, tzinfo=UTC)) -> NodeView:
    return NodeView(rows=rows, last_fired=fired or {}, first_seen={r.id: seen for r in rows},
                    tz=NY, node="node-a", grace=GRACE)


def test_a_window_is_due_from_its_instant_and_not_a_microsecond_before() -> None:
    row = _row(interval_minutes=10)
    window = datetime(2026, 12, 4, 15, 30, tzinfo=UTC)
    view = _view(row)
    before = {"s-1": window - timedelta(minutes=10)}  # the previous window was decided
    assert due_now(view, now=window - timedelta(microseconds=1), decided=before) == []
    (due,) = due_now(view, now=window, decided={"s-1": window - timedelta(minutes=10)})
    assert due.window == window and due.coalesced == []
    assert next_start(view, now=window - timedelta(seconds=3),
                      decided={"s-1": window - timedelta(minutes=10)}) == window


def test_windows_that_piled_up_while_the_node_was_away_run_once_the_latest() -> None:
    row = _row(interval_minutes=2)
    now = datetime(2026, 12, 4, 15, 31, 30, tzinfo=UTC)
    (due,) = due_now(_view(row), now=now, decided={"s-1": datetime(2026, 12, 4, 15, 26,
                                                                  tzinfo=UTC)})
    assert due.window == datetime(2026, 12, 4, 15, 30, tzinfo=UTC)
    assert due.coalesced == [datetime(2026, 12, 4, 15, 28, tzinfo=UTC)]


def test_older_than_the_grace_is_never_due_and_a_decided_window_never_again() -> None:
    row = _row(interval_minutes=1)
    window = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    assert due_now(_view(row), now=window + GRACE + timedelta(minutes=1, seconds=1),
                   decided={"s-1": window - timedelta(minutes=1)})[0].window > window
    assert due_now(_view(row), now=window + timedelta(seconds=2), decided={"s-1": window}) == []
    assert due_now(_view(row, fired={"s-1": window}), now=window + timedelta(seconds=2),
                   decided={}) == []


def test_spring_forward_the_0230_window_fires_once_at_0300_edt() -> None:
    # 2026-03-08: 02:30 EST does not exist; cron fires it once, at 03:00 EDT (07:00 UTC).
    row = _row(hours=["2"], minute="30")
    before = datetime(2026, 3, 8, 6, 59, 57, tzinfo=UTC)
    assert next_start(_view(row), now=before, decided={}) == datetime(2026, 3, 8, 7, 0,
                                                                       tzinfo=UTC)
    (due,) = due_now(_view(row), now=datetime(2026, 3, 8, 7, 0, tzinfo=UTC), decided={})
    assert due.window == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)


def test_fall_back_a_fixed_hour_fires_in_the_first_copy_only() -> None:
    # 2026-11-01: 01:30 happens twice (05:30 UTC EDT, 06:30 UTC EST); a fixed-hour row fires once.
    row = _row(hours=["1"], minute="30")
    first = datetime(2026, 11, 1, 5, 30, tzinfo=UTC)
    assert next_start(_view(row), now=first - timedelta(seconds=1), decided={}) == first
    after = next_start(_view(row), now=first + timedelta(seconds=1), decided={"s-1": first})
    assert after == datetime(2026, 11, 2, 6, 30, tzinfo=UTC)


def test_jitter_moves_the_start_not_the_window() -> None:
    row = LocalSchedule.model_validate({**_row(interval_minutes=60).model_dump(),
                                        "jitter": 600})
    window = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    start = next_start(_view(row), now=window - timedelta(seconds=1),
                       decided={"s-1": window - timedelta(hours=1)})
    assert start is not None and window < start < window + timedelta(seconds=600)
    assert due_now(_view(row), now=start - timedelta(microseconds=1),
                   decided={"s-1": window - timedelta(hours=1)}) == []
    (due,) = due_now(_view(row), now=start, decided={"s-1": window - timedelta(hours=1)})
    assert (due.window, due.start) == (window, start)


def test_a_paused_row_has_no_next_start_and_nothing_due() -> None:
    row = LocalSchedule.model_validate({**_row(interval_minutes=1).model_dump(),
                                        "paused": {"note": "disk swap", "until": None}})
    now = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    assert due_now(_view(row), now=now, decided={}) == []
    assert next_start(_view(row), now=now, decided={}) is None


def _runs(batch: list[tuple[Due, bool]], now: datetime) -> list[Guarded | Exception]:
    """A start guard that runs every window."""
    return [(StartDecision(Verdict.RUN, "on time", stamp=True), None) for _ in batch]


def _loop(view: Callable[[datetime], NodeView], decided: Decided,
          clock: Callable[[], datetime], **hands: Any) -> FiringLoop:
    """Return a loop whose hands default to: run everything, note nothing."""
    return FiringLoop(view=view, decided=decided, clock=clock,
                      **{"guard": _runs, "start": lambda fire: None, "skip": lambda fire: None,
                         "missed": lambda items, view: None, "fail": lambda fire: None,
                         **hands})


def test_the_loop_decides_each_window_at_its_start_even_while_slots_are_busy(
    tmp_path: Path,
) -> None:
    # Every window goes to the guard at its start: one waiting for a slot is the
    # jobs' to run in its turn, never coalesced into the next (a bug once: W skipped for W+1).
    row = _row(interval_minutes=1)
    start = datetime(2026, 12, 4, 15, 0, 0, tzinfo=UTC)
    clock = Clock(start - timedelta(seconds=1))
    fired: list[datetime | None] = []
    skipped: list[tuple[datetime | None, str]] = []
    loop = _loop(lambda now: _view(row, seen=start - timedelta(hours=1)),
                 Decided(tmp_path / "decided.json", now=clock.now), clock,
                 start=lambda fire: fired.append(fire.window),
                 skip=lambda fire: skipped.append((fire.window, fire.reason)))
    loop.decided.note("s-1", start - timedelta(minutes=1))
    for minute in range(3):
        clock.now = start + timedelta(minutes=minute, milliseconds=5)
        loop.turn(clock.now)
    assert fired == [start + timedelta(minutes=n) for n in range(3)]
    assert skipped == []
    assert Decided(tmp_path / "decided.json", now=clock.now).values() == {
        "s-1": start + timedelta(minutes=2)}, "a restart decides nothing twice"


def test_the_decided_record_keeps_the_nodes_format(tmp_path: Path) -> None:
    # Existing state folders keep working: one JSON object, schedule id -> Go time text.
    path = tmp_path / "decided.json"
    path.write_text('{"s-1":"2026-12-04T14:59:00Z","bad":"x"}')
    decided = Decided(path, now=datetime(2026, 12, 4, 15, 0, tzinfo=UTC))
    assert decided.values() == {"s-1": datetime(2026, 12, 4, 14, 59, tzinfo=UTC)}
    decided.note("s-1", datetime(2026, 12, 4, 15, 0, tzinfo=UTC))
    decided.save({"s-1"})
    assert path.read_text() == '{"s-1":"2026-12-04T15:00:00Z"}'


def test_the_loop_skips_the_older_windows_a_stop_left_and_reports_the_missed(
    tmp_path: Path,
) -> None:
    row = LocalSchedule.model_validate({**_row(interval_minutes=2).model_dump(),
                                        "miss_policy": "run-once-within-24h"})
    last = datetime(2026, 12, 4, 14, 0, tzinfo=UTC)
    now = datetime(2026, 12, 4, 15, 1, 30, tzinfo=UTC)  # back after an hour
    calls: list[tuple[str, datetime, bool]] = []
    skipped: list[datetime | None] = []
    missed: list[int] = []

    def guard(batch: list[tuple[Due, bool]], at: datetime) -> list[Guarded | Exception]:
        calls.extend((due.row.id, due.window, recovery) for due, recovery in batch)
        return _runs(batch, at)

    loop = _loop(lambda at: _view(row, fired={"s-1": last}, seen=last),
                 Decided(tmp_path / "d.json", now=now), lambda: now, guard=guard,
                 skip=lambda fire: skipped.append(fire.window),
                 missed=lambda items, view: missed.extend(item.count for item in items))
    report = loop.turn(now)
    # 14:02 .. 14:56 are older than the grace: missed (policy: the latest is the 15:00 one
    # inside the grace, which runs as a window, so none is recovered); 14:58 and 15:00 are
    # due: the latest runs, the older is coalesced into it.
    assert calls == [("s-1", datetime(2026, 12, 4, 15, 0, tzinfo=UTC), False)]
    assert skipped == [datetime(2026, 12, 4, 14, 58, tzinfo=UTC)]
    assert missed == [28] and report.coalesced == {"s-1": 1}


def test_the_loop_sleeps_until_the_next_start_and_wakes_early_when_told(tmp_path: Path) -> None:
    row = _row(hours=["3"], minute="0")
    now = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    loop = _loop(lambda at: _view(row), Decided(tmp_path / "d.json", now=now), lambda: now,
                 guard=lambda batch, at: [(StartDecision(Verdict.SKIP, "x"), None)
                                          for _ in batch])
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,), daemon=True)
    thread.start()
    deadline = datetime.now(UTC) + timedelta(seconds=5)
    while loop.turns < 1 and datetime.now(UTC) < deadline:
        threading.Event().wait(0.01)
    assert loop.turns == 1
    loop.wake()
    while loop.turns < 2 and datetime.now(UTC) < deadline:
        threading.Event().wait(0.01)
    assert loop.turns == 2, "a wake makes the loop look again at once"
    stop.set()
    loop.wake()
    thread.join(5)
    assert not thread.is_alive()


def test_a_window_that_cannot_start_holds_up_no_other_and_ends_with_its_reason(
    tmp_path: Path,
) -> None:
    # Three rows on one instant; s-2's start fails on a full disk (OSError 28) every time.
    rows = [_row(sid) for sid in ("s-1", "s-2", "s-3")]
    start = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    clock = Clock(start + timedelta(milliseconds=5))
    fired: list[str] = []
    failed: list[tuple[str, str]] = []

    def begin(fire: Fire) -> None:
        if fire.schedule.id == "s-2":
            raise OSError(28, "No space left on device", "/state/outbox/x/job.json")
        fired.append(fire.schedule.id)

    loop = _loop(lambda now: _view(*rows, seen=start - timedelta(hours=1)),
                 Decided(tmp_path / "decided.json", now=clock.now), clock, start=begin,
                 fail=lambda fire: failed.append((fire.schedule.id, fire.reason)))
    for row in rows:
        loop.decided.note(row.id, start - timedelta(hours=1))
    report = loop.turn(clock.now)
    assert sorted(fired) == ["s-1", "s-3"], "the failing start held up the one after it"
    assert report.upcoming == clock.now + timedelta(seconds=1), "tried again in a second"
    assert list(loop.failing) == [("s-2", start)]
    loop.turn(clock.now + timedelta(seconds=1))
    assert sorted(fired) == ["s-1", "s-3"] and failed == [], "tried again within its grace"
    # Past its grace: it ends with its reason, once, and is not missed or tried again.
    clock.now = start + GRACE + timedelta(seconds=1)
    report = loop.turn(clock.now)
    ((sid, reason),) = failed
    assert sid == "s-2" and reason.startswith(
        "not started: the node's state folder is full (No space left on device: "
        "/state/outbox/x/job.json)")
    assert loop.failing == {} and [fire.schedule.id for fire in report.ended] == ["s-2"]
    assert report.missed == []
    loop.turn(clock.now + timedelta(seconds=1))
    assert len(failed) == 1


def test_a_window_whose_start_fails_once_runs_at_the_next_try_and_a_read_only_disk_says_so(
    tmp_path: Path,
) -> None:
    row = _row(interval_minutes=1)
    start = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    clock = Clock(start)
    tries: list[datetime] = []

    def guard(batch: list[tuple[Due, bool]], at: datetime) -> list[Guarded | Exception]:
        tries.append(at)
        if len(tries) == 1:
            raise OSError(30, "Read-only file system", "/state/cache.json")
        return _runs(batch, at)

    fired: list[datetime | None] = []
    loop = _loop(lambda now: _view(row, seen=start - timedelta(hours=1)),
                 Decided(tmp_path / "decided.json", now=start), clock, guard=guard,
                 start=lambda fire: fired.append(fire.window))
    loop.decided.note("s-1", start - timedelta(minutes=1))
    loop.turn(start)
    (item,) = loop.failing.values()
    assert item.reason.startswith("the node's state folder cannot be written (Read-only")
    loop.turn(start + timedelta(seconds=1))
    assert fired == [start] and loop.failing == {}


def test_a_decided_file_the_disk_refuses_is_kept_in_memory_and_written_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    decided = Decided(tmp_path / "decided.json", now=datetime(2026, 12, 4, tzinfo=UTC))
    row = _row(interval_minutes=1)
    start = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    fired: list[datetime | None] = []
    loop = _loop(lambda now: _view(row, seen=start - timedelta(hours=1)), decided,
                 lambda: start, start=lambda fire: fired.append(fire.window))
    decided.note("s-1", start - timedelta(minutes=1))
    real_save = Decided.save

    def full(self: Decided, keep: set[str]) -> None:
        raise OSError(28, "No space left on device", str(self.path))

    monkeypatch.setattr(Decided, "save", full)
    loop.turn(start)  # the turn goes on: the window ran, its decision is kept in memory
    assert fired == [start] and decided.values() == {"s-1": start}
    assert not (tmp_path / "decided.json").exists()
    monkeypatch.setattr(Decided, "save", real_save)
    loop.turn(start + timedelta(seconds=1))
    assert fired == [start], "decided once"
    assert Decided(tmp_path / "decided.json", now=start).values() == {"s-1": start}


def test_ten_windows_of_one_instant_are_decided_together_and_start_together(
    tmp_path: Path,
) -> None:
    # Each start waits for the nine others: on a loop that starts windows one after another
    # the first waits alone and its barrier breaks.
    rows = [_row(f"s-{n}") for n in range(10)]
    start = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    together = threading.Barrier(10, timeout=30)
    batches: list[int] = []
    fired: list[str] = []

    def guard(batch: list[tuple[Due, bool]], now: datetime) -> list[Guarded | Exception]:
        batches.append(len(batch))
        return _runs(batch, now)

    def begin(fire: Fire) -> None:
        together.wait()
        fired.append(fire.schedule.id)

    loop = _loop(lambda now: _view(*rows, seen=start - timedelta(hours=1)),
                 Decided(tmp_path / "decided.json", now=start), lambda: start, guard=guard,
                 start=begin)
    for row in rows:
        loop.decided.note(row.id, start - timedelta(hours=1))
    report = loop.turn(start)
    assert batches == [10], "decided in one step (one write of the cache)"
    assert sorted(fired) == sorted(row.id for row in rows) and loop.failing == {}
    assert report.failed == [] and len(report.fired) == 10


def test_windows_start_in_the_loops_thread_when_no_thread_can_be_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = [_row(f"s-{n}") for n in range(3)]
    start = datetime(2026, 12, 4, 15, 0, tzinfo=UTC)
    fired: list[str] = []

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    loop = _loop(lambda now: _view(*rows, seen=start - timedelta(hours=1)),
                 Decided(tmp_path / "decided.json", now=start), lambda: start,
                 start=lambda fire: fired.append(fire.schedule.id))
    for row in rows:
        loop.decided.note(row.id, start - timedelta(hours=1))
    monkeypatch.setattr(threading.Thread, "start", refuse)
    report = loop.turn(start)
    assert sorted(fired) == ["s-0", "s-1", "s-2"] and report.failed == []
