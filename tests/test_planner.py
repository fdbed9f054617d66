"""The node's planned runs on a real Prefect server: created ahead, deleted when their row's
policies now skip the window or the row lost it, moved when the row's jitter changed.

The planner (``sched_node.planner``) over the pure rule :func:`sched_core.plan.planned_fate`.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from prefect.client.schemas.filters import FlowRunFilter

from sched_core.firing import NodeView
from sched_core.model import LocalSchedule
from sched_core.values import parse_api_time
from sched_node.identity import AGENT_TAG
from sched_node.planner import Planner
from sched_node.prefect_api import PrefectApi
from sched_node.registration import RUN_JOB, Deployments

UTC_ZONE = ZoneInfo("UTC")
DAY_ISH = timedelta(hours=23)


def _row(**extra: Any) -> LocalSchedule:
    hour = (datetime.now(UTC).hour + 6) % 24  # tomorrow's and the day after's window
    return LocalSchedule.model_validate({
        "id": "nightly", "name": "nightly", "repo_id": "r-1", "action": "echo",
        "schedule": {"days": ["*"], "hours": [str(hour)], "minute": "30"},
        "miss_policy": "skip", "enabled": True, "version": 1, **extra})


def _scheduled(api: PrefectApi, deployment: str) -> dict[str, datetime]:
    """Return the deployment's Scheduled runs: name to expected start."""
    runs = api.filter_runs(FlowRunFilter.model_validate({
        "deployment_id": {"any_": [deployment]}, "state": {"type": {"any_": ["SCHEDULED"]}}}))
    found = {run["name"]: parse_api_time(run["expected_start_time"]) for run in runs}
    return {name: at for name, at in found.items() if at is not None}


def test_the_planner_moves_a_rejittered_run_and_deletes_the_runs_a_new_pause_skips(
    tmp_path: Path, prefect_server: str,
) -> None:
    api = PrefectApi(prefect_server)
    node = f"plan-{uuid.uuid4().hex[:8]}"
    deployments = Deployments(api, node, tags=[AGENT_TAG])
    now = datetime.now(UTC)
    planner = Planner(api, deployments, tmp_path / "plan.json", horizon=timedelta(hours=1),
                      min_windows=2, max_runs=100, now=now)

    def view(row: LocalSchedule) -> NodeView:
        return NodeView(rows=[row], last_fired={}, first_seen={}, tz=UTC_ZONE, node=node,
                        grace=timedelta(minutes=5))

    try:
        first = planner.plan(view(_row()), now=now)
        deployment = deployments.get()[RUN_JOB]
        planned = _scheduled(api, deployment)
        assert len(first.created) == 2 and len(planned) == 2, (first, planned)
        assert all(at.minute == 30 and at.second == 0 for at in planned.values())

        # A jitter: the same runs (same names, same windows), their starts moved: each is
        # made again at its new start (Prefect keeps a run's expected start otherwise).
        jittered = planner.plan(view(_row(jitter=600)), now=now)
        assert not jittered.deleted and len(jittered.moved) == 2
        assert sorted(name for name, _ in jittered.created) == sorted(planned)
        moved = _scheduled(api, deployment)
        assert set(moved) == set(planned)
        shifts = {moved[name] - planned[name] for name in planned}
        assert len(shifts) == 1
        shifts_seen = shifts.pop()
        assert timedelta(0) < shifts_seen < timedelta(seconds=600)

        # A pause until after the first window: that run goes, saying why; the other stays.
        first_window = min(planned.values())
        until = (first_window + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        paused = planner.plan(view(_row(jitter=600, paused={"note": "disk swap",
                                                             "until": until})), now=now)
        assert [why for _, why in paused.deleted] == [
            f"schedule nightly skips this window: paused: disk swap (until "
            f"{(first_window + timedelta(hours=1)):%Y-%m-%d %H:%M} UTC)"]
        # The paused window's run is gone; the plan keeps two windows ahead (min_windows).
        after_pause = _scheduled(api, deployment)
        assert first_window not in {at - shifts_seen for at in after_pause.values()}
        assert len(after_pause) == 2 and min(after_pause.values()) > first_window + DAY_ISH

        # The row gone: its runs go too.
        gone = planner.plan(NodeView(rows=[], last_fired={}, first_seen={}, tz=UTC_ZONE,
                                     node=node, grace=timedelta(minutes=5)), now=now)
        assert [why for _, why in gone.deleted] == [
            "schedule nightly was removed from this node's list"] * 2
        assert _scheduled(api, deployment) == {}
    finally:
        api.close()
