"""``sched alerts install`` on a real Prefect server: the automations exist, and they fire.

The windows are short (10 s, Prefect's least for a proactive trigger) so the
proactive alerts fire within the test. The events are sent by the code that
sends them in production: the node's recorder (``flows.recorder.job_event``), the
controller's ``controller.central.emit_gave_up``, and Prefect's own server for
a ``reconcile`` flow run that completes (a real deployment and flow run whose
states are set through the API). Each firing is read back from the server: the
automation's ``prefect.automation.triggered`` event with the labels it fired
for, and its action's ``prefect.automation.action.executed`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from typer.testing import CliRunner

from sched_cli import app as sched


def emit_job_event(node: str, payload: dict[str, Any], *, completed: bool) -> None:
    """Send a job's event as the node's recorder sends it (its format, through the REST API)."""
    from flows.prefect_api import PrefectApi, api_settings
    from flows.records import job_event

    api = PrefectApi(api_settings())
    try:
        api.emit_events([job_event(node, payload, completed=completed,
                                   occurred=datetime.now(UTC))])
    finally:
        api.close()

pytestmark = pytest.mark.prefect

WITHIN = 10  # seconds: Prefect's minimum for a proactive trigger


def install(*args: str) -> Any:
    result = CliRunner().invoke(sched, ["alerts", "install", "--json", *args])
    return result


def events(name: str, resource: str, done: Callable[[list[dict[str, Any]]], bool],
           timeout: float = 60) -> list[dict[str, Any]]:
    """Return the events called name about resource once done(events) holds (or timeout s)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            found: list[dict[str, Any]] = client.request("POST", "/events/filter", json={
                "filter": {"event": {"name": [name]}, "resource": {"id": [resource]},
                           "any_resource": None},
                "limit": 50,
            }).json()["events"]
            if done(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def fired_for(automation_id: str, label: str, value: str,
              timeout: float = 60) -> list[dict[str, Any]]:
    """Return the automation's triggered events whose triggering label is value (waiting)."""
    def mine(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in found
                if (e["payload"].get("triggering_labels") or {}).get(label) == value]

    return mine(events("prefect.automation.triggered", f"prefect.automation.{automation_id}",
                       lambda found: bool(mine(found)), timeout))


def executed(automation_id: str, triggered: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the automation's action.executed events that follow triggered (waiting)."""
    def mine(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in found if any(
            r["prefect.resource.id"] == f"prefect.event.{triggered['id']}" for r in e["related"])]

    return mine(events("prefect.automation.action.executed",
                       f"prefect.automation.{automation_id}", lambda found: bool(mine(found))))


@pytest.fixture(scope="module")
def alerts(prefect_server: str) -> Iterator[dict[str, str]]:
    """Install the alerts with 10 s windows; yield {what: automation id}; delete them after."""
    from prefect.client.orchestration import get_client

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    result = install("--prefix", prefix, "--wave-within", str(WITHIN),
                     "--reconcile-within", str(WITHIN))
    assert result.exit_code == 0, result.output
    done = json.loads(result.output)["automations"]
    assert [d["done"] for d in done] == ["created"] * 4
    ids = {}
    for item in done:
        for key in ("wave", "failed", "reconcile", "gave up"):
            if key in item["name"]:
                ids[key] = item["id"]
    assert len(ids) == 4, done
    ids["prefix"] = prefix
    yield ids
    with get_client(sync_client=True) as client:
        for automation in client.read_automations():
            if automation.name.startswith(f"{prefix}: "):
                client.delete_automation(automation.id)


def test_install_creates_the_four_and_a_second_install_keeps_them(
    alerts: dict[str, str],
) -> None:
    from prefect.client.orchestration import get_client

    prefix = alerts["prefix"]
    again = install("--prefix", prefix, "--wave-within", str(WITHIN),
                    "--reconcile-within", str(WITHIN))
    assert again.exit_code == 0, again.output
    kept = json.loads(again.output)["automations"]
    assert [(d["done"], d["id"]) for d in kept] == [
        ("kept", alerts[k]) for k in ("wave", "failed", "reconcile", "gave up")]
    with get_client(sync_client=True) as client:
        mine = {a.name: a for a in client.read_automations() if a.name.startswith(prefix)}
    assert sorted(mine) == sorted(d["name"] for d in kept)
    wave = mine[next(n for n in mine if "wave" in n)]
    assert wave.trigger.posture == "Proactive"  # type: ignore[union-attr]
    assert wave.trigger.within.total_seconds() == WITHIN  # type: ignore[union-attr]
    assert wave.trigger.for_each == {"prefect.resource.id"}  # type: ignore[union-attr]
    assert [a.type for a in wave.actions] == ["do-nothing"]


def test_a_changed_window_replaces_the_alert_and_a_bad_block_is_refused(
    prefect_server: str,
) -> None:
    from prefect.client.orchestration import get_client

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    first = install("--prefix", prefix)
    assert first.exit_code == 0, first.output
    assert "26 h" in first.output and "30 min" in first.output
    second = install("--prefix", prefix, "--wave-within", str(25 * 3600))
    assert second.exit_code == 0, second.output
    done = {(d["done"], d["name"]) for d in json.loads(second.output)["automations"]}
    assert ("deleted", f"{prefix}: no completed wave job on a node for 26 h") in done
    assert ("created", f"{prefix}: no completed wave job on a node for 25 h") in done
    assert sum(1 for what, _ in done if what == "kept") == 3

    refused = install("--prefix", prefix, "--block", "no-such-block")
    assert refused.exit_code == 1
    assert "--block 'no-such-block': no notification block of that name" in refused.output
    too_short = install("--prefix", prefix, "--wave-within", "5")
    assert too_short.exit_code == 2
    with get_client(sync_client=True) as client:
        mine = [a for a in client.read_automations() if a.name.startswith(f"{prefix}: ")]
        assert len(mine) == 4  # the refused installs changed nothing
        for automation in mine:
            client.delete_automation(automation.id)


def test_a_notification_block_becomes_each_alerts_action(prefect_server: str) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    block = f"fleet-hook-{uuid.uuid4().hex[:6]}"
    block_id = CustomWebhookNotificationBlock(
        name="hook", url="http://127.0.0.1:9/hook", json_data={"text": "{{body}}"},
    ).save(block, overwrite=True)
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    result = install("--prefix", prefix, "--block", block)
    assert result.exit_code == 0, result.output
    with get_client(sync_client=True) as client:
        mine = [a for a in client.read_automations() if a.name.startswith(f"{prefix}: ")]
        assert len(mine) == 4
        for automation in mine:
            (action,) = automation.actions
            assert action.type == "send-notification"
            assert str(action.block_document_id) == str(block_id)  # type: ignore[union-attr]
            client.delete_automation(automation.id)


def test_a_node_without_a_completed_wave_job_in_the_window_fires_for_that_node_only(
    alerts: dict[str, str],
) -> None:
    node, quiet, other = (f"alert-{uuid.uuid4().hex[:6]}" for _ in range(3))
    for who in (node, quiet):
        emit_job_event(who, {"node": who, "action": "backup", "schedule_id": "s-1",
                             "window": "2026-12-03T02:30:00Z", "flow_run_id": str(uuid.uuid4()),
                             "flow_run_name": "backup", "state": "Completed"}, completed=True)
    # other only completes a job of an action outside the wave: no bucket is opened for it.
    emit_job_event(other, {"node": other, "action": "prune", "schedule_id": "s-9", "window": "",
                           "flow_run_id": str(uuid.uuid4()), "flow_run_name": "prune",
                           "state": "Completed"}, completed=True)
    # quiet keeps completing backups: its bucket never runs out.
    stop = time.monotonic() + WITHIN * 2.5
    while time.monotonic() < stop:
        time.sleep(2)
        emit_job_event(quiet, {"node": quiet, "action": "copy", "schedule_id": "s-2",
                               "window": "", "flow_run_id": str(uuid.uuid4()),
                               "flow_run_name": "copy", "state": "Completed"}, completed=True)
        if fired_for(alerts["wave"], "prefect.resource.id", f"sched.agent.{node}", timeout=0):
            break
    fired = fired_for(alerts["wave"], "prefect.resource.id", f"sched.agent.{node}")
    assert len(fired) == 1, "the node's silence fires the proactive alert once"
    assert fired[0]["resource"]["prefect.resource.name"].endswith("no completed wave job "
                                                                   "on a node for 10 s")
    assert executed(alerts["wave"], fired[0]), "its action ran"
    for silent in (quiet, other):
        assert fired_for(alerts["wave"], "prefect.resource.id", f"sched.agent.{silent}",
                         timeout=0) == []


def test_a_failed_job_fires_at_once(alerts: dict[str, str]) -> None:
    node = f"alert-{uuid.uuid4().hex[:6]}"
    run_id = str(uuid.uuid4())
    emit_job_event(node, {"node": node, "action": "backup", "schedule_id": "s-1",
                          "window": "2026-12-03T02:30:00Z", "flow_run_id": run_id,
                          "flow_run_name": "backup", "state": "Crashed"}, completed=False)
    fired = fired_for(alerts["failed"], "prefect.resource.id", f"sched.agent.{node}",
                      timeout=30)
    assert len(fired) == 1
    assert executed(alerts["failed"], fired[0])


def test_a_central_task_that_gave_up_fires(alerts: dict[str, str]) -> None:
    from controller.central import emit_gave_up
    from controller.claims import Claim

    name = f"task-{uuid.uuid4().hex[:6]}"
    at = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)
    claim = Claim(task_id=1, name=name, scheduled_at=at, worker_id="w-1", locked_until=at,
                  event=None, deployment="backup/node-a", cron="0 7 * * *")
    emit_gave_up(claim, "Prefect at http://127.0.0.1:9/api did not answer", attempts=5)
    fired = fired_for(alerts["gave up"], "prefect.resource.id", f"sched.task.{name}",
                      timeout=30)
    assert len(fired) == 1
    assert executed(alerts["gave up"], fired[0])


def test_a_node_whose_reconcile_stops_completing_fires_for_that_node(
    alerts: dict[str, str],
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Running

    node = f"alert-{uuid.uuid4().hex[:6]}"
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("reconcile")
        deployment_id = client.create_deployment(flow_id=flow_id, name=node)
        run = client.create_flow_run_from_deployment(deployment_id)
        client.set_flow_run_state(run.id, Running(), force=True)
        client.set_flow_run_state(run.id, Completed(), force=True)
    fired = fired_for(alerts["reconcile"], "related:deployment:prefect.resource.name", node,
                      timeout=WITHIN * 6)
    assert len(fired) == 1, "no Completed reconcile for 10 s fires for that node's deployment"
    assert executed(alerts["reconcile"], fired[0])
