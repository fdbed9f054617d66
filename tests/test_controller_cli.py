"""`sched controller migrate` and `serve` as real subprocesses, on a temporary SQLite file."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from controller.db import migrate

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from controller.cli import app; app()"]
ADMIN_TOKEN = "cli-admin-token-4242"
NODE_TOKEN = "cli-node-token-1717"


def clean_env(**extra: str) -> dict[str, str]:
    """Return the environment without any SCHED_* setting, plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHED_")}
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=ROOT, env=env or clean_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    conn.close()
    return {name for (name,) in rows}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_migrate_goes_up_and_down(tmp_path: Path) -> None:
    path = tmp_path / "controller.db"
    url = f"sqlite:///{path}"

    up = run_cli("migrate", "--database-url", url)
    assert up.returncode == 0, up.stderr
    assert {"agent_schedule", "scheduled_task", "alembic_version"} <= tables(path)

    refused = run_cli("migrate", "--downgrade", "--database-url", url)
    assert refused.returncode == 2
    assert "--revision" in refused.stderr
    assert "agent_schedule" in tables(path)

    down = run_cli("migrate", "--downgrade", "--revision", "base", "--database-url", url)
    assert down.returncode == 0, down.stderr
    assert not {"agent_schedule", "scheduled_task"} & tables(path)

    # The URL may come from the environment instead of the flag.
    again = run_cli("migrate", env=clean_env(SCHED_DATABASE_URL=url))
    assert again.returncode == 0, again.stderr
    assert "agent_schedule" in tables(path)


def test_migrate_reports_the_url_without_its_password(tmp_path: Path) -> None:
    url = "postgresql://sched:hunter2-secret@127.0.0.1:1/sched?connect_timeout=1"
    result = run_cli("migrate", "--database-url", url)
    assert result.returncode != 0
    assert "hunter2-secret" not in result.stdout


@pytest.mark.parametrize(
    "env",
    [
        {"SCHED_NODE_TOKENS": f"node-a={NODE_TOKEN}"},
        {},
        {"SCHED_ADMIN_TOKEN": "  "},
    ],
)
def test_serve_refuses_to_start_without_an_admin_token(
    tmp_path: Path, env: dict[str, str]
) -> None:
    result = run_cli(
        "serve", "--api-only", "--port", str(free_port()),
        env=clean_env(SCHED_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}", **env),
    )
    assert result.returncode == 2
    assert "no admin token" in result.stderr
    assert "--insecure-no-auth" in result.stderr
    assert NODE_TOKEN not in result.stdout + result.stderr


def test_serve_refuses_a_bad_token_configuration_without_echoing_it(tmp_path: Path) -> None:
    result = run_cli(
        "serve", "--api-only", "--port", str(free_port()),
        env=clean_env(SCHED_ADMIN_TOKEN=ADMIN_TOKEN, SCHED_NODE_TOKENS="just-a-secret-value"),
    )
    assert result.returncode == 2
    assert "SCHED_NODE_TOKENS" in result.stderr
    assert "just-a-secret-value" not in result.stdout + result.stderr
    assert ADMIN_TOKEN not in result.stdout + result.stderr


def test_api_only_and_scheduler_only_exclude_each_other() -> None:
    result = run_cli("serve", "--api-only", "--scheduler-only")
    assert result.returncode != 0
    assert "exclude each other" in result.stderr


@contextmanager
def serving(tmp_path: Path, *args: str, **env: str) -> Iterator[tuple[str, Path]]:
    """Run `serve` as a subprocess until the block ends; yield its URL and stderr file."""
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [*CLI, "serve", "--port", str(port), *args], cwd=ROOT,
            env=clean_env(SCHED_DATABASE_URL=url, **env),
            stdout=log_file, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)  # polling for the server to come up
        yield base, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert code == 0, log_path.read_text()


SCHEDULE = {
    "name": "nightly", "action": "backup",
    "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
    "miss_policy": "skip", "enabled": True,
}


def test_serve_api_only_answers_with_auth_and_logs_without_tokens(tmp_path: Path) -> None:
    with serving(tmp_path, "--api-only", SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                 SCHED_NODE_TOKENS=f"node-a={NODE_TOKEN}", PREFECT_API_URL="") as (base, log_path):
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        node = {"Authorization": f"Bearer {NODE_TOKEN}"}
        put = httpx.put(f"{base}/api/nodes/node-a/schedules/s-1", json=SCHEDULE, headers=admin)
        assert put.status_code == 200, put.text
        # No PREFECT_API_URL: no sched.schedules.updated event, said in the answer.
        assert put.json()["_propagation"]["event_sent"] is False
        assert "PREFECT_API_URL is not set" in put.json()["_propagation"]["reason"]
        pulled = httpx.get(f"{base}/api/schedules?node=node-a", headers=node)
        assert pulled.status_code == 200
        assert [s["id"] for s in pulled.json()["schedules"]] == ["s-1"]
        assert httpx.get(f"{base}/api/schedules?node=node-b", headers=node).status_code == 403
        assert httpx.get(f"{base}/api/schedules?node=node-a").status_code == 401
    log = log_path.read_text()
    assert "WARNING controller.events: the controller has no Prefect API" in log  # at start-up
    assert "GET /api/schedules node=node-a principal=node:node-a status=200" in log
    assert "principal=node:node-a status=403" in log
    assert "status=401" in log
    assert ADMIN_TOKEN not in log
    assert NODE_TOKEN not in log


def test_serve_insecure_no_auth_makes_every_caller_admin(tmp_path: Path) -> None:
    with serving(tmp_path, "--api-only", "--insecure-no-auth") as (base, log_path):
        response = httpx.get(f"{base}/api/schedules?node=any")
        assert response.status_code == 200
        assert response.json() == {"schedules": []}
    assert "WITHOUT authentication" in log_path.read_text()


NO_PREFECT = "http://127.0.0.1:9/api"  # configured, never reached: no task is due


def test_serve_refuses_to_run_the_scheduler_without_a_prefect_api(tmp_path: Path) -> None:
    """Without PREFECT_API_URL, Prefect would dispatch into a temporary server of its own."""
    env = {k: v for k, v in clean_env(SCHED_ADMIN_TOKEN=ADMIN_TOKEN).items()
           if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile setting it either
    for args in (["serve"], ["serve", "--scheduler-only"]):
        result = run_cli(*args, "--port", str(free_port()), env=env)
        assert result.returncode == 2, result.stderr
        assert "PREFECT_API_URL" in result.stderr and "--api-only" in result.stderr


def test_serve_runs_api_and_central_scheduler_and_stops_both(tmp_path: Path) -> None:
    with serving(tmp_path, SCHED_ADMIN_TOKEN=ADMIN_TOKEN,
                 PREFECT_API_URL=NO_PREFECT) as (base, log_path):
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert httpx.get(f"{base}/api/tasks", headers=admin).json() == {"tasks": []}
        assert "central scheduler started" in log_path.read_text()
    log = log_path.read_text()
    assert "central scheduler stopped" in log
    assert log.index("central scheduler stopped") > log.index("Shutting down")
    assert "controller stopped" in log


def test_serve_scheduler_only_needs_no_token_and_stops_on_sigterm(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [*CLI, "serve", "--scheduler-only"], cwd=ROOT,
            env=clean_env(SCHED_DATABASE_URL=url, PREFECT_API_URL=NO_PREFECT),
            stdout=log_file, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "central scheduler started" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)  # polling for the process to come up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "central scheduler stopped" in log
    assert "Uvicorn running" not in log


def test_sched_console_script_has_the_controller_commands(tmp_path: Path) -> None:
    sched = Path(sys.executable).parent / "sched"
    path = tmp_path / "controller.db"
    result = subprocess.run(
        [str(sched), "controller", "migrate", "--database-url", f"sqlite:///{path}"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "agent_schedule" in tables(path)


def test_log_lines_carry_their_context_fields() -> None:
    """An operator reading the log sees which task failed, when, and why."""
    import logging
    from datetime import UTC, datetime

    from controller.cli import ContextFormatter

    record = logging.LogRecord("controller.central", logging.WARNING, __file__, 1,
                               "dispatch failed; will retry", (), None)
    record.__dict__.update(task_name="nightly", error="ValueError: no such 'x'",
                           scheduled_at=datetime(2026, 12, 2, 7, 30, tzinfo=UTC), attempts=2)
    line = ContextFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == ("WARNING controller.central: dispatch failed; will retry task_name=nightly "
                    "error=\"ValueError: no such 'x'\" scheduled_at=2026-12-02T07:30:00+00:00 "
                    "attempts=2")
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "started", (), None)
    assert ContextFormatter("%(message)s").format(plain) == "started"
    access = logging.LogRecord("controller.access", logging.INFO, __file__, 1,
                               "GET /healthz node=- principal=- status=200 1.0ms", (), None)
    access.__dict__.update(method="GET", path="/healthz", status=200)  # already in the text
    assert ContextFormatter("%(message)s").format(access) == access.getMessage()
