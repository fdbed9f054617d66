"""The cache file: salvaged part by part under the wire rules, generations, future times.

Times are explicit (T0 = Monday 2026-11-30 10:00 EST = 15:00Z, as in test_scheduler).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sched_core.cache import (
    FUTURE_SLACK,
    dump_cache,
    load_cache,
    load_cache_file,
    read_generation,
)
from sched_core.model import Cache
from sched_core.scheduler import Scheduler
from sched_core.statefile import stamp_of
from sched_core.values import format_go_time, parse_go_time
from tests.test_scheduler import T0, Agent, row, started


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _go_cache_text(rows: list[str], **fields: str) -> str:
    """A cache file written by hand: rows and fields as raw JSON text."""
    parts = [f'"schedules": [{", ".join(rows)}]',
             '"last_fired_at": {"a": "2026-11-30T13:00:00Z"}',
             '"last_fetched_at": "2026-11-30T14:30:00Z"']
    parts += [f'"{name}": {value}' for name, value in fields.items()]
    return "{" + ", ".join(parts) + "}"


def _row_text(sid: str, **raw: str) -> str:
    data = json.dumps(row(sid))
    for name, value in raw.items():
        data = data[:-1] + f', "{name}": {value}}}'
    return data


@pytest.mark.parametrize(
    ("bad_row", "reason"),
    [
        (_row_text("b", name='"\\ud800"'), "unpaired UTF-16 surrogate"),
        (_row_text("b", storage='"x\\udc00"'), "unpaired UTF-16 surrogate"),
        (_row_text("b", params='{"x": NaN}'), "NaN is not JSON"),
        (_row_text("b", params='{"x": 1e400}'), "beyond a float64"),
        (_row_text("b", version="1" + "0" * 5000), "beyond a float64"),
        (_row_text("b", params='{"\\ud83d": 1}'), "unpaired UTF-16 surrogate"),
        (_row_text("b", params='{"a":' * 150 + "1" + "}" * 150), "nested deeper than 102"),
        (_row_text("b", repo_id='"q/../../escaped"'), "repo_id 'q/../../escaped' is not an id"),
    ],
)
def test_a_row_breaking_a_wire_rule_is_dropped_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad_row: str, reason: str
) -> None:
    _write(tmp_path / "cache.json", _go_cache_text([_row_text("a"), bad_row, _row_text("c")]))
    with caplog.at_level(logging.WARNING):
        agent = Agent(tmp_path, "{controller down")
    assert [s.id for s in agent.scheduler.schedules()] == ["a", "c"]
    (warned,) = [r for r in caplog.records if r.getMessage().startswith("dropped invalid schedule")]
    assert warned.schedule_id == "b" and reason in warned.getMessage()  # type: ignore[attr-defined]
    assert list(tmp_path.glob("cache.json.corrupt-*")) == []
    # The rewritten file loads strictly and equals memory; a restart warns no more.
    assert load_cache(agent.cache_path, now=T0) == agent.scheduler.cache()
    caplog.clear()
    agent.restart(now=T0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert started(agent.scheduler, now=T0) == 2


@pytest.mark.parametrize(
    ("fields", "dropped"),
    [
        ({"last_fired_at": '{"a": "2026-11-30T13:00:00Z", "\\udc00": "2026-11-30T13:00:00Z"}'},
         "last_fired_at['\\\\udc00']"),
        ({"first_seen_at": '{"a": NaN}'}, "first_seen_at['a']"),
        ({"etag": '"\\ud800"', "etag_url": '"https://c.test/x"'}, "etag"),
        ({"etag": '"\\u20ac"', "etag_url": '"https://c.test/x"'}, "etag"),  # not Latin-1
        ({"last_fetched_at": "1e400"}, "last_fetched_at"),
    ],
)
def test_a_field_entry_breaking_a_wire_rule_is_dropped_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fields: dict[str, str], dropped: str
) -> None:
    text = _go_cache_text([_row_text("a")]).replace(
        '"last_fired_at": {"a": "2026-11-30T13:00:00Z"}', '"x": 0'
    ) if "last_fired_at" in fields else _go_cache_text([_row_text("a")])
    _write(tmp_path / "cache.json", text[:-1] + ", " + ", ".join(
        f'"{name}": {value}' for name, value in fields.items()) + "}")
    with caplog.at_level(logging.WARNING):
        agent = Agent(tmp_path, "{controller down")
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]
    assert any(dropped in r.getMessage() for r in caplog.records), dropped
    cache = agent.scheduler.cache()
    assert cache.etag is None
    assert load_cache(agent.cache_path, now=T0) == cache
    assert started(agent.scheduler, now=T0) == 1


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,  # past the parser's recursion limit
        '{"schedules": ' + "[" * 5000 + "]" * 5000 + "}",
        '{"schedules": [], "last_fired_at": {"a": "\\ud800"',  # truncated
    ],
)
def test_a_cache_that_cannot_be_parsed_is_moved_aside_byte_for_byte(
    tmp_path: Path, content: str
) -> None:
    _write(tmp_path / "cache.json", content)
    agent = Agent(tmp_path, [row("a")])
    assert agent.scheduler.schedules() == []
    (aside,) = tmp_path.glob("cache.json.corrupt-*")
    assert aside.read_text() == content
    assert started(agent.scheduler, now=T0) == 0
    agent.scheduler.pull(now=T0)
    assert [s.id for s in agent.scheduler.schedules()] == ["a"]


def test_times_before_year_1000_are_written_with_four_digits(tmp_path: Path) -> None:
    early = datetime(1, 1, 1, 14, 0, tzinfo=UTC)
    assert format_go_time(early) == "0001-01-01T14:00:00Z"
    assert format_go_time(datetime(999, 12, 31, 23, 59, 59, 5, tzinfo=UTC)) == (
        "0999-12-31T23:59:59.000005Z"
    )
    assert parse_go_time(format_go_time(early)) == early
    cache = Cache.model_validate({"last_fired_at": {"a": "0001-01-01T14:00:00Z"},
                                  "first_seen_at": {"a": "0500-06-01T00:00:00Z"}})
    assert Cache.model_validate_json(dump_cache(cache)) == cache
    _write(tmp_path / "cache.json", dump_cache(cache))
    assert load_cache(tmp_path / "cache.json", now=T0) == cache


@pytest.mark.parametrize(
    ("ahead", "clamped"),
    [
        (FUTURE_SLACK, False),  # within the slack: another process's later now
        (FUTURE_SLACK + timedelta(seconds=1), True),
        (datetime(2099, 1, 1, tzinfo=UTC) - T0, True),
        (datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC) - T0, True),
    ],
)
def test_a_time_in_the_future_is_clamped_to_now_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, ahead: timedelta, clamped: bool
) -> None:
    future = format_go_time(T0 + ahead)
    text = json.dumps({"schedules": [row("a"), row("b")],
                       "last_fired_at": {"a": future, "b": "2026-11-30T13:00:00Z"},
                       "first_seen_at": {"a": "2026-11-01T00:00:00Z", "b": future},
                       "last_fetched_at": "2026-11-30T14:30:00Z"})
    _write(tmp_path / "cache.json", text)
    with caplog.at_level(logging.WARNING):
        agent = Agent(tmp_path, "{controller down", now=T0)
    cache = agent.scheduler.cache()
    warned = {getattr(r, "field", None) for r in caplog.records if "clamped" in r.getMessage()}
    if not clamped:
        assert warned == set()
        assert cache.last_fired_at["a"] == T0 + ahead
        return
    assert warned == {"last_fired_at", "first_seen_at"}
    assert any("last_fired_at['a']" in r.getMessage() and future in r.getMessage()
               for r in caplog.records)
    assert cache.last_fired_at["a"] == T0 and cache.first_seen_at["b"] == T0
    # The schedules fire again from the next window on, and the file says so.
    assert started(agent.scheduler, now=T0 + timedelta(hours=1)) == 2
    assert load_cache(agent.cache_path, now=T0).last_fired_at == {
        "a": T0 + timedelta(hours=1), "b": T0 + timedelta(hours=1)}


def test_every_save_raises_the_generation_at_the_head_of_the_file(tmp_path: Path) -> None:
    agent = Agent(tmp_path, [row("a")])
    assert read_generation(agent.cache_path) is None  # nothing written yet
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    assert agent.cache_path.read_bytes().startswith(b'{"generation":1,"schedules":[')
    started(agent.scheduler, now=T0)
    assert read_generation(agent.cache_path) == 2
    assert load_cache_file(agent.cache_path, now=T0).generation == 2
    # Go ignores the field; the Go kit's own fields are all there.
    data = json.loads(agent.cache_path.read_text())
    assert set(data) >= {"schedules", "last_fired_at", "last_fetched_at"}


def test_a_save_reusing_inode_mtime_and_size_is_still_reloaded(tmp_path: Path) -> None:
    """The old bug, forced: two saves within one timestamp tick can leave the file with
    the inode, modification time and size another process last saw. Judged by that
    stamp alone, that process skipped the reload and fired the window again."""
    cache_path = tmp_path / "cache.json"
    a = Agent(tmp_path, [row("s")])
    a.scheduler.pull(now=T0 - timedelta(hours=2))
    assert started(a.scheduler, now=T0 - timedelta(hours=1)) == 1  # stamps 14:00Z
    seen = os.stat(cache_path)
    keep = tmp_path / "keep"
    os.link(cache_path, keep)  # keeps the inode A saw alive, to be reused
    b = Scheduler(a.config, now=T0)
    assert started(b, now=T0) == 1  # B fires the 15:00Z window and saves a new file
    new = cache_path.read_bytes()
    assert len(new) == seen.st_size  # 14:00Z and 15:00Z stamps: the same size
    with keep.open("r+b") as handle:  # B's bytes in A's inode...
        handle.write(new)
    os.replace(keep, cache_path)
    os.utime(cache_path, ns=(seen.st_atime_ns, seen.st_mtime_ns))  # ...in the same tick
    assert stamp_of(cache_path) == a.scheduler.store.stamp  # A's stamp cannot tell
    assert started(a.scheduler, now=T0 + timedelta(seconds=30)) == 0
    # A's 14:00Z and B's 15:00Z (both call the same fire): 15:00Z once, not twice.
    assert [f.window for f in a.fired] == [T0 - timedelta(hours=1), T0]
    assert a.scheduler.cache().last_fired_at == {"s": T0}


def test_a_cache_without_a_generation_is_judged_by_its_stamp(tmp_path: Path) -> None:
    """A file the Go kit wrote has no generation: a change of it is still seen."""
    agent = Agent(tmp_path, [row("a")])
    go = json.dumps({"schedules": [row("a")], "last_fired_at": {},
                     "last_fetched_at": "2026-11-30T14:00:00Z"})
    _write(agent.cache_path, go)
    assert started(agent.scheduler, now=T0) == 1  # reloaded: a stamp it had never seen
    assert read_generation(agent.cache_path) is not None  # and now it is ours
