"""The chain: prune, then check, once per chain day, after the wave drains.

Times are New York local (EST, UTC-5) on Monday 2026-11-30 unless stated.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sched_core import ConfigError
from sched_core.chain import Chain, Spec, Stage
from sched_core.scheduler import Config, Fire, Scheduler

NIGHT = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)  # 03:00 EST


def row(sid: str, action: str, on: str = "after_wave") -> dict[str, Any]:
    return {
        "id": sid, "name": sid, "repo_id": "r", "action": action,
        "schedule": {"on": on} if on else {"days": ["*"], "hours": ["2"], "minute": "0"},
        "miss_policy": "skip", "enabled": True, "version": 1,
    }


class Fleet:
    """An agent with a wave (backup), a prune stage and a check stage, and a fake job registry."""

    def __init__(self, tmp: Path, rows: list[dict[str, Any]] | None = None) -> None:
        rows = rows if rows is not None else [
            row("b1", "backup", on=""), row("p1", "prune"), row("p2", "prune"), row("c1", "check"),
        ]
        (tmp / "list.json").write_text(json.dumps({"schedules": rows}))
        self.fired: list[Fire] = []
        self.fail: set[str] = set()
        self.running: dict[str, int] = {"backup": 0, "prune": 0, "check": 0}
        self.wave_done = True
        self.tmp = tmp
        config = Config(pull_url=(tmp / "list.json").as_uri(), node_name="n",
                        cache_path=tmp / "cache.json", fire=self._fire)
        self.scheduler = Scheduler(config, now=NIGHT)
        self.scheduler.pull(now=NIGHT - timedelta(hours=2))
        self.chain = self.new_chain()

    def new_chain(self) -> Chain:
        def stage(action: str) -> Stage:
            return Stage(
                name=action, trigger_key=f"chain-{action}",
                match=lambda s: s.schedule.on == "after_wave" and s.action == action,
                active=lambda: self.running[action] > 0,
            )

        return Chain(self.scheduler, Spec(
            stages=[stage("prune"), stage("check")],
            is_wave_job=lambda action: action in ("backup", "copy"),
            wave_complete=lambda: self.wave_done,
            marker_path=self.tmp / "chain.json",
        ))

    def _fire(self, fire: Fire) -> None:
        if fire.schedule.id in self.fail:
            raise RuntimeError("worker unreachable")
        self.fired.append(fire)
        self.running[fire.schedule.action] += 1

    def finish(self, action: str) -> None:
        self.running[action] -= 1

    def ids(self) -> list[str]:
        return [f.schedule.id for f in self.fired]


def test_wave_then_prune_then_check_once_per_day(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.wave_done = False
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == []  # wave not drained
    fleet.wave_done = True
    assert fleet.chain.on_job_complete("backup", now=NIGHT + timedelta(minutes=1)) == ["prune"]
    assert fleet.ids() == ["p1", "p2"]
    assert {f.key for f in fleet.fired} == {"p1@prune@2026-11-30", "p2@prune@2026-11-30"}
    assert fleet.fired[0].trigger_key == "chain-prune"
    fleet.finish("prune")
    assert fleet.chain.on_job_complete("prune", now=NIGHT + timedelta(minutes=5)) == []
    fleet.finish("prune")
    assert fleet.chain.on_job_complete("prune", now=NIGHT + timedelta(minutes=6)) == ["check"]
    assert fleet.ids() == ["p1", "p2", "c1"]
    fleet.finish("check")
    for action in ("check", "backup", "prune"):
        assert fleet.chain.on_job_complete(action, now=NIGHT + timedelta(hours=2)) == []
    assert fleet.ids() == ["p1", "p2", "c1"]
    # The next day the chain runs again.
    assert fleet.chain.on_job_complete("backup", now=NIGHT + timedelta(days=1)) == ["prune"]


def test_restart_neither_refires_nor_skips(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    fleet.chain = fleet.new_chain()  # a restart mid-morning
    assert fleet.chain.on_job_complete("backup", now=NIGHT + timedelta(minutes=1)) == []
    fleet.finish("prune")
    fleet.finish("prune")
    fleet.chain = fleet.new_chain()
    assert fleet.chain.on_job_complete("prune", now=NIGHT + timedelta(minutes=9)) == ["check"]


def test_first_boot_and_non_wave_jobs_fire_nothing(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.chain.on_job_complete("prune", now=NIGHT) == []
    assert fleet.chain.on_job_complete("check", now=NIGHT) == []
    assert fleet.fired == [] and not (tmp_path / "chain.json").exists()


def test_stage_that_fires_nothing_hands_on_in_the_same_call(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, [row("b1", "backup", on=""), row("c1", "check")])
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune", "check"]
    assert fleet.ids() == ["c1"]


def test_stage_whose_jobs_already_drained_hands_on(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.running["prune"] = -2  # the prune jobs finish before the call returns
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune", "check"]


def test_prune_that_drains_after_midnight_still_leads_to_check(tmp_path: Path) -> None:
    late = datetime(2026, 12, 1, 4, 55, tzinfo=UTC)  # Mon 23:55 EST
    fleet = Fleet(tmp_path)
    assert fleet.chain.on_job_complete("backup", now=late) == ["prune"]
    fleet.finish("prune")
    fleet.finish("prune")
    after = late + timedelta(minutes=15)  # Tue 00:10 EST
    assert fleet.chain.on_job_complete("prune", now=after) == ["check"]
    marks = fleet.chain.marks(now=after)
    assert marks["check"].day.isoformat() == "2026-11-30"
    assert fleet.fired[-1].key == "c1@check@2026-11-30"


def test_stale_predecessor_is_not_followed(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    fleet.finish("prune")
    fleet.finish("prune")
    assert fleet.chain.on_job_complete("prune", now=NIGHT + timedelta(hours=25)) == []


def test_failed_stage_fire_is_retried_for_the_failed_schedules_only(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.fail = {"p2"}
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    assert fleet.ids() == ["p1"]
    assert not fleet.chain.marks(now=NIGHT)["prune"].complete
    assert list(fleet.chain.incomplete(now=NIGHT)) == ["prune"]
    fleet.finish("prune")
    # Still failing: retried on this completion, and still incomplete.
    assert fleet.chain.on_job_complete("prune", now=NIGHT + timedelta(minutes=1)) == ["prune"]
    assert fleet.ids() == ["p1"]
    fleet.fail.clear()
    assert fleet.chain.on_job_complete("backup", now=NIGHT + timedelta(minutes=2)) == ["prune"]
    assert fleet.ids() == ["p1", "p2"]
    assert fleet.chain.marks(now=NIGHT)["prune"].complete
    assert fleet.chain.incomplete(now=NIGHT) == {}


def test_failed_stage_zero_is_retried_on_any_completion_after_the_last_wave_job(
    tmp_path: Path,
) -> None:
    """The wave's last backup fired a prune that failed to start: the day's chain still runs."""
    fleet = Fleet(tmp_path)
    fleet.fail = {"p1", "p2"}
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    assert fleet.ids() == []
    assert set(fleet.chain.incomplete(now=NIGHT)) == {"prune"}
    fleet.fail.clear()
    # No wave job completes again today; some other job does (an ad hoc check).
    later = NIGHT + timedelta(hours=1)
    assert fleet.chain.on_job_complete("check", now=later) == ["prune"]
    assert fleet.ids() == ["p1", "p2"]
    assert [f.key for f in fleet.fired] == ["p1@prune@2026-11-30", "p2@prune@2026-11-30"]
    fleet.finish("prune")
    fleet.finish("prune")
    assert fleet.chain.on_job_complete("prune", now=later + timedelta(minutes=5)) == ["check"]
    assert fleet.ids() == ["p1", "p2", "c1"]
    # A marker left incomplete longer than the follow window is not retried any more.
    (tmp_path / "two").mkdir()
    fleet2 = Fleet(tmp_path / "two")
    fleet2.fail = {"p1", "p2"}
    assert fleet2.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    assert set(fleet2.chain.incomplete(now=NIGHT + timedelta(hours=23))) == {"prune"}
    assert fleet2.chain.incomplete(now=NIGHT + timedelta(hours=25)) == {}


def test_bad_spec_is_a_config_error(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    stage = Stage(name="x", trigger_key="x", match=lambda s: True, active=lambda: False)
    with pytest.raises(ConfigError, match="empty"):
        Chain(fleet.scheduler, Spec([], lambda a: True, lambda: True, tmp_path / "m.json"))
    with pytest.raises(ConfigError, match="unique"):
        Chain(fleet.scheduler, Spec([stage, stage], lambda a: True, lambda: True,
                                    tmp_path / "m.json"))
    with pytest.raises(ConfigError, match="does not exist"):
        Chain(fleet.scheduler, Spec([stage], lambda a: True, lambda: True,
                                    tmp_path / "no" / "m.json"))


def test_corrupt_marker_file_is_moved_aside(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    (tmp_path / "chain.json").write_text("{oops")
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    assert len(list(tmp_path.glob("chain.json.corrupt-*"))) == 1


def test_failed_stage_zero_is_retried_after_midnight_for_its_own_day(tmp_path: Path) -> None:
    """A prune that failed to start at 23:50 is retried at 00:05 under 11-30's key, not 12-01's."""
    late = datetime(2026, 12, 1, 4, 50, tzinfo=UTC)  # Mon 23:50 EST
    fleet = Fleet(tmp_path)
    fleet.fail = {"p2"}
    assert fleet.chain.on_job_complete("backup", now=late) == ["prune"]
    fleet.fail.clear()
    after = late + timedelta(minutes=15)  # Tue 00:05 EST: some job completes
    assert fleet.chain.on_job_complete("prune", now=after) == ["prune"]
    assert [f.key for f in fleet.fired] == ["p1@prune@2026-11-30", "p2@prune@2026-11-30"]
    assert fleet.chain.marks(now=after)["prune"].day.isoformat() == "2026-11-30"
    fleet.finish("prune")
    fleet.finish("prune")
    assert fleet.chain.on_job_complete("prune", now=after + timedelta(minutes=5)) == ["check"]
    assert fleet.fired[-1].key == "c1@check@2026-11-30"
    fleet.finish("check")
    # Tuesday night's wave still gets its own chain.
    tuesday = late + timedelta(hours=3, minutes=10)  # Tue 03:00 EST
    assert fleet.chain.on_job_complete("backup", now=tuesday) == ["prune"]
    assert fleet.fired[-1].key == "p2@prune@2026-12-01"


def test_a_new_wave_supersedes_an_incomplete_stage_zero(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.fail = {"p1", "p2"}
    assert fleet.chain.on_job_complete("backup", now=NIGHT) == ["prune"]
    fleet.wave_done = False  # the next night's wave is running: no retry meanwhile
    assert fleet.chain.on_job_complete("check", now=NIGHT + timedelta(hours=23)) == []
    fleet.fail.clear()
    fleet.wave_done = True
    assert fleet.chain.on_job_complete("backup", now=NIGHT + timedelta(days=1)) == ["prune"]
    assert [f.key for f in fleet.fired] == ["p1@prune@2026-12-01", "p2@prune@2026-12-01"]
    assert fleet.chain.incomplete(now=NIGHT + timedelta(days=1)) == {}
