"""A row its node would refuse is refused when it is written, with the node's own message.

A real controller over HTTP on loopback and a node's real Reporter: the node publishes its
action table (never an action's env) in its reports; PUT and PATCH render each row against
it with the node's own code (:func:`sched_core.render.render_argv`, lexical).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import text

from controller.auth import Tokens
from controller.db import make_engine
from sched_core.model import LocalSchedule
from sched_core.render import ValueRefused, render_argv
from sched_node.node_report import Reporter
from sched_node.outbox import Outbox
from sched_node.settings import AgentSettings, load_settings
from tests.factories import nightly, served_controller

ADMIN = "admin-secret-token-0123456789"
NODE = "node-a"
NODE_TOKEN = "node-a-secret-token-0123456789"
SECRET = "hunter2-restic-password"

AGENT_TOML = f"""
node_name = "{NODE}"
pull_url = "schedules.json"
state_dir = "state"

[actions.backup]
argv = ["restic", "-r", "{{repo_id}}", "backup", "{{param:path}}", "--tag", "{{param:tag}}"]
env = {{ RESTIC_PASSWORD = "{SECRET}" }}

[actions.backup.params.path]
type = "path"
under = ["/srv", "/home"]

[actions.backup.params.tag]
type = "string"
pattern = "[a-z]+"
"""


class Center:
    """The controller: its URL, the admin's client and its database."""

    def __init__(self, base: str, url: str) -> None:
        self.base = base
        self.url = url
        self.admin = httpx.Client(base_url=base, timeout=30,
                                  headers={"Authorization": f"Bearer {ADMIN}"})

    def put(self, row: dict[str, Any], node: str = NODE) -> httpx.Response:
        return self.admin.put(f"/api/nodes/{node}/schedules/{row['id']}", json=row)

    def stored_contract(self) -> tuple[str, str] | None:
        engine = make_engine(self.url)
        try:
            with engine.connect() as conn:
                found = conn.execute(text("SELECT contract_hash, contract FROM node_contract "
                                          "WHERE node = :node"), {"node": NODE}).first()
        finally:
            engine.dispose()
        return None if found is None else (found[0], str(found[1]))


@pytest.fixture
def center(tmp_path: Path) -> Iterator[Center]:
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    with served_controller(url, Tokens(admin=[ADMIN], nodes={NODE: [NODE_TOKEN]})) as base:
        center = Center(base, url)
        yield center
        center.admin.close()


def _settings(tmp_path: Path, report_url: str) -> AgentSettings:
    config = tmp_path / "agent.toml"
    config.write_text(f'report_url = "{report_url}"\n' + AGENT_TOML)
    settings = load_settings(config)
    return settings.model_copy(update={"token": SecretStr(NODE_TOKEN)})


def _reporter(tmp_path: Path, report_url: str) -> Reporter:
    settings = _settings(tmp_path, report_url)

    def facts(now: datetime) -> dict[str, Any]:
        return {"node": NODE, "agent_version": "0.1.0", "timezone": "UTC", "grace_s": 60.0,
                "reported_at": now.isoformat()}

    return Reporter(settings, Outbox(tmp_path / "outbox", max_bytes=1 << 30),
                    clock=lambda: datetime.now(UTC), facts=facts)


def _row(schedule_id: str, **changes: Any) -> dict[str, Any]:
    return nightly(schedule_id, **{"params": {"path": "/srv/data", "tag": "nightly"},
                                   **changes})


def _nodes_message(tmp_path: Path, row: dict[str, Any]) -> str:
    """What the node itself says of row when it renders the job's command."""
    settings = _settings(tmp_path, "http://127.0.0.1:9/unused")
    schedule = LocalSchedule.model_validate(row)
    with pytest.raises(ValueRefused) as refused:
        render_argv(settings.action(schedule.action), schedule, state_dir=settings.state_dir,
                    node=NODE, window=None, trigger_key="schedule", now=datetime.now(UTC))
    return str(refused.value)


def _reported(tmp_path: Path, center: Center) -> Reporter:
    """The node's reporter on center, its first report (the table with it) sent."""
    reporter = _reporter(tmp_path, f"{center.base}/api/nodes/{NODE}/report")
    assert reporter.send_now()
    return reporter


def test_a_row_the_node_would_refuse_is_refused_when_written_with_the_nodes_own_message(
        tmp_path: Path, center: Center) -> None:
    _reported(tmp_path, center)

    typo = center.put(_row("s-typo", action="bakup"))
    assert typo.status_code == 422, typo.text
    assert ("no action 'bakup' in the action table (known: backup)"
            in typo.json()["detail"][0]["msg"])

    outside = _row("s-etc", params={"path": "/etc", "tag": "nightly"})
    answer = center.put(outside)
    assert answer.status_code == 422, answer.text
    message = answer.json()["detail"][0]["msg"]
    assert message.startswith(f"node '{NODE}' would refuse this row: ")
    assert _nodes_message(tmp_path, outside).split(" (it resolves to")[0] in message
    assert "params.path = '/etc' refused: it is not under /srv or /home" in message

    dash = center.put(_row("s-dash", params={"path": "/srv/x", "tag": "nightly"},
                           repo_id="-rf"))
    assert dash.status_code == 422, dash.text

    good = center.put(_row("s-good"))
    assert good.status_code == 200, good.text
    assert good.json()["_propagation"]["checked"] is True
    assert "checked against the action table" in good.json()["_propagation"]["check"]

    patched = center.admin.patch(f"/api/nodes/{NODE}/schedules/s-good",
                                 json={"params": {"path": "/srv/../etc", "tag": "x"}},
                                 headers={"Content-Type": "application/merge-patch+json"})
    assert patched.status_code == 422, patched.text
    assert "refused: it is not under /srv or /home" in patched.text
    kept = center.admin.get(f"/api/nodes/{NODE}/schedules/s-good").json()
    assert kept["params"]["path"] == "/srv/data"  # the last good row stays
    assert center.admin.get(f"/api/nodes/{NODE}/schedules/s-typo").status_code == 404


def test_the_table_is_published_without_any_env_and_its_pattern_rules_stay_the_nodes(
        tmp_path: Path, center: Center) -> None:
    _reported(tmp_path, center)
    stored = center.stored_contract()
    assert stored is not None
    assert SECRET not in stored[1] and "RESTIC_PASSWORD" not in stored[1]
    # A node's regex never runs on the controller: the node checks it at the window.
    answer = center.put(_row("s-tag", params={"path": "/srv/data", "tag": "NOT-lower"}))
    assert answer.status_code == 200, answer.text
    assert "pattern" in _nodes_message(tmp_path, _row("s-tag", params={
        "path": "/srv/data", "tag": "NOT-lower"}))


def test_a_row_for_a_node_never_seen_is_accepted_and_its_answer_says_it_was_not_checked(
        center: Center) -> None:
    answer = center.put(_row("s-1", action="bakup"), node="node-new")
    assert answer.status_code == 200, answer.text
    spread = answer.json()["_propagation"]
    assert spread["checked"] is False
    assert "not checked: node 'node-new' has not published its action table" in spread["check"]


def test_a_controller_that_lost_the_table_asks_for_it_and_the_next_report_brings_it(
        tmp_path: Path, center: Center) -> None:
    reporter = _reported(tmp_path, center)
    first = center.stored_contract()
    assert first is not None
    engine = make_engine(center.url)
    with engine.begin() as conn:  # a database restored from before the node's start
        conn.execute(text("DELETE FROM node_contract"))
    engine.dispose()
    assert reporter.send_now()  # the hash only: answered "wanted"
    assert center.stored_contract() is None
    assert reporter.send_now()
    assert center.stored_contract() == first
    assert center.put(_row("s-typo", action="bakup")).status_code == 422


def test_hostile_tables_are_refused_and_only_the_nodes_own_token_publishes(
        tmp_path: Path, center: Center) -> None:
    url = f"/api/nodes/{NODE}/report"
    base = {"node": NODE, "agent_version": "0.1.0", "timezone": "UTC", "grace_s": 60.0,
            "reported_at": "2026-12-07T10:00:00Z", "contract_hash": "ab" * 16}
    node = {"Authorization": f"Bearer {NODE_TOKEN}"}
    with_env = {"actions": {"backup": {"argv": ["restic"], "env": {"K": "v"}}}}
    answer = httpx.post(center.base + url, json={**base, "contract": with_env}, headers=node)
    assert answer.status_code == 422 and "env is never published" in answer.text
    many = {"actions": {f"a{i}": {"argv": ["true"]} for i in range(201)}}
    assert httpx.post(center.base + url, json={**base, "contract": many},
                      headers=node).status_code == 422
    bad_name = {"actions": {"../x": {"argv": ["true"]}}}
    assert httpx.post(center.base + url, json={**base, "contract": bad_name},
                      headers=node).status_code == 422
    template = {"actions": {"backup": {"argv": ["{param:path}"]}}}
    assert httpx.post(center.base + url, json={**base, "contract": template},
                      headers=node).status_code == 422
    loose = {"actions": {"backup": {"argv": ["true"]}}}
    # The admin's token may post a node's report, but never its table.
    assert center.admin.post(url, json={**base, "contract": loose}).status_code == 204
    assert center.stored_contract() is None
    assert center.put(_row("s-1", action="anything")).json()["_propagation"]["checked"] is False


def test_a_controller_that_knows_no_table_still_gets_every_report(tmp_path: Path) -> None:
    bodies: list[dict[str, Any]] = []

    class Older(BaseHTTPRequestHandler):
        """A controller of the version before tables: unknown fields are refused."""

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            bodies.append(body)
            refused = "contract" in body or "contract_hash" in body
            self.send_response(422 if refused else 204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Older)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reporter = _reporter(tmp_path, f"http://127.0.0.1:{server.server_address[1]}/r")
        assert reporter.send_now()
        assert reporter.send_now()
    finally:
        server.shutdown()
        server.server_close()
    assert "contract" in bodies[0]
    assert "contract_hash" not in bodies[-1]
    assert len(bodies) == 3  # the table once, refused; then the plain reports
