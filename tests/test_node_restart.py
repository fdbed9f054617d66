"""A node's restart on a real Prefect server: what it sends when nothing changed, and when
something did (tests/nodekit.py's node, in this process, started twice on one folder).

The restart neither registers its deployments again (a flow upsert and a deployment upsert
each), nor reads them, nor records a ``reconcile`` run when its list and plan are as before;
its first periodic reconcile reads them back once. It registers again when the registration
changed (a new agent, at the start), and when that read finds a deployment deleted or
changed on the server, or its plan finds the deployment gone. Every request the node sends
is seen through its own client (Prefect's: its one CSRF-token look per process left out).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect import flow

from sched_node import registration
from sched_node.registration import FLOWS, RECONCILE, RUN_JOB, Deployments, _wrong
from tests.nodekit import NodeUnderTest, Prefect, row
from tests.procs import wait_for

pytestmark = [pytest.mark.prefect]

UPSERTS = {("POST", "/api/flows/"), ("POST", "/api/deployments/")}


def _rows() -> list[dict[str, Any]]:
    # Daily at 03:00 in the node's zone: planned ahead, never fired while the test runs.
    return [row("r-1", every=None, minute="0", hours=["3"])]


def _start_once(folder: Path, url: str, name: str, *, periodic: int = 0,
                ) -> tuple[NodeUnderTest, list[tuple[str, str]]]:
    """Start a node on folder until its start's reconcile ended, then run that many periodic
    reconciles, stop it (its recorder drains); return it and the (method, path) of every
    request it sent to Prefect, with a ``("--", "periodic")`` before each periodic one."""
    node = NodeUnderTest(folder, url, name=name, rows=_rows())
    built = node.build()
    sent: list[tuple[str, str]] = []

    def seen(request: httpx.Request) -> None:
        if not request.url.path.endswith("/csrf-token"):  # Prefect's client, once a process
            sent.append((request.method, request.url.path))

    built.api.watch(seen)
    node.start()
    try:
        wait_for("the start's reconcile", lambda: built.reconciler.finished >= 1, 60)
        for _ in range(periodic):
            sent.append(("--", "periodic"))
            built.reconciler.reconcile([("interval", None)])
    finally:
        node.stop()
    return node, sent


def _split(sent: list[tuple[str, str]]) -> list[list[str]]:
    """Return the paths sent at the start, then at each periodic reconcile."""
    parts: list[list[str]] = [[]]
    for _, path in sent:
        if path == "periodic":
            parts.append([])
        else:
            parts[-1].append(path)
    return parts


def _reconcile_runs(prefect: Prefect, name: str) -> list[dict[str, Any]]:
    return [run for run in prefect.node_runs(name) if run["name"].startswith("reconcile-")]


def _deployments(prefect: Prefect, name: str) -> dict[str, dict[str, Any]]:
    found = {flow: prefect.deployment(flow, name) for flow in FLOWS}
    assert all(found.values()), found
    return {flow: item for flow, item in found.items() if item}


def test_a_restart_with_nothing_changed_registers_nothing_and_records_no_reconcile_run(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    name = f"rst-{uuid.uuid4().hex[:6]}"
    first, sent = _start_once(tmp_path, prefect_server, name)
    assert UPSERTS <= set(sent), "the first start registers"
    assert first.build().deployments.why.startswith("first start")
    assert len(_reconcile_runs(prefect, name)) == 1, "the first start's pull added a row"
    before = _deployments(prefect, name)

    again, sent = _start_once(tmp_path, prefect_server, name, periodic=2)
    assert not UPSERTS & set(sent), f"the restart registered again: {sent}"
    assert not [path for _, path in sent if "automations" in path or "create_flow_run" in path]
    at_start, periodic, later = _split(sent)
    # The node pulls a file (no controller to carry Prefect's wakes): its start checks for
    # ad hoc runs itself, and that is all it asks Prefect.
    assert at_start == ["/api/flow_runs/filter"], at_start
    assert periodic.count("/api/deployments/filter") == 1, periodic
    after = _deployments(prefect, name)
    assert {f: d["updated"] for f, d in after.items()} == {
        f: d["updated"] for f, d in before.items()}, "a deployment was written again"
    assert len(_reconcile_runs(prefect, name)) == 1, "the restart changed nothing"
    deployments = again.build().deployments
    assert deployments.ids == {f: d["id"] for f, d in before.items()}
    assert deployments.how == "cached" and "read back as registered" in deployments.why
    assert "/api/deployments/filter" not in later, "read back twice"


def _started_then_deleted(folder: Path, url: str, prefect: Prefect,
                          ) -> tuple[str, dict[str, dict[str, Any]]]:
    """Start a new node once, then delete its run-job deployment on the server; return its
    name and its deployments as they were."""
    name = f"del-{uuid.uuid4().hex[:6]}"
    _start_once(folder, url, name)
    old = _deployments(prefect, name)
    prefect.request("DELETE", f"/deployments/{old[RUN_JOB]['id']}")
    return name, old


def _planned_on(prefect: Prefect, name: str, deployment_id: str) -> list[dict[str, Any]]:
    return [run for run in prefect.node_runs(name)
            if run["state_type"] == "SCHEDULED" and run["deployment_id"] == deployment_id]


def test_a_restart_registers_again_when_its_deployment_was_deleted(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    name, old = _started_then_deleted(tmp_path, prefect_server, prefect)

    again, sent = _start_once(tmp_path, prefect_server, name, periodic=1)
    at_start, periodic = _split(sent)
    assert not UPSERTS & set(at_start), "the start asked Prefect about its deployments"
    assert {path for _, path in UPSERTS} <= set(periodic), (
        "the first periodic reconcile did not register the deleted deployment")
    deployments = again.build().deployments
    assert deployments.how == "registered" and "gone" in deployments.why
    now = _deployments(prefect, name)
    assert now[RUN_JOB]["id"] != old[RUN_JOB]["id"]
    assert now[RECONCILE]["id"] == old[RECONCILE]["id"]
    kept = json.loads((again.state / "deployments.json").read_text())
    assert kept["deployments"][RUN_JOB] == now[RUN_JOB]["id"]

    # Its runs went with it: the plan is made again on the new deployment.
    assert _planned_on(prefect, name, now[RUN_JOB]["id"]), "no plan on the new deployment"

    _, sent = _start_once(tmp_path, prefect_server, name, periodic=1)  # the new ids kept
    assert not UPSERTS & set(sent), sent


def test_a_plan_that_finds_its_deployment_gone_registers_it_again(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    name, old = _started_then_deleted(tmp_path, prefect_server, prefect)
    (tmp_path / "state" / "plan.json").unlink()  # the plan is made again at the start

    again, sent = _start_once(tmp_path, prefect_server, name)
    assert UPSERTS <= set(sent), "the plan did not register the deleted deployment"
    assert "a deployment was deleted" in again.build().deployments.why
    now = _deployments(prefect, name)
    assert now[RUN_JOB]["id"] != old[RUN_JOB]["id"]
    assert _planned_on(prefect, name, now[RUN_JOB]["id"]), "no plan on the new deployment"


def test_a_restart_registers_again_when_the_registration_changed(
    tmp_path: Path, prefect_server: str, prefect: Prefect, monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"ver-{uuid.uuid4().hex[:6]}"
    _start_once(tmp_path, prefect_server, name)
    # A new agent whose run-job takes another parameter.
    flows = registration.flow_objects()
    monkeypatch.setattr(registration, "flow_objects", lambda: {**flows, RUN_JOB: newer_run_job})

    again, sent = _start_once(tmp_path, prefect_server, name)
    assert UPSERTS <= set(sent), "the restart kept a registration that changed"
    assert "the registration changed" in again.build().deployments.why
    found = _deployments(prefect, name)[RUN_JOB]
    assert "note" in found["parameter_openapi_schema"]["properties"]


def test_a_restart_registers_again_when_the_servers_copy_was_changed(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    name = f"srv-{uuid.uuid4().hex[:6]}"
    _start_once(tmp_path, prefect_server, name)
    old = _deployments(prefect, name)
    prefect.request("PATCH", f"/deployments/{old[RECONCILE]['id']}", json={"paused": True})
    assert _deployments(prefect, name)[RECONCILE]["paused"] is True

    again, sent = _start_once(tmp_path, prefect_server, name, periodic=1)
    assert {path for _, path in UPSERTS} <= set(_split(sent)[1]), (
        "the node kept a deployment paused on the server")
    assert "reconcile" in again.build().deployments.why and "paused" in again.build(
    ).deployments.why
    assert _deployments(prefect, name)[RECONCILE]["paused"] is False


@flow(name="run-job")
def newer_run_job(schedule_id: str, note: str = "") -> None:
    """A run-job of a newer agent (one more parameter)."""


# -- pure -----------------------------------------------------------------------------------


def test_the_registration_version_follows_what_is_registered() -> None:
    def version(node: str, tags: list[str], pool: str = "sched-agent") -> str:
        return Deployments(None, node, tags, work_pool=pool).version()  # type: ignore[arg-type]

    base = version("n-1", ["sched-agent"])
    assert base == version("n-1", ["sched-agent"])
    assert base != version("n-2", ["sched-agent"])
    assert base != version("n-1", ["sched-agent", "x"])
    assert base != version("n-1", ["sched-agent"], pool="other")


def test_a_deployment_read_back_is_wrong_for_the_node_when_it_is_gone_moved_or_paused() -> None:
    right = {"work_pool_name": "p", "work_queue_name": "n-1", "paused": False,
             "entrypoint": "flows.run_job.run_job"}
    assert _wrong(right, "p", "n-1") == ""
    assert "gone" in _wrong(None, "p", "n-1")
    assert "work pool p" in _wrong({**right, "work_pool_name": None}, "p", "n-1")
    assert "work queue n-1" in _wrong({**right, "work_queue_name": "default"}, "p", "n-1")
    assert _wrong({**right, "paused": True}, "p", "n-1") == "paused"
    assert "entrypoint" in _wrong({**right, "entrypoint": ""}, "p", "n-1")


@pytest.mark.parametrize(("draw", "first_s"), [(1.0, 2.0), (0.0, 4.0)])
def test_the_first_periodic_reconcile_comes_in_the_intervals_second_half(
    monkeypatch: pytest.MonkeyPatch, draw: float, first_s: float,
) -> None:
    """Nodes started together (a fleet-wide restart) spread their reconciles: the first
    periodic one comes at a random point of the interval's second half, the next ones a whole
    interval apart (here 4 s; the draw fixed at either end)."""
    import random
    import time
    from datetime import timedelta

    from sched_node import reconcile
    from tests.factories import bare_reconciler

    times: list[tuple[float, list[tuple[str, str | None]]]] = []

    class Noted(reconcile.Reconciler):
        def reconcile(self, reasons: list[tuple[str, str | None]]) -> None:
            self.runs += 1
            times.append((time.monotonic(), reasons))

    monkeypatch.setattr(random, "random", lambda: draw)
    noted = bare_reconciler(Noted, timedelta(seconds=4)).start()
    try:
        wait_for("two periodic reconciles", lambda: len(times) >= 3, 30)
    finally:
        noted.stop()
    assert times[0][1] == [("start", None)] and times[1][1] == [("interval", None)]
    first, second = times[1][0] - times[0][0], times[2][0] - times[1][0]
    assert first_s - 0.1 <= first < first_s + 1.5, first
    assert 3.9 <= second < 5.5, second
