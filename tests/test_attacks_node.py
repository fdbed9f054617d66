"""The node, attacked as anyone with the Prefect API could: its clock, its chain, its pulls.

1. The clock: a run created with a ``now`` (or a ``window``) parameter used to
   replace the node's clock in the start guard; the guard still takes a ``now``
   (the mechanism is live), but nothing a caller of the Prefect API sends reaches
   it: an ad hoc run is an ad hoc job, decided at the node's own clock, and no
   window is stamped, early or late.
2. The chain: a forged ``sched.job.completed`` event used to fire the day's prune
   through ``advance-chain``; the server still takes such an event, but the chain
   runs on the node from its own jobs only: nothing fires.
3. A flood of ``sched.schedules.updated``: each event used to queue one
   reconcile run; the node folds a burst into a pull or two (at most one a second
   while it lasts) and records no reconcile run for a list that did not change.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from sched_core.guard import decide_start
from sched_core.model import LocalSchedule
from sched_core.view import NodeView
from sched_node.reconcile import ANNOUNCED_GAP_S
from sched_node.records import job_event
from tests.nodekit import NodeUnderTest, Prefect, chain_row, final, row
from tests.procs import wait_for

pytestmark = [pytest.mark.prefect]




def _cache(node: NodeUnderTest) -> dict[str, object]:
    data: dict[str, object] = json.loads((node.state / "cache.json").read_text())
    return data


def test_a_runs_parameters_never_move_the_nodes_clock(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    nightly = row("s-1", every=None, hours=["2"], minute="30")
    # The mechanism is live: a guard handed the attacker's now runs 02:30 six minutes early.
    window = datetime(2026, 12, 4, 7, 30, tzinfo=UTC)
    forged = window + timedelta(seconds=1)
    parsed = LocalSchedule.model_validate(nightly)
    view = NodeView(rows=[parsed], last_fired={}, first_seen={},
                    tz=ZoneInfo("America/New_York"), node="", grace=timedelta(minutes=5))
    early = decide_start(parsed, view, schedule_id="s-1", window=window, first_try=forged,
                         now=forged)
    assert early.runs, "a forged now makes the guard run the window"
    node = NodeUnderTest(tmp_path, prefect_server, name=f"clk-{uuid.uuid4().hex[:6]}",
                         rows=[nightly])
    started = node.start()
    try:
        wait_for("the node's deployments", lambda: prefect.deployment(
            "run-job", node.name) is not None, 30)
        wait_for("the node's event stream", lambda: bool(
            started.channel.stream and started.channel.stream.connected.is_set()), 30)
        before = _cache(node)
        forged_parameters = {
            "schedule_id": "s-1", "trigger_key": "schedule", "window": window.isoformat(),
            "now": forged.isoformat(), "key": "s-1@2026-12-04T02:30-05:00"}
        # The flow's schema names schedule_id only, and anyone with the API may skip it.
        run = {"id": prefect.create_run("run-job", node.name, forged_parameters,
                                        enforce_parameter_schema=False)}
        wait_for("the forged run's end", lambda: final(prefect.api.read_run(str(run["id"]))), 30)
        after = _cache(node)
    finally:
        node.stop()
    done = prefect.api.read_run(str(run["id"]))
    assert done is not None and done["state"]["type"] == "COMPLETED"
    assert "trigger:manual" in done["tags"] and "trigger:schedule" not in done["tags"]
    assert done["parameters"]["key"] == "s-1@2026-12-04T02:30-05:00", "its own, untouched"
    # The node ran the cached row now, as an ad hoc job: no window was stamped, and the
    # times the guard reads (last fired, first seen) are as they were.
    assert after["last_fired_at"] == before["last_fired_at"] == {}
    assert after["first_seen_at"] == before["first_seen_at"]
    (job,) = [item for item in json.loads((node.state / "history.json").read_text())["ended"]
              if item["schedule_id"] == "s-1"]
    assert job["window"] is None and job["key"] == f"s-1@manual@{run['id']}"
    assert job["trigger_key"] == "manual"


def test_a_forged_job_event_fires_no_chain_stage(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=f"chn-{uuid.uuid4().hex[:6]}",
                         rows=[row("w-1", every=None, hours=["3"], minute="7"),
                               chain_row("p-1", "prune"), chain_row("c-1", "check")])
    node.start()
    try:
        wait_for("the node's deployments", lambda: prefect.deployment(
            "run-job", node.name) is not None, 30)
        forged = {"node": node.name, "action": "echo", "schedule_id": "w-1",
                  "flow_run_id": str(uuid.uuid4()), "flow_run_name": "echo-w-1",
                  "state": "Completed", "trigger_key": "schedule", "window": ""}
        prefect.api.emit_events([job_event(node.name, forged, completed=True,
                                           occurred=datetime.now(UTC))])
        # The server took it (it is live) ...
        assert prefect.events("sched.job.completed", node.name), "the forged event is stored"
        time.sleep(5)
    finally:
        node.stop()
    # ... and nothing fired: no stage job, no marker.
    chain = [run for run in prefect.node_runs(node.name)
             if any(tag.startswith("trigger:chain-") for tag in run["tags"])]
    assert chain == []
    assert not (node.state / "chain.json").exists() or json.loads(
        (node.state / "chain.json").read_text()).get("stages", {}) == {}


def test_a_flood_of_change_events_is_a_pull_or_two_and_no_reconcile_run(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=f"fld-{uuid.uuid4().hex[:6]}",
                         rows=[row("s-1", every=None, hours=["3"], minute="7")])
    started = node.start()
    try:
        wait_for("the node's event stream", lambda: bool(
            started.channel.stream and started.channel.stream.connected.is_set()), 30)
        wait_for("the start's reconcile recorded", lambda: any(
            run["name"].startswith("reconcile-") and final(run)
            for run in prefect.runs(tags={"all_": [f"node:{node.name}"]})), 30)
        pulls = started.reconciler.runs
        stream = started.channel.stream
        before = stream.events
        events = [{"id": str(uuid.uuid4()), "occurred": datetime.now(UTC).isoformat(),
                   "event": "sched.schedules.updated",
                   "resource": {"prefect.resource.id": f"sched.agent.{node.name}",
                                "prefect.resource.name": node.name},
                   "payload": {"node": node.name, "schedule_id": "s-1", "version": n,
                               "op": "put"}} for n in range(200)]
        prefect.api.emit_events(events)
        # How long the burst took to reach the node: a fraction of a second on an idle
        # machine, seconds on a loaded one; the node starts at most one reconcile a gap.
        wait_for("the burst's first event at the node", lambda: stream.events > before, 30)
        first = time.monotonic()
        wait_for("all 200 events at the node", lambda: stream.events >= before + 200, 60)
        span = time.monotonic() - first
        time.sleep(2 * ANNOUNCED_GAP_S + 1)  # the burst's last reconcile, begun and ended
        flood = started.reconciler.runs - pulls
    finally:
        node.stop()
    bound = 2 + span / ANNOUNCED_GAP_S
    assert 1 <= flood <= bound, f"200 events in {span:.1f} s gave {flood} reconciles"
    recorded = [run for run in prefect.runs(tags={"all_": [f"node:{node.name}"]})
                if run["name"].startswith("reconcile-")]
    assert len(recorded) == 1, "the list did not change: no reconcile run is recorded for it"
