"""The operator's ``sched`` commands against a real controller over loopback (and Prefect for run).

The controller is the real app (``create_app`` on a SQLite file, migrated),
served by uvicorn in a thread; the commands run in-process through typer's
runner, and once as the installed ``sched`` program. Commands reading the
fleet-status endpoints (FLEET-CONTRACT.md: ``/api/status``, node status,
``/api/upcoming``, ``PATCH``) run against the controller's own; their tables
are also checked on the contract's shapes as pure functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from controller.api.app import create_app
from controller.auth import Tokens
from controller.testing import serve_in_thread
from sched_cli import app as sched
from sched_ops import cli as ops
from sched_ops import cli_schedules
from tests.fixtures_pg import sqlite_engine
from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
ADMIN, NODE_TOKEN = "admin-secret-1", "node-a-secret"

ROW: dict[str, Any] = {
    "id": "s-1", "name": "nightly backup", "repo_id": "r-9", "action": "backup",
    "storage": "b2", "schedule": {"days": ["mon", "tue"], "hours": ["2"], "minute": "30"},
    "miss_policy": "run-once-within-24h", "enabled": True, "params": {"threads": 4},
    "version": 0,
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """A real controller on a free loopback port: (base URL, the app)."""
    with sqlite_engine(tmp_path_factory.mktemp("ops-controller")) as engine:
        app = create_app(engine, Tokens([ADMIN], {"node-a": [NODE_TOKEN]}))
        with serve_in_thread(app) as base:
            yield base, app


@pytest.fixture
def base(served: tuple[str, Any]) -> str:
    return served[0]


def run(*args: str, token: str | None = ADMIN, base: str | None = None,
        stdin: str | None = None) -> Any:
    env = {"SCHED_TOKEN": token or "", "SCHED_CONTROLLER_URL": base or ""}
    return CliRunner().invoke(sched, list(args), env=env, input=stdin)


# ------------------------------------------------------------ writes and exit codes


def test_put_from_a_file_then_from_flags_stores_the_row(base: str, tmp_path: Path) -> None:
    path = tmp_path / "row.json"
    path.write_text(json.dumps(ROW))
    result = run("schedules", "put", "--node", "node-a", "--file", str(path), base=base)
    assert result.exit_code == 0, result.output
    assert "stored s-1 on node-a (version 1)" in result.output
    # The controller's word on propagation, whole: this node never pulled, no Prefect API.
    (said,) = [x for x in result.output.splitlines() if x.startswith("next window ")]
    assert "the node is NOT likely to have it by then (change event not sent)" in said
    assert "never made a request" in said and "PREFECT_API_URL" in said and "…" not in said
    stored = httpx.get(f"{base}/api/nodes/node-a/schedules/s-1",
                       headers={"authorization": f"Bearer {ADMIN}"}).json()
    assert stored["schedule"] == ROW["schedule"] and stored["params"] == {"threads": 4}

    result = run("schedules", "put", "s-2", "--node", "node-a", "--name", "quarter-hourly copy",
                 "--action", "copy", "--interval", "15", "--miss-policy", "skip",
                 "--repo-id", "r-9", "--storage", "b2", "--param", "copy_to=/mnt/x",
                 "--param", "threads=2", "--json", base=base)
    assert result.exit_code == 0, result.output
    stored = json.loads(result.output)
    assert stored["schedule"]["interval_minutes"] == 15
    assert stored["params"] == {"copy_to": "/mnt/x", "threads": 2}
    assert (stored["id"], stored["action"], stored["version"]) == ("s-2", "copy", 1)


def test_a_row_the_controller_refuses_exits_1_naming_the_field(base: str) -> None:
    result = run("schedules", "put", "bad", "--node", "node-a", "--name", "x",
                 "--action", "backup", "--days", "someday", "--hours", "2", "--minute", "30",
                 "--miss-policy", "skip", base=base)
    assert result.exit_code == 1
    assert "422" in result.output and "unknown day name 'someday'" in result.output


def test_a_file_that_is_not_a_row_is_a_usage_error(base: str, tmp_path: Path) -> None:
    path = tmp_path / "row.json"
    path.write_text('[{"id": "s-1"}]')
    result = run("schedules", "put", "--node", "node-a", "--file", str(path), base=base)
    assert result.exit_code == 2 and "not a JSON object" in result.output
    path.write_text('{"id": "s-1", "params": {"x": NaN}}')
    result = run("schedules", "put", "--node", "node-a", "--file", str(path), base=base)
    assert result.exit_code == 2 and "not valid JSON" in result.output


def test_rm_deletes_and_a_second_rm_is_not_found(base: str) -> None:
    row = {**ROW, "id": "gone"}
    assert run("schedules", "put", "--node", "node-b", "--file", "-", base=base,
               stdin=json.dumps(row)).exit_code == 0
    result = run("schedules", "rm", "gone", "--node", "node-b", base=base)
    assert result.exit_code == 0 and "deleted gone on node-b" in result.output
    result = run("schedules", "rm", "gone", "--node", "node-b", base=base)
    assert result.exit_code == 1 and "404" in result.output and "gone" in result.output
    assert "no such endpoint" not in result.output  # a missing row is not a missing route


def test_a_route_the_controller_lacks_says_it_is_older_than_sched(base: str) -> None:
    from sched_ops.client import Controller, Exit, OpsError

    with Controller(base, ADMIN) as client:
        for method in ("GET", "PATCH"):
            with pytest.raises(OpsError) as refused:
                client.json(method, "/api/no-such-endpoint")
            assert refused.value.code == Exit.REFUSED
            assert "no such endpoint: it is older than this sched" in str(refused.value)


def test_exit_codes_for_tokens_and_a_missing_controller(base: str) -> None:
    result = run("schedules", "rm", "s-1", "--node", "node-a", token="wrong", base=base)
    assert result.exit_code == 1 and "401" in result.output and "SCHED_TOKEN" in result.output
    result = run("schedules", "rm", "s-1", "--node", "node-a", token=NODE_TOKEN, base=base)
    assert result.exit_code == 1 and "403" in result.output
    result = run("schedules", "rm", "s-1", "--node", "node-a", base=None)
    assert result.exit_code == 2 and "SCHED_CONTROLLER_URL" in result.output
    result = run("schedules", "rm", "s-1", "--node", "node-a", base="ftp://x")
    assert result.exit_code == 2
    # The token is never echoed, whatever fails.
    assert ADMIN not in result.output


def test_the_installed_sched_program_exits_3_when_the_controller_is_unreachable() -> None:
    program = Path(sys.executable).parent / "sched"
    assert program.exists(), "make puts sched in .venv/bin"
    port = free_port()  # nobody listens there
    done = subprocess.run(
        [str(program), "schedules", "rm", "s-1", "--node", "node-a",
         "--controller", f"http://user:pw@127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SCHED_TOKEN": ADMIN},
    )
    assert done.returncode == 3, done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "cannot reach" in done.stderr
    assert "pw" not in done.stderr.replace("http", "")  # no password in the message


# ------------------------------------------------------------ the fleet-status endpoints


def test_nodes_ls_describe_upcoming_pause_and_resume(served: tuple[str, Any]) -> None:
    base, _app = served
    assert run("schedules", "put", "--node", "node-c", "--file", "-", base=base,
               stdin=json.dumps({**ROW, "schedule": {"days": ["*"], "hours": ["*"],
                                                     "minute": "5"}})).exit_code == 0
    result = run("nodes", base=base)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].split() == [
        "NODE", "SCHEDULES", "LAST", "PULL", "AGO", "LAST", "SEEN", "STATUS", "TZ", "VERSION"]
    assert any(line.startswith("node-c") for line in result.output.splitlines())
    status = json.loads(run("nodes", "--json", base=base).output)
    assert "node-c" in {n["node"] for n in status["nodes"]}

    result = run("schedules", "ls", "--node", "node-c", base=base)
    assert result.exit_code == 0, result.output
    assert "s-1" in result.output and "nightly backup" in result.output

    result = run("schedules", "pause", "s-1", "--node", "node-c", "--note", "disk swap",
                 "--until", "2h", base=base)
    assert result.exit_code == 0, result.output
    assert "paused s-1 on node-c: disk swap" in result.output
    row = json.loads(run("schedules", "describe", "s-1", "--node", "node-c", "--json",
                         "--runs", "0", base=base).output)["row"]
    assert row["paused"]["note"] == "disk swap" and row["schedule"]["minute"] == "5"
    listed = run("schedules", "ls", "--node", "node-c", base=base).output
    assert "PAUSED: disk swap" in listed
    result = run("schedules", "resume", "s-1", "--node", "node-c", base=base)
    assert result.exit_code == 0 and "(it was paused: disk swap)" in result.output
    row = json.loads(run("schedules", "describe", "s-1", "--node", "node-c", "--json",
                         "--runs", "0", base=base).output)["row"]
    assert "paused" not in row or row["paused"] is None
    assert row["name"] == "nightly backup"  # the PATCH kept the rest of the row

    described = run("schedules", "describe", "s-1", "--node", "node-c", "--runs", "0",
                    base=base).output
    assert "Next windows:" in described and described.count(":05 ") >= 10

    result = run("upcoming", "--hours", "3", "--node", "node-c", base=base)
    assert result.exit_code == 0, result.output
    assert result.output.count("node-c") >= 3


# ------------------------------------------------------------ pure tables


NOW = datetime(2026, 11, 1, 5, 0, tzinfo=UTC)


def test_nodes_table_shows_last_pull_in_the_nodes_zone_and_how_long_ago() -> None:
    text = ops.nodes_table({"nodes": [
        {"node": "node-a", "schedules": 3, "last_pull_at": "2026-11-01T04:57:00Z",
         "last_pull_status": "304", "list_version_served": "v1", "list_version_current": "v2",
         "status": "ok", "timezone": "America/New_York", "agent_version": "0.1.0"},
        {"node": "node-\x1b[31mb", "schedules": 0, "last_pull_at": None, "status": "never-seen",
         "timezone": None, "agent_version": None},
    ]}, NOW)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["NODE", "SCHEDULES", "LAST"]
    assert "Sun 2026-11-01 00:57 EDT (304) behind" in lines[1] and "3 min" in lines[1]
    assert "\x1b" not in text and "node-\\u001b[31mb" in lines[2]  # no terminal escapes


def test_schedules_table_and_describe_show_when_next_last_policy_and_dst_notes() -> None:
    status = {"node": "node-a", "timezone": "America/New_York", "status": "failing",
              "schedules": [{
                  "id": "s-1", "name": "nightly", "action": "backup", "enabled": True,
                  "paused": {"note": "disk swap", "until": None}, "when": "Sun at 01:30",
                  "miss_policy": "skip", "last_fire": "2026-11-01T05:30:00Z",
                  "last_outcome": {"state": "Failed", "window": "2026-11-01T05:30:00Z",
                                   "ended_at": "2026-11-01T05:31:00Z", "flow_run_name": "b-1"},
                  "next_windows": [{"at": "2026-11-08T06:30:00Z",
                                    "local": "Sun 2026-11-08 01:30 EST",
                                    "note": "first copy of a repeated hour"}]}]}
    row = {**ROW, "id": "s-1", "jitter": 300, "paused": {"note": "disk swap"}}
    text = cli_schedules.schedules_table(status, {"s-1": row})
    assert "Sun at 01:30" in text and "Sun 2026-11-08 01:30 EST (DST)" in text
    assert "01:30 EDT Failed" in text and "PAUSED: disk swap" in text and "jitter 5 min" in text
    described = cli_schedules.describe_text(row, status["schedules"][0], status, [])
    assert "first copy of a repeated hour" in described and "until resumed" in described
    assert "latest job: Failed" in described and '"jitter": 300' in described


def test_upcoming_table_keeps_the_order_and_marks_paused_windows() -> None:
    text = ops.upcoming_table([
        {"node": "a", "schedule_id": "s-1", "name": "n", "action": "backup",
         "at": "2026-11-01T06:30:00Z", "local": "Sun 2026-11-01 01:30 EDT",
         "note": "first copy of a repeated hour", "paused": False},
        {"node": "b", "schedule_id": "s-2", "name": "m", "action": "copy",
         "at": "2026-11-01T07:00:00Z", "local": "Sun 2026-11-01 08:00 CET", "paused": True},
    ])
    lines = text.splitlines()
    assert lines[1].startswith("2026-11-01 06:30Z") and "repeated hour" in lines[1]
    assert lines[2].startswith("2026-11-01 07:00Z") and "PAUSED" in lines[2]


def test_until_reads_durations_and_rfc3339_and_refuses_the_rest() -> None:
    from sched_ops.client import OpsError

    assert cli_schedules.parse_until("90m", NOW) == "2026-11-01T06:30:00Z"
    assert cli_schedules.parse_until("3d", NOW) == "2026-11-04T05:00:00Z"
    assert cli_schedules.parse_until("2026-12-24T06:00:00+01:00", NOW) == "2026-12-24T05:00:00Z"
    with pytest.raises(OpsError, match="neither an RFC 3339"):
        cli_schedules.parse_until("tomorrow", NOW)
    with pytest.raises(OpsError):
        cli_schedules.parse_until("2026-12-24T06:00:00", NOW)  # no offset: whose 06:00?


# ------------------------------------------------------------ sched run (Prefect)


@pytest.mark.prefect
def test_run_creates_a_run_job_run_of_the_node_and_prints_its_url(
    base: str, prefect_server: str
) -> None:
    from prefect.client.orchestration import get_client

    node = "ops-run-node"
    assert run("schedules", "put", "--node", node, "--file", "-", base=base,
               stdin=json.dumps(ROW)).exit_code == 0
    result = run("run", "s-1", "--node", node, base=base)
    assert result.exit_code == 1 and f"no deployment 'run-job/{node}'" in result.output

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("run-job")
        client.create_deployment(flow_id=flow_id, name=node, tags=["sched-agent"])
    result = run("run", "s-1", "--node", node, base=base)
    assert result.exit_code == 0, result.output
    # The node never made a request of its own: the run is created, and the command says so.
    assert (f"warning: node {node} has never made a request to the controller with its own "
            "token: the run waits in Prefect until an agent serves it") in result.output
    url = result.output.strip().splitlines()[-1]
    ui = prefect_server.rstrip("/").removesuffix("/api")
    assert url.startswith(f"{ui}/runs/flow-run/")
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(url.rsplit("/", 1)[1])
    assert flow_run.parameters == {"schedule_id": "s-1"}
    assert {"sched-agent", f"node:{node}", "action:backup", "schedule:s-1",
            "trigger:manual"} <= set(flow_run.tags)

    result = run("run", "nope", "--node", node, base=base)
    assert result.exit_code == 1 and "404" in result.output  # the controller has no such row


# ------------------------------------------- the status commands on a fleet that reported

FALL_BACK = datetime(2026, 11, 1, 4, 0, tzinfo=UTC)  # 00:00 EDT; New York falls back at 06:00Z


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real controller, its clock at FALL_BACK: node-a pulled and reported a failed job."""
    with sqlite_engine(tmp_path_factory.mktemp("ops-fleet")) as engine:
        app = create_app(engine, Tokens([ADMIN], {"node-a": [NODE_TOKEN]}),
                         clock=lambda: FALL_BACK)
        with serve_in_thread(app) as base:
            nightly = {**ROW, "schedule": {"days": ["*"], "hours": ["1"], "minute": "30"}}
            assert run("schedules", "put", "--node", "node-a", "--file", "-", base=base,
                       stdin=json.dumps(nightly)).exit_code == 0
            assert run("schedules", "put", "s-2", "--node", "node-b", "--name", "copy", "--action",
                       "copy", "--repo-id", "r-1", "--storage", "b2", "--interval", "240",
                       "--miss-policy", "skip", base=base).exit_code == 0
            node = {"authorization": f"Bearer {NODE_TOKEN}"}
            assert httpx.get(f"{base}/api/schedules", params={"node": "node-a"},
                             headers=node).status_code == 200
            job = {"state": "Failed", "window": "2026-10-31T05:30:00Z",
                   "ended_at": "2026-10-31T05:41:00Z",
                   "flow_run_id": "2b0c1c1e-1111-4a4a-8b8b-000000000001",
                   "flow_run_name": "backup-s-1-20261031T0530Z"}
            answer = httpx.post(f"{base}/api/nodes/node-a/report", headers=node, json={
                "node": "node-a", "agent_version": "0.1.0", "timezone": "America/New_York",
                "grace_s": 300, "reported_at": "2026-11-01T03:59:00Z",
                "last_pull": {"at": "2026-11-01T03:59:00Z", "ok": True, "error": None,
                              "status": "200"},
                "schedules": [{"id": "s-1", "last_fired": job["window"], "latest_job": job}],
                "counts": {"skipped": 0, "missed": 0}})
            assert answer.status_code == 204, answer.text
            yield base
            app.state.pull_recorder.close()


def test_nodes_shows_each_nodes_pull_status_zone_and_version(reported: str) -> None:
    result = run("nodes", base=reported)
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines()[1:]}
    assert set(lines) == {"node-a", "node-b"}
    assert "Sun 2026-11-01 00:00 EDT (200)" in lines["node-a"]
    assert "failing" in lines["node-a"] and "America/New_York" in lines["node-a"]
    assert "0.1.0" in lines["node-a"]
    assert "never-seen" in lines["node-b"]
    status = json.loads(run("nodes", "--json", base=reported).output)
    assert status["stale_after_s"] > 0
    assert {n["node"]: n["status"] for n in status["nodes"]} == {
        "node-a": "failing", "node-b": "never-seen"}
    refused = run("nodes", token=NODE_TOKEN, base=reported)
    assert refused.exit_code == 1 and "403" in refused.output and "admin" in refused.output


def test_ls_and_describe_show_the_dst_night_and_the_failed_job(reported: str) -> None:
    listed = run("schedules", "ls", "--node", "node-a", base=reported)
    assert listed.exit_code == 0, listed.output
    line = next(x for x in listed.output.splitlines() if x.startswith("s-1"))
    assert "Sun 2026-11-01 01:30 EDT (DST)" in line and "Failed" in line
    assert "run-once-within-24h" in line and line.rstrip().endswith("yes")
    # A node's own token reads its node.
    assert run("schedules", "ls", "--node", "node-a", token=NODE_TOKEN,
               base=reported).exit_code == 0

    described = run("schedules", "describe", "s-1", "--node", "node-a", "--runs", "0",
                    base=reported)
    assert described.exit_code == 0, described.output
    text = described.output
    assert "01:30 happens twice on 2026-11-01" in text
    assert "latest job: Failed" in text and "backup-s-1-20261031T0530Z" in text
    windows = text.split("Next windows:")[1].split("Last fire")[0]
    assert windows.count("01:30 E") == 10  # 10 windows, each at 01:30 local
    assert "Sun 2026-11-01 01:30 EDT" in windows and "Mon 2026-11-02 01:30 EST" in windows


def test_upcoming_lists_the_fleet_in_time_order_and_pause_marks_it(reported: str) -> None:
    result = run("upcoming", "--hours", "24", "--json", base=reported)
    assert result.exit_code == 0, result.output
    windows = json.loads(result.output)["windows"]
    assert [w["at"] for w in windows] == sorted(w["at"] for w in windows)
    assert {w["node"] for w in windows} == {"node-a", "node-b"}
    assert any(w["schedule_id"] == "s-1" and w["at"] == "2026-11-01T05:30:00Z" for w in windows)
    refused = run("upcoming", token=NODE_TOKEN, base=reported)
    assert refused.exit_code == 1 and "403" in refused.output

    paused = run("schedules", "pause", "s-2", "--node", "node-b", "--note", "bucket move",
                 base=reported)
    assert paused.exit_code == 0, paused.output
    table = run("upcoming", "--hours", "24", "--node", "node-b", base=reported).output
    rows = [x for x in table.splitlines()[1:] if x.strip()]
    assert rows and all("PAUSED" in x and "node-b" in x for x in rows)
    resumed = run("schedules", "resume", "s-2", "--node", "node-b", base=reported)
    assert resumed.exit_code == 0 and "(it was paused: bucket move)" in resumed.output
    table = run("upcoming", "--hours", "24", "--node", "node-b", base=reported).output
    assert "PAUSED" not in table
