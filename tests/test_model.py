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


# -- policy fields ----------------------------------------------------------------------

POLICY_ROW = SPEC_ROW[:-1] + (
    ',"timezone":"Asia/Kolkata","overlap":"buffer-one","jitter":600,"catchup_window":3600,'
    '"paused":{"note":"disk swap \\u003c 2 h","until":"2026-12-01T05:00:00Z"},'
    '"not_before":"2026-01-01T00:00:00Z","not_after":"2027-01-01T00:00:00Z",'
    '"blackouts":[{"days":["sat","sun"],"from":"22:00","to":"06:00"}],'
    '"min_interval":604800,"repo_lock":true}'
)


def test_a_row_without_policies_dumps_byte_identical_to_the_go_kits() -> None:
    """Unset, empty, zero and false policies are left out, so Go's row is unchanged."""
    import json

    row = LocalSchedule.model_validate_json(SPEC_ROW)
    assert row.model_dump_json() == SPEC_ROW
    empty = {"timezone": "", "overlap": None, "jitter": 0, "catchup_window": None,
             "paused": None, "not_before": None, "not_after": "0001-01-01T00:00:00Z",
             "blackouts": [], "min_interval": 0, "repo_lock": False}
    spelled_out = LocalSchedule.model_validate({**json.loads(SPEC_ROW), **empty})
    assert spelled_out.model_dump_json() == SPEC_ROW
    assert spelled_out == row


def test_a_row_with_every_policy_round_trips_byte_for_byte() -> None:
    row = LocalSchedule.model_validate_json(POLICY_ROW)
    assert row.model_dump_json() == POLICY_ROW
    assert row.paused is not None and row.paused.note == "disk swap < 2 h"
    assert row.paused.until == datetime(2026, 12, 1, 5, 0, tzinfo=UTC)
    assert row.blackouts is not None and row.blackouts[0].start_minute == 22 * 60
    assert LocalSchedule.model_validate_json(row.model_dump_json()) == row
    cache = Cache.model_validate({"schedules": [row]})
    assert Cache.model_validate_json(cache.model_dump_json()) == cache


def test_a_bare_pause_and_a_pause_without_until_mean_paused_until_resumed() -> None:
    bare = LocalSchedule.model_validate_json(SPEC_ROW[:-1] + ',"paused":{}}')
    assert bare.paused is not None and bare.paused.until is None
    assert bare.model_dump_json().endswith(',"version":7,"paused":{}}')
    null = LocalSchedule.model_validate_json(SPEC_ROW[:-1] + ',"paused":{"until":null}}')
    assert null.paused == bare.paused


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"timezone": "Mars/Olympus"}, "timezone: timezone 'Mars/Olympus' is not a zone"),
        ({"timezone": "localtime"}, "timezone: timezone 'localtime' is not an IANA zone name"),
        ({"timezone": "/etc/localtime"}, "timezone: timezone '/etc/localtime' is not an IANA"),
        ({"timezone": "../../etc/passwd"}, "timezone: timezone '../../etc/passwd' is not"),
        ({"overlap": "queue"}, "overlap: Input should be 'skip', 'allow', 'buffer-one' or"),
        ({"jitter": 3601}, "jitter: Input should be less than or equal to 3600"),
        ({"jitter": -1}, "jitter: Input should be greater than or equal to 0"),
        ({"jitter": "60"}, "jitter: Input should be a valid integer"),
        ({"jitter": True}, "jitter: Input should be a valid integer"),
        ({"catchup_window": 0}, "catchup_window: Input should be greater than or equal to 60"),
        ({"catchup_window": 8 * 86400}, "catchup_window: Input should be less than or equal"),
        ({"paused": {"untill": "2026-12-01T00:00:00Z"}}, "paused.untill: Extra inputs"),
        ({"paused": {"until": "2026-12-01T00:00:00"}}, "paused.until: .* has no UTC offset"),
        ({"paused": {"note": "x" * 1001}}, "paused.note: String should have at most 1000"),
        ({"paused": True}, "paused: Input should be a valid dictionary"),
        ({"not_before": "tomorrow"}, "not_before: Invalid isoformat string"),
        ({"not_before": "2026-02-01T00:00:00Z", "not_after": "2026-01-01T00:00:00Z"},
         "not_after 2026-01-01T00:00:00Z is before not_before 2026-02-01T00:00:00Z"),
        ({"blackouts": [{"days": ["Sat"], "from": "22:00", "to": "06:00"}]},
         "blackouts.0.days: unknown day name 'Sat'"),
        ({"blackouts": [{"days": [], "from": "22:00", "to": "06:00"}]},
         "blackouts.0.days: no days"),
        ({"blackouts": [{"days": ["*"], "from": "2:00", "to": "06:00"}]},
         "blackouts.0.from: '2:00' is not a time HH:MM"),
        ({"blackouts": [{"days": ["*"], "from": "22:00", "to": "24:01"}]},
         "blackouts.0.to: '24:01' is not a time HH:MM"),
        ({"blackouts": [{"days": ["*"], "from": "24:00", "to": "06:00"}]},
         "blackouts.0.from: '24:00' is only a 'to'"),
        ({"blackouts": [{"days": ["*"], "from": "00:00", "to": "24:00", "x": 1}]},
         "blackouts.0.x: Extra inputs are not permitted"),
        ({"blackouts": [{"days": ["*"], "from": "06:00", "to": "06:00"}]},
         "blackouts.0: from '06:00' equals to '06:00': a blackout must not be empty"),
        ({"min_interval": 400 * 86400}, "min_interval: Input should be less than or equal"),
        ({"repo_lock": "yes"}, "repo_lock: Input should be a valid boolean"),
        ({"repo_lock": True, "repo_id": ""}, "repo_lock is true but repo_id is empty"),
    ],
)
def test_a_bad_policy_value_is_an_error_naming_the_field(
    fields: dict[str, object], reason: str
) -> None:
    import json

    from sched_core.cache import describe_validation_error

    with pytest.raises(ValidationError) as caught:
        LocalSchedule.model_validate({**json.loads(SPEC_ROW), **fields})
    assert __import__("re").search(reason, describe_validation_error(caught.value))


def test_a_pulled_row_with_a_bad_policy_is_dropped_and_its_last_good_version_kept(
    tmp_path: object,
) -> None:
    import json
    from pathlib import Path

    from sched_core import Config, Scheduler

    path = Path(str(tmp_path))
    source = path / "list.json"
    good = {**json.loads(SPEC_ROW), "jitter": 60}
    other = {**json.loads(SPEC_ROW), "id": "s-2"}
    source.write_text(json.dumps({"schedules": [good, other]}))
    scheduler = Scheduler(Config(pull_url=source.as_uri(), node_name="n",
                                 cache_path=path / "cache.json", fire=lambda fire: None),
                          now=datetime(2026, 11, 30, tzinfo=UTC))
    scheduler.pull(datetime(2026, 11, 30, tzinfo=UTC))
    source.write_text(json.dumps({"schedules": [{**good, "jitter": 7200, "version": 8}, other]}))
    result = scheduler.pull(datetime(2026, 11, 30, 0, 5, tzinfo=UTC))
    assert result.rejected == [("s-1", "jitter: Input should be less than or equal to 3600")]
    assert result.kept_last_good == ["s-1"]
    kept = {row.id: row for row in scheduler.schedules()}["s-1"]
    assert kept.jitter == 60 and kept.version == 7
