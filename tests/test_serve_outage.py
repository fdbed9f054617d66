"""The node's serve process across a Prefect outage: it listens again by itself, and stops.

A real ``prefect server start`` (SQLite under the test's folder) and the real
``python -m deployments.serve``, each its own process. The server is stopped
and started again on the same port and database, as an operator's restart or
a crash would: the serve process's listener reconnects by itself and pulls a
change announced after the return; then a SIGTERM stops serve with exit code 0.
During the outage the runner gives up within seconds and the supervisor starts
serving again with a backoff: that is expected, and logged.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _row(version: int) -> dict[str, Any]:
    return {"id": "s-1", "name": "nightly", "repo_id": "r-1", "action": "backup",
            "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
            "miss_policy": "skip", "enabled": True, "version": version}


def _wait(what: str, done: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
            raise AssertionError(f"{what}: not within {timeout:g} s; {log.name} ends:\n"
                                 + "\n".join(tail))
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


class Node:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.rows = tmp / "schedules.json"
        self.rows.write_text(json.dumps({"schedules": [_row(1)]}))
        (tmp / "agent.toml").write_text(
            'node_name = "outage-node"\npull_url = "schedules.json"\nstate_dir = "state"\n')
        self.env = {
            **os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
            "SCHED_CONFIG": str(tmp / "agent.toml"), "PYTHONPATH": str(ROOT),
        }
        for name in ("SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
            self.env.pop(name, None)
        self.server: subprocess.Popen[bytes] | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.server_log, self.serve_log = tmp / "server.log", tmp / "serve.log"

    def start_server(self) -> None:
        with self.server_log.open("ab") as log:
            self.server = subprocess.Popen(
                [str(Path(sys.executable).parent / "prefect"), "server", "start",
                 "--host", "127.0.0.1", "--port", str(self.port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.tmp)

        def healthy() -> bool:
            try:
                return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait("the Prefect server healthy", healthy, 120, self.server_log)

    def stop_server(self) -> None:
        assert self.server is not None
        _stop(self.server)

    def start_serve(self) -> None:
        with self.serve_log.open("ab") as log:
            self.serve = subprocess.Popen(
                [sys.executable, "-m", "deployments.serve"], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                cwd=ROOT)

    def said(self, text: str) -> int:
        return self.serve_log.read_text(errors="replace").count(text) \
            if self.serve_log.exists() else 0

    def cached(self) -> int | None:
        try:
            cache = json.loads((self.tmp / "state" / "cache.json").read_text())
        except (OSError, ValueError):
            return None
        versions = [row["version"] for row in cache.get("schedules", []) if row["id"] == "s-1"]
        return int(versions[0]) if versions else None


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    node = Node(tmp_path)
    yield node
    for proc in (node.serve, node.server):
        if proc is not None:
            _stop(proc)


def test_serve_listens_again_after_a_prefect_outage_and_then_stops_when_told(
    node: Node,
) -> None:
    from controller.events import PrefectEvents

    node.start_server()
    node.start_serve()
    assert node.serve is not None
    listening = "listening for the controller's changes to outage-node's schedules"
    _wait("serve listening", lambda: node.said(listening) >= 1, 120, node.serve_log)
    assert node.cached() == 1  # serve's reconcile at start pulled the first version

    # The server goes away, then comes back on the same port and database.
    node.stop_server()
    _wait("the listener seeing the stream lost", lambda: node.said("lost the event stream") >= 1,
          60, node.serve_log)
    node.start_server()
    _wait("the listener back", lambda: node.said(listening) >= 2, 90, node.serve_log)
    assert node.serve.poll() is None
    node.rows.write_text(json.dumps({"schedules": [_row(2)]}))
    assert PrefectEvents(node.api).announce("outage-node", "s-1", 2, "put").sent
    _wait("version 2 pulled after the outage", lambda: node.cached() == 2, 30, node.serve_log)

    # Back to normal: a SIGTERM stops serve, with exit code 0.
    node.serve.send_signal(signal.SIGTERM)
    try:
        code = node.serve.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("serve did not stop on SIGTERM; its log ends:\n"
                             + "\n".join(node.serve_log.read_text().splitlines()[-30:])) from None
    assert code == 0
