"""The loop's kept starts (sched_core.firing.Starts) answer what due_now and next_start answer
on the whole view, at every turn of a random walk: time moving on by seconds to hours (and
now and then back), windows fired and decided, rows stamped by another process, rows
replaced, added and removed."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from hypothesis import given, settings
from hypothesis import strategies as st

from sched_core.firing import NodeView, Starts, due_now, next_start
from sched_core.model import LocalSchedule

NY = ZoneInfo("America/New_York")
START = datetime(2026, 10, 31, 20, 0, tzinfo=UTC)  # the night DST ends in New York


def _row(rnd: random.Random, sid: str) -> LocalSchedule:
    shape: dict[str, object] = (
        {"interval_minutes": rnd.choice([1, 7, 30, 90])} if rnd.random() < 0.3 else
        {"days": rnd.choice([["*"], ["sat", "sun"], ["mon"]]),
         "hours": rnd.choice([["*"], ["1"], ["2", "14"]]), "minute": str(rnd.randrange(60))})
    body: dict[str, object] = {"id": sid, "name": sid, "repo_id": "r", "action": "backup",
                               "schedule": shape, "miss_policy": "skip", "enabled": True}
    if rnd.random() < 0.3:
        body["jitter"] = rnd.choice([10, 300])
    if rnd.random() < 0.2:
        body["min_interval"] = rnd.choice([3600, 6 * 3600])
    if rnd.random() < 0.1:
        body["enabled"] = False
    if rnd.random() < 0.1:
        body["paused"] = {"note": "swap"}
    return LocalSchedule.model_validate(body)


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_kept_starts_answer_as_the_functions_on_the_whole_view(seed: int) -> None:
    rnd = random.Random(seed)
    rows = {f"s-{n}": _row(rnd, f"s-{n}") for n in range(rnd.randrange(1, 8))}
    fired: dict[str, datetime] = {}
    seen = {sid: START - timedelta(days=2) for sid in rows}
    decided: dict[str, datetime] = {}
    starts = Starts()
    now = START
    for _ in range(60):
        view = NodeView(rows=list(rows.values()), last_fired=dict(fired), first_seen=dict(seen),
                        tz=NY, node="node-a", grace=timedelta(minutes=5))
        due = due_now(view, now=now, decided=decided)
        assert starts.due(view, now=now, decided=decided, through=decided) == due
        for item in due:  # fired and decided, as the loop and the guard do
            if rnd.random() < 0.8:
                fired[item.row.id] = item.window
            decided[item.row.id] = item.window
        view = NodeView(rows=view.rows, last_fired=dict(fired), first_seen=dict(seen), tz=NY,
                        node="node-a", grace=view.grace)
        assert starts.next(view, now=now, decided=decided) == next_start(
            view, now=now, decided=decided)
        step = rnd.random()
        if step < 0.15 and rows:  # another process stamped a row (an ad hoc run, the chain)
            fired[rnd.choice(list(rows))] = now.replace(second=0, microsecond=0)
        elif step < 0.25:  # a row changed (a new object), added or removed
            sid = rnd.choice([*rows, "s-new"])
            if sid in rows and rnd.random() < 0.3:
                del rows[sid]
            else:
                rows[sid] = _row(rnd, sid)
                seen.setdefault(sid, now)
        now += (timedelta(seconds=-rnd.randrange(1, 600)) if step > 0.97 else
                timedelta(seconds=rnd.choice([1, 29, 30, 59, 61, 300, 3600, 4 * 3600])))
