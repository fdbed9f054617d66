"""The per-node Scheduler: pull, the firing loop's turn at a given now, cache sharing.

Times are explicit: the New York spring-forward day 2026-03-08 jumps from
02:00 EST (07:00Z) to 03:00 EDT; the fall-back day 2026-11-01 repeats 01:00-01:59
(05:00Z-05:59Z as EDT, 06:00Z-06:59Z as EST).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from sched_core import Cache, ConfigError, PullError
from sched_core.scheduler import MAX_PAYLOAD, Config, Fire, Scheduler
from tests.factories import every
from tests.factories import job as row

T0 = datetime(2026, 11, 30, 15, 0, tzinfo=UTC)  # Monday 10:00 EST


def clock(days: list[str], hours: list[str], minute: str) -> dict[str, Any]:
    return {"days": days, "hours": hours, "minute": minute}


def started(scheduler: Scheduler, *, now: datetime) -> int:
    """Run one turn of the firing loop at now; return how many windows it started."""
    return len(scheduler.turn(now).fired)


class Agent:
    """A scheduler on a file:// schedule list, recording every fire."""

    def __init__(self, tmp: Path, rows: list[dict[str, Any]] | Any, *, now: datetime = T0,
                 fail: set[str] | None = None, **config: Any) -> None:
        self.list_path = tmp / "schedules.json"
        self.cache_path = tmp / "cache.json"
        self.fired: list[Fire] = []
        self.fail = fail if fail is not None else set()
        self.write(rows)
        self.config = Config(
            pull_url=self.list_path.as_uri(), node_name="node-a", cache_path=self.cache_path,
            fire=self._fire, **config,
        )
        self.scheduler = Scheduler(self.config, now=now)

    def write(self, rows: Any) -> None:
        body = rows if isinstance(rows, (str, bytes)) else json.dumps({"schedules": rows})
        self.list_path.write_bytes(body.encode() if isinstance(body, str) else body)

    def _fire(self, fire: Fire) -> None:
        if fire.schedule.id in self.fail:
            raise RuntimeError(f"cannot start {fire.schedule.id}")
        self.fired.append(fire)

    def restart(self, now: datetime) -> None:
        self.scheduler = Scheduler(self.config, now=now)

    def windows(self) -> list[tuple[str, str]]:
        return [(f.schedule.id, f.window.isoformat() if f.window else "-") for f in self.fired]


# -- configuration ---------------------------------------------------------------


@pytest.mark.parametrize("missing", ["pull_url", "node_name", "cache_path", "fire"])
def test_missing_required_config_names_the_field(tmp_path: Path, missing: str) -> None:
    fields: dict[str, Any] = {
        "pull_url": "file:///x.json", "node_name": "n", "cache_path": tmp_path / "c.json",
        "fire": print,
    }
    del fields[missing]
    with pytest.raises(ConfigError, match=f"Config.{missing} is required"):
        Config(**fields)


def test_bad_config_values_are_config_errors(tmp_path: Path) -> None:
    good: dict[str, Any] = {"pull_url": "file:///x", "node_name": "n",
                            "cache_path": tmp_path / "c.json", "fire": print}
    with pytest.raises(ConfigError, match="timezone 'Mars/Olympus' is unknown"):
        Config(**good, timezone="Mars/Olympus")
    with pytest.raises(ConfigError, match="must be http"):
        Config(**{**good, "pull_url": "ftp://host/x"})
    with pytest.raises(ConfigError, match="fire_grace must be a positive timedelta"):
        Config(**good, fire_grace=timedelta(0))
    with pytest.raises(ConfigError, match="does not exist"):
        Config(**{**good, "cache_path": tmp_path / "no" / "c.json"})
    assert Config(**good, timezone="Europe/Berlin").tz.key == "Europe/Berlin"


# -- pull ------------------------------------------------------------------------


def test_pull_replaces_the_list_and_writes_a_private_cache(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")])
    result = agent.scheduler.pull(now=T0)
    assert result.added == ["a", "b"] and not result.removed and not result.rejected
    assert [s.id for s in agent.scheduler.schedules()] == ["a", "b"]
    assert stat.S_IMODE(os.stat(agent.cache_path).st_mode) == 0o600
    on_disk = Cache.model_validate_json(agent.cache_path.read_text())
    assert on_disk.last_fetched_at == T0 and set(on_disk.first_seen_at) == {"a", "b"}

    agent.write([row("b", name="renamed", version=2)])
    result = agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    assert result.removed == ["a"] and result.changed == ["b"]
    assert [s.name for s in agent.scheduler.schedules()] == ["renamed"]
    assert agent.scheduler.cache().first_seen_at == {"b": T0}


def test_a_snapshot_is_the_cache_as_it_was_whatever_comes_after(tmp_path: Path) -> None:
    """Scheduler.snapshot shares the rows but not the lists and maps: a later start, pull or
    ETag leaves a snapshot taken before as it was (the node's reports and reconciles read one)."""
    agent = Agent(tmp_path, [row("a"), row("b")])
    agent.scheduler.pull(now=T0)
    before = agent.scheduler.snapshot()
    assert before == agent.scheduler.cache() and before.etag == agent.scheduler.etag()
    assert started(agent.scheduler, now=T0) == 2
    agent.write([row("b", name="renamed", version=2)])
    agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    assert [s.id for s in before.schedules] == ["a", "b"] and before.schedules[1].name == "job b"
    assert before.last_fired_at == {} and before.last_fetched_at == T0
    assert set(agent.scheduler.cache().last_fired_at) == {"b"}


def test_pull_keeps_last_fired_for_surviving_ids(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")])
    agent.scheduler.pull(now=T0)
    assert started(agent.scheduler, now=T0) == 2
    agent.write([row("a", version=2)])
    agent.scheduler.pull(now=T0 + timedelta(seconds=20))
    assert agent.scheduler.cache().last_fired_at == {"a": T0}
    assert started(agent.scheduler, now=T0 + timedelta(seconds=30)) == 0


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('{"rows": []}', "has no 'schedules' field"),
        ('{"schedules": {"a": 1}}', "must be a JSON list"),
        ('"text"', "must be a JSON list"),
        (json.dumps([row("a"), row("a")]), "repeats id 'a'"),
        # A row that names no schedule: the list cannot be diffed against the cache.
        ("[null, null]", "row 0 is not a JSON object (got null)"),
        ("[1, 2]", "row 0 is not a JSON object (got a number)"),
        (json.dumps([row("a"), ["b"]]), "row 1 is not a JSON object (got a list)"),
        ('{"schedules": [{"error": "db down"}]}', "row 0 has no id"),
        (json.dumps([{"id": 5, "name": "x"}]), "row 0 has id 5, not a non-empty string"),
        (json.dumps([row("a"), row("")]), "row 1 has id '', not a non-empty string"),
        (json.dumps([row("a"), row(None)]), "row 1 has id None, not a non-empty string"),
    ],
)
def test_bad_payload_rejects_the_whole_pull(tmp_path: Path, payload: str, reason: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")])
    agent.scheduler.pull(now=T0)
    before = agent.cache_path.read_bytes()
    agent.write(payload)
    with pytest.raises(PullError, match=re.escape(reason)):
        agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    assert agent.cache_path.read_bytes() == before
    assert [s.id for s in agent.scheduler.schedules()] == ["a", "b"]
    assert any(agent.list_path.as_uri() == getattr(r, "url", None) for r in caplog.records)
    assert started(agent.scheduler, now=T0) == 2  # still firing from the last good list


def test_junk_pull_keeps_fire_history_and_windows_keep_firing(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0) == 1
    before = agent.scheduler.cache()
    # The controller serves junk from 10:05 to 12:30 EST: the cache keeps firing.
    agent.write('{"schedules": [{"error": "db down"}]}')
    with pytest.raises(PullError, match="row 0 has no id"):
        agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    assert agent.scheduler.cache() == before
    for minute in range(6, 150):
        started(agent.scheduler, now=T0 + timedelta(minutes=minute))
    agent.write([row("a")])
    agent.scheduler.pull(now=T0 + timedelta(hours=2, minutes=30))
    assert started(agent.scheduler, now=T0 + timedelta(hours=2, minutes=30)) == 0
    assert [w for _, w in agent.windows()] == [
        (T0 + timedelta(hours=h)).isoformat() for h in range(3)
    ]
    assert agent.scheduler.cache().first_seen_at == {"a": T0 - timedelta(hours=1)}


def test_junk_pull_keeps_the_etag(tmp_path: Path) -> None:
    answers = [httpx.Response(200, json={"schedules": [row("a")]}, headers={"ETag": '"v1"'}),
               httpx.Response(200, text="[null]", headers={"ETag": '"v2"'}),
               httpx.Response(304)]
    sent: list[str | None] = []

    def controller(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("If-None-Match"))
        return answers.pop(0)

    agent = _http_agent(tmp_path, httpx.MockTransport(controller))
    agent.scheduler.pull(now=T0)
    with pytest.raises(PullError, match=re.escape("row 0 is not a JSON object (got null)")):
        agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    assert agent.scheduler.cache().etag == '"v1"'
    assert not agent.scheduler.pull(now=T0 + timedelta(minutes=10)).changed_anything
    assert sent == [None, '"v1"', '"v1"']


def test_list_of_only_invalid_rows_is_refused_while_schedules_are_cached(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0) == 2
    before = agent.cache_path.read_bytes()
    all_bad = [row("a", schedule=clock(["Mon"], ["2"], "0")), row("c", miss_policy="often")]
    agent.write(all_bad)
    with caplog.at_level(logging.WARNING), pytest.raises(PullError, match=re.escape(
        "every one of the 2 rows of the schedule list from "
        f"{agent.list_path.as_uri()} is invalid (first: a: schedule: unknown day name 'Mon'"
    )) as info:
        agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    assert "keeping the 2 cached schedules" in str(info.value)
    assert agent.cache_path.read_bytes() == before
    assert agent.scheduler.cache().last_fired_at == {"a": T0, "b": T0}
    assert not [r for r in caplog.records if r.msg.startswith("dropped")]  # nothing was dropped
    # One valid row is enough for the list to count: the rest is dropped as usual.
    agent.write([*all_bad, row("b")])
    result = agent.scheduler.pull(now=T0 + timedelta(minutes=10))
    assert result.removed == [] and result.kept_last_good == ["a"]
    assert [rid for rid, _ in result.rejected] == ["a", "c"]
    # With nothing cached there is nothing to protect: the rows are reported rejected.
    (tmp_path / "fresh").mkdir()
    fresh = Agent(tmp_path / "fresh", all_bad)
    result = fresh.scheduler.pull(now=T0)
    assert [rid for rid, _ in result.rejected] == ["a", "c"] and fresh.scheduler.schedules() == []


def test_oversized_file_is_rejected(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0)
    agent.write(b"[" + b" " * MAX_PAYLOAD + b"]")
    with pytest.raises(PullError, match="larger than 16777216 bytes"):
        agent.scheduler.pull(now=T0)
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]


def test_empty_list_empties_the_schedules(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0)
    agent.write("[]")
    assert agent.scheduler.pull(now=T0).removed == ["a"]
    assert agent.scheduler.schedules() == []


def test_invalid_row_is_dropped_and_its_last_good_version_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = Agent(tmp_path, [row("a"), row("b", version=1)])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0) == 2
    bad_b = row("b", version=2, schedule=clock(["Mon"], ["2"], "0"))
    bad_c = row("c", schedule=clock(["mon"], ["24"], "0"))
    no_action = {k: v for k, v in row("d").items() if k != "action"}
    agent.write([row("a"), bad_b, bad_c, no_action, row("e", schedule=every(0))])
    with caplog.at_level(logging.WARNING):
        result = agent.scheduler.pull(now=T0 + timedelta(minutes=5))
    reasons = dict(result.rejected)
    assert "unknown day name 'Mon'" in reasons["b"]
    assert "hour '24'" in reasons["c"]
    assert reasons["d"].startswith("action:")
    assert "interval_minutes 0 is below 1" in reasons["e"]
    assert result.kept_last_good == ["b"]
    kept = {s.id: s for s in agent.scheduler.schedules()}
    assert set(kept) == {"a", "b"} and kept["b"].version == 1
    dropped = {getattr(r, "schedule_id", None) for r in caplog.records if "dropped" in r.msg}
    assert dropped == {"b", "c", "d", "e"}
    # The kept version keeps its history: no window fires twice, none is lost.
    cache = agent.scheduler.cache()
    assert cache.last_fired_at == {"a": T0, "b": T0}
    assert cache.first_seen_at["b"] == T0 - timedelta(hours=1)


def _http_agent(tmp_path: Path, transport: httpx.BaseTransport) -> Agent:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0)
    http = Config(
        pull_url="https://user:secret@controller.test/api/schedules?node=node-a",
        node_name="node-a", cache_path=agent.cache_path, fire=agent._fire,
        http_client=httpx.Client(transport=transport),
    )
    agent.scheduler = Scheduler(http, now=T0)
    return agent


@pytest.mark.parametrize(
    ("handler", "reason"),
    [
        (lambda r: httpx.Response(503, text="down"), "answered HTTP 503"),
        (lambda r: httpx.Response(200, text="<html>"), "not valid JSON"),
    ],
)
def test_http_failures_keep_the_cache(tmp_path: Path, handler: Any, reason: str,
                                      caplog: pytest.LogCaptureFixture) -> None:
    agent = _http_agent(tmp_path, httpx.MockTransport(handler))
    with pytest.raises(PullError, match=reason) as info:
        agent.scheduler.pull(now=T0)
    assert "secret" not in str(info.value)
    assert all("secret" not in str(getattr(r, "url", "")) for r in caplog.records)
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]


def test_http_timeout_is_a_pull_error(tmp_path: Path) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    agent = _http_agent(tmp_path, httpx.MockTransport(slow))
    with pytest.raises(PullError, match="ReadTimeout"):
        agent.scheduler.pull(now=T0)
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]


# -- the firing loop's turn -------------------------------------------------------


def test_due_window_fires_once_even_across_restarts(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0 + timedelta(seconds=1)) == 1
    assert started(agent.scheduler, now=T0 + timedelta(seconds=2)) == 0
    agent.restart(now=T0 + timedelta(seconds=3))
    assert started(agent.scheduler, now=T0 + timedelta(seconds=4)) == 0
    assert started(agent.scheduler, now=T0 + timedelta(minutes=30)) == 0
    (fire,) = agent.fired
    assert fire.trigger_key == "schedule" and not fire.missed_recovery
    assert fire.window == T0 and fire.key == "a@2026-11-30T10:00-05:00"


def test_turn_fires_late_and_early_windows_inside_the_grace_only(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    # Half a second early: the window is not due yet.
    assert started(agent.scheduler, now=T0 - timedelta(seconds=0.5)) == 0
    assert started(agent.scheduler, now=T0 + timedelta(minutes=5)) == 1  # the grace is inclusive
    (tmp_path / "late").mkdir()
    agent2 = Agent(tmp_path / "late", [row("a")])
    agent2.scheduler.pull(now=T0 - timedelta(minutes=30))
    report = agent2.scheduler.turn(T0 + timedelta(minutes=5, seconds=1))
    # Past the grace: missed, and the miss policy's (which recovers it here).
    assert [(item.schedule_id, item.windows) for item in report.missed] == [("a", [T0])]
    assert [(f.window, f.trigger_key) for f in report.fired] == [(T0, "schedule-recovery")]


def test_older_pending_windows_are_coalesced(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a", schedule=every(1))])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0) == 1
    report = agent.scheduler.turn(T0 + timedelta(minutes=4, seconds=10))
    assert [f.window for f in report.fired] == [T0 + timedelta(minutes=4)]
    assert report.coalesced == {"a": 3}
    assert [f.window for f in report.skipped] == [T0 + timedelta(minutes=m) for m in (1, 2, 3)]
    assert all(f.reason.startswith("coalesced into") for f in report.skipped)


def test_failed_fire_is_not_stamped_and_is_retried(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")], fail={"a"})
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    report = agent.scheduler.turn(T0)
    assert [f.schedule.id for f in report.fired] == ["b"]
    assert [f.schedule.id for f, _ in report.failed] == ["a"]
    assert "a" not in agent.scheduler.cache().last_fired_at
    agent.fail.clear()
    assert agent.windows() == [("b", T0.isoformat())]
    assert started(agent.scheduler, now=T0 + timedelta(minutes=2)) == 1
    assert agent.windows()[-1] == ("a", T0.isoformat())


def test_a_window_that_cannot_start_within_its_grace_ends_with_its_reason(
    tmp_path: Path,
) -> None:
    ended: list[Fire] = []
    agent = Agent(tmp_path, [row("a")], fail={"a"})
    agent.scheduler = Scheduler(Config(pull_url=agent.list_path.as_uri(), node_name="node-a",
                                       cache_path=agent.cache_path, fire=agent._fire,
                                       fail=ended.append), now=T0)
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    report = agent.scheduler.turn(T0)
    assert report.fired == [] and [f.window for f, _ in report.failed] == [T0]
    assert report.upcoming == T0 + timedelta(seconds=1)  # tried again soon, within the grace
    assert [f.window for f, _ in agent.scheduler.turn(T0 + timedelta(minutes=5)).failed] == [T0]
    agent.fail.clear()
    report = agent.scheduler.turn(T0 + timedelta(minutes=5, seconds=1))
    assert report.fired == [] and report.missed == []  # ended, not missed: never recovered
    (fire,) = ended
    assert report.ended == ended and fire.window == T0 and fire.key == "a@2026-11-30T10:00-05:00"
    assert fire.reason.startswith("not started: RuntimeError: cannot start a (tried from")
    assert started(agent.scheduler, now=T0 + timedelta(minutes=30)) == 0
    assert agent.fired == []


def test_disabled_and_event_schedules_never_tick(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("off", enabled=False),
                             row("ev", schedule={"on": "after_wave"}, action="prune")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0) == 0
    assert started(agent.scheduler, now=T0 + timedelta(hours=2)) == 0


def test_fresh_agent_fires_the_window_of_the_minute_it_first_saw_the_schedule(
    tmp_path: Path,
) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 + timedelta(seconds=30))
    assert started(agent.scheduler, now=T0 + timedelta(seconds=40)) == 1

    late = tmp_path / "late"
    late.mkdir()
    agent = Agent(late, [row("a")])
    agent.scheduler.pull(now=T0 + timedelta(minutes=1))
    assert started(agent.scheduler, now=T0 + timedelta(minutes=1, seconds=5)) == 0
    assert agent.scheduler.turn(T0 + timedelta(minutes=10)).missed == []


# -- DST -------------------------------------------------------------------------

SPRING = datetime(2026, 3, 8, 7, 0, tzinfo=UTC)  # 02:00 EST -> 03:00 EDT
FALL_EDT = datetime(2026, 11, 1, 5, 30, tzinfo=UTC)  # 01:30 EDT, first copy
FALL_EST = datetime(2026, 11, 1, 6, 30, tzinfo=UTC)  # 01:30 EST, second copy


def test_spring_forward_gap_window_fires_at_three(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a", schedule=clock(["*"], ["2"], "30"))])
    agent.scheduler.pull(now=SPRING - timedelta(hours=1))
    assert started(agent.scheduler, now=SPRING - timedelta(seconds=1)) == 0
    assert started(agent.scheduler, now=SPRING + timedelta(seconds=1)) == 1
    assert agent.fired[0].window == SPRING
    assert agent.fired[0].key == "a@2026-03-08T03:00-04:00"
    assert started(agent.scheduler, now=SPRING + timedelta(minutes=30)) == 0


def test_fall_back_fixed_hour_fires_once_wildcard_twice(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("fixed", schedule=clock(["*"], ["1"], "30")),
                             row("wild", schedule=clock(["*"], ["*"], "30"))])
    agent.scheduler.pull(now=FALL_EDT - timedelta(days=1))
    assert started(agent.scheduler, now=FALL_EDT) == 2
    assert started(agent.scheduler, now=FALL_EST) == 1
    assert sorted(agent.windows()) == [  # the two of one instant start together: any order
        ("fixed", FALL_EDT.isoformat()), ("wild", FALL_EDT.isoformat()),
        ("wild", FALL_EST.isoformat()),
    ]
    keys = sorted(f.key for f in agent.fired if f.schedule.id == "wild")
    assert keys == ["wild@2026-11-01T01:30-04:00", "wild@2026-11-01T01:30-05:00"]
    assert started(agent.scheduler, now=FALL_EST + timedelta(minutes=30)) == 0


# -- miss policy -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("skip", []), ("run-once-within-24h", [T0 + timedelta(hours=3)]),
     ("run-all", [T0 + timedelta(hours=3)])],
)
def test_miss_policy_after_downtime(tmp_path: Path, policy: str, expected: list[datetime],
                                    caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent(tmp_path, [row("a", miss_policy=policy)])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert started(agent.scheduler, now=T0) == 1
    # Down from 10:01 to 13:30: the 11:00, 12:00 and 13:00 windows were missed.
    agent.restart(now=T0 + timedelta(hours=3, minutes=30))
    with caplog.at_level(logging.WARNING):
        assert started(agent.scheduler, now=T0 + timedelta(hours=3, minutes=30)) == len(
            expected
        )
    assert [f.window for f in agent.fired[1:]] == expected
    truncated = [getattr(r, "truncated", None) for r in caplog.records]
    assert (2 in truncated) == (policy == "run-all")
    # Recovery happens once.
    assert started(agent.scheduler, now=T0 + timedelta(hours=3, minutes=40)) == 0


def test_a_window_inside_the_grace_is_fired_not_recovered(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(hours=5))
    report = agent.scheduler.turn(T0 + timedelta(minutes=2))
    assert [(f.window, f.trigger_key) for f in report.fired] == [(T0, "schedule")]
    (item,) = report.missed  # the five older windows: reported, none recovered (a later ran)
    assert item.count == 5 and item.recover is None


def test_recovery_looks_back_24_hours_only(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a", schedule=clock(["mon"], ["10"], "0"))])
    agent.scheduler.pull(now=T0 - timedelta(days=2))
    assert started(agent.scheduler, now=T0 + timedelta(hours=23, minutes=59)) == 1
    agent2_dir = tmp_path / "b"
    agent2_dir.mkdir()
    agent2 = Agent(agent2_dir, [row("a", schedule=clock(["mon"], ["10"], "0"))])
    agent2.scheduler.pull(now=T0 - timedelta(days=2))
    assert started(agent2.scheduler, now=T0 + timedelta(hours=24)) == 0


# -- the cache on disk -----------------------------------------------------------


@pytest.mark.parametrize("content", ['{"schedules": [', "[1, 2]", '"text"'])
def test_corrupt_cache_is_moved_aside_and_agent_starts_empty(tmp_path: Path,
                                                             content: str) -> None:
    cache = tmp_path / "cache.json"
    cache.write_text(content)
    agent = Agent(tmp_path, [row("a")])
    assert agent.scheduler.schedules() == []
    aside = list(tmp_path.glob("cache.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content
    agent.scheduler.pull(now=T0)
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]


def test_cache_written_by_the_go_kit_is_used(tmp_path: Path) -> None:
    go_cache = {
        "schedules": [row("a"), row("bad", schedule=clock(["funday"], ["1"], "0"))],
        "last_fired_at": {"a": "2026-11-30T13:00:00.000000001Z"},
        "last_fetched_at": "2026-11-30T14:30:00.123456789Z",
        "debug": True,
    }
    (tmp_path / "cache.json").write_text(json.dumps(go_cache))
    agent = Agent(tmp_path, [row("a")], now=T0 + timedelta(hours=5))
    cache = agent.scheduler.cache()
    assert [s.id for s in cache.schedules] == ["a"]
    assert cache.first_seen_at == {"a": datetime(2026, 11, 30, 14, 30, 0, 123456, tzinfo=UTC)}
    # 15:00Z to 17:00Z were missed after the Go kit's last fetch: the latest is recovered.
    fired = started(agent.scheduler, now=T0 + timedelta(hours=2, minutes=30))
    assert fired == 1 and agent.fired[0].window == T0 + timedelta(hours=2)


FETCHED = datetime(2026, 11, 30, 14, 30, 0, 123456, tzinfo=UTC)  # as Go wrote it, below


def _go_cache(**fields: Any) -> dict[str, Any]:
    return {
        "schedules": [row("a"), row("b")],
        "last_fired_at": {"a": "2026-11-30T13:00:00.000000001Z", "gone": "0001-01-01T00:00:00Z"},
        "last_fetched_at": "2026-11-30T14:30:00.123456789Z",
        **fields,
    }


@pytest.mark.parametrize(
    ("bad", "expected", "field", "key", "value"),
    [
        ({"last_fired_at": {"a": "2026-11-30T13:00:00.5-05:00", "b": "yesterday",
                            "gone": "0001-01-01T00:00:00Z"}},
         {"last_fired_at": {"a": datetime(2026, 11, 30, 18, 0, 0, 500000, tzinfo=UTC)}},
         "last_fired_at", "b", "'yesterday'"),
        ({"last_fired_at": {"a": "2026-11-30T13:00:00"}}, {"last_fired_at": {}},
         "last_fired_at", "a", "'2026-11-30T13:00:00'"),
        ({"last_fired_at": {"a": "0001-01-01T00:00:00+01:00"}}, {"last_fired_at": {}},
         "last_fired_at", "a", "'0001-01-01T00:00:00+01:00'"),
        ({"last_fired_at": "yesterday"}, {"last_fired_at": {}},
         "last_fired_at", None, "'yesterday'"),
        ({"first_seen_at": {"a": 17, "b": "2026-11-29T00:00:00Z"}},
         {"first_seen_at": {"a": FETCHED, "b": datetime(2026, 11, 29, tzinfo=UTC)}},
         "first_seen_at", "a", "17"),
        ({"etag": 12345, "etag_url": "https://c.test/x"}, {"etag": None, "etag_url": None},
         "etag", None, "12345"),
        ({"etag": '"v1"', "etag_url": ["x"]}, {"etag": None, "etag_url": None},
         "etag_url", None, "['x']"),
        ({"last_fetched_at": "yesterday"},
         {"last_fetched_at": None, "first_seen_at": {"a": T0, "b": T0}},
         "last_fetched_at", None, "'yesterday'"),
    ],
)
def test_bad_cache_field_drops_only_that_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: dict[str, Any],
    expected: dict[str, Any], field: str, key: str | None, value: str,
) -> None:
    (tmp_path / "cache.json").write_text(json.dumps(_go_cache(**bad)))
    with caplog.at_level(logging.WARNING):
        agent = Agent(tmp_path, [row("a"), row("b")])
    cache = agent.scheduler.cache()
    assert [s.id for s in cache.schedules] == ["a", "b"]
    assert list(tmp_path.glob("cache.json.corrupt-*")) == []
    defaults = {
        "last_fired_at": {"a": datetime(2026, 11, 30, 13, tzinfo=UTC)},
        "last_fetched_at": FETCHED,
        "first_seen_at": {"a": FETCHED, "b": FETCHED},
        "etag": None,
    }
    for name, want in {**defaults, **expected}.items():
        assert getattr(cache, name) == want, name
    (warned,) = [r for r in caplog.records if getattr(r, "field", None) == field]
    assert warned.levelno == logging.WARNING
    assert (getattr(warned, "schedule_id", None), getattr(warned, "value", None)) == (key, value)
    assert field in warned.getMessage() and value in warned.getMessage()
    # The file was rewritten without the bad part: it loads strictly, and once.
    assert Cache.model_validate_json(agent.cache_path.read_text()) == cache
    caplog.clear()
    agent.restart(now=T0 + timedelta(minutes=1))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert agent.scheduler.cache() == cache


def test_cache_that_cannot_be_rewritten_still_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    content = json.dumps(_go_cache(etag=12345))
    (tmp_path / "cache.json").write_text(content)

    def disk_full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sched_core.store.save_cache", disk_full)
    agent = Agent(tmp_path, [row("a"), row("b")])
    assert [s.id for s in agent.scheduler.schedules()] == ["a", "b"]
    assert agent.cache_path.read_text() == content
    assert any("could not rewrite" in r.getMessage() for r in caplog.records)


def test_bad_time_entry_in_cache_still_recovers_missed_windows(tmp_path: Path) -> None:
    # The controller is down (no list to pull) and one last fire is unreadable.
    bad = {"last_fired_at": {"a": "2026-11-30T13:00:00Z", "b": "yesterday"}}
    (tmp_path / "cache.json").write_text(json.dumps(_go_cache(**bad)))
    agent = Agent(tmp_path, "{down", now=T0 + timedelta(hours=2, minutes=30))
    assert started(agent.scheduler, now=T0 + timedelta(hours=2, minutes=30)) == 2
    assert sorted(agent.windows()) == [("a", "2026-11-30T17:00:00+00:00"),
                                       ("b", "2026-11-30T17:00:00+00:00")]


def test_cache_whose_schedules_is_not_a_list_keeps_its_fire_history(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    content = json.dumps(_go_cache(
        schedules={"a": row("a")}, first_seen_at={"a": "2026-11-29T00:00:00Z"}
    ))
    (tmp_path / "cache.json").write_text(content)
    agent = Agent(tmp_path, [row("a")], now=T0 + timedelta(hours=2, minutes=30))
    assert agent.scheduler.schedules() == []
    (copy,) = tmp_path.glob("cache.json.corrupt-*")
    assert copy.read_text() == content and stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert any("schedules is an object, not a list" in r.getMessage() for r in caplog.records)
    agent.restart(now=T0 + timedelta(hours=2, minutes=30, seconds=1))
    assert len(list(tmp_path.glob("cache.json.corrupt-*"))) == 1  # rewritten: copied once
    # The next pull brings the row back with its history: 14:00-17:00Z were missed.
    agent.scheduler.pull(now=T0 + timedelta(hours=2, minutes=30))
    assert started(agent.scheduler, now=T0 + timedelta(hours=2, minutes=30)) == 1
    assert agent.windows() == [("a", "2026-11-30T17:00:00+00:00")]


def _tick_forever(cache_path: str, list_uri: str, ids: list[str], rounds: int) -> None:
    fired: list[str] = []
    config = Config(pull_url=list_uri, node_name="p", cache_path=cache_path,
                    fire=lambda f: fired.append(f.schedule.id))
    for i in range(rounds):
        scheduler = Scheduler(config, now=T0)
        now = T0 + timedelta(minutes=i)
        scheduler.fire_matching("manual", lambda s: s.id in ids, now=now)


def test_processes_sharing_one_cache_lose_no_update(tmp_path: Path) -> None:
    rows = [row(f"s{i}") for i in range(8)]
    agent = Agent(tmp_path, rows)
    agent.scheduler.pull(now=T0)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_tick_forever,
                    args=(str(agent.cache_path), agent.list_path.as_uri(), [f"s{i}"], 20))
        for i in range(8)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    stamps = Cache.model_validate_json(agent.cache_path.read_text()).last_fired_at
    assert stamps == {f"s{i}": T0 + timedelta(minutes=19) for i in range(8)}


# -- on demand and loops ---------------------------------------------------------


def test_fire_matching_uses_the_given_key_and_stamps(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("p", action="prune", schedule={"on": "after_wave"}),
                             row("b"), row("off", action="prune", enabled=False)])
    agent.scheduler.pull(now=T0)
    count = agent.scheduler.fire_matching(
        "chain-prune", lambda s: s.action == "prune", now=T0, key="prune@2026-11-30"
    )
    assert count == 1
    (fire,) = agent.fired
    assert (fire.trigger_key, fire.window, fire.key) == ("chain-prune", None, "p@prune@2026-11-30")
    assert agent.scheduler.cache().last_fired_at["p"] == T0


def test_start_pulls_and_stop_is_idempotent(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a"), row("b", name="aaa")],
                  pull_interval=timedelta(seconds=30))
    agent.scheduler.start()
    agent.scheduler.start()  # a second start does nothing
    threads = list(agent.scheduler._threads)
    assert len(threads) == 2
    try:
        for _ in range(500):
            if agent.scheduler.schedules():
                break
            threading.Event().wait(0.01)
    finally:
        agent.scheduler.stop()
    agent.scheduler.stop()
    assert [s.id for s in agent.scheduler.schedules()] == ["b", "a"]  # sorted by name
    assert all(not t.is_alive() for t in threads)
    assert agent.scheduler._threads == []


def test_unchanged_list_costs_a_304(tmp_path: Path) -> None:
    seen: list[str | None] = []
    body = json.dumps({"schedules": [row("a")]})

    def controller(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("If-None-Match"))
        if request.headers.get("If-None-Match") == '"v1"':
            return httpx.Response(304)
        return httpx.Response(200, text=body, headers={"ETag": '"v1"'})

    def agent_for(url: str) -> Scheduler:
        return Scheduler(Config(pull_url=url, node_name="node-a", cache_path=tmp_path / "c.json",
                                fire=print, http_client=httpx.Client(
                                    transport=httpx.MockTransport(controller))), now=T0)

    scheduler = agent_for("https://controller.test/api/schedules?node=node-a")
    assert scheduler.pull(now=T0).added == ["a"]
    result = scheduler.pull(now=T0 + timedelta(minutes=5))
    assert not result.changed_anything
    assert seen == [None, '"v1"']
    cache = scheduler.cache()
    assert [s.id for s in cache.schedules] == ["a"]
    assert cache.last_fetched_at == T0 + timedelta(minutes=5)
    # Another node's URL never reuses this list's ETag.
    other = agent_for("https://controller.test/api/schedules?node=node-b")
    other.pull(now=T0 + timedelta(minutes=6))
    assert seen[-1] is None


def test_datetime_subclasses_and_naive_times(tmp_path: Path) -> None:
    # Prefect hands flows a pendulum-style DateTime whose arithmetic can drop the zone.
    from prefect.types._datetime import DateTime

    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    early = DateTime(2026, 11, 30, 15, 0, 0, tzinfo=UTC)  # a turn on the dot
    (fire,) = agent.scheduler.turn(early).fired
    assert fire.key == "a@2026-11-30T10:00-05:00" and type(fire.window) is datetime
    with pytest.raises(ValueError, match="is naive"):
        started(agent.scheduler, now=datetime(2026, 11, 30, 15, 1))


# --- The loop decides through the agent's own start guard (one rule, one engine) ---


def test_a_paused_row_does_not_fire_and_fires_after_the_pause(tmp_path: Path) -> None:
    until = (T0 + timedelta(hours=1, minutes=30)).isoformat()
    agent = Agent(tmp_path, [row("a", paused={"note": "disk swap", "until": until}), row("b")])
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    report = agent.scheduler.turn(T0)
    assert [f.schedule.id for f in report.fired] == ["b"]
    assert report.skipped == [] and report.missed == []  # never to run: neither one
    assert started(agent.scheduler, now=T0 + timedelta(hours=1)) == 1  # b only: a is still paused
    report = agent.scheduler.turn(T0 + timedelta(hours=2))
    assert sorted(f.schedule.id for f in report.fired) == ["a", "b"]  # the pause is over
    assert report.missed == []  # the paused windows are not missed either


def test_the_guard_skips_a_window_a_pause_holds_back_with_its_reason(tmp_path: Path) -> None:
    # The pause arrives between the decision that the window is due and its guard (another
    # process shares the cache): the guard reads the row as it is then, and says why.
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    guard = agent.scheduler.loop.guard

    def pause_first(batch: Any, now: datetime) -> Any:
        agent.write([row("a", paused={"note": "disk swap", "until": None})])
        agent.scheduler.pull(now=now)
        return guard(batch, now)

    agent.scheduler.loop.guard = pause_first
    report = agent.scheduler.turn(T0)
    assert report.fired == [] and agent.fired == []
    (fire,) = report.skipped
    assert fire.window == T0 and "paused" in fire.reason and "disk swap" in fire.reason


def test_tick_holds_min_interval_and_fires_a_jittered_row_at_its_start(tmp_path: Path) -> None:
    from sched_core.policies import jitter_offset

    agent = Agent(tmp_path, [row("m", schedule=every(1), min_interval=600),
                             row("j", jitter=240)])
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    offset = timedelta(seconds=jitter_offset("node-a", "j", 240))
    assert [f.schedule.id for f in agent.scheduler.turn(T0).fired] == ["m"]
    assert agent.scheduler.turn(T0 + timedelta(minutes=1)).fired == []  # min_interval
    assert offset > timedelta(0)  # stable: a hash of the node and the row
    report = agent.scheduler.turn(T0 + offset - timedelta(seconds=1))
    assert "j" not in [f.schedule.id for f in report.fired]  # not before its start
    fired = agent.scheduler.turn(T0 + offset).fired
    assert [(f.schedule.id, f.window) for f in fired if f.schedule.id == "j"] == [("j", T0)]
    later = agent.scheduler.turn(T0 + timedelta(minutes=10)).fired
    assert [f.schedule.id for f in later] == ["m"]  # m's next allowed window; j ran once


def test_a_paused_row_recovers_no_missed_window(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a", paused={"note": "maintenance", "until": None})])
    agent.scheduler.pull(now=T0 - timedelta(hours=3))
    report = agent.scheduler.turn(T0 + timedelta(minutes=30))
    assert report.fired == [] and report.missed == []


def test_turn_fires_a_row_with_its_own_zone_at_that_zones_wall_clock(tmp_path: Path) -> None:
    # 10:00 in Berlin on 2026-11-30 is 09:00Z; the node runs in New York (04:00 there).
    berlin_ten = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
    agent = Agent(tmp_path, [row("z", schedule=clock(["*"], ["10"], "0"),
                                timezone="Europe/Berlin"),
                             row("n", schedule=clock(["*"], ["10"], "0"))])
    agent.scheduler.pull(now=berlin_ten - timedelta(hours=2))
    fired = agent.scheduler.turn(berlin_ten).fired
    assert [(f.schedule.id, f.window) for f in fired] == [("z", berlin_ten)]
    fired = agent.scheduler.turn(T0).fired  # 10:00 in New York
    assert [(f.schedule.id, f.window) for f in fired] == [("n", T0)]


def test_turn_recovers_a_row_with_its_own_zone_at_that_zones_window(
    tmp_path: Path,
) -> None:
    # Down over Berlin's 10:00 (09:00Z) on 2026-11-30: the recovery is that window, keyed in
    # Berlin's time, not New York's 10:00 (which has not come yet at 11:00Z).
    berlin_ten = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
    agent = Agent(tmp_path, [row("z", schedule=clock(["*"], ["10"], "0"),
                                timezone="Europe/Berlin", miss_policy="run-once-within-24h")])
    agent.scheduler.pull(now=berlin_ten - timedelta(hours=2))
    fired = agent.scheduler.turn(berlin_ten + timedelta(hours=2)).fired
    assert [(f.schedule.id, f.window, f.missed_recovery) for f in fired] == [
        ("z", berlin_ten, True)]
    assert fired[0].key == "z@2026-11-30T10:00+01:00"


def test_a_stamp_the_disk_refuses_is_not_kept_and_one_can_be_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An hourly row first seen an hour ago: its 15:00 window is due at T0.
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    store = agent.scheduler.store
    real_save = type(store).save

    def full(self: Any) -> None:
        raise OSError(28, "No space left on device", str(self.path))

    monkeypatch.setattr(type(store), "save", full)
    with pytest.raises(OSError):
        agent.scheduler.start_window("a", T0, first_try=T0, now=T0)
    assert "a" not in agent.scheduler.cache().last_fired_at, "a stamp that is not on disk"
    monkeypatch.setattr(type(store), "save", real_save)
    decision, _ = agent.scheduler.start_window("a", T0, first_try=T0, now=T0)
    assert decision.runs and agent.scheduler.cache().last_fired_at["a"] == T0
    # What it was to start did not start: the stamp goes, on disk too, and the window
    # decides again.
    agent.scheduler.unstamp("a", T0, now=T0)
    assert "a" not in agent.scheduler.cache().last_fired_at
    agent.restart(T0)
    again, _ = agent.scheduler.start_window("a", T0, first_try=T0, now=T0)
    assert again.runs


def test_many_windows_are_decided_and_stamped_in_one_write_or_none_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent = Agent(tmp_path, [row("a"), row("b"), row("c", enabled=False)])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    store = agent.scheduler.store
    real_save = type(store).save
    saves: list[int] = []

    def counted(self: Any) -> None:
        saves.append(1)
        real_save(self)

    monkeypatch.setattr(type(store), "save", counted)
    answers = agent.scheduler.start_windows([("a", T0, False), ("b", T0, False),
                                             ("c", T0, False)], now=T0)
    assert [answer[0].runs for answer in answers if not isinstance(answer, Exception)] == [
        True, True, False]
    assert saves == [1], "one write for the step"
    assert agent.scheduler.cache().last_fired_at == {"a": T0, "b": T0}
    # The next hour, on a disk that refuses: no stamp stays, each answer says why.
    later = T0 + timedelta(hours=1)

    def full(self: Any) -> None:
        raise OSError(28, "No space left on device", str(self.path))

    monkeypatch.setattr(type(store), "save", full)
    refused = agent.scheduler.start_windows([("a", later, False), ("b", later, False)],
                                            now=later)
    assert all(isinstance(answer, OSError) for answer in refused)
    assert agent.scheduler.cache().last_fired_at == {"a": T0, "b": T0}


def test_windows_of_one_instant_start_concurrently(tmp_path: Path) -> None:
    # Each start waits until all ten have entered: a loop that starts them one after another
    # never gets past the first (its wait breaks, and nine windows fail).
    ids = [f"r{n}" for n in range(10)]
    entered = threading.Barrier(len(ids), timeout=30)
    fired: list[str] = []

    def fire(fire: Fire) -> None:
        entered.wait()
        fired.append(fire.schedule.id)

    agent = Agent(tmp_path, [row(sid) for sid in ids])
    agent.scheduler = Scheduler(Config(pull_url=agent.list_path.as_uri(), node_name="node-a",
                                       cache_path=agent.cache_path, fire=fire), now=T0)
    agent.scheduler.pull(now=T0 - timedelta(minutes=30))
    report = agent.scheduler.turn(T0)
    assert report.failed == [] and not entered.broken
    assert sorted(f.schedule.id for f in report.fired) == sorted(fired) == ids
    assert agent.scheduler.cache().last_fired_at == dict.fromkeys(ids, T0)
