"""A test node: its folder, settings and schedules, run in-process or as its own process.

The node's clock is the wall clock shifted by a fixed offset (``Node(clock=...)``),
so a test puts a window a few real seconds ahead instead of waiting for the next
minute; every duration the node measures is still real. The process form
(``python -m tests.node_proc``) is the real node process with that clock, for
the tests that kill it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sched_node.node import Node
from sched_node.prefect_api import PrefectApi, new_state
from sched_node.settings import load_settings
from tests.procs import ROOT, start, wait_for

ACTIONS = """
[actions.echo]
argv = ["sh", "-c", "echo started $0 at $(date -u +%s.%N); sleep $1; echo done $0", "{repo_id}",
        "{param:sleep}"]
timeout = 120

[actions.echo.params.sleep]
type = "int"
min = 0
max = 600

[actions.fail]
argv = ["sh", "-c", "echo failing $0; exit 2", "{repo_id}"]
timeout = 60
retries = 1
retry_delay = 0.2

[actions.env]
argv = ["env"]
timeout = 30
env = {DECLARED = "yes"}

[actions.prune]
argv = ["sh", "-c", "echo prune $0", "{repo_id}"]
timeout = 60

[actions.check]
argv = ["sh", "-c", "echo check $0", "{repo_id}"]
timeout = 60
"""


def row(sid: str, action: str = "echo", *, every: int | None = 1, minute: str = "0",
        hours: list[str] | None = None, sleep: int = 0, repo: str | None = None,
        policy: str = "skip", **extra: Any) -> dict[str, Any]:
    """Return a schedule row: every ``every`` minutes (or at ``minute`` past ``hours``)."""
    schedule: dict[str, Any] = {"days": ["*"], "hours": hours or ["*"], "minute": minute}
    if every:
        schedule["interval_minutes"] = every
    data: dict[str, Any] = {
        "id": sid, "name": f"test {sid}", "repo_id": repo or sid, "action": action,
        "schedule": schedule, "miss_policy": policy, "enabled": True, "version": 1, **extra}
    if action == "echo":
        data["params"] = {"sleep": sleep}
    return data


def chain_row(sid: str, action: str) -> dict[str, Any]:
    """Return an ``after_wave`` row of a chain stage."""
    return {"id": sid, "name": f"chain {sid}", "repo_id": sid, "action": action,
            "schedule": {"on": "after_wave"}, "miss_policy": "skip", "enabled": True,
            "version": 1}


def offset_to(seconds_before_minute: float, *, minutes_ahead: int = 2) -> timedelta:
    """Return a clock offset that puts the node seconds_before_minute before a minute boundary."""
    real = datetime.now(UTC)
    boundary = real.replace(second=0, microsecond=0) + timedelta(minutes=minutes_ahead)
    return boundary - timedelta(seconds=seconds_before_minute) - real


class NodeUnderTest:
    """A node's folder (agent.toml, schedules.json, state/) and its in-process Node."""

    def __init__(self, folder: Path, api_url: str, *, name: str,
                 rows: list[dict[str, Any]], offset: timedelta = timedelta(0),
                 settings: str = "", wave: str = '["echo"]') -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.api_url = api_url
        self.name = name
        self.offset = offset
        self.rows_path = folder / "schedules.json"
        self.write_rows(rows)
        self.config = folder / "agent.toml"
        self.config.write_text(
            f'node_name = "{name}"\npull_url = "schedules.json"\nstate_dir = "state"\n'
            f'timezone = "America/New_York"\nwave = {wave}\n{settings}\n'
            '[[stages]]\nname = "prune"\naction = "prune"\n\n'
            '[[stages]]\nname = "check"\naction = "check"\n' + ACTIONS)
        self.node: Node | None = None
        self._thread: threading.Thread | None = None

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        """Write the node's pull file."""
        self.rows_path.write_text(json.dumps({"schedules": rows}))

    def clock(self) -> datetime:
        """Return the node's now."""
        return datetime.now(UTC) + self.offset

    def build(self) -> Node:
        """Return the Node (built once)."""
        if self.node is None:
            settings = load_settings(self.config)
            self.node = Node(settings, api=PrefectApi(self.api_url),
                             clock=self.clock)
        return self.node

    def start(self) -> Node:
        """Run the node in a thread until :meth:`stop`."""
        node = self.build()
        self._thread = threading.Thread(target=node.run, daemon=True)
        self._thread.start()
        return node

    def stop(self) -> None:
        """Stop the node (its keepers finish their commands)."""
        if self.node is not None:
            self.node.stop()
        if self._thread is not None:
            self._thread.join(30)

    @property
    def state(self) -> Path:
        """The node's state folder."""
        return self.folder / "state"

    def env(self) -> dict[str, str]:
        """Return the environment of the node as a process."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("SCHED_")}
        env.update({"SCHED_CONFIG": str(self.config), "PREFECT_API_URL": self.api_url,
                    "PYTHONPATH": str(ROOT),
                    "SCHED_TEST_OFFSET_S": f"{self.offset.total_seconds():.6f}"})
        return env

    def spawn(self, log: Path) -> Any:
        """Start the node as its own process (``tests.node_proc``) with this node's clock."""
        return start([sys.executable, "-m", "tests.node_proc"], env=self.env(), log=log)


class Prefect:
    """What the tests read of Prefect and ask of it, through Prefect's client (as the node's
    ``PrefectApi`` and the operator's tools do), as JSON objects."""

    def __init__(self, url: str) -> None:
        self.api = PrefectApi(url)

    @property
    def client(self) -> Any:
        """Prefect's client (``SyncPrefectClient``)."""
        return self.api.client

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request of the API through Prefect's client; return its JSON answer."""
        response = self.api.call(lambda c: c.request(method, path, **kwargs),  # type: ignore[arg-type]
                                 f"{method} {path}")
        return response.json() if response.content else None

    def runs(self, **flow_runs: Any) -> list[dict[str, Any]]:
        """Return the flow runs a filter selects (all pages)."""
        from prefect.client.schemas.filters import FlowRunFilter

        found: list[dict[str, Any]] = []
        offset = 0
        wanted = FlowRunFilter.model_validate(flow_runs)
        while True:
            page = self.api.filter_runs(wanted, limit=200, offset=offset,
                                        sort="EXPECTED_START_TIME_ASC")
            found += page
            if len(page) < 200:
                return found
            offset += 200

    def node_runs(self, node: str) -> list[dict[str, Any]]:
        """Return every run tagged ``node:<node>``."""
        return self.runs(tags={"all_": [f"node:{node}"]})

    def run_named(self, node: str, name: str) -> dict[str, Any] | None:
        """Return the node's run called name, or None."""
        return next((run for run in self.node_runs(node) if run["name"] == name), None)

    def logs(self, run_id: str) -> list[str]:
        """Return a run's log messages, oldest first."""
        from prefect.client.schemas.filters import LogFilter

        found = self.api.filter_logs(LogFilter.model_validate(
            {"flow_run_id": {"any_": [run_id]}}))
        return [str(item["message"]) for item in found]

    def artifacts(self, run_id: str) -> list[dict[str, Any]]:
        """Return a run's artifacts."""
        return self.api.run_artifacts(run_id)

    def task_runs(self, run_id: str) -> list[dict[str, Any]]:
        """Return a flow run's task runs, oldest first, each with its states (``states``)."""
        found = self.request("POST", "/task_runs/filter", json={
            "flow_runs": {"id": {"any_": [run_id]}}, "sort": "EXPECTED_START_TIME_ASC"})
        for item in found:
            states = self.request("GET", "/task_run_states/",
                                  params={"task_run_id": item["id"]})
            item["states"] = sorted(states, key=lambda state: state["timestamp"])
        return list(found)

    def deployment(self, flow: str, node: str) -> dict[str, Any] | None:
        """Return the deployment ``flow/node`` (None when there is none)."""
        return self.api.deployment_by_name(flow, node)

    def ensure_deployment(self, flow: str, name: str) -> str:
        """Create (or find) a bare deployment ``flow/name`` through Prefect's client."""
        return str(self.api.call(lambda c: c.create_deployment(
            flow_id=c.create_flow_from_name(flow), name=name), f"deploy {flow}/{name}"))

    def create_run(self, flow: str, node: str, parameters: dict[str, Any],
                   **fields: Any) -> str:
        """Create a run of ``flow/node`` now, as the UI's Run does; return its id."""
        from prefect.client.schemas.actions import DeploymentFlowRunCreate
        from prefect.states import to_state_create

        deployment = self.deployment(flow, node)
        assert deployment is not None, f"no deployment {flow}/{node}"
        created = self.api.create_run(str(deployment["id"]), DeploymentFlowRunCreate(
            parameters=parameters, state=to_state_create(new_state("SCHEDULED")), **fields))
        return str(created["id"])

    def retry(self, run_id: str) -> str:
        """Press the UI's Retry on a run: the very request the UI sends; return the answer."""
        answer = self.request("POST", f"/flow_runs/{run_id}/set_state", json={
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry",
                      "message": "Retry from the UI"}, "force": False})
        return str(answer["status"])

    def events(self, name: str, node: str, *, at_least: int = 1,
               timeout: float = 20) -> list[dict[str, Any]]:
        """Return the events called name about node once there are at_least (or timeout s).

        The server stores events in batches, so this polls; the window is a day
        each side of now (a test node's clock runs ahead of the server's).
        """
        day = timedelta(days=1)
        now = datetime.now(UTC)
        deadline = time.monotonic() + timeout
        while True:
            data = self.request("POST", "/events/filter", json={"filter": {
                "event": {"name": [name]}, "resource": {"id": [f"sched.agent.{node}"]},
                "occurred": {"since": (now - day).isoformat(), "until": (now + day).isoformat()},
                "any_resource": None}, "limit": 50})
            events: list[dict[str, Any]] = data["events"]
            if len(events) >= at_least or time.monotonic() > deadline:
                return events
            time.sleep(0.3)

    def close(self) -> None:
        """Close the client."""
        self.api.close()

    def states(self, run_id: str) -> list[dict[str, Any]]:
        """Return a run's states, oldest first."""
        data: list[dict[str, Any]] = self.request("GET", "/flow_run_states/",
                                                  params={"flow_run_id": run_id})
        return sorted(data, key=lambda item: item["timestamp"])


def final(run: dict[str, Any] | None) -> bool:
    """Return whether a run is in a final state."""
    kind = ((run or {}).get("state") or {}).get("type")
    return kind in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def wait_runs(prefect: Prefect, node: str, names: list[str], timeout: float,
              *, done: Callable[[dict[str, Any]], bool] = final) -> dict[str, dict[str, Any]]:
    """Wait until each named run of the node satisfies done; return them by name."""
    found: dict[str, dict[str, Any]] = {}

    def ready() -> bool:
        runs = {run["name"]: run for run in prefect.node_runs(node)}
        found.update({name: runs[name] for name in names if name in runs})
        return all(name in runs and done(runs[name]) for name in names)

    try:
        wait_for(f"runs {names} of {node}", ready, timeout, every=0.5)
    except AssertionError as exc:
        states = {name: ((found.get(name) or {}).get("state") or {}).get("name")
                  for name in names}
        raise AssertionError(f"{exc}; states: {states}") from None
    return found
