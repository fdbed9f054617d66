"""``sched alerts install`` on a real Prefect server, and the controller's alerts firing it.

The events are sent by the code that sends them in production: the
controller's fleet watch (:class:`controller.watch.FleetWatch`, over a real
controller app that nodes report to with their own tokens) and its central
scheduler's ``controller.central.emit_gave_up``. Each firing is read back from
the server: the automation's ``prefect.automation.triggered`` event with the
labels it fired for, and its action's ``prefect.automation.action.executed``
event. The controller's clock is the test's (its ``clock`` parameter), so a
node "goes silent" by the test moving the clock on; the events carry the
real time.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from controller.watch import FleetWatch
from sched_cli import app as sched
from tests.factories import Clock

pytestmark = pytest.mark.prefect


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


KINDS = {"silent": "a node went silent", "missed": "a window was missed",
         "failed": "a window failed", "resolved": "resolved",
         "gave up": "a central task gave up"}


@pytest.fixture(scope="module")
def alerts(prefect_server: str) -> Iterator[dict[str, str]]:
    """Install the alerts under a fresh prefix; yield {what: automation id}; delete them after."""
    from prefect.client.orchestration import get_client

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    result = install("--prefix", prefix)
    assert result.exit_code == 0, result.output
    done = json.loads(result.output)["automations"]
    assert [d["done"] for d in done] == ["created"] * 5
    ids = {key: next(d["id"] for d in done if d["name"] == f"{prefix}: {name}")
           for key, name in KINDS.items()}
    ids["prefix"] = prefix
    yield ids
    with get_client(sync_client=True) as client:
        for automation in client.read_automations():
            if automation.name.startswith(f"{prefix}: "):
                client.delete_automation(automation.id)


def test_install_creates_the_five_and_a_second_install_keeps_them(
    alerts: dict[str, str],
) -> None:
    from prefect.client.orchestration import get_client

    prefix = alerts["prefix"]
    again = install("--prefix", prefix)
    assert again.exit_code == 0, again.output
    kept = json.loads(again.output)["automations"]
    assert [(d["done"], d["id"]) for d in kept] == [("kept", alerts[k]) for k in KINDS]
    with get_client(sync_client=True) as client:
        mine = {a.name: a for a in client.read_automations() if a.name.startswith(prefix)}
    assert sorted(mine) == sorted(d["name"] for d in kept)
    silent = mine[f"{prefix}: a node went silent"]
    # Reactive, for every node: no node has to complete anything first to be watched.
    assert silent.trigger.posture == "Reactive"  # type: ignore[union-attr]
    assert silent.trigger.expect == {"sched.node.silent"}  # type: ignore[union-attr]
    assert silent.trigger.after == set()  # type: ignore[union-attr]
    assert [a.type for a in silent.actions] == ["do-nothing"]
    resolved = mine[f"{prefix}: resolved"]
    assert resolved.trigger.expect == {  # type: ignore[union-attr]
        "sched.node.recovered", "sched.node.window-recovered"}


def test_an_earlier_installs_alerts_are_replaced_and_a_bad_block_is_refused(
    prefect_server: str,
) -> None:
    from prefect.automations import AutomationCore
    from prefect.client.orchestration import get_client
    from prefect.events.actions import DoNothing
    from prefect.events.schemas.automations import EventTrigger

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    old = f"{prefix}: no completed wave job on a node for 26 h"
    with get_client(sync_client=True) as client:
        client.create_automation(AutomationCore(
            name=old, trigger=EventTrigger(expect={"sched.job.completed"}),
            actions=[DoNothing()]))
    first = install("--prefix", prefix)
    assert first.exit_code == 0, first.output
    done = {(d["done"], d["name"]) for d in json.loads(first.output)["automations"]}
    assert ("deleted", old) in done
    assert sum(1 for what, _ in done if what == "created") == 5

    refused = install("--prefix", prefix, "--block", "no-such-block")
    assert refused.exit_code == 1
    assert "--block 'no-such-block': no notification block of that name" in refused.output
    with get_client(sync_client=True) as client:
        mine = [a for a in client.read_automations() if a.name.startswith(f"{prefix}: ")]
        assert len(mine) == 5  # the refused install changed nothing
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
        assert len(mine) == 5
        for automation in mine:
            (action,) = automation.actions
            assert action.type == "send-notification"
            assert str(action.block_document_id) == str(block_id)  # type: ignore[union-attr]
            client.delete_automation(automation.id)


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


# -- the controller's alerts, from its fleet watch --------------------------------------------

T0 = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
ADMIN = {"Authorization": "Bearer alerts-admin-token"}


@contextmanager
def watched_controller(url: str, clock: Clock, nodes: list[str], prefect_api: str,
                       ) -> Iterator[tuple[httpx.Client, FleetWatch]]:
    """A real controller (its API over loopback) and its fleet watch sending to Prefect."""
    from controller.api import create_app
    from controller.auth import Tokens
    from controller.db import make_engine, migrate
    from controller.events import PrefectEvents
    from controller.fleet import FleetSettings
    from controller.testing import serve_in_thread

    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=["alerts-admin-token"], nodes={n: [f"{n}-token"] for n in nodes})
    settings = FleetSettings()
    app = create_app(engine, tokens, clock=clock, fleet_settings=settings)
    events = PrefectEvents(prefect_api)
    watch = FleetWatch(engine, settings, emit=events.send, clock=clock)
    try:
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield client, watch
    finally:
        events.close()
        engine.dispose()


def node_report(node: str, jobs: list[dict[str, Any]] | None = None,
                heartbeat: float = 10) -> dict[str, Any]:
    return {"node": node, "agent_version": "0.2.0", "timezone": "UTC", "grace_s": 60,
            "reported_at": "2026-12-04T10:00:00Z", "heartbeat_s": heartbeat, "jobs": jobs or []}


def every_5_min(rid: str) -> dict[str, Any]:
    return {"id": rid, "name": rid, "action": "backup", "schedule": {"interval_minutes": 5},
            "miss_policy": "skip", "enabled": True}


def payloads(automation_id: str, node: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Return the payloads of the controller events that fired the automation for node."""
    fired = fired_for(automation_id, "prefect.resource.id", f"sched.node.{node}",
                      timeout=timeout)
    return [e["payload"]["triggering_event"]["payload"] for e in fired]


def test_a_node_stopped_right_after_the_install_is_alerted_and_then_resolved(
    alerts: dict[str, str], prefect_server: str, tmp_path: Any,
) -> None:
    """The node has never completed anything: it pulls once, reports (10 s heartbeat), stops."""
    node = f"alert-{uuid.uuid4().hex[:6]}"
    clock = Clock(T0)
    with watched_controller(f"sqlite:///{tmp_path / 'c.db'}", clock, [node],
                            prefect_server) as (c, watch):
        mine = {"Authorization": f"Bearer {node}-token"}
        assert c.put(f"/api/nodes/{node}/schedules/bk", json=every_5_min("bk"),
                     headers=ADMIN).status_code == 200
        assert c.get("/api/schedules", params={"node": node}, headers=mine).status_code == 200
        assert c.post(f"/api/nodes/{node}/report", json=node_report(node),
                      headers=mine).status_code == 204
        clock.now = T0 + timedelta(seconds=30)
        assert watch.check() == []  # 3 heartbeats (30 s) not yet past
        clock.now = T0 + timedelta(seconds=31)
        (silent,) = watch.check()
        assert (silent.kind, silent.subject) == ("node-silent", "silent@2026-12-04T10:00:00Z")
        (said,) = payloads(alerts["silent"], node)
        assert said["reason"].startswith(f"node {node} is silent: no request of its own for "
                                         "31 s")
        assert said["last_seen_at"] == "2026-12-04T10:00:00Z" and said["heartbeat_s"] == 10
        assert watch.check() == []  # raised once
        # The 10:05 window passes its grace (60 s) and the report slack (60 s): missed.
        clock.now = T0 + timedelta(minutes=7)
        (missed,) = watch.check()
        assert (missed.kind, missed.subject) == ("window-missed", "bk@2026-12-04T10:05+00:00")
        (said,) = payloads(alerts["missed"], node)
        assert said["schedule_id"] == "bk" and said["window"] == "2026-12-04T10:05:00Z"
        assert said["reason"].startswith("bk window 2026-12-04 10:05 UTC: missed: no report "
                                         f"from the node (node {node} is silent")
        # The node is back and reports the 10:10 window done: both alerts are resolved.
        clock.now = T0 + timedelta(minutes=11)
        done = {"key": "bk@2026-12-04T10:10+00:00", "schedule_id": "bk",
                "window": "2026-12-04T10:10:00Z", "trigger_key": "schedule",
                "state": "Completed", "started_at": "2026-12-04T10:10:01Z",
                "ended_at": "2026-12-04T10:10:31Z", "seq": 1}
        assert c.post(f"/api/nodes/{node}/report", json=node_report(node, [done]),
                      headers=mine).status_code == 204
        back = {a.kind: a for a in watch.check()}
        assert set(back) == {"node-recovered", "window-recovered"}
        resolved = payloads(alerts["resolved"], node, timeout=60)
        deadline = time.monotonic() + 60
        while len(resolved) < 2 and time.monotonic() < deadline:
            resolved = payloads(alerts["resolved"], node, timeout=0)
            time.sleep(0.5)
        assert sorted(p["kind"] for p in resolved) == ["node-recovered", "window-recovered"]
        window_back = next(p for p in resolved if p["kind"] == "window-recovered")
        assert window_back["resolves"] == ["bk@2026-12-04T10:05+00:00"]
        assert watch.check() == []


def test_a_failed_window_of_a_node_that_never_completed_anything_fires(
    alerts: dict[str, str], prefect_server: str, tmp_path: Any,
) -> None:
    node, quiet = (f"alert-{uuid.uuid4().hex[:6]}" for _ in range(2))
    clock = Clock(T0 + timedelta(minutes=6))
    with watched_controller(f"sqlite:///{tmp_path / 'c.db'}", clock, [node, quiet],
                            prefect_server) as (c, watch):
        clock.now = T0
        for who in (node, quiet):
            c.put(f"/api/nodes/{who}/schedules/bk", json=every_5_min("bk"), headers=ADMIN)
        clock.now = T0 + timedelta(minutes=6)
        failed = {"key": "bk@2026-12-04T10:05+00:00", "schedule_id": "bk",
                  "window": "2026-12-04T10:05:00Z", "trigger_key": "schedule",
                  "state": "Failed", "started_at": "2026-12-04T10:05:00Z",
                  "ended_at": "2026-12-04T10:05:09Z", "error": "tar exited with code 2",
                  "offline": True, "seq": 3}
        assert c.post(f"/api/nodes/{node}/report", json=node_report(node, [failed], 600),
                      headers={"Authorization": f"Bearer {node}-token"}).status_code == 204
        # quiet never showed up: its 10:05 window is missed once its grace (the default
        # 300 s: it never reported its own) and the report slack (60 s) have passed, and it
        # is silent (never seen).
        clock.now = T0 + timedelta(minutes=11, seconds=30)
        raised = {(a.node, a.kind) for a in watch.check()}
        assert raised == {(node, "window-failed"), (quiet, "window-missed"),
                          (quiet, "node-silent")}
        (said,) = payloads(alerts["failed"], node)
        assert said["error"] == "tar exited with code 2" and said["state"] == "Failed"
        assert said["reason"] == ("bk window 2026-12-04 10:05 UTC: Failed: tar exited with "
                                  "code 2 (ran offline, recorded later)")
        (never,) = payloads(alerts["silent"], quiet)
        assert never["reason"] == (f"node {quiet} has never made a request to this "
                                   "controller with its own token")


def test_two_controller_instances_raise_and_send_each_alert_once(
    postgres_url: str, prefect_server: str,
) -> None:
    """Two fleet watches on one Postgres, passes at once: each alert is inserted and sent once."""
    import threading

    from controller.db import make_engine
    from controller.fleet import FleetSettings

    node = f"alert-{uuid.uuid4().hex[:6]}"
    clock = Clock(T0)
    sent: list[dict[str, Any]] = []
    lock = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        with lock:
            sent.append(event)

    with watched_controller(postgres_url, clock, [node], prefect_server) as (c, _watch):
        for rid in ("a", "b", "c"):
            c.put(f"/api/nodes/{node}/schedules/{rid}", json=every_5_min(rid), headers=ADMIN)
        clock.now = T0 + timedelta(minutes=22)
        engines = [make_engine(postgres_url) for _ in range(2)]
        watches = [FleetWatch(e, FleetSettings(), emit=emit, clock=clock) for e in engines]
        barrier = threading.Barrier(2)

        def one(watch: FleetWatch) -> None:
            barrier.wait()
            watch.check()

        threads = [threading.Thread(target=one, args=(w,)) for w in watches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for engine in engines:
            engine.dispose()
    # 3 rows, each its first missed window (10:05: past its grace, 300 s, and the report
    # slack, 60 s; 10:00 came with the write; 10:10 and 10:15 wait for it to resolve), and
    # the never-seen node.
    assert sum(w.raised for w in watches) == 4
    assert sum(w.sent for w in watches) == 4 == len(sent)
    assert len({e["id"] for e in sent}) == 4
