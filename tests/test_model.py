"""The wire format: byte-for-byte the Go kit's JSON."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from sched_core import Cache, LocalSchedule, MissPolicy, Schedule

SPEC_ROW = (
    '{"id":"s-1","name":"nightly backup","repo_id":"r-9","action":"backup","storage":"b2",'
    '"schedule":{"days":["mon","tue"],"hours":["2"],"minute":"30"},'
    '"miss_policy":"run-once-within-24h","enabled":true,"params":{"threads":4},"version":7}'
)


def test_spec_row_round_trips_byte_for_byte() -> None:
    row = LocalSchedule.model_validate_json(SPEC_ROW)
    assert row.miss_policy is MissPolicy.RUN_ONCE_WITHIN_24H
    assert row.model_dump_json() == SPEC_ROW


def test_omitempty_fields_are_left_out() -> None:
    row = LocalSchedule(
        id="s-2", name="n", repo_id="r", action="prune",
        schedule=Schedule(on="after_wave"), miss_policy=MissPolicy.SKIP, enabled=True,
    )
    assert row.model_dump_json() == (
        '{"id":"s-2","name":"n","repo_id":"r","action":"prune",'
        '"schedule":{"days":null,"hours":null,"minute":"","on":"after_wave"},'
        '"miss_policy":"skip","enabled":true,"version":0}'
    )


def test_go_escapes_html_characters() -> None:
    row = LocalSchedule.model_validate_json(SPEC_ROW.replace("nightly backup", "a<b>&c"))
    assert '"name":"a\\u003cb\\u003e\\u0026c"' in row.model_dump_json()
    assert LocalSchedule.model_validate_json(row.model_dump_json()).name == "a<b>&c"


def test_cache_written_by_go_loads() -> None:
    go = (
        '{"schedules":[' + SPEC_ROW + '],'
        '"last_fired_at":{"s-1":"2026-11-30T02:30:00.5-05:00","gone":"0001-01-01T00:00:00Z"},'
        '"last_fetched_at":"2026-11-30T07:31:02.123456789Z","unknown_field":{"x":1}}'
    )
    cache = Cache.model_validate_json(go)
    assert cache.last_fired_at == {"s-1": datetime(2026, 11, 30, 7, 30, 0, 500000, tzinfo=UTC)}
    assert cache.last_fetched_at == datetime(2026, 11, 30, 7, 31, 2, 123456, tzinfo=UTC)
    dumped = cache.model_dump_json()
    assert dumped.endswith(
        '"last_fired_at":{"s-1":"2026-11-30T07:30:00.5Z"},'
        '"last_fetched_at":"2026-11-30T07:31:02.123456Z"}'
    )


def test_never_fetched_is_go_zero_time() -> None:
    cache = Cache.model_validate_json('{"schedules":null,"last_fired_at":null,'
                                      '"last_fetched_at":"0001-01-01T00:00:00Z"}')
    assert cache.last_fetched_at is None and cache.schedules == []
    assert cache.model_dump_json() == (
        '{"schedules":[],"last_fired_at":{},"last_fetched_at":"0001-01-01T00:00:00Z"}'
    )


@pytest.mark.parametrize("text", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_time_out_of_range_in_utc_is_a_validation_error(text: str) -> None:
    # Converting to UTC overflows the datetime range: an invalid value, not a crash.
    with pytest.raises(ValidationError, match="is out of range in UTC"):
        Cache.model_validate({"last_fired_at": {"a": text}})
    with pytest.raises(ValidationError, match="is out of range in UTC"):
        Cache.model_validate({"last_fetched_at": text})


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ({"days": ["Mon"], "hours": ["2"], "minute": "0"}, "unknown day name 'Mon'"),
        ({"days": ["mon"], "hours": ["24"], "minute": "0"}, "hour '24'"),
        ({"days": ["mon"], "hours": ["2"], "minute": "60"}, "minute '60'"),
        ({"days": ["mon"], "hours": ["2"], "minute": ""}, "minute ''"),
        ({"days": [], "hours": ["2"], "minute": "0"}, "days is empty or null"),
        ({"days": ["*"], "hours": None, "minute": "0"}, "hours is empty or null"),
        ({"interval_minutes": 0}, "interval_minutes 0 is below 1"),
    ],
)
def test_invalid_shapes_name_the_problem(shape: dict[str, object], reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        Schedule.model_validate(shape)


def test_event_and_interval_schedules_ignore_clock_fields() -> None:
    assert Schedule.model_validate({"on": "after_wave", "days": ["bogus"]}).is_event
    assert Schedule.model_validate({"interval_minutes": 15, "hours": None}).is_interval


def test_fast_cache_dump_equals_the_model_dump() -> None:
    from sched_core.cache import dump_cache, dump_rows

    # Identifiers are ASCII now (check_identifier): the non-ASCII goes in the
    # name, the storage and a time map's key, which are not identifiers.
    with pytest.raises(ValidationError, match="id 's-ü' is not an identifier"):
        LocalSchedule.model_validate_json(SPEC_ROW.replace('"s-1"', '"s-ü"'))
    odd = SPEC_ROW.replace("nightly backup", "é<&>\u2028").replace('"b2"', '"bü<"')
    cache = Cache.model_validate({
        "schedules": [LocalSchedule.model_validate_json(odd), LocalSchedule.model_validate_json(
            SPEC_ROW.replace('"s-1"', '"s-2"'))],
        "last_fired_at": {"s-ü": "2026-11-30T07:30:00.25Z", "s-2": "2026-11-29T07:30:00Z"},
        "last_fetched_at": "2026-11-30T07:31:02Z",
        "first_seen_at": {"s-2": "2026-11-01T00:00:00Z"},
    })
    assert dump_cache(cache) == cache.model_dump_json()
    assert dump_cache(cache, dump_rows(cache.schedules)) == cache.model_dump_json()
    assert Cache.model_validate_json(dump_cache(cache)) == cache
