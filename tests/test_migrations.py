"""The controller's migrations go up and down on SQLite and Postgres, and match the models."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlmodel import SQLModel

from controller import db
from controller import models as _models  # noqa: F401  (registers the tables)

TABLES = {"agent_schedule", "node_revision", "scheduled_task", "task_dispatch"}


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_empty_url"))
    return f"sqlite:///{tmp_path / 'fresh.db'}"


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _differences(url: str) -> list[object]:
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, SQLModel.metadata))
    finally:
        engine.dispose()


def test_migrations_go_up_down_and_up_again(empty_url: str) -> None:
    db.migrate(empty_url)
    assert _tables(empty_url) == TABLES
    db.downgrade(empty_url)
    assert _tables(empty_url) == set()
    db.migrate(empty_url, "head")
    assert _tables(empty_url) == TABLES


def test_the_migrated_schema_matches_the_models(empty_url: str) -> None:
    db.migrate(empty_url)
    foreign = {"alembic_version"}
    diffs = [d for d in _differences(empty_url)
             if not (isinstance(d, tuple) and d[0] == "remove_table" and d[1].name in foreign)]
    assert diffs == []


def test_migrate_is_idempotent(empty_url: str) -> None:
    db.migrate(empty_url)
    db.migrate(empty_url)
    assert _tables(empty_url) == TABLES


def test_database_url_defaults_and_normalises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCHED_DATABASE_URL", raising=False)
    assert db.database_url().database == str(db.DEFAULT_SQLITE_PATH)
    assert db.DEFAULT_SQLITE_PATH.parent.name == ".data"
    monkeypatch.setenv("SCHED_DATABASE_URL", "postgresql://u:secret@h:5432/sched")
    url = db.database_url()
    assert url.drivername == "postgresql+psycopg" and url.password == "secret"
    assert "secret" not in db.safe_url(url) and db.is_postgres(url)
    assert db.libpq_conninfo(url).startswith("postgresql://u:secret@h:5432/sched")


def test_wire_column_is_filled_for_existing_rows_and_dropped_on_downgrade(
    empty_url: str,
) -> None:
    from sqlalchemy import text

    from controller import schedules
    from sched_core.model import LocalSchedule

    db.migrate(empty_url, "0001")
    engine = db.make_engine(empty_url)
    row = {"id": "s-1", "name": "a <b> & c", "repo_id": "r-9", "action": "backup",
           "storage": "", "schedule": '{"days": ["mon"], "hours": ["2"], "minute": "30"}',
           "miss_policy": "skip", "enabled": True, "params": '{"threads": 4}', "version": 3}
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO agent_schedule (node, id, name, repo_id, action, storage, schedule,"
                " miss_policy, enabled, params, version, updated_at) VALUES ('n', :id, :name,"
                " :repo_id, :action, :storage, :schedule, :miss_policy, :enabled, :params,"
                " :version, CURRENT_TIMESTAMP)"), row)
            conn.execute(text(
                "INSERT INTO node_revision (node, epoch, revision) VALUES ('n', 'e', 1)"))
        db.migrate(empty_url)
        with engine.connect() as conn:
            (wire,) = conn.execute(text("SELECT wire FROM agent_schedule")).one()
        from sqlmodel import Session

        with Session(engine) as session:
            (model,), _ = schedules.list_schedules(session, "n")
        assert wire == model.model_dump_json()
        assert LocalSchedule.model_validate_json(wire).version == 3
        db.downgrade(empty_url, "0001")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM agent_schedule")).scalars().all() == ["s-1"]
            assert "wire" not in {c["name"] for c in inspect(conn).get_columns("agent_schedule")}
    finally:
        engine.dispose()


def test_upgrade_names_an_invalid_stored_row(empty_url: str) -> None:
    from sqlalchemy import text

    db.migrate(empty_url, "0001")
    engine = db.make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO agent_schedule (node, id, name, repo_id, action, storage, schedule,"
                " miss_policy, enabled, params, version, updated_at) VALUES ('n', 'bad-1', 'x',"
                " '', 'backup', '', '{\"days\": [\"someday\"], \"hours\": [\"2\"],"
                " \"minute\": \"30\"}', 'skip', true, NULL, 1, CURRENT_TIMESTAMP)"))
    finally:
        engine.dispose()
    with pytest.raises(ValueError, match="node='n' id='bad-1'"):
        db.migrate(empty_url)


def test_names_sort_by_code_point_on_every_database(empty_url: str) -> None:
    """A pull lists a node's rows in the same (byte) order on SQLite and Postgres."""
    import json

    from sqlalchemy import text
    from sqlmodel import Session

    from controller import schedules
    from sched_core.model import LocalSchedule

    db.migrate(empty_url)
    ids = ["b-1", "B-2", "a_1", "a-2", "a1", "\u00e9t\u00e9", "Z", "_x", "~y"]
    engine = db.make_engine(empty_url)
    try:
        with Session(engine) as session:
            for schedule_id in ids:
                schedules.put_schedule(session, "n", LocalSchedule.model_validate({
                    "id": schedule_id, "name": schedule_id, "action": "backup",
                    "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
                    "miss_policy": "skip", "enabled": True,
                }))
            listed, _ = schedules.list_schedules(session, "n")
            wire, _ = schedules.list_wire(session, "n")
        assert [row.id for row in listed] == sorted(ids)
        assert [json.loads(row)["id"] for row in wire] == sorted(ids)
        if db.is_postgres(empty_url):
            query = text("SELECT table_name || '.' || column_name, collation_name"
                         " FROM information_schema.columns WHERE table_name || '.' ||"
                         " column_name IN ('agent_schedule.node', 'agent_schedule.id',"
                         " 'node_revision.node', 'scheduled_task.name', 'task_dispatch.task_name')")
            with engine.connect() as conn:
                assert {row[0]: row[1] for row in conn.execute(query)} == dict.fromkeys(
                    ["agent_schedule.node", "agent_schedule.id", "node_revision.node",
                     "scheduled_task.name", "task_dispatch.task_name"], "C")
            db.downgrade(empty_url, "0002")
            with engine.connect() as conn:
                assert {row[1] for row in conn.execute(query)} == {None}
    finally:
        engine.dispose()
