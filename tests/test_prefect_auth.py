"""The agent and the controller's dispatcher against a Prefect server with auth on.

Starts a real ``prefect server start`` with ``PREFECT_SERVER_API_AUTH_STRING``
on a free loopback port (as docs/agent.md's multi-node section sets it up),
then, as separate processes with ``PREFECT_API_AUTH_STRING`` (as a node and a
controller host run them): the node registers its deployments, pulls and plans
(a reconcile), and runs an ad hoc run of a cached ``schedule_id`` (its log lines
and its ``sched.job.completed`` event reach the server); the controller's
``PrefectDispatcher`` dispatches one deployment claim and one event claim. An
unauthenticated client, or one with the wrong string, gets 401 from the API
and cannot run a flow or dispatch; only the health probe answers without it.
Every process started carries a marker in its environment, and none is left.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import PrefectServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent
AT = "2026-12-02T07:30:00+00:00"


def _marked(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class AuthServer:
    """A Prefect server with an auth string, and the environments of its clients."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.node = f"auth-{uuid.uuid4().hex[:6]}"
        self.secret = f"sched:{uuid.uuid4().hex}"
        self.marker = uuid.uuid4().hex
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("PREFECT_", "SCHED_"))}
        self.base = {
            **base,
            "PREFECT_HOME": str(tmp / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "SCHED_AUTH_TEST_MARKER": self.marker,
        }
        self.server_env = {
            **self.base,
            "PREFECT_SERVER_API_AUTH_STRING": self.secret,
            "PREFECT_SERVER_UI_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            **{f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
               for name in ("SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS",
                            "CANCELLATION_CLEANUP", "REPOSSESSOR", "DB_VACUUM", "TRIGGERS")},
        }
        config = tmp / "agent.toml"
        (tmp / "schedules.json").write_text(json.dumps({"schedules": [{
            "id": "s-1", "name": "auth backup", "repo_id": "r-1", "action": "backup",
            "schedule": {"on": "manual"}, "miss_policy": "skip", "enabled": True,
        }]}))
        py = json.dumps(sys.executable)
        config.write_text(
            f'node_name = "{self.node}"\npull_url = "schedules.json"\nstate_dir = "state"\n'
            f"[actions.backup]\nargv = [{py}, \"-c\", \"print('authenticated job of', "
            "'{repo_id}')\"]\n"
        )
        self.client_env = {
            **self.base,
            "PREFECT_API_URL": self.api,
            "PREFECT_API_AUTH_STRING": self.secret,
            "SCHED_CONFIG": str(config),
            "SCHED_NODE_NAME": self.node,
        }
        # Its log is tmp/server.log; it runs in tmp, in a session of its own.
        self.prefect = PrefectServer(tmp, port=port, env=self.server_env)

    def start(self) -> None:
        self.prefect.start(timeout=120)

    def stop(self) -> None:
        self.prefect.stop()

    def python(self, code: str, *, auth: str | None = "same") -> subprocess.CompletedProcess[str]:
        """Run code in a fresh interpreter as a client (with the auth string, another, or none)."""
        env = dict(self.client_env)
        if auth is None:
            env.pop("PREFECT_API_AUTH_STRING")
        elif auth != "same":
            env["PREFECT_API_AUTH_STRING"] = auth
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=180, check=False)

    def http(self) -> httpx.Client:
        token = base64.b64encode(self.secret.encode()).decode()
        return httpx.Client(base_url=self.api, timeout=10,
                            headers={"Authorization": f"Basic {token}"})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AuthServer]:
    srv = AuthServer(tmp_path)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        left = _marked(srv.marker)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert left == [], f"processes left behind: {left}"


def _result(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def _wait(read: Callable[[], list[Any]], timeout: float = 30) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        found = read()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


AGENT = """
import json
from sched_node.node import Node
from prefect.client.schemas.actions import DeploymentFlowRunCreate
from prefect.states import to_state_create
from sched_node.prefect_api import PrefectApi, new_state
from sched_node.settings import load_settings
api = PrefectApi()
node = Node(load_settings(), api=api)
ids = node.deployments.get()  # registers run-job/<node>, reconcile/<node>, chain/<node>
node.reconciler.reconcile([("start", None)])  # pull, plan, record the reconcile
run = api.create_run(ids["run-job"], DeploymentFlowRunCreate(
    parameters={"schedule_id": "s-1"}, state=to_state_create(new_state("SCHEDULED"))))
assert node.control.check() == 1  # the node, its pool's worker, takes the ad hoc run
assert node.jobs.wait_idle(60)
node.recorder.drain()
out = {"schedules": len(node.scheduler.schedules()), "run_id": str(run["id"]),
       "completed": api.read_run(str(run["id"]))["state"]["type"] == "COMPLETED"}
node.jobs.stop()
print("RESULT " + json.dumps(out))
"""

DISPATCH = """
import json
from datetime import datetime
from controller.dispatch import PrefectDispatcher
from controller.claims import Claim
at = datetime.fromisoformat(AT)
dispatch = PrefectDispatcher()
dispatch(Claim(task_id=1, name="auth-run", scheduled_at=at, worker_id="t", locked_until=at,
               event=None, deployment="run-job/" + NODE, payload={"schedule_id": "s-1"}))
dispatch(Claim(task_id=2, name="auth-event", scheduled_at=at, worker_id="t", locked_until=at,
               event="sched.task.due", deployment=None, payload={"node": NODE}))
print("RESULT " + json.dumps({"dispatched": 2}))
"""


def test_agent_and_dispatcher_work_with_auth_and_anonymous_clients_get_401(
    server: AuthServer,
) -> None:
    prelude = f"NODE = {server.node!r}\nAT = {AT!r}\n"

    # Without the auth string (or with another), the API answers 401 to everything but
    # the health probe, and neither a node nor the controller gets anything done.
    anonymous = httpx.post(f"{server.api}/flow_runs/filter", json={}, timeout=10)
    assert anonymous.status_code == 401, anonymous.text
    assert anonymous.json() == {"exception_message": "Unauthorized"}
    wrong = base64.b64encode(b"sched:guess").decode()
    assert httpx.post(f"{server.api}/flow_runs/filter", json={}, timeout=10,
                      headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    assert httpx.post(f"{server.api}/events", json=[], timeout=10).status_code == 401
    assert httpx.get(f"{server.api}/health", timeout=10).status_code == 200
    refused = server.python(prelude + AGENT, auth=None)
    assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr, refused.stderr
    refused = server.python(prelude + DISPATCH, auth="sched:guess")
    assert refused.returncode != 0 and "401" in refused.stdout + refused.stderr, refused.stderr
    with server.http() as client:
        assert client.post("/flow_runs/filter", json={}).json() == []  # nothing got in

    # The node: pull, register run-job, run a job by schedule id.
    agent = _result(server.python(prelude + AGENT))
    assert agent["schedules"] == 1 and agent["completed"] is True
    with server.http() as client:
        run = client.get(f"/flow_runs/{agent['run_id']}").json()
        assert run["state"]["type"] == "COMPLETED" and f"node:{server.node}" in run["tags"]
        logs = _wait(lambda: [
            log["message"] for log in client.post("/logs/filter", json={
                "logs": {"flow_run_id": {"any_": [agent["run_id"]]}}}).json()
            if "authenticated job of r-1" in log["message"]])
        assert logs, "the job's output reached the server"
        events = _wait(lambda: client.post("/events/filter", json={"filter": {
            "event": {"name": ["sched.job.completed"]},
            "resource": {"id": [f"sched.agent.{server.node}"]},
            "any_resource": None}}).json()["events"])
        assert [e["payload"]["flow_run_id"] for e in events] == [agent["run_id"]]

    # The controller: one deployment claim, one event claim.
    assert _result(server.python(prelude + DISPATCH)) == {"dispatched": 2}
    with server.http() as client:
        runs = client.post("/flow_runs/filter", json={}).json()
        dispatched = [r for r in runs if r["idempotency_key"] == f"auth-run:{AT}"]
        assert len(dispatched) == 1 and dispatched[0]["parameters"] == {"schedule_id": "s-1"}
        events = _wait(lambda: client.post("/events/filter", json={"filter": {
            "event": {"name": ["sched.task.due"]},
            "resource": {"id": ["sched.task.auth-event"]},
            "any_resource": None}}).json()["events"])
        assert len(events) == 1 and events[0]["payload"]["node"] == server.node
