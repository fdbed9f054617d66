"""A node that cannot start on its settings says so in the controller's view.

A real controller on loopback and a real node process (``python -m sched_node``)
started on a config with a typo: it exits 2 as before, and the controller's status, its
report and the fleet's summary say the node cannot start, and why, at once (not minutes
later as "silent"); its next good report clears it. The failure is no sign of life.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.auth import Tokens
from tests.factories import nightly, served_controller
from tests.procs import ROOT

ADMIN = "admin-secret-token-0123456789"
NODE = "node-b"
TOKEN = "node-b-secret-token-0123456789"


@pytest.fixture
def base(tmp_path: Path) -> Iterator[str]:
    with served_controller(f"sqlite:///{tmp_path / 'controller.db'}",
                           Tokens(admin=[ADMIN], nodes={NODE: [TOKEN]})) as found:
        yield found


def _admin(base: str, path: str) -> dict[str, Any]:
    answer = httpx.get(base + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    data: dict[str, Any] = answer.json()
    return data


def _start_node(tmp_path: Path, config_text: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "agent.toml"
    config.write_text(config_text)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHED_")}
    env.update({"SCHED_CONFIG": str(config), "SCHED_TOKEN": TOKEN, "PYTHONPATH": str(ROOT),
                "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    return subprocess.run([sys.executable, "-m", "sched_node"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_a_node_that_cannot_start_says_so_in_the_controllers_view_until_it_reports_again(
        tmp_path: Path, base: str) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.put(f"{base}/api/nodes/{NODE}/schedules/s-1", json=nightly("s-1"),
                     headers=admin, timeout=30).status_code == 200
    done = _start_node(tmp_path, f'node_name = "{NODE}"\n'
                                 f'pull_url = "{base}/api/schedules?node={NODE}"\n'
                                 'state_dir = "state"\ngracee = 60\n')
    assert done.returncode == 2, done.stderr
    assert "gracee" in done.stderr
    assert "told the controller this node cannot start" in done.stderr

    row = next(item for item in _admin(base, "/api/status")["nodes"] if item["node"] == NODE)
    assert row["status"] == "cannot-start", row
    assert "gracee" in row["start_error"] and row["last_seen_at"] is None, row
    from typer.testing import CliRunner

    from sched_cli import app as sched

    listed = CliRunner().invoke(sched, ["nodes", "--controller", base, "--token", ADMIN])
    assert listed.exit_code == 0, listed.output
    assert "cannot-start" in listed.output
    assert f"{NODE} its agent cannot start on its settings" in listed.output
    report = _admin(base, f"/api/report?node={NODE}")
    node = report["nodes"][0]
    assert node["silent"] is True and "cannot start on its settings" in node["silence"]
    assert "gracee" in report["summary"]["text"], report["summary"]["text"]

    good = {"node": NODE, "agent_version": "0.1.0", "timezone": "UTC", "grace_s": 60.0,
            "reported_at": "2026-12-07T10:00:00Z"}
    assert httpx.post(f"{base}/api/nodes/{NODE}/report", json=good, timeout=30, headers={
        "Authorization": f"Bearer {TOKEN}"}).status_code == 204
    row = next(item for item in _admin(base, "/api/status")["nodes"] if item["node"] == NODE)
    assert row["status"] != "cannot-start" and row["start_error"] is None, row


def test_a_start_failure_naming_no_controller_is_only_the_local_error(tmp_path: Path) -> None:
    done = _start_node(tmp_path, 'node_name = "n"\npull_url = "schedules.json"\ngracee = 1\n')
    assert done.returncode == 2
    assert "gracee" in done.stderr and "told the controller" not in done.stderr
