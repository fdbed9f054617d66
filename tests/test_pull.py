"""Pulls under hostile answers: refused whole naming where, accepted only with their save."""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from sched_core import PullError
from sched_core.cache import load_cache
from sched_core.model import Cache
from sched_core.pull import merge_pull, parse_schedule_list
from sched_core.scheduler import Config, Scheduler
from tests.test_scheduler import T0, Agent, row, started


def _with(sid: str, **raw: str) -> str:
    data = json.dumps(row(sid))
    for name, value in raw.items():
        data = data[:-1] + f', "{name}": {value}}}'
    return data


def _list(*rows: str) -> str:
    return '{"schedules": [' + ", ".join(rows) + "]}"


HOSTILE = [
    (_list(_with("a"), _with("b", params='{"x": ' + "[" * 1100 + "]" * 1100 + "}")),
     "nested deeper than 102 levels"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 102 levels"),
    ('{"a":' * 5000 + "1" + "}" * 5000, "nested deeper than 102 levels"),
    (_list(_with("a"), _with("b", params='{"x": ' + "[" * 101 + "]" * 101 + "}")),
     "schedules[1].params.x" + "[0]" * 98 + ": JSON nested deeper than 102 levels"),
    (_list(_with("a", params='{"n": ' + "7" * 4301 + "}")),
     "schedules[0].params.n: number 77777777777777777777...7777777777 is beyond a float64"),
    (_list(_with("a", version="9" * 400)), "schedules[0].version: number"),
    ("[" + "1" * 5000 + "]", "[0]: number"),
    (_list(_with("a", name='"\\ud800"')),
     "schedules[0].name contains an unpaired UTF-16 surrogate"),
    (_list(_with("a", repo_id='"r\\udfff"')), "schedules[0].repo_id contains an unpaired"),
    (_list(_with("a", storage='"\\ud83d"')), "schedules[0].storage contains an unpaired"),
    (_list(_with("a", params='{"\\udc00k": 1}')), "contains an unpaired UTF-16 surrogate"),
    (_list(_with("a", params='{"x": NaN}')), "schedules[0].params.x: NaN is not JSON"),
    (_list(_with("a", params='{"x": [Infinity]}')), "params.x[0]: Infinity is not JSON"),
    (_list(_with("a", params='{"x": -1e400}')), "params.x: number -1e400 is beyond a float64"),
    ('{"schedules": [], "etag": 1e999}', "etag: number 1e999 is beyond a float64"),
]


@pytest.mark.parametrize(("payload", "reason"), HOSTILE)
def test_a_payload_breaking_a_wire_rule_is_refused_naming_where(
    tmp_path: Path, payload: str, reason: str
) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    before_file, before = agent.cache_path.read_bytes(), agent.scheduler.cache()
    agent.write(payload)
    with pytest.raises(PullError, match=re.escape(reason)) as info:
        agent.scheduler.pull(now=T0)
    assert agent.list_path.as_uri() in str(info.value) and len(str(info.value)) < 600
    assert agent.cache_path.read_bytes() == before_file
    assert agent.scheduler.cache() == before
    assert started(agent.scheduler, now=T0) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("id", "a/../../x"), ("repo_id", "q/../../escaped"), ("repo_id", "*"),
     ("action", "--password-command=sh"), ("id", "-rf"), ("id", ".hidden")],
)
def test_a_row_with_a_hostile_identifier_is_dropped_and_its_last_good_version_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: str
) -> None:
    agent = Agent(tmp_path, [row("a"), row("b")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    hostile = row("b", **{field: value}) if field != "id" else row(value)
    agent.write([row("a"), hostile])
    with caplog.at_level(logging.WARNING):
        result = agent.scheduler.pull(now=T0)
    ((label, reason),) = result.rejected
    assert label == (value if field == "id" else "b")
    assert f"{field}: {field} {value!r} is not an identifier" in reason
    kept = {s.id: s for s in agent.scheduler.schedules()}
    if field == "id":  # a new, refused id: b is simply gone from the list
        assert set(kept) == {"a"} and result.removed == ["b"]
    else:
        assert result.kept_last_good == ["b"] and kept["b"].repo_id == "r-1"
        assert kept["b"].action == "backup"
    assert any("is not an identifier" in r.getMessage() for r in caplog.records)
    assert load_cache(agent.cache_path, now=T0) == agent.scheduler.cache()
    # Every row hostile while schedules are cached: the whole list is refused.
    agent.write([row("a", repo_id="*"), row("b", action="-x")])
    with pytest.raises(PullError, match="every one of the 2 rows"):
        agent.scheduler.pull(now=T0 + timedelta(minutes=1))


def test_a_pull_whose_save_fails_changes_neither_memory_nor_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = Agent(tmp_path, [row("a")])
    agent.scheduler.pull(now=T0 - timedelta(hours=1))
    before_file, before = agent.cache_path.read_bytes(), agent.scheduler.cache()

    def disk_full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr("sched_core.store.save_cache", disk_full)
        agent.write([row("a", version=2), row("b")])
        with pytest.raises(PullError, match=r"could not save the cache file .*No space left"):
            agent.scheduler.pull(now=T0)
        assert agent.scheduler.cache() == before
        assert agent.cache_path.read_bytes() == before_file
    assert started(agent.scheduler, now=T0) == 1  # the old list fires (the disk has room again)
    result = agent.scheduler.pull(now=T0 + timedelta(minutes=1))
    assert result.added == ["b"] and result.changed == ["a"]
    assert load_cache(agent.cache_path, now=T0) == agent.scheduler.cache()


def test_a_non_ascii_etag_goes_back_byte_for_byte(tmp_path: Path) -> None:
    etag = '"v\u00e9-\u20ac"'.encode()  # UTF-8 bytes: obs-text to RFC 7232
    sent: list[bytes | None] = []

    def controller(request: httpx.Request) -> httpx.Response:
        got = request.headers.raw
        sent.append(next((v for k, v in got if k.lower() == b"if-none-match"), None))
        if sent[-1] == etag:
            return httpx.Response(304)
        return httpx.Response(200, json={"schedules": [row("a")]}, headers=[(b"ETag", etag)])

    config = Config(pull_url="https://controller.test/api/schedules?node=n", node_name="n",
                    cache_path=tmp_path / "cache.json", fire=print,
                    http_client=httpx.Client(transport=httpx.MockTransport(controller)))
    scheduler = Scheduler(config, now=T0)
    assert scheduler.pull(now=T0).added == ["a"]
    assert scheduler.cache().etag == etag.decode("latin-1")
    assert not scheduler.pull(now=T0 + timedelta(minutes=5)).changed_anything
    restarted = Scheduler(config, now=T0 + timedelta(minutes=6))  # from the file
    assert not restarted.pull(now=T0 + timedelta(minutes=10)).changed_anything
    assert sent == [None, etag, etag]


def test_an_etag_that_cannot_be_sent_back_is_not_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    answers = [httpx.Response(200, json={"schedules": [row("a")]},
                              headers=[(b"ETag", b'"' + b"x" * 2000 + b'"')])]
    config = Config(pull_url="https://controller.test/x", node_name="n",
                    cache_path=tmp_path / "cache.json", fire=print,
                    http_client=httpx.Client(
                        transport=httpx.MockTransport(lambda r: answers[0])))
    scheduler = Scheduler(config, now=T0)
    scheduler.pull(now=T0)
    assert scheduler.cache().etag is None
    assert any("ignored the ETag" in r.getMessage() for r in caplog.records)


def test_parse_and_merge_are_pure() -> None:
    rows = parse_schedule_list(json.dumps([row("a"), row("b")]).encode(), "test")
    assert [r["id"] for r in rows] == ["a", "b"]
    from sched_core.cache import validate_rows

    good, rejected = validate_rows(rows, source="test")
    empty = Cache()
    merged, result = merge_pull(empty, good, rejected, rows=2, etag='"1"', etag_url="u",
                                source="test", now=T0)
    assert empty == Cache() and result.added == ["a", "b"]  # the input is untouched
    assert merged.first_seen_at == {"a": T0, "b": T0} and merged.etag == '"1"'
