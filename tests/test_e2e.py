"""End to end, as a user does it: server, work pool, deploy, worker, ad hoc runs, chain, shutdown.

Runs the real CLI on the real ``prefect.yaml``: ``prefect server start``,
``prefect work-pool create``, ``prefect --no-prompt deploy --all``,
``prefect worker start``, ``prefect deployment run``. The server runs its
triggers service, so a completed backup reaches ``advance-chain`` through the
deployment trigger of ``prefect.yaml``, and the chain fires the prune stage.
Every process it starts carries a marker in its environment, so the test can
prove none is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
PRUNE_ROW = {
    "id": "e2e-prune", "name": "prune after the wave", "repo_id": "r-e2e", "action": "prune",
    "schedule": {"on": "after_wave"}, "miss_policy": "skip", "enabled": True,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _marked(marker: str) -> list[int]:
    """Return the pids of live processes whose environment holds marker."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, then SIGKILL it after grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class User:
    """The environment and processes of one user session on a throwaway node."""

    def __init__(self, tmp: Path) -> None:
        self.node = f"e2e-{uuid.uuid4().hex[:6]}"
        self.marker = f"SCHED_E2E_MARKER={uuid.uuid4().hex}"
        port = _free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        config = tmp / "agent.toml"
        (tmp / "schedules.json").write_text(json.dumps({"schedules": [PRUNE_ROW]}))
        self.state = tmp / "state"
        python = json.dumps(sys.executable)
        config.write_text(
            f'node_name = "{self.node}"\npull_url = "schedules.json"\nstate_dir = "state"\n'
            f"[actions.backup]\nargv = [{python}, \"-c\", "
            "\"print('hello from the e2e job', '{repo_id}')\"]\n"
            f"[actions.prune]\nargv = [{python}, \"-c\", "
            "\"print('prune of', '{repo_id}', 'fired by', '{trigger_key}')\"]\n"
            '[[stages]]\nname = "prune"\naction = "prune"\n'
        )
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(tmp / "prefect-home"),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "SCHED_NODE_NAME": self.node,
            "SCHED_CONFIG": str(config),
            self.marker.split("=")[0]: self.marker.split("=")[1],
            # Cheaper, not different: no UI, no services that ad hoc runs and the
            # chain's trigger do not need (so no scheduled ticks compete for the
            # CPU), faster polling. The triggers service stays on.
            "PREFECT_SERVER_UI_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            **{
                f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
                for name in ("SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS",
                             "CANCELLATION_CLEANUP", "REPOSSESSOR", "DB_VACUUM")
            },
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        }
        self.port = port
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log = tmp / "processes.log"

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as log:
            proc = subprocess.Popen(
                [PREFECT, *args], env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [PREFECT, *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{self.api}{path}", json=body, timeout=10)
        response.raise_for_status()
        return response.json()

    def finished_run(
        self, flow_name: str, what: str, *, tags: list[str] | None = None,
        action: str | None = None, timeout: float = 180,
    ) -> dict[str, Any]:
        """Wait for a run of flow_name (with tags, or parameter action) to end; return it."""
        body: dict[str, Any] = {"flows": {"name": {"any_": [flow_name]}}}
        if tags:
            body["flow_runs"] = {"tags": {"all_": tags}}
        deadline = time.monotonic() + timeout
        runs: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            runs = [
                run for run in self.post("/flow_runs/filter", body)
                if action is None or run["parameters"].get("action") == action
            ]
            if runs and runs[0]["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED"):
                return runs[0]
            time.sleep(1)
        raise AssertionError(f"{what}: no finished {flow_name} run in {timeout:g} s: {runs}")

    def log_lines(self, run_id: str, expected: str) -> list[str]:
        """Return the run's log messages once expected is among them (or after 30 s)."""
        messages: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            logs = self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}})
            messages = [item["message"] for item in logs]
            if expected in messages:
                break
            time.sleep(0.5)
        return messages


@pytest.fixture
def user(tmp_path: Path) -> Iterator[User]:
    session = User(tmp_path)
    yield session
    # Workers first (they may be running flows), then the server.
    for proc in reversed(session.procs):
        _stop(proc, grace_s=30)
    left = _marked(session.marker.split("=")[1])
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left behind: {left}"


def test_deploy_worker_ad_hoc_run_and_chain_like_a_user(user: User) -> None:
    t0 = time.monotonic()

    def phase(name: str) -> None:
        print(f"e2e: {name} at {time.monotonic() - t0:.1f} s", flush=True)

    server = user.start("server", "start", "--host", "127.0.0.1", "--port", str(user.port))
    deadline = time.monotonic() + 180
    while True:
        assert server.poll() is None, user.log.read_text()
        try:
            if httpx.get(f"{user.api}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.5)

    phase("server healthy")
    user.run("work-pool", "create", "sched-agent", "--type", "process", "--overwrite")
    phase("pool created")
    out = user.run("--no-prompt", "deploy", "--all", timeout=240)
    phase("deployed")
    for flow_name in ("fire-tick", "reconcile", "run-job", "advance-chain"):
        assert f"{flow_name}/{user.node}" in out
    # The node pulls its list first (the chain fires the cached after_wave rows);
    # the run waits in the queue until the worker starts.
    user.run("deployment", "run", f"reconcile/{user.node}")
    user.start("worker", "start", "--pool", "sched-agent", "--work-queue", user.node)
    pulled = user.finished_run("reconcile", "the pull")
    assert pulled["state"]["type"] == "COMPLETED", pulled["state"]
    phase("pulled")

    schedule = {
        "id": "e2e-1", "name": "ad hoc backup", "repo_id": "r-e2e", "action": "backup",
        "schedule": {"on": "manual"}, "miss_policy": "skip", "enabled": True,
    }
    user.run("deployment", "run", f"run-job/{user.node}",
             "--params", json.dumps({"schedule": schedule}))
    phase("run created")
    run = user.finished_run("run-job", "the ad hoc backup", tags=[f"node:{user.node}",
                                                                 "action:backup"])
    phase("run finished")
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"].startswith("backup-e2e-1-")
    line = "hello from the e2e job r-e2e"
    assert line in user.log_lines(run["id"], line)

    # The chain: sched.job.completed -> the advance-chain trigger -> the prune stage
    # fires the cached after_wave row -> its completion triggers advance-chain again.
    chained = user.finished_run("advance-chain", "the trigger on the backup", action="backup")
    phase("advance-chain after the backup finished")
    assert chained["state"]["type"] == "COMPLETED", chained["state"]
    assert chained["name"] == "chain-after-backup"
    assert chained["parameters"] == {
        "action": "backup", "node": user.node, "completed_run": run["id"]
    }
    prune = user.finished_run("run-job", "the prune stage", tags=[f"node:{user.node}",
                                                                 "action:prune"])
    phase("prune finished")
    assert prune["state"]["type"] == "COMPLETED", prune["state"]
    assert prune["name"].startswith("prune-e2e-prune-")
    assert "trigger:chain-prune" in prune["tags"]
    line = "prune of r-e2e fired by chain-prune"
    assert line in user.log_lines(prune["id"], line)
    marks = json.loads((user.state / "chain.json").read_text())["stages"]
    assert marks["prune"]["fired"] == ["e2e-prune"] and marks["prune"]["complete"]
    after = user.finished_run("advance-chain", "the trigger on the prune", action="prune")
    phase("advance-chain after the prune finished")
    assert after["state"]["type"] == "COMPLETED", after["state"]
