"""The controller API over real HTTP on loopback: auth, validation, wire format, ETag.

One uvicorn server per module, in a thread, on a free port, over a temporary
SQLite file migrated with the real migrations. Tests that look at ETags or
stored rows use their own node names, so they do not depend on each other.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy.engine import Engine

from controller import schedules as schedule_store
from controller import tasks
from controller.api import PullCache, create_app, etag_matches, schedules_body
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.models import TaskIn
from controller.testing import serve_in_thread
from sched_core.errors import PullError
from sched_core.model import LocalSchedule
from sched_core.scheduler import Config, Fire, Scheduler
from sched_core.values import STORED_BEFORE_RULES
from tests.factories import nightly
from tests.procs import wait_for

ADMIN_TOKEN = "admin-secret-token-0123456789"
NODE_A_TOKEN = "node-a-secret-token-abcdef"
NODE_B_TOKEN = "node-b-secret-token-fedcba"
AGENT_TOKEN = "agent-1-secret-token-777"
ALL_TOKENS = (ADMIN_TOKEN, NODE_A_TOKEN, NODE_B_TOKEN, AGENT_TOKEN)


def row(schedule_id: str, **changes: Any) -> dict[str, Any]:
    """Return a valid wire-format row (tests.factories.nightly, on storage b2) with changes."""
    return nightly(schedule_id, **{"storage": "b2", **changes})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


ADMIN = bearer(ADMIN_TOKEN)


@pytest.fixture(scope="module")
def db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('api') / 'controller.db'}"
    migrate(url)
    return url


@pytest.fixture(scope="module")
def base_url(db_url: str) -> Iterator[str]:
    engine = make_engine(db_url)
    tokens = Tokens(
        admin=[ADMIN_TOKEN],
        nodes={"node-a": [NODE_A_TOKEN], "node-b": [NODE_B_TOKEN], "agent-1": [AGENT_TOKEN]},
    )
    try:
        with serve_in_thread(create_app(engine, tokens)) as url_:
            yield url_
    finally:
        engine.dispose()


@pytest.fixture()
def client(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def put(client: httpx.Client, node: str, data: dict[str, Any]) -> httpx.Response:
    return client.put(f"/api/nodes/{node}/schedules/{data['id']}", json=data, headers=ADMIN)


# --- auth matrix ----------------------------------------------------------------------

CALLERS = {
    "admin": bearer(ADMIN_TOKEN),
    "own-node": bearer(NODE_A_TOKEN),
    "other-node": bearer(NODE_B_TOKEN),
    "unknown": bearer("not-a-configured-token"),
    "missing": {},
    "wrong-scheme": {"Authorization": f"Basic {ADMIN_TOKEN}"},
}

# (operation, expected status per caller); the target is always node-a's data.
MATRIX: dict[str, dict[str, int]] = {
    "pull": {"admin": 200, "own-node": 200, "other-node": 403},
    "list-node": {"admin": 200, "own-node": 200, "other-node": 403},
    "get-one": {"admin": 200, "own-node": 200, "other-node": 403},
    "put": {"admin": 200, "own-node": 403, "other-node": 403},
    "delete": {"admin": 204, "own-node": 403, "other-node": 403},
    "nodes": {"admin": 200, "own-node": 403, "other-node": 403},
    "tasks-list": {"admin": 200, "own-node": 403, "other-node": 403},
    "task-get": {"admin": 200, "own-node": 403, "other-node": 403},
    "task-put": {"admin": 200, "own-node": 403, "other-node": 403},
    "task-delete": {"admin": 204, "own-node": 403, "other-node": 403},
    "task-dispatches": {"admin": 200, "own-node": 403, "other-node": 403},
}
for _expected in MATRIX.values():
    _expected.update({"unknown": 401, "missing": 401, "wrong-scheme": 401})

TASK = {"cron": "30 2 * * *", "event": "backup.nightly", "payload": {"repo": "r-9"}}


def call(
    client: httpx.Client, operation: str, headers: dict[str, str], key: str
) -> httpx.Response:
    """Perform operation on node-a's data (rows and tasks named after key)."""
    if operation == "pull":
        return client.get("/api/schedules", params={"node": "node-a"}, headers=headers)
    if operation == "list-node":
        return client.get("/api/nodes/node-a/schedules", headers=headers)
    if operation == "get-one":
        return client.get(f"/api/nodes/node-a/schedules/{key}", headers=headers)
    if operation == "put":
        return client.put(f"/api/nodes/node-a/schedules/{key}", json=row(key), headers=headers)
    if operation == "delete":
        return client.delete(f"/api/nodes/node-a/schedules/{key}", headers=headers)
    if operation == "nodes":
        return client.get("/api/nodes", headers=headers)
    if operation == "tasks-list":
        return client.get("/api/tasks", headers=headers)
    if operation == "task-get":
        return client.get(f"/api/tasks/{key}", headers=headers)
    if operation == "task-put":
        return client.put(f"/api/tasks/{key}", json=TASK, headers=headers)
    if operation == "task-delete":
        return client.delete(f"/api/tasks/{key}", headers=headers)
    if operation == "task-dispatches":
        return client.get(f"/api/tasks/{key}/dispatches", headers=headers)
    raise AssertionError(operation)


@pytest.mark.parametrize("caller", list(CALLERS))
@pytest.mark.parametrize("operation", list(MATRIX))
def test_auth_matrix(client: httpx.Client, operation: str, caller: str) -> None:
    key = f"m-{operation}-{caller}"
    # The target exists, so the admin's answer is the success code, not a 404.
    assert put(client, "node-a", row(key)).status_code == 200
    assert client.put(f"/api/tasks/{key}", json=TASK, headers=ADMIN).status_code == 200

    response = call(client, operation, CALLERS[caller], key)

    assert response.status_code == MATRIX[operation][caller], response.text
    if response.status_code == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")
    for token in ALL_TOKENS:
        assert token not in response.text


def test_refused_write_changes_nothing(client: httpx.Client) -> None:
    assert put(client, "node-a", row("keep-me", name="original")).status_code == 200
    changed = row("keep-me", name="changed by a node")
    for headers in (bearer(NODE_A_TOKEN), bearer(NODE_B_TOKEN), {}):
        answer = client.put("/api/nodes/node-a/schedules/keep-me", json=changed, headers=headers)
        assert answer.status_code in (401, 403)
        deleted = client.delete("/api/nodes/node-a/schedules/keep-me", headers=headers)
        assert deleted.status_code in (401, 403)
    stored = client.get("/api/nodes/node-a/schedules/keep-me", headers=ADMIN).json()
    assert stored["name"] == "original"
    assert stored["version"] == 1


def test_node_token_reads_only_its_node_on_every_read_path(client: httpx.Client) -> None:
    assert put(client, "node-b", row("b-only")).status_code == 200
    headers = bearer(NODE_A_TOKEN)
    assert client.get("/api/schedules?node=node-b", headers=headers).status_code == 403
    assert client.get("/api/nodes/node-b/schedules", headers=headers).status_code == 403
    assert client.get("/api/nodes/node-b/schedules/b-only", headers=headers).status_code == 403
    own = client.get("/api/schedules?node=node-b", headers=bearer(NODE_B_TOKEN))
    assert own.status_code == 200
    assert "b-only" in [s["id"] for s in own.json()["schedules"]]


def test_authentication_is_checked_before_the_body(client: httpx.Client) -> None:
    response = client.put(
        "/api/nodes/node-a/schedules/x", content=b"{not json", headers={"X-Other": "1"}
    )
    assert response.status_code == 401
    assert client.get("/api/schedules").status_code == 401  # no node, no token: 401 first


def test_healthz_needs_no_token_and_checks_the_database(client: httpx.Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


def healthz_of(engine: Engine) -> httpx.Response:
    """GET /healthz of an app of its own on engine, which is disposed of after."""
    try:
        with serve_in_thread(create_app(engine, Tokens(admin=[ADMIN_TOKEN]))) as url:
            return httpx.get(f"{url}/healthz", timeout=30)
    finally:
        engine.dispose()


def test_healthz_reports_an_unreachable_database(tmp_path: Path) -> None:
    # A SQLite file inside a folder that is really a file cannot be opened.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    engine = make_engine(f"sqlite:///{tmp_path}/missing/controller.db")
    # make_engine made the folder and an empty private file; the folder becomes a file.
    (tmp_path / "missing" / "controller.db").unlink()
    (tmp_path / "missing").rmdir()
    (tmp_path / "missing").symlink_to(blocker)
    response = healthz_of(engine)
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable"


# --- wire format and CRUD -------------------------------------------------------------


def test_pull_answer_is_byte_for_byte_the_go_json(client: httpx.Client) -> None:
    first = row("w-1", name="a <b> & c", params={"z": 1, "a": [True, None]})
    second = row("w-2", storage="", params=None,
                 schedule={"days": ["*"], "hours": ["*"], "minute": "0", "interval_minutes": 15})
    assert put(client, "wire", second).status_code == 200
    assert put(client, "wire", first).status_code == 200

    response = client.get("/api/schedules", params={"node": "wire"}, headers=ADMIN)

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    expected = [
        LocalSchedule.model_validate({**first, "version": 1}),
        LocalSchedule.model_validate({**second, "version": 1}),
    ]
    assert response.content == schedules_body(expected)
    raw = response.content.decode()
    assert '"name":"a \\u003cb\\u003e \\u0026 c"' in raw  # Go escapes <, > and &
    assert '"storage"' not in raw.split('"id":"w-2"')[1]  # omitempty
    assert '"params"' not in raw.split('"id":"w-2"')[1]
    assert response.content.startswith(b'{"schedules":[{"id":"w-1","name":')
    # The answer parses back to the same rows.
    parsed = [LocalSchedule.model_validate(s) for s in response.json()["schedules"]]
    assert parsed == expected


def test_path_and_query_forms_of_the_pull_agree(client: httpx.Client) -> None:
    assert put(client, "forms", row("f-1")).status_code == 200
    by_query = client.get("/api/schedules?node=forms", headers=ADMIN)
    by_path = client.get("/api/nodes/forms/schedules", headers=ADMIN)
    assert by_query.content == by_path.content
    assert by_query.headers["etag"] == by_path.headers["etag"]


def test_empty_node_answers_an_empty_list(client: httpx.Client) -> None:
    response = client.get("/api/schedules?node=never-seen", headers=ADMIN)
    assert response.status_code == 200
    assert response.content == b'{"schedules":[]}'
    assert response.headers["etag"]


def test_put_bumps_version_and_ignores_the_body_version(client: httpx.Client) -> None:
    first = put(client, "crud", row("c-1", version=99))
    assert first.status_code == 200
    assert first.json()["version"] == 1
    second = put(client, "crud", row("c-1", name="renamed"))
    assert second.json()["version"] == 2
    assert second.json()["name"] == "renamed"
    got = client.get("/api/nodes/crud/schedules/c-1", headers=ADMIN)
    # PUT answers the stored row's bytes, plus the fleet contract's "_propagation" key.
    assert second.content.startswith(got.content[:-1] + b',"_propagation":{')
    assert {k: v for k, v in second.json().items() if k != "_propagation"} == got.json()


def test_put_takes_the_id_from_the_path_when_the_body_has_none(client: httpx.Client) -> None:
    data = row("unused")
    del data["id"]
    response = client.put("/api/nodes/crud/schedules/from-path", json=data, headers=ADMIN)
    assert response.status_code == 200
    assert response.json()["id"] == "from-path"


def test_delete_then_get_is_404_and_second_delete_is_404(client: httpx.Client) -> None:
    assert put(client, "crud", row("d-1")).status_code == 200
    assert client.delete("/api/nodes/crud/schedules/d-1", headers=ADMIN).status_code == 204
    assert client.get("/api/nodes/crud/schedules/d-1", headers=ADMIN).status_code == 404
    assert client.delete("/api/nodes/crud/schedules/d-1", headers=ADMIN).status_code == 404


def test_nodes_lists_nodes_with_rows(client: httpx.Client) -> None:
    assert put(client, "listed-node", row("n-1")).status_code == 200
    nodes = client.get("/api/nodes", headers=ADMIN).json()["nodes"]
    assert "listed-node" in nodes
    assert nodes == sorted(nodes)


def test_task_crud(client: httpx.Client) -> None:
    saved = client.put("/api/tasks/t-crud", json=TASK, headers=ADMIN)
    assert saved.status_code == 200, saved.text
    assert saved.json()["name"] == "t-crud"
    assert saved.json()["event"] == "sched.task.backup.nightly"
    assert saved.json()["next_run_at"]
    got = client.get("/api/tasks/t-crud", headers=ADMIN)
    assert got.json()["cron"] == "30 2 * * *"
    names = [t["name"] for t in client.get("/api/tasks", headers=ADMIN).json()["tasks"]]
    assert "t-crud" in names
    assert client.delete("/api/tasks/t-crud", headers=ADMIN).status_code == 204
    assert client.get("/api/tasks/t-crud", headers=ADMIN).status_code == 404
    assert client.delete("/api/tasks/t-crud", headers=ADMIN).status_code == 404


def test_task_dispatches_list_the_newest_records_first(base_url: str, db_url: str) -> None:
    """What an operator reads after a missed run: each dispatch, its status and error."""
    from sqlmodel import Session

    from controller.central import CentralScheduler, CentralSettings
    from controller.testing import RecordingDispatcher

    t0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            task = TaskIn(name="t-dispatches", cron="0 * * * *", event="x")
            tasks.save_task(session, task, now=t0 - timedelta(minutes=1))
        scheduler = CentralScheduler(
            engine, CentralSettings(max_attempts=1), worker_id="w-api",
            dispatcher=RecordingDispatcher(fail_names={"t-dispatches"}),
        )
        try:
            assert scheduler.run_once(now=t0) == 1  # fails: gives up on 12:00
            scheduler.dispatcher = RecordingDispatcher()
            assert scheduler.run_once(now=t0 + timedelta(hours=1)) == 1
        finally:
            scheduler.stop()
    finally:
        engine.dispose()
    with httpx.Client(base_url=base_url, timeout=30) as client:
        response = client.get("/api/tasks/t-dispatches/dispatches", headers=ADMIN)
        assert response.status_code == 200, response.text
        records = response.json()["dispatches"]
        assert [(r["scheduled_at"], r["status"]) for r in records] == [
            ("2026-12-02T13:00:00Z", "dispatched"), ("2026-12-02T12:00:00Z", "failed")]
        assert records[1]["error"].startswith("gave up after 1 failed dispatch attempts")
        one = client.get("/api/tasks/t-dispatches/dispatches?limit=1", headers=ADMIN).json()
        assert [r["status"] for r in one["dispatches"]] == ["dispatched"]
        bad = client.get("/api/tasks/t-dispatches/dispatches?limit=0", headers=ADMIN)
        assert bad.status_code == 422 and "limit" in bad.text
        missing = client.get("/api/tasks/no-such-task/dispatches", headers=ADMIN)
        assert missing.status_code == 404 and "no-such-task" in missing.text


# --- validation -------------------------------------------------------------------------


def only_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert len(detail) == 1, detail
    error: dict[str, Any] = detail[0]
    return error


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"schedule": {"days": ["Mon"], "hours": ["2"], "minute": "30"}},
         "schedule", "unknown day name 'Mon'"),
        ({"schedule": {"days": ["mon"], "hours": ["24"], "minute": "30"}},
         "schedule", "hour '24'"),
        ({"schedule": {"days": ["mon"], "hours": ["2"], "minute": "60"}},
         "schedule", "minute '60'"),
        ({"schedule": {"days": [], "hours": ["2"], "minute": "1"}}, "schedule", "days is empty"),
        ({"schedule": {"interval_minutes": 0}}, "schedule", "interval_minutes 0 is below 1"),
        ({"miss_policy": "sometimes"}, "miss_policy", "'skip', 'run-once-within-24h' or"),
        ({"enabled": "perhaps"}, "enabled", "boolean"),
        ({"action": ""}, "action", "at least 1"),
        ({"schedule": "nightly"}, "schedule", "Input should be an object"),
    ],
)
def test_invalid_schedule_is_422_naming_the_field(
    client: httpx.Client, changes: dict[str, Any], field: str, words: str
) -> None:
    key = f"bad-{abs(hash(json.dumps(changes, sort_keys=True)))}"
    error = only_error(put(client, "valid", row(key, **changes)))
    assert error["field"] == field
    assert error["loc"][0] == "body"
    assert words in error["msg"]
    if field == "miss_policy":
        assert error["input"] == "sometimes"
    assert client.get(f"/api/nodes/valid/schedules/{key}", headers=ADMIN).status_code == 404


@pytest.mark.parametrize("expr", ["0 0 30 2 *", "0 0 31 4,6 *"])
def test_a_cron_that_never_matches_is_422_and_keeps_the_last_good_task(
    client: httpx.Client, expr: str
) -> None:
    name = f"t-never-{expr.replace(' ', '_').replace('*', 'x')}"
    good = {"cron": "0 6 * * *", "event": "report"}
    assert client.put(f"/api/tasks/{name}", json=good, headers=ADMIN).status_code == 200
    bad = client.put(f"/api/tasks/{name}", json={**good, "cron": expr}, headers=ADMIN)
    error = only_error(bad)
    assert error["field"] == "cron"
    assert f"cron expression '{expr}' never matches" in error["msg"]
    assert client.get(f"/api/tasks/{name}", headers=ADMIN).json()["cron"] == "0 6 * * *"


def test_a_new_task_with_a_never_matching_cron_is_not_created(client: httpx.Client) -> None:
    body = {"cron": "0 0 30 2 *", "event": "report"}
    only_error(client.put("/api/tasks/t-never-new", json=body, headers=ADMIN))
    assert client.get("/api/tasks/t-never-new", headers=ADMIN).status_code == 404


def test_missing_field_is_named(client: httpx.Client) -> None:
    data = row("no-action")
    del data["action"]
    error = only_error(put(client, "valid", data))
    assert error["field"] == "action"
    assert error["type"] == "missing"


def test_body_id_differing_from_path_is_422(client: httpx.Client) -> None:
    response = client.put("/api/nodes/valid/schedules/path-id", json=row("body-id"),
                          headers=ADMIN)
    error = only_error(response)
    assert error["field"] == "id"
    assert "'body-id'" in error["msg"] and "'path-id'" in error["msg"]
    assert client.get("/api/nodes/valid/schedules/path-id", headers=ADMIN).status_code == 404
    assert client.get("/api/nodes/valid/schedules/body-id", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    ("field", "value"),
    [("repo_id", "q/../../escaped"), ("repo_id", "*"), ("action", "-o"), ("action", "back up"),
     ("id", ".hidden"), ("id", "a" * 129)],
)
def test_hostile_identifier_is_422_naming_the_field(
    client: httpx.Client, field: str, value: str
) -> None:
    """Identifiers end up in argv, file names and find patterns: they are checked here."""
    sid = value if field == "id" else "ident-1"
    response = client.put(f"/api/nodes/valid/schedules/{sid}",
                          json=row(sid, **{field: value}), headers=ADMIN)
    error = only_error(response)
    assert error["field"] == field and "is not an identifier" in error["msg"]
    assert client.get(f"/api/nodes/valid/schedules/{sid}", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    "node", [".hidden", "-o", "a b", "a*b", "x\x1b[2Jy", "\u00e9t\u00e9", "n" * 129, "~n"],
)
def test_a_node_name_that_is_no_identifier_is_422_on_a_write(
    client: httpx.Client, node: str
) -> None:
    """Node names follow the kit's identifier rule when stored: 422 naming node, nothing stored."""
    response = client.put(f"/api/nodes/{quote(node, safe='')}/schedules/s-1", json=row("s-1"),
                          headers=ADMIN)
    error = only_error(response)
    assert error["field"] == "node" and error["loc"] == ["path", "node"]
    assert "is not an identifier" in error["msg"]
    assert node not in client.get("/api/nodes", headers=ADMIN).json()["nodes"]


def test_a_node_stored_before_the_identifier_rule_stays_readable_and_deletable(
    db_url: str, client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """As the length rule: reads and deletes of a stored legacy node name keep working."""
    from sqlmodel import Session

    caplog.set_level(logging.INFO)
    legacy = ["\u00e9t\u00e9", "x\x1b[2Jy"]
    engine = make_engine(db_url)
    try:
        with Session(engine) as session:
            for node in legacy:
                schedule_store.put_schedule(session, node, LocalSchedule.model_validate(
                    {**row("legacy-1"), "version": 1}, context={STORED_BEFORE_RULES: True}
                ))
            session.commit()
    finally:
        engine.dispose()
    listed = client.get("/api/nodes", headers=ADMIN).json()["nodes"]
    assert set(legacy) <= set(listed)
    for node in legacy:
        pulled = client.get("/api/schedules", params={"node": node}, headers=ADMIN)
        assert [r["id"] for r in pulled.json()["schedules"]] == ["legacy-1"]
        path = f"/api/nodes/{quote(node, safe='')}/schedules/legacy-1"
        assert client.get(path, headers=ADMIN).status_code == 200
        assert client.delete(path, headers=ADMIN).status_code == 204
        # A write to it is refused: the row cannot be re-created under that name.
        only_error(client.put(path, json=row("legacy-1"), headers=ADMIN))
    # The escape sequence reached no log line raw: the access log's and the delete's.
    for record in caplog.records:
        assert "\x1b" not in record.getMessage(), record.getMessage()
        assert all("\x1b" not in str(v) for v in record.__dict__.values()), record.__dict__
    deleted = [r for r in caplog.records if r.getMessage() == "schedule deleted"]
    assert [r.__dict__["node"] for r in deleted] == ["\u00e9t\u00e9", "x\\x1b[2Jy"]


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"{not json", "invalid JSON"), (b"[1, 2]", "JSON object"),
     (b'{"name": "n", "params": {"x": NaN}}', "NaN is not JSON"),
     (b"\xff", "the body is not UTF-8 (byte 0xff at offset 0)")],
)
def test_malformed_body_is_422(client: httpx.Client, content: bytes, words: str) -> None:
    response = client.put("/api/nodes/valid/schedules/x", content=content, headers=ADMIN)
    error = only_error(response)
    assert error["loc"] == ["body"]
    assert words in error["msg"]


def test_oversized_body_is_413(client: httpx.Client) -> None:
    data = row("huge", params={"blob": "x" * (1 << 20)})
    assert put(client, "valid", data).status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"blob": "'
        for _ in range(300):
            yield b"x" * 4096
        yield b'"}'

    response = client.put("/api/nodes/valid/schedules/huge", content=chunked(), headers=ADMIN)
    assert response.status_code == 413
    assert client.get("/api/nodes/valid/schedules/huge", headers=ADMIN).status_code == 404


def test_healthz_fails_on_an_unmigrated_database(tmp_path: Path) -> None:
    response = healthz_of(make_engine(f"sqlite:///{tmp_path / 'empty.db'}"))
    assert response.status_code == 503


def test_pull_without_node_is_422_naming_node(client: httpx.Client) -> None:
    error = only_error(client.get("/api/schedules", headers=ADMIN))
    assert error["field"] == "node"


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({**TASK, "timezone": "Mars/Olympus"}, "timezone", "unknown timezone 'Mars/Olympus'"),
        ({**TASK, "cron": "61 * * * *"}, "cron", "invalid cron expression '61 * * * *'"),
        ({"cron": "* * * * *", "payload": {}}, "", "exactly one of event or deployment"),
        ({**TASK, "name": "other-name"}, "name", "differs"),
        ({**TASK, "payload": [1]}, "payload", "Input should be an object"),
        # These answered 500: a folder of the zone database, a name too long for a
        # file name, an instant before year 1 once in UTC.
        ({**TASK, "timezone": "Europe"}, "timezone", "unknown timezone 'Europe'"),
        ({**TASK, "timezone": "America/"}, "timezone", "unknown timezone 'America/'"),
        ({**TASK, "timezone": "Z" * 256}, "timezone", "256 characters long; the most is 64"),
        ({**TASK, "timezone": "Europe/" + "P" * 300}, "timezone", "307 characters long"),
        ({"run_at": "0001-01-01T00:00:00+01:00", "event": "x"}, "run_at",
         "run_at 0001-01-01T00:00:00+01:00 is out of range in UTC"),
        ({"run_at": "9999-12-31T23:30:00-01:00", "event": "x"}, "run_at", "out of range"),
    ],
)
def test_invalid_task_is_422_naming_the_problem(
    client: httpx.Client, body: dict[str, Any], field: str, words: str
) -> None:
    error = only_error(client.put("/api/tasks/t-invalid", json=body, headers=ADMIN))
    assert error["field"] == field
    assert words in error["msg"]
    assert client.get("/api/tasks/t-invalid", headers=ADMIN).status_code == 404


def _raw_put(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.put(path, content=body.encode(),
                      headers={**ADMIN, "Content-Type": "application/json"})


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1" + "0" * 400, "-1" + "0" * 4400])
def test_number_beyond_a_float64_is_422_and_keeps_the_last_good_row(
    client: httpx.Client, number: str
) -> None:
    """Go's encoding/json refuses such a number; Python's json read 1e400 as inf, served null."""
    key = f"n-{len(number)}"  # each case its own row and task
    path = f"/api/nodes/numbers/schedules/{key}"
    assert put(client, "numbers", row(key, params={"threads": 4})).status_code == 200
    body = json.dumps(row(key)).replace('"threads": 4', f'"threads": {number}')
    error = only_error(_raw_put(client, path, body))
    assert error["loc"] == ["body"] and "beyond a float64" in error["msg"]
    assert number[:20] in error["msg"] and len(error["msg"]) < 200
    task = json.dumps({**TASK, "payload": {"size": 0}}).replace("0}", f"{number}}}")
    assert "beyond a float64" in only_error(_raw_put(client, f"/api/tasks/t-{key}", task))["msg"]
    kept = client.get(path, headers=ADMIN).json()
    assert (kept["params"], kept["version"]) == ({"threads": 4}, 1)
    assert client.get(f"/api/tasks/t-{key}", headers=ADMIN).status_code == 404


def test_numbers_within_a_float64_are_kept_exactly(client: httpx.Client) -> None:
    params = {"big": 10**40, "i64": 2**63, "neg": -(2**64), "max": 1.7976931348623157e308,
              "tiny": 5e-324, "under": 0.0}
    body = json.dumps(row("exact", params=params)).replace("0.0}", "1e-400}")
    saved = _raw_put(client, "/api/nodes/numbers/schedules/exact", body)
    assert saved.status_code == 200, saved.text
    pulled = client.get("/api/schedules?node=numbers", headers=ADMIN).json()["schedules"]
    assert [s["params"] for s in pulled if s["id"] == "exact"] == [{**params, "under": 0.0}]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def test_body_nested_too_deep_is_422(client: httpx.Client) -> None:
    """The body is level 1, so params may nest 99 deep; a RecursionError was a 500."""
    path = "/api/nodes/deep/schedules/d-1"
    assert put(client, "deep", row("d-1", params=_nested(99))).status_code == 200
    error = only_error(put(client, "deep", row("d-1", params=_nested(100))))
    assert error["field"] == "params" and "deeper than 100" in error["msg"]
    error = only_error(_raw_put(client, path, '{"params": ' + "[" * 5000 + "]" * 5000 + "}"))
    assert "deeper than 100" in error["msg"]
    assert client.get(path, headers=ADMIN).json()["version"] == 1


@pytest.mark.parametrize(
    ("key", "raw", "field", "words"),
    [
        ("name", '"a\\u0000b"', "name", "NUL character"),
        ("storage", '"\\u0000"', "storage", "NUL character"),
        ("name", '"\\ud800"', "name", "unpaired UTF-16 surrogate"),
        ("params", '{"x": ["ok", "\\udc00"]}', "params.x.1", "unpaired UTF-16 surrogate"),
        ("params", '{"\\ud83d": 1}', "params.\\ud83d", "unpaired UTF-16 surrogate"),
    ],
)
def test_text_no_database_holds_is_422_naming_the_field(
    client: httpx.Client, key: str, raw: str, field: str, words: str
) -> None:
    """Postgres text holds no NUL (a 500 there, stored on SQLite); a lone surrogate was a 500."""
    others = {name: value for name, value in row("t-1").items() if name != key}
    body = json.dumps(others)[:-1] + f', "{key}": {raw}}}'
    error = only_error(_raw_put(client, "/api/nodes/text/schedules/t-1", body))
    assert error["field"] == field and words in error["msg"]
    assert client.get("/api/nodes/text/schedules/t-1", headers=ADMIN).status_code == 404


def test_nul_inside_params_is_kept_as_json_escapes(client: httpx.Client) -> None:
    """A JSON column stores the escape, so params (unlike text fields) may hold a NUL."""
    assert put(client, "text", row("nul-ok", params={"a\u0000": "b\u0000"})).status_code == 200
    got = client.get("/api/nodes/text/schedules/nul-ok", headers=ADMIN)
    assert got.json()["params"] == {"a\u0000": "b\u0000"}


# --- ETag ---------------------------------------------------------------------------------


def pull(client: httpx.Client, node: str, etag: str | None = None) -> httpx.Response:
    headers = dict(ADMIN)
    if etag is not None:
        headers["If-None-Match"] = etag
    return client.get("/api/schedules", params={"node": node}, headers=headers)


def test_etag_gives_304_until_a_write_and_again_after_a_delete(client: httpx.Client) -> None:
    assert put(client, "etag", row("e-1")).status_code == 200
    first = pull(client, "etag")
    etag = first.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"')

    unchanged = pull(client, "etag", etag)
    assert unchanged.status_code == 304
    assert unchanged.content == b""
    assert unchanged.headers["etag"] == etag

    assert put(client, "etag", row("e-2")).status_code == 200
    after_write = pull(client, "etag", etag)
    assert after_write.status_code == 200
    assert after_write.headers["etag"] != etag
    assert [s["id"] for s in after_write.json()["schedules"]] == ["e-1", "e-2"]
    written_etag = after_write.headers["etag"]
    assert pull(client, "etag", written_etag).status_code == 304

    assert client.delete("/api/nodes/etag/schedules/e-1", headers=ADMIN).status_code == 204
    after_delete = pull(client, "etag", written_etag)
    assert after_delete.status_code == 200
    assert after_delete.headers["etag"] not in (etag, written_etag)
    assert [s["id"] for s in after_delete.json()["schedules"]] == ["e-2"]
    assert pull(client, "etag", after_delete.headers["etag"]).status_code == 304


def test_etag_changes_when_a_row_is_replaced_with_identical_content(
    client: httpx.Client,
) -> None:
    assert put(client, "etag-same", row("s-1")).status_code == 200
    before = pull(client, "etag-same").headers["etag"]
    assert put(client, "etag-same", row("s-1")).status_code == 200  # the version is bumped
    assert pull(client, "etag-same", before).status_code == 200


def test_failed_and_refused_writes_keep_the_etag(client: httpx.Client) -> None:
    assert put(client, "etag-keep", row("k-1")).status_code == 200
    etag = pull(client, "etag-keep").headers["etag"]
    bad = row("k-1", schedule={"days": ["Mon"], "hours": ["2"], "minute": "3"})
    assert put(client, "etag-keep", bad).status_code == 422
    refused = client.put("/api/nodes/etag-keep/schedules/k-1", json=row("k-1"),
                         headers=bearer(NODE_A_TOKEN))
    assert refused.status_code == 403
    assert client.delete("/api/nodes/etag-keep/schedules/nope", headers=ADMIN).status_code == 404
    assert pull(client, "etag-keep", etag).status_code == 304


def test_etag_of_one_node_ignores_writes_to_another(client: httpx.Client) -> None:
    assert put(client, "etag-x", row("x-1")).status_code == 200
    etag = pull(client, "etag-x").headers["etag"]
    assert put(client, "etag-y", row("y-1")).status_code == 200
    assert pull(client, "etag-x", etag).status_code == 304


@pytest.mark.parametrize(
    ("header", "matches"),
    [('"a-1"', True), ('W/"a-1"', True), ('"b", "a-1"', True), ("*", True),
     ('"a-2"', False), ("", False), ('"a-1-"', False)],
)
def test_if_none_match_parsing(header: str, matches: bool) -> None:
    assert etag_matches(header, '"a-1"') is matches


def test_if_none_match_star_and_list_over_http(client: httpx.Client) -> None:
    assert put(client, "etag-star", row("st-1")).status_code == 200
    etag = pull(client, "etag-star").headers["etag"]
    assert pull(client, "etag-star", "*").status_code == 304
    assert pull(client, "etag-star", f'"nope", W/{etag}').status_code == 304
    assert pull(client, "etag-star", '"nope"').status_code == 200


def test_304_needs_authorization_too(client: httpx.Client) -> None:
    assert put(client, "node-a", row("auth-etag")).status_code == 200
    etag = pull(client, "node-a").headers["etag"]
    response = client.get("/api/schedules?node=node-a",
                          headers={**bearer(NODE_B_TOKEN), "If-None-Match": etag})
    assert response.status_code == 403
    assert client.get("/api/schedules?node=node-a",
                      headers={"If-None-Match": etag}).status_code == 401


def test_node_etag_agrees_with_the_stores_list_etags(tmp_path: Path) -> None:
    """The pull reads node_etag first; it must equal the ETag of the rows it then reads."""
    from sqlmodel import Session

    url = f"sqlite:///{tmp_path / 'etag.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        with Session(engine) as session:

            def agree() -> str:
                _, listed = schedule_store.list_schedules(session, "n")
                _, wired = schedule_store.list_wire(session, "n")
                assert schedule_store.node_etag(session, "n") == listed == wired
                return listed

            seen = {agree()}  # never had rows
            schedule_store.put_schedule(session, "n", LocalSchedule.model_validate(row("a")))
            seen.add(agree())
            schedule_store.put_schedule(session, "other", LocalSchedule.model_validate(row("a")))
            assert agree() in seen
            schedule_store.put_schedule(session, "n", LocalSchedule.model_validate(row("b")))
            seen.add(agree())
            assert schedule_store.delete_schedule(session, "n", "a")
            assert schedule_store.delete_schedule(session, "n", "b")
            seen.add(agree())  # emptied, but not "never had rows"
            assert len(seen) == 4
    finally:
        engine.dispose()


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0])
def test_two_api_instances_never_serve_a_stale_list(tmp_path: Path, cache_bytes: int) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    migrate(url)
    engine_a, engine_b = make_engine(url), make_engine(url)
    tokens = Tokens(admin=[ADMIN_TOKEN])
    try:
        with serve_in_thread(create_app(engine_a, tokens, pull_cache_bytes=cache_bytes)) as a, \
                serve_in_thread(create_app(engine_b, tokens, pull_cache_bytes=cache_bytes)) as b:
            with httpx.Client(base_url=a, headers=ADMIN) as via_a, \
                    httpx.Client(base_url=b, headers=ADMIN) as via_b:
                assert put(via_a, "n", row("s-1")).status_code == 200
                first = via_b.get("/api/schedules?node=n")
                assert [s["id"] for s in first.json()["schedules"]] == ["s-1"]
                assert via_b.get("/api/schedules?node=n").content == first.content  # cached

                assert put(via_a, "n", row("s-1", name="renamed")).status_code == 200
                second = via_b.get("/api/schedules?node=n")
                assert second.json()["schedules"][0]["name"] == "renamed"
                assert second.headers["etag"] != first.headers["etag"]
                stale = via_b.get("/api/schedules?node=n",
                                  headers={"If-None-Match": first.headers["etag"]})
                assert stale.status_code == 200

                assert via_a.delete("/api/nodes/n/schedules/s-1").status_code == 204
                third = via_b.get("/api/schedules?node=n")
                assert third.content == b'{"schedules":[]}'
                assert third.headers["etag"] not in (first.headers["etag"],
                                                     second.headers["etag"])
    finally:
        engine_a.dispose()
        engine_b.dispose()


def test_pull_cache_serves_only_the_matching_etag_and_evicts_by_size() -> None:
    cache = PullCache(max_bytes=10)
    cache.put("a", '"1"', b"aaaa")
    assert cache.get("a", '"1"') == b"aaaa"
    assert cache.get("a", '"2"') is None
    assert cache.get("b", '"1"') is None
    cache.put("b", '"1"', b"bbbb")
    cache.get("a", '"1"')  # a is now the most recently used
    cache.put("c", '"1"', b"cccc")  # over 10 bytes: b goes
    assert cache.get("b", '"1"') is None
    assert cache.get("a", '"1"') == b"aaaa"
    assert cache.get("c", '"1"') == b"cccc"
    cache.put("a", '"2"', b"a2")  # a new version replaces the old one
    assert cache.get("a", '"1"') is None
    assert cache.get("a", '"2"') == b"a2"
    cache.put("huge", '"1"', b"x" * 11)  # larger than the whole cache: not kept
    assert cache.get("huge", '"1"') is None
    assert cache.get("c", '"1"') == b"cccc"


WIRE_ROWS = [
    # U+2028 (escaped by Go's encoder) in params: a name may not hold it.
    row("b-params", name="a <b> & c é", params={"z": 1, "a": [True, None, 1.5],
                                              "nested": {"k": "<&>"}, "sep": "a\u2028b"}),
    row("a-interval", storage="", params=None,
        schedule={"days": ["*"], "hours": ["*"], "minute": "0", "interval_minutes": 15}),
    row("c-on", action="prune", storage="s3 & <local>", params={},
        schedule={"days": ["mon"], "hours": ["3"], "minute": "5", "on": "after_wave"}),
    row("d-plain", name="", repo_id="", miss_policy="skip", enabled=False),
]


def test_uncached_pull_is_byte_for_byte_the_model_built_body(database_url: str) -> None:
    """The body spliced from stored wire JSON equals the one serialized from validated rows."""
    from sqlmodel import Session

    engine = make_engine(database_url)
    try:
        app = create_app(engine, Tokens(admin=[ADMIN_TOKEN]), pull_cache_bytes=0)
        with serve_in_thread(app) as base, \
                httpx.Client(base_url=base, headers=ADMIN, timeout=30) as client:
            for data in WIRE_ROWS:
                assert put(client, "wire-db", data).status_code == 200
            # An update: version 2, a new name and params.
            changed = row("b-params", name="renamed <again> &", params={"threads": 8})
            assert put(client, "wire-db", changed).status_code == 200
            assert put(client, "wire-other", row("x-1")).status_code == 200
            pulled = client.get("/api/schedules", params={"node": "wire-db"})
        with Session(engine) as session:
            models, etag = schedule_store.list_schedules(session, "wire-db")
            wires, wire_etag = schedule_store.list_wire(session, "wire-db")
    finally:
        engine.dispose()

    assert pulled.status_code == 200
    assert [m.model_dump_json() for m in models] == wires
    assert pulled.content == schedules_body(models)
    assert pulled.headers["etag"] == etag == wire_etag
    inputs = {d["id"]: {**d, "version": 1} for d in WIRE_ROWS}
    inputs["b-params"] = {**changed, "version": 2}
    expected = [LocalSchedule.model_validate(inputs[key]) for key in sorted(inputs)]
    assert pulled.content == schedules_body(expected)
    raw = pulled.content.decode()
    assert '"name":"renamed \\u003cagain\\u003e \\u0026"' in raw
    assert '"interval_minutes":15' in raw and '"on":"after_wave"' in raw
    assert '"storage":"s3 \\u0026 \\u003clocal\\u003e"' in raw


def test_round_trip_on_each_database(database_url: str) -> None:
    """Write, pull, 304, delete and a task through two instances, on SQLite and Postgres."""
    engines = [make_engine(database_url), make_engine(database_url)]
    tokens = Tokens(admin=[ADMIN_TOKEN], nodes={"node-a": [NODE_A_TOKEN]})
    try:
        with serve_in_thread(create_app(engines[0], tokens)) as a, \
                serve_in_thread(create_app(engines[1], tokens)) as b, \
                httpx.Client(base_url=a, headers=ADMIN, timeout=30) as writer, \
                httpx.Client(base_url=b, headers=bearer(NODE_A_TOKEN), timeout=30) as agent:
            empty = agent.get("/api/schedules?node=node-a")
            assert empty.content == b'{"schedules":[]}'
            for key in ("r-2", "r-1"):
                assert put(writer, "node-a", row(key, params={"k": key})).status_code == 200
            pulled = agent.get("/api/schedules?node=node-a")
            expected = [LocalSchedule.model_validate({**row(k, params={"k": k}), "version": 1})
                        for k in ("r-1", "r-2")]
            assert pulled.content == schedules_body(expected)
            etag = pulled.headers["etag"]
            assert etag != empty.headers["etag"]
            assert agent.get("/api/schedules?node=node-a",
                             headers={"If-None-Match": etag}).status_code == 304

            assert writer.delete("/api/nodes/node-a/schedules/r-1").status_code == 204
            after = agent.get("/api/schedules?node=node-a", headers={"If-None-Match": etag})
            assert after.status_code == 200
            assert [s["id"] for s in after.json()["schedules"]] == ["r-2"]
            assert agent.put("/api/nodes/node-a/schedules/r-2", json=row("r-2")).status_code == 403

            saved = writer.put("/api/tasks/t-1", json=TASK)
            assert saved.status_code == 200, saved.text
            assert writer.get("/api/tasks/t-1").json()["cron"] == TASK["cron"]
            assert a != b
    finally:
        for engine in engines:
            engine.dispose()


LONG = "n" * 201
NAME_CASES = [  # (method, path, field, words); admin token on each
    ("PUT", f"/api/nodes/{LONG}/schedules/s-1", "node", "201 characters long; the most is 200"),
    ("PUT", f"/api/nodes/node-a/schedules/{LONG}", "id", "201 characters long"),
    ("PUT", f"/api/tasks/{LONG}", "name", "201 characters"),
    ("PUT", "/api/nodes/a%00b/schedules/s-1", "node", "NUL character"),
    ("GET", "/api/schedules?node=a%00b", "node", "NUL character"),
    ("PUT", "/api/nodes/node-a/schedules/s%00", "id", "NUL character"),
    ("GET", "/api/nodes/node-a/schedules/s%00", "id", "NUL character"),
    ("PUT", "/api/tasks/t%00", "name", "NUL character"),
    ("PUT", "/api/nodes/node-a/schedules/s-2", "name", "NUL character"),  # in the body
    ("PUT", "/api/tasks/t-2", "event", "NUL character"),  # in the body
]


def test_names_no_column_holds_are_422_on_each_database(database_url: str) -> None:
    """Over 200 characters or with a NUL: 422 naming the field, never 500 (Postgres) or stored.

    SQLite stored such names, while Postgres failed with a 500 on the write
    (varchar(200), and text cannot hold NUL); now both refuse to store them, a
    NUL is refused on every path, and a longer name read or deleted is not found.
    """
    engine = make_engine(database_url)
    try:
        with serve_in_thread(create_app(engine, Tokens(admin=[ADMIN_TOKEN]))) as base, \
                httpx.Client(base_url=base, headers=ADMIN, timeout=30) as client:
            longest = "\u00e9" * 200  # 200 characters, 400 bytes: fits on both
            # A node name and a schedule id being stored are identifiers (ASCII, at most
            # 128 characters): such names are refused naming the field...
            refused = only_error(put(client, longest, row("s-1")))
            assert refused["field"] == "node" and "is not an identifier" in refused["msg"]
            refused = only_error(put(client, "node-a", row(longest)))
            assert refused["field"] == "id" and "is not an identifier" in refused["msg"]
            longest_id = "s" * 128
            # ...while a node name stored before the rule still fills its column.
            from sqlmodel import Session

            with Session(engine) as session:
                schedule_store.put_schedule(session, longest, LocalSchedule.model_validate(
                    {**row(longest_id), "version": 1}, context={STORED_BEFORE_RULES: True}
                ))
                session.commit()
            assert client.put(f"/api/tasks/{longest}", json=TASK).status_code == 200
            for method, path, field, words in NAME_CASES:
                body = None
                if method == "PUT":
                    data = TASK if "/tasks/" in path else row("s-1")
                    if path.endswith("/s-2"):
                        data = row("s-2", name="a\u0000b")
                    elif path.endswith("/t-2"):
                        data = {**TASK, "event": "a\u0000b"}
                    else:
                        data = {k: v for k, v in data.items() if k not in ("id", "name")}
                    body = json.dumps(data).encode()
                response = client.request(method, path, content=body)
                error = only_error(response)
                assert (error["field"], words in error["msg"]) == (field, True), (path, error)
            # Reading or deleting by a longer name is just not found, on both databases.
            for method, path, status in [
                ("GET", f"/api/nodes/{LONG}/schedules/s-1", 404),
                ("DELETE", f"/api/nodes/{LONG}/schedules/s-1", 404),
                ("GET", f"/api/nodes/node-a/schedules/{LONG}", 404),
                ("DELETE", f"/api/nodes/node-a/schedules/{LONG}", 404),
                ("GET", f"/api/nodes/{LONG}/schedules", 200),
                ("GET", f"/api/schedules?node={LONG}", 200),
                ("GET", f"/api/tasks/{LONG}", 404),
                ("GET", f"/api/tasks/{LONG}/dispatches", 404),
                ("DELETE", f"/api/tasks/{LONG}", 404),
            ]:
                assert client.request(method, path).status_code == status, (method, path)
            assert client.get(f"/api/schedules?node={LONG}").json() == {"schedules": []}
            nodes = client.get("/api/nodes").json()["nodes"]
            tasks = [task["name"] for task in client.get("/api/tasks").json()["tasks"]]
            got = client.get(f"/api/nodes/{longest}/schedules/{longest_id}")
            assert got.status_code == 200 and got.json()["id"] == longest_id
    finally:
        engine.dispose()
    assert nodes == [longest]
    assert tasks == [longest]


# --- logging --------------------------------------------------------------------------------


def test_access_log_has_node_and_status_and_never_a_token(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client.get("/api/schedules?node=node-a", headers=bearer(NODE_A_TOKEN))
    client.get("/api/schedules?node=node-a", headers=bearer(NODE_B_TOKEN))
    client.get("/api/schedules?node=node-a", headers=bearer("wrong-token-xyz"))
    put(client, "node-a", row("logged"))
    # An access line is written once the answer is sent: the client may read it first.
    wait_for("the PUT's access line", lambda: any(
        r.getMessage().startswith("PUT ") for r in caplog.records
        if r.name == "controller.access"), 10)

    access = [r for r in caplog.records if r.name == "controller.access"]
    lines = [r.getMessage() for r in access]
    assert any("node=node-a" in line and "principal=node:node-a" in line
               and "status=200" in line for line in lines), lines
    assert any("principal=node:node-b" in line and "status=403" in line for line in lines)
    assert any("status=401" in line for line in lines)
    assert any(line.startswith("PUT /api/nodes/node-a/schedules/logged") and
               "principal=admin" in line for line in lines)
    client.get("/api/schedules", params={"node": "x\nGET /forged status=200"}, headers=ADMIN)
    wait_for("the forged request's access line", lambda: "forged" in [
        r.getMessage() for r in caplog.records if r.name == "controller.access"][-1], 10)
    forged = [r.getMessage() for r in caplog.records if r.name == "controller.access"][-1]
    assert "\n" not in forged and "node=x\\nGET /forged" in forged
    everything = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    for token in (*ALL_TOKENS, "wrong-token-xyz"):
        assert token not in everything


# --- an agent pulling from the API -----------------------------------------------------------


def test_agent_scheduler_pulls_fires_and_follows_deletes(
    client: httpx.Client, base_url: str, tmp_path: Path
) -> None:
    hourly = row("a-hourly", schedule={"days": ["*"], "hours": ["*"], "minute": "30"})
    weekly = row("a-weekly", schedule={"days": ["sun"], "hours": ["4"], "minute": "0"})
    assert put(client, "agent-1", hourly).status_code == 200
    assert put(client, "agent-1", weekly).status_code == 200
    fires: list[Fire] = []
    # 2026-11-30 is a Monday; 07:30Z is 02:30 EST, a window of a-hourly.
    pulled_at = datetime(2026, 11, 30, 7, 29, 30, tzinfo=UTC)

    with httpx.Client(headers=bearer(AGENT_TOKEN), timeout=30) as http:
        scheduler = Scheduler(Config(
            pull_url=f"{base_url}/api/schedules?node=agent-1",
            node_name="agent-1",
            cache_path=tmp_path / "cache.json",
            fire=fires.append,
            http_client=http,
        ), now=pulled_at)
        try:
            result = scheduler.pull(now=pulled_at)
            assert result.added == ["a-hourly", "a-weekly"]
            assert result.rejected == []
            served = client.get("/api/schedules?node=agent-1", headers=ADMIN).json()
            assert [s.model_dump(mode="json") for s in scheduler.schedules()] == sorted(
                served["schedules"], key=lambda s: s["name"]
            )

            assert len(scheduler.turn(datetime(2026, 11, 30, 7, 30, 5, tzinfo=UTC)).fired) == 1
            assert [f.schedule.id for f in fires] == ["a-hourly"]
            assert fires[0].window == datetime(2026, 11, 30, 7, 30, tzinfo=UTC)

            assert client.delete("/api/nodes/agent-1/schedules/a-weekly",
                                 headers=ADMIN).status_code == 204
            again = scheduler.pull(now=datetime(2026, 11, 30, 7, 31, tzinfo=UTC))
            assert again.removed == ["a-weekly"]
            assert [s.id for s in scheduler.schedules()] == ["a-hourly"]
        finally:
            scheduler.stop()


def test_agent_with_another_nodes_token_keeps_its_last_good_list(
    client: httpx.Client, base_url: str, tmp_path: Path
) -> None:
    assert put(client, "agent-1", row("a-kept")).status_code == 200
    now = datetime(2026, 11, 30, 7, 0, tzinfo=UTC)
    config = {"node_name": "agent-1", "cache_path": tmp_path / "cache.json",
              "fire": lambda _fire: None}
    with httpx.Client(headers=bearer(AGENT_TOKEN), timeout=30) as http:
        Scheduler(Config(pull_url=f"{base_url}/api/schedules?node=agent-1",
                         http_client=http, **config), now=now).pull(now=now)
    for headers in (bearer(NODE_B_TOKEN), {}):
        with httpx.Client(headers=headers, timeout=30) as http:
            scheduler = Scheduler(Config(pull_url=f"{base_url}/api/schedules?node=agent-1",
                                         http_client=http, **config), now=now)
            with pytest.raises(PullError, match=r"HTTP 40[13]"):
                scheduler.pull(now=now)
            assert "a-kept" in [s.id for s in scheduler.schedules()]


def test_a_long_name_stored_before_the_limit_stays_readable_and_deletable(tmp_path: Path) -> None:
    """SQLite held names over 200 characters before the API refused them: GET and DELETE work."""
    from sqlmodel import Session

    url = f"sqlite:///{tmp_path / 'legacy.db'}"
    migrate(url)
    engine = make_engine(url)
    legacy = "x" * 250
    try:
        with Session(engine) as session:
            # Stored before the limits (and the identifier rule): as a legacy database holds it.
            schedule_store.put_schedule(session, "node-a", LocalSchedule.model_validate(
                {**row(legacy), "version": 1}, context={STORED_BEFORE_RULES: True}
            ))
        with serve_in_thread(create_app(engine, Tokens(admin=[ADMIN_TOKEN]))) as base, \
                httpx.Client(base_url=base, headers=ADMIN, timeout=30) as client:
            pulled = client.get("/api/schedules?node=node-a").json()["schedules"]
            assert [item["id"] for item in pulled] == [legacy]
            assert client.get(f"/api/nodes/node-a/schedules/{legacy}").status_code == 200
            assert client.delete(f"/api/nodes/node-a/schedules/{legacy}").status_code == 204
            assert client.get("/api/schedules?node=node-a").json() == {"schedules": []}
    finally:
        engine.dispose()


def test_a_pull_looks_its_token_up_once(tmp_path: Path) -> None:
    """A pull's route checks the token and its handler checks the node: one lookup serves
    both (with 10,000 node tokens each lookup was a measurable part of a pull)."""
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    lookups: list[str | None] = []

    class Counting(Tokens):
        def authenticate(self, token: str | None) -> Any:
            lookups.append(token)
            return super().authenticate(token)

    tokens = Counting(admin=[ADMIN_TOKEN], nodes={"node-a": [NODE_A_TOKEN]})
    with serve_in_thread(create_app(make_engine(url), tokens)) as base, \
            httpx.Client(base_url=base, timeout=30) as http:
        answer = http.get("/api/schedules", params={"node": "node-a"},
                          headers={"Authorization": f"Bearer {NODE_A_TOKEN}"})
        assert answer.status_code == 200, answer.text
        assert lookups == [NODE_A_TOKEN]
        lookups.clear()
        assert http.get("/api/nodes/node-a/schedules", headers=ADMIN).status_code == 200
        assert lookups == [ADMIN_TOKEN]
