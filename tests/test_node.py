"""The node on a real Prefect server: it fires, and Prefect records.

Each test runs a real node (``sched_node.node.Node``, in this process) against the
session's Prefect server, its clock shifted so that a window comes a few real
seconds after the start (tests/nodekit.py). Commands are real processes; the
record is read back through Prefect's REST API as the UI would.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from sched_node.identity import job_run_name
from sched_node.prefect_api import new_state
from tests.nodekit import NodeUnderTest, Prefect, chain_row, final, offset_to, row, wait_runs
from tests.procs import wait_for

NODE_ZONE = ZoneInfo("America/New_York")  # tests/nodekit.py's agent.toml

pytestmark = [pytest.mark.prefect]




def _name() -> str:
    return f"n-{uuid.uuid4().hex[:8]}"


def _upcoming(prefect: Prefect, node: str) -> list[dict[str, Any]]:
    return [item for item in prefect.node_runs(node)
            if item["state"]["type"] == "SCHEDULED" and "trigger:schedule" in item["tags"]]


def _one_window(node: NodeUnderTest, prefect: Prefect, action: str, sid: str, *,
                planned: int = 0) -> tuple[dict[str, Any], datetime]:
    """Start the node, wait for the run of sid's next minute window to end (and for planned
    coming windows to be in Prefect, on a loaded machine too); return it."""
    window = (node.clock() + timedelta(seconds=10)).replace(second=0, microsecond=0)
    name = job_run_name(action, sid, window)
    node.start()
    try:
        runs = wait_runs(prefect, node.name, [name], timeout=60)
        wait_for(f"{planned} planned runs", lambda: len(_upcoming(prefect, node.name)) >= planned,
                 60)
    finally:
        node.stop()
    return runs[name], window


def test_a_window_starts_at_its_instant_never_before_and_prefect_records_it(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    offset = offset_to(4)
    node = NodeUnderTest(tmp_path, prefect_server, name=_name(), rows=[row("s-1")], offset=offset)
    run, window = _one_window(node, prefect, "echo", "s-1", planned=3)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert f"ran on {node.name} from " in run["state"]["message"]
    logs = prefect.logs(run["id"])
    started = next(line for line in logs if line.startswith("started s-1 at "))
    real_start = float(started.rsplit(" ", 1)[1])
    real_window = (window - offset).timestamp()
    assert real_start >= real_window, "the command started before its window"
    assert real_start - real_window < 1.0, f"started {real_start - real_window:.3f} s late"
    assert "done s-1" in logs
    assert any(line.startswith("start guard: window ") and "on time" in line for line in logs)
    kinds = [state["type"] for state in prefect.states(run["id"])]
    assert kinds[-2:] == ["RUNNING", "COMPLETED"], kinds
    # The start's own minute fires too (first seen in it): two runs, one event each.
    events = [event for event in prefect.events("sched.job.completed", node.name, at_least=2)
              if event["payload"]["flow_run_id"] == run["id"]]
    assert len(events) == 1
    assert events[0]["payload"]["state"] == "Completed"
    assert events[0]["occurred"] == run["state"]["message"].rsplit(" to ", 1)[1].rstrip(")")
    artifacts = prefect.artifacts(run["id"])
    assert len(artifacts) == 1 and "exit code" in artifacts[0]["data"]
    assert run["parameters"] == {"schedule_id": "s-1"}, "a schedule, never a time"
    assert run["work_queue_name"] == "planned", "planned in the pool's paused queue"
    (task,) = prefect.task_runs(run["id"])
    assert [state["type"] for state in task["states"]] == ["RUNNING", "COMPLETED"]
    upcoming = _upcoming(prefect, node.name)
    assert len(upcoming) >= 3, "the coming windows are planned as Scheduled runs"
    assert all(item["expected_start_time"] > run["expected_start_time"] for item in upcoming)


def test_a_failing_command_is_tried_again_and_ends_failed_with_its_error(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=_name(), rows=[row("f-1", "fail")],
                    offset=offset_to(3))
    run, _ = _one_window(node, prefect, "fail", "f-1")
    assert run["state"]["type"] == "FAILED"
    # Why, in the command's own words: the last lines it wrote.
    assert run["state"]["message"].startswith("sh exited with code 2: failing f-1 (after 2 "
                                              "tries)")
    assert prefect.logs(run["id"]).count("failing f-1") == 2
    # The row's retry is Prefect's: the flow run goes AwaitingRetry, then Retrying, and
    # counts two runs; each try is a task run of its own that failed.
    names = [state["name"] for state in prefect.states(run["id"])]
    assert names[-4:] == ["Running", "AwaitingRetry", "Retrying", "Failed"], names
    assert run["run_count"] == 2 and run["empirical_policy"]["retries"] == 1
    tasks = prefect.task_runs(run["id"])
    assert [[state["name"] for state in task["states"]] for task in tasks] == [
        ["Running", "Failed"], ["Running", "Failed"]]
    (event,) = [item for item in prefect.events("sched.job.failed", node.name, at_least=2)
                if item["payload"]["flow_run_id"] == run["id"]]
    assert event["payload"]["error"] == "sh exited with code 2: failing f-1"


def test_a_job_gets_its_declared_env_and_never_the_agents_credentials(
    tmp_path: Path, prefect_server: str, prefect: Prefect, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCHED_TOKEN", "node-secret-token")
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:hunter2")
    node = NodeUnderTest(tmp_path, prefect_server, name=_name(), rows=[row("e-1", "env")],
                    offset=offset_to(3))
    run, _ = _one_window(node, prefect, "env", "e-1")
    logs = prefect.logs(run["id"])
    assert "DECLARED=yes" in logs and "TZ=UTC" in logs
    printed = "\n".join(logs)
    assert "node-secret-token" not in printed and "hunter2" not in printed
    assert "PREFECT_API_URL" not in printed and "SCHED_" not in printed


def test_the_chain_prunes_then_checks_after_a_wave_and_not_after_a_failed_one(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    good = NodeUnderTest(tmp_path / "good", prefect_server, name=_name(),
                    rows=[row("w-1"), chain_row("p-1", "prune"), chain_row("c-1", "check")],
                    offset=offset_to(3))
    bad = NodeUnderTest(tmp_path / "bad", prefect_server, name=_name(), wave='["fail"]',
                   rows=[row("w-2", "fail"), chain_row("p-2", "prune"),
                         chain_row("c-2", "check")], offset=offset_to(3))
    good.start()
    bad.start()
    try:
        day = good.clock().astimezone(NODE_ZONE).date()  # the chain's day is the node's
        wait_for("prune and check on the good node", lambda: {
            run["name"].split("-", 1)[0] for run in prefect.node_runs(good.name)
            if final(run) and any(tag.startswith("trigger:chain-") for tag in run["tags"])}
            == {"prune", "check"}, 90, every=0.5)
        window = (bad.clock() + timedelta(seconds=5)).replace(second=0, microsecond=0)
        failed = wait_runs(prefect, bad.name, [job_run_name("fail", "w-2", window)],
                           timeout=60)
        # The node's day when the chain ran: the day it started, or the next when the test
        # crossed the node zone's midnight (05:00 UTC in winter) while it ran.
        days = {day.isoformat(), good.clock().astimezone(NODE_ZONE).date().isoformat()}
    finally:
        good.stop()
        bad.stop()
    chain = [run for run in prefect.node_runs(good.name)
             if any(tag.startswith("trigger:chain-") for tag in run["tags"])]
    by_stage = {run["name"].split("-", 1)[0]: run for run in chain}
    assert by_stage["prune"]["state"]["type"] == "COMPLETED"
    assert by_stage["check"]["state"]["type"] == "COMPLETED"
    assert by_stage["prune"]["idempotency_key"] in {f"{good.name}:p-1@prune@{d}" for d in days}
    assert by_stage["check"]["start_time"] >= by_stage["prune"]["end_time"]
    # The day's chain is one run of chain/<node>: a task run per stage, each stage's job a
    # child run under it.
    (day_run,) = [run for run in prefect.node_runs(good.name) if "trigger:chain" in run["tags"]]
    assert day_run["name"] in {f"chain-{good.name}-{d}" for d in days}
    wait_for("the chain run's end", lambda: final(prefect.api.read_run(day_run["id"])), 30)
    day_run = prefect.api.read_run(day_run["id"]) or {}
    assert day_run["state"]["type"] == "COMPLETED", day_run["state"]
    assert day_run["deployment_id"] == (prefect.deployment("chain", good.name) or {})["id"]
    stages = {task["name"]: task for task in prefect.task_runs(day_run["id"])}
    assert set(stages) == {"prune", "check"}
    assert all(task["state_type"] == "COMPLETED" for task in stages.values())
    assert by_stage["prune"]["parent_task_run_id"] == stages["prune"]["id"]
    assert by_stage["check"]["parent_task_run_id"] == stages["check"]["id"]
    assert not [run for run in prefect.node_runs(bad.name)
                if any(tag.startswith("trigger:chain") for tag in run["tags"])]
    (only,) = failed.values()
    assert any("stage prune not fired" in line for line in prefect.logs(only["id"]))


def test_an_ad_hoc_run_starts_within_seconds_and_a_cancel_stops_its_command(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=_name(),
                    rows=[row("q-1", every=None, minute="7", hours=["3"]),
                          row("slow", every=None, minute="7", hours=["3"], sleep=300)])
    node.start()
    try:
        wait_for("the node's deployments", lambda: prefect.deployment(
            "run-job", node.name) is not None, 30)
        assert node.node is not None
        wait_for("the node's event stream", lambda: bool(
            node.node and node.node.channel.stream
            and node.node.channel.stream.connected.is_set()), 30)
        asked = time.monotonic()
        quick = prefect.create_run("run-job", node.name, {"schedule_id": "q-1"})
        wait_for("the ad hoc run's end", lambda: final(prefect.api.read_run(quick)), 30)
        took = time.monotonic() - asked
        slow = prefect.create_run("run-job", node.name, {"schedule_id": "slow"})
        wait_for("the slow run Running", lambda: (prefect.api.read_run(slow) or {}).get(
            "state", {}).get("type") == "RUNNING", 30)
        pid = _command_pid(node.state)
        cancel = time.monotonic()
        prefect.api.set_state(slow, new_state("CANCELLING", message="stop it"), force=False)
        wait_for("the slow run Cancelled", lambda: (prefect.api.read_run(slow) or {}).get(
            "state", {}).get("type") == "CANCELLED", 30)
        stopped = time.monotonic() - cancel
    finally:
        node.stop()
    assert took < 15, f"the ad hoc run took {took:.1f} s"
    run = prefect.api.read_run(quick)
    assert run is not None and run["state"]["type"] == "COMPLETED"
    assert run["name"].startswith("echo-q-1-") and "trigger:manual" in run["tags"]
    assert stopped < 15, f"the cancel took {stopped:.1f} s"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert (prefect.api.read_run(slow) or {})["state"]["message"].startswith("cancelled")


def _command_pid(state: Path) -> int:
    import json

    for started in sorted(state.glob("outbox/*/a1.started")):
        data = json.loads(started.read_text())
        try:
            os.kill(int(data["pid"]), 0)
        except ProcessLookupError:
            continue
        return int(data["pid"])
    raise AssertionError("no running command found in the outbox")


def test_a_reconcile_run_from_prefect_reconciles_and_is_recorded_into_that_run(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=_name(),
                    rows=[row("r-1", every=None, minute="7", hours=["3"])])
    node.start()
    try:
        wait_for("the node's event stream", lambda: bool(
            node.node and node.node.channel.stream
            and node.node.channel.stream.connected.is_set()), 30)
        node.write_rows([row("r-1", every=None, minute="7", hours=["3"]),
                         row("r-2", every=None, minute="9", hours=["3"])])
        run_id = prefect.create_run("reconcile", node.name, {})
        wait_for("the reconcile run's end", lambda: final(prefect.api.read_run(run_id)), 30)
    finally:
        node.stop()
    run = prefect.api.read_run(run_id)
    assert run is not None and run["state"]["type"] == "COMPLETED", run
    (artifact,) = prefect.artifacts(run_id)
    # The pull file's watch (every 2 s) may have pulled r-2 just before: either way the
    # run asked for reconciled, and its plan holds r-2.
    # (A pull file's change found in the same moment shares the reconcile: "why: a, b".)
    why = next(line for line in artifact["data"].splitlines() if line.startswith("why: "))
    assert "on demand" in why.removeprefix("why: ").split(", "), why
    assert "| `r-2` | test r-2 |" in artifact["data"]
    added = [event["payload"]["added_ids"]
             for event in prefect.events("sched.schedules.changed", node.name, at_least=2)]
    assert sorted(added) == [["r-1"], ["r-2"]], "the start's pull, then the one asked for"
