"""The Prefect project a Prefect user finds: flows in ``flows/``, ``prefect deploy --all``, a
work pool whose workers are the nodes, and ad hoc runs, Retry and ``run_deployment`` that
work on the node that owns the deployment.

Against real Prefect servers (the session's, and one of its own where the foreman's timings
matter) and real nodes: in this process (tests/nodekit.py), or as processes to be killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sched_node.registration import FLOWS, PLANNED_QUEUE
from tests.nodekit import NodeUnderTest, Prefect, chain_row, final, offset_to, row
from tests.procs import ROOT, PrefectServer, stop_group, wait_for

pytestmark = [pytest.mark.prefect]

PREFECT = str(Path(sys.executable).parent / "prefect")


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _deploy(url: str, node: str, config: Path,
            cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the README's two commands from the project: the pool (once per server; it may be
    there already), then ``prefect --no-prompt deploy --all``."""
    env = {**os.environ, "PREFECT_API_URL": url, "SCHED_NODE": node,
           "SCHED_CONFIG": str(config), "PREFECT_CLI_PROMPT": "false"}
    subprocess.run([PREFECT, "work-pool", "create", "sched-agent", "--type", "process"],
                   cwd=cwd, env=env, capture_output=True, timeout=120, check=False,
                   stdin=subprocess.DEVNULL)
    return subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240, check=False,
                          stdin=subprocess.DEVNULL)


def _comparable(found: dict[str, Any]) -> dict[str, Any]:
    """Return what a deployment is to a user and to the node (its entrypoint's form aside)."""
    return {key: found[key] for key in ("name", "work_pool_name", "work_queue_name", "paused",
                                        "schedules", "tags", "enforce_parameter_schema",
                                        "parameter_openapi_schema", "description")}


def test_prefect_deploy_all_makes_the_nodes_three_deployments_and_the_node_keeps_them(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    from prefect.flows import load_flow_from_entrypoint

    node = NodeUnderTest(tmp_path, prefect_server, name=_name("dep"), rows=[row("s-1")])
    done = _deploy(prefect_server, node.name, node.config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    deployed = {flow: prefect.deployment(flow, node.name) for flow in FLOWS}
    assert all(deployed.values()), deployed
    for flow, found in deployed.items():
        assert found is not None
        assert (found["work_pool_name"], found["work_queue_name"]) == ("sched-agent", node.name)
        assert found["schedules"] == [] and found["paused"] is False, "no run every minute"
        assert found["job_variables"]["env"]["SCHED_CONFIG"] == str(node.config)
        loaded: Any = load_flow_from_entrypoint(str(ROOT / found["entrypoint"]))
        assert loaded.name == flow, "the entrypoint loads with Prefect's own loader"
    schema = deployed["run-job"]["parameter_openapi_schema"]  # type: ignore[index]
    assert list(schema["properties"]) == ["schedule_id", "voucher"] and schema["required"] == [
        "schedule_id"], "the schema is the flow's signature"
    # The build step made the pool's paused queue of planned runs.
    queue = prefect.request("POST", "/work_pools/sched-agent/queues/filter", json={})
    assert {item["name"]: item["is_paused"] for item in queue}[PLANNED_QUEUE] is True

    # The node starts and keeps what prefect deploy made: it registers nothing.
    started = node.start()
    try:
        wait_for("the node's deployments", lambda: started.deployments.ids is not None, 60)
        ids = started.deployments.ids
    finally:
        node.stop()
    assert ids == {flow: found["id"] for flow, found in deployed.items() if found}
    assert all(prefect.deployment(flow, node.name)["updated"] == found["updated"]  # type: ignore[index]
               for flow, found in deployed.items() if found), "the node wrote a deployment"


def test_the_node_registers_the_deployments_prefect_deploy_would_and_their_entrypoints_load(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    from prefect.flows import load_flow_from_entrypoint

    node = NodeUnderTest(tmp_path / "node", prefect_server, name=_name("reg"),
                         rows=[row("s-1")])
    started = node.start()
    try:
        wait_for("the node's deployments", lambda: started.deployments.ids is not None, 60)
    finally:
        node.stop()
    by_node = {flow: prefect.deployment(flow, node.name) for flow in FLOWS}
    # The same node deployed by prefect.yaml under another name: the two sets compare equal.
    twin = _name("yaml")
    done = _deploy(prefect_server, twin, node.config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for flow in FLOWS:
        mine, theirs = by_node[flow], prefect.deployment(flow, twin)
        assert mine is not None and theirs is not None
        assert {**_comparable(mine), "name": twin, "work_queue_name": twin} == _comparable(
            theirs), flow
        assert load_flow_from_entrypoint(mine["entrypoint"]).name == flow
        assert mine["job_variables"]["env"]["SCHED_NODE_SOCKET"] == str(
            node.state.resolve() / "node.sock")


def _run_parent(url: str, deployment: str, schedule_id: str, log: Path) -> dict[str, Any]:
    """Run, in a process of its own, a user's flow that calls run_deployment and returns what
    the child run ended in."""
    code = f"""
import json
from prefect import flow
from prefect.deployments import run_deployment

@flow
def parent():
    child = run_deployment({deployment!r}, parameters={{"schedule_id": {schedule_id!r}}},
                           timeout=120)
    return {{"id": str(child.id), "type": child.state.type.value, "name": child.state.name,
             "message": child.state.message}}

print("RESULT " + json.dumps(parent()))
"""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PREFECT_API_URL": url},
                          capture_output=True, text=True, timeout=240, check=False)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    line = [item for item in done.stdout.splitlines() if item.startswith("RESULT ")][-1]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_run_deployment_from_a_users_flow_waits_for_the_nodes_job_and_returns_its_state(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=_name("rdp"),
                         rows=[row("ok", every=None, minute="7", hours=["3"], sleep=1),
                               row("bad", "fail", every=None, minute="7", hours=["3"])])
    started = node.start()
    try:
        wait_for("the node's event stream", lambda: bool(
            started.channel.stream and started.channel.stream.connected.is_set()), 60)
        ok = _run_parent(prefect_server, f"run-job/{node.name}", "ok", tmp_path / "ok.log")
        bad = _run_parent(prefect_server, f"run-job/{node.name}", "bad", tmp_path / "bad.log")
    finally:
        node.stop()
    assert (ok["type"], ok["name"]) == ("COMPLETED", "Completed"), ok
    assert "done ok" in prefect.logs(ok["id"])
    assert bad["type"] == "FAILED" and "sh exited with code 2: failing bad (after 2 tries)" in (
        bad["message"])
    run = prefect.api.read_run(bad["id"])
    assert run is not None and run["run_count"] == 2, "the row's retry is the run's"


def test_the_uis_retry_runs_a_planned_windows_job_again_into_the_same_run(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=_name("rty"),
                         rows=[row("w-1", "fail")], offset=offset_to(4))
    started = node.start()
    try:
        wait_for("the failed window's run", lambda: any(
            run["state"]["type"] == "FAILED" for run in prefect.node_runs(node.name)), 90)
        failed = next(run for run in prefect.node_runs(node.name)
                      if run["state"]["type"] == "FAILED")
        wait_for("the node's event stream", lambda: bool(
            started.channel.stream and started.channel.stream.connected.is_set()), 60)
        assert failed["run_count"] == 2 and failed["work_queue_name"] == PLANNED_QUEUE
        assert prefect.retry(failed["id"]) == "ACCEPT"

        def retried() -> bool:
            found = prefect.api.read_run(failed["id"]) or {}
            return final(found) and found.get("run_count", 0) >= 4

        wait_for("the retried run's end", retried, 60)
    finally:
        node.stop()
    run = prefect.api.read_run(failed["id"])
    assert run is not None and run["state"]["type"] == "FAILED"
    assert run["run_count"] == 4, "two tries, then the Retry's two"
    assert run["name"] == failed["name"] and "trigger:schedule" in run["tags"]
    names = [state["name"] for state in prefect.states(failed["id"])]
    after = names[names.index("Failed") + 1:]
    assert after == ["AwaitingRetry", "Pending", "Running", "AwaitingRetry", "Retrying",
                     "Failed"], names
    assert prefect.logs(failed["id"]).count("failing w-1") == 4


def test_a_run_handed_by_prefects_engine_runs_on_the_node_and_the_engine_records_it(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    """``prefect flow-run execute`` (what a process worker runs) of a run-job run: the flow's
    tasks hand the job to the node on this host and follow it; the run ends as the job did."""
    node = NodeUnderTest(tmp_path, prefect_server, name=_name("eng"),
                         rows=[row("q-1", every=None, minute="7", hours=["3"])])
    started = node.start()
    try:
        wait_for("the node's deployments", lambda: started.deployments.ids is not None, 60)
        # In a queue the node does not take runs from: only the engine runs it.
        run_id = prefect.create_run("run-job", node.name, {"schedule_id": "q-1"},
                                    work_queue_name="by-hand")
        env = {**os.environ, "PREFECT_API_URL": prefect_server,
               "SCHED_NODE_SOCKET": str(node.state / "node.sock")}
        done = subprocess.run([PREFECT, "flow-run", "execute", run_id], env=env,
                              capture_output=True, text=True, timeout=180, check=False)
        missing = prefect.create_run("run-job", node.name, {"schedule_id": "nope"},
                                     work_queue_name="by-hand")
        refused = subprocess.run([PREFECT, "flow-run", "execute", missing], env=env,
                                 capture_output=True, text=True, timeout=180, check=False)
        history = json.loads((node.state / "history.json").read_text())["ended"]
    finally:
        node.stop()
    run = prefect.api.read_run(run_id)
    assert run is not None and run["state"]["type"] == "COMPLETED", (
        run, done.stdout[-2000:], done.stderr[-2000:])
    logs = prefect.logs(run_id)
    assert "done q-1" in logs and any("handed this job to the node" in line for line in logs)
    tasks = sorted(task["name"].rsplit("-", 1)[0] for task in prefect.task_runs(run_id))
    assert tasks == ["check-inputs", "run-command", "write-artifact"], tasks
    assert [item["trigger_key"] for item in history if item["schedule_id"] == "q-1"] == [
        "manual"], "the node ran it, once"
    bad = prefect.api.read_run(missing)
    assert bad is not None and bad["state"]["type"] == "FAILED"
    assert any("no schedule 'nope'" in line for line in prefect.logs(missing)), refused.stdout


def test_without_a_node_on_the_host_the_flow_fails_saying_so(
    tmp_path: Path, prefect_server: str,
) -> None:
    code = "from flows.run_job import run_job\nrun_job('s-1')\n"
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHED_")}
    env.update({"PREFECT_API_URL": prefect_server,
                "SCHED_NODE_SOCKET": str(tmp_path / "none" / "node.sock")})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT)
    assert done.returncode != 0
    assert "no node answers on this host" in done.stdout + done.stderr
    env.pop("SCHED_NODE_SOCKET")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT)
    assert done.returncode != 0 and "set SCHED_CONFIG" in done.stdout + done.stderr


def test_an_ad_hoc_chain_run_goes_through_prefects_engine_its_stages_as_subflow_runs(
    tmp_path: Path, prefect_server: str, prefect: Prefect,
) -> None:
    node = NodeUnderTest(tmp_path, prefect_server, name=_name("chn"),
                         rows=[row("w-1", every=None, minute="7", hours=["3"]),
                               chain_row("p-1", "prune"), chain_row("c-1", "check")])
    started = node.start()
    try:
        wait_for("the node's event stream", lambda: bool(
            started.channel.stream and started.channel.stream.connected.is_set()), 60)
        run_id = prefect.create_run("chain", node.name, {})
        wait_for("the chain run's end", lambda: final(prefect.api.read_run(run_id)), 180,
                 log=node.state / "engine" / f"{run_id}.log")
        children = prefect.runs(parent_flow_run_id={"any_": [run_id]})
        chain_file = node.state / "chain.json"
        marks = json.loads(chain_file.read_text()).get("stages", {}) if chain_file.exists() else {}
    finally:
        node.stop()
    run = prefect.api.read_run(run_id)
    assert run is not None and run["state"]["type"] == "COMPLETED", run
    # Each stage a task run, each job under it a subflow run (whose call is a task run too).
    stages = sorted((task for task in prefect.task_runs(run_id)
                     if not task["name"].startswith("run-job")),
                    key=lambda task: task["start_time"])
    assert [task["name"].rsplit("-", 1)[0] for task in stages] == ["prune", "check"]
    assert sorted(child["parameters"]["schedule_id"] for child in children) == ["c-1", "p-1"]
    assert all(child["state"]["type"] == "COMPLETED" for child in children)
    assert marks == {}, "an ad hoc chain does not use up the day's chain"


def test_the_node_is_a_worker_of_its_pool_ready_while_it_runs_not_ready_after_its_death(
    tmp_path: Path,
) -> None:
    server = PrefectServer(tmp_path / "server")
    server.env.update({
        "PREFECT_SERVER_SERVICES_FOREMAN_LOOP_SECONDS": "2",
        "PREFECT_SERVER_SERVICES_FOREMAN_DEPLOYMENT_LAST_POLLED_TIMEOUT_SECONDS": "10",
        "PREFECT_SERVER_SERVICES_FOREMAN_WORK_QUEUE_LAST_POLLED_TIMEOUT_SECONDS": "10",
    })
    server.start()
    prefect = Prefect(server.url)
    node = NodeUnderTest(tmp_path / "node", server.url, name=_name("rdy"),
                         rows=[row("s-1", every=None, minute="7", hours=["3"])],
                         settings="worker_poll = 3\nworker_heartbeat = 5\n")
    proc = None

    def statuses() -> set[str]:
        return {str((prefect.deployment(flow, node.name) or {}).get("status"))
                for flow in FLOWS}

    try:
        proc = node.spawn(tmp_path / "node.log")
        wait_for("the deployments Ready", lambda: statuses() == {"READY"}, 90,
                 log=tmp_path / "node.log")
        workers = prefect.request("POST", "/work_pools/sched-agent/workers/filter", json={})
        mine = [item for item in workers if item["name"] == node.name]
        assert mine and mine[0]["status"] == "ONLINE" and mine[0]["last_heartbeat_time"]
        time.sleep(15)  # past the server's timeout: the node's polls keep them Ready
        assert statuses() == {"READY"}
        stop_group(proc, grace=0)  # kill -9
        died = time.monotonic()
        wait_for("the deployments Not Ready", lambda: statuses() == {"NOT_READY"}, 60)
        gone = time.monotonic() - died
        proc = node.spawn(tmp_path / "node.log")
        wait_for("the deployments Ready again", lambda: statuses() == {"READY"}, 90,
                 log=tmp_path / "node.log")
    finally:
        stop_group(proc)
        prefect.close()
        server.stop()
    assert gone < 30, f"Not Ready {gone:.0f} s after the node's death"
