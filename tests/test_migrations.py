"""The controller's migrations go up and down on SQLite and Postgres, and match the models."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlmodel import Session, SQLModel

from controller import db, schedules
from controller import models as _models  # noqa: F401  (registers the tables)
from sched_core.model import LocalSchedule
from sched_core.values import STORED_BEFORE_RULES

TABLES = {"agent_schedule", "node_revision", "scheduled_task", "task_dispatch", "node_report",
          "node_report_history", "node_pull", "revoked_session", "node_seen", "node_job",
          "schedule_version", "fleet_alert", "watch_turn", "node_contract", "login_failure"}
HEAD = ScriptDirectory.from_config(db.alembic_config("sqlite://")).get_current_head()
"""The newest revision: every upgrade below must end there."""


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


def test_database_url_defaults_and_normalises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SCHED_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert db.database_url().database == str(db.default_sqlite_path())
    assert db.default_sqlite_path().parent.name == ".data"
    # The working directory's .data, never the package's folder (site-packages in a wheel).
    assert db.default_sqlite_path() == tmp_path / ".data" / "controller.db"
    assert Path(db.__file__).resolve().parent.parent not in db.default_sqlite_path().parents
    monkeypatch.setenv("SCHED_DATABASE_URL", "postgresql://u:secret@h:5432/sched")
    url = db.database_url()
    assert url.drivername == "postgresql+psycopg" and url.password == "secret"
    assert "secret" not in db.safe_url(url) and db.is_postgres(url)
    assert db.libpq_conninfo(url).startswith("postgresql://u:secret@h:5432/sched")


def _schema(url: str) -> dict[str, Any]:
    """Return the revision, every table's columns and every table's indexes at url."""
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            inspector = inspect(conn)
            tables = sorted(inspector.get_table_names())
            versions = (conn.execute(text("SELECT version_num FROM alembic_version")).scalars()
                        .all() if "alembic_version" in tables else None)
            return {
                "alembic_version": versions,
                "columns": {t: [(c["name"], str(c["type"]), c["nullable"])
                                for c in inspector.get_columns(t)] for t in tables},
                "indexes": {t: sorted(str(i["name"]) for i in inspector.get_indexes(t))
                            for t in tables},
            }
    finally:
        engine.dispose()


def _execute(url: str, *statements: str) -> None:
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def _back_to_head(url: str) -> None:
    """Migrate up to head (again), and check the database says it is there."""
    db.migrate(url)
    assert _schema(url)["alembic_version"] == [HEAD]


def test_a_failed_upgrade_leaves_no_step_half_done(empty_url: str) -> None:
    """A failure after DDL rolls the whole upgrade back, on SQLite as on Postgres.

    The failure is real, not injected: a table made by hand under a name the schema
    creates makes the upgrade fail after it has created the tables before it.
    """
    _execute(empty_url, "CREATE TABLE node_contract (x INTEGER)")
    with pytest.raises(Exception, match="node_contract"):
        db.migrate(empty_url)
    assert _tables(empty_url) == {"node_contract"}
    assert _schema(empty_url)["alembic_version"] in (None, [])
    _execute(empty_url, "DROP TABLE node_contract")
    _back_to_head(empty_url)


_MIGRATOR = """
import sys, time
from pathlib import Path
from controller import db
folder = Path(sys.argv[2])
(folder / sys.argv[3]).touch()
while not (folder / "go").exists():
    time.sleep(0.001)
db.migrate(sys.argv[1])
"""


def test_concurrent_migrators_on_one_sqlite_file_all_succeed(tmp_path: Path) -> None:
    """Each waits for the one migrating, then finds the database at head."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    names = [f"ready-{n}" for n in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", _MIGRATOR, url, str(tmp_path), name],
                              stderr=subprocess.PIPE, text=True) for name in names]
    deadline = time.monotonic() + 60
    # Start them together, once each has imported everything.
    while not all((tmp_path / name).exists() for name in names) and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], errors
    assert _schema(url)["alembic_version"] == [HEAD]
    assert _tables(url) == TABLES


def test_a_new_file_waits_for_a_writer_before_it_turns_on_wal(tmp_path: Path) -> None:
    """SQLite refuses the WAL switch at once while another holds the write lock: ask again.

    Three migrators on a new file failed once this way ("database is locked"
    from ``PRAGMA journal_mode=WAL``, in 0.1 ms, whatever the busy timeout).
    Here the other connection is a plain writer on a file still in rollback
    mode; it commits 0.5 s later, and the new engine's connection then opens.
    """
    path = tmp_path / "fresh.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE t (x INTEGER)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    release = threading.Timer(0.5, writer.execute, ("COMMIT",))
    release.start()
    engine = db.make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("SELECT x FROM t").scalars().all() == [1]
    finally:
        release.join()
        engine.dispose()
        writer.close()


def test_migrate_at_head_does_not_wait_for_a_running_writer(tmp_path: Path) -> None:
    """A routine migrate at deploy time only reads: it never queues behind the write lock."""
    url = f"sqlite:///{tmp_path / 'busy.db'}"
    db.migrate(url)
    engine = db.make_engine(url)
    errors: list[BaseException] = []

    def again() -> None:
        try:
            db.migrate(url)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        with engine.connect() as writer:  # a controller in the middle of a write
            writer.execute(
                text("INSERT INTO node_revision (node, epoch, revision) VALUES ('n', 'e', 1)")
            )
            migrator = threading.Thread(target=again)
            migrator.start()
            migrator.join(timeout=20)  # the lock's busy timeout is 30 s
            assert not migrator.is_alive(), "migrate waited for the writer's lock"
            writer.rollback()
    finally:
        engine.dispose()
    assert errors == []
    assert _schema(url)["alembic_version"] == [HEAD]


def test_names_sort_by_code_point_on_every_database(empty_url: str) -> None:
    """A pull lists a node's rows in the same (byte) order on SQLite and Postgres."""
    db.migrate(empty_url)
    # "été" and "~y" are no identifiers now (the API refuses them), but rows stored
    # before the rule still list in byte order: they are read as such rows.
    ids = ["b-1", "B-2", "a_1", "a-2", "a1", "\u00e9t\u00e9", "Z", "_x", "~y"]
    engine = db.make_engine(empty_url)
    try:
        with Session(engine) as session:
            for schedule_id in ids:
                schedules.put_schedule(session, "n", LocalSchedule.model_validate({
                    "id": schedule_id, "name": schedule_id, "action": "backup",
                    "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
                    "miss_policy": "skip", "enabled": True,
                }, context={STORED_BEFORE_RULES: True}))
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
    finally:
        engine.dispose()
