"""The controller's migrations go up and down on SQLite and Postgres, and match the models."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlmodel import Session, SQLModel

from controller import db, nodes, schedules
from controller import models as _models  # noqa: F401  (registers the tables)
from controller.models import AgentSchedule
from sched_core.model import LocalSchedule
from sched_core.values import STORED_BEFORE_RULES

TABLES = {"agent_schedule", "node_revision", "scheduled_task", "task_dispatch", "node_report",
          "node_report_history", "node_pull", "revoked_session", "node_seen", "node_job",
          "schedule_version", "fleet_alert", "watch_turn", "node_contract", "login_failure"}
MORNING_TABLES = {"node_seen", "node_job", "schedule_version", "fleet_alert", "watch_turn",
                  "node_contract", "login_failure"}
"""0008's tables, and the later ones (0009's fleet watch turn, 0010's node contracts, 0011's
login failures)."""
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


def test_wire_column_is_filled_for_existing_rows_and_dropped_on_downgrade(
    empty_url: str,
) -> None:
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


def _put_before_0008(engine: Any, node: str, row: Any) -> Any:
    """Store a row as the code of revisions 0005 to 0007 did (no version history yet)."""
    values = schedules.stored_values(node, row, version=1)
    with engine.begin() as conn:
        conn.execute(AgentSchedule.__table__.insert().values(**values))
        conn.execute(text("INSERT INTO node_revision (node, epoch, revision) VALUES (:n, 'e', 1)"
                          " ON CONFLICT (node) DO NOTHING"), {"n": node})
    return row.model_copy(update={"version": 1})


_INSERT_ROW = (
    "INSERT INTO agent_schedule (node, id, name, repo_id, action, storage, schedule,"
    " miss_policy, enabled, params, version, updated_at) VALUES ('n', '{id}', 'x', '',"
    " 'backup', '', '{{\"days\": [\"{day}\"], \"hours\": [\"2\"], \"minute\": \"30\"}}',"
    " 'skip', true, NULL, 1, CURRENT_TIMESTAMP)"
)


def test_upgrade_names_an_invalid_stored_row_changes_nothing_and_reruns(empty_url: str) -> None:
    """The documented way out works: fix the named row, run the same upgrade again."""
    db.migrate(empty_url, "0001")
    _execute(empty_url, _INSERT_ROW.format(id="good-1", day="mon"),
             _INSERT_ROW.format(id="bad-1", day="someday"))
    before = _schema(empty_url)
    with pytest.raises(ValueError, match="node='n' id='bad-1'"):
        db.migrate(empty_url)
    assert _schema(empty_url) == before  # no wire column, still at 0001
    _execute(empty_url, "UPDATE agent_schedule SET schedule = '{\"days\": [\"tue\"],"
             " \"hours\": [\"2\"], \"minute\": \"30\"}' WHERE id = 'bad-1'")
    db.migrate(empty_url)
    after = _schema(empty_url)
    assert after["alembic_version"] == [HEAD]
    assert "wire" in {column[0] for column in after["columns"]["agent_schedule"]}


def test_a_failed_upgrade_leaves_no_step_half_done(empty_url: str) -> None:
    """A failure after DDL rolls the whole upgrade back, on SQLite as on Postgres.

    The failure is real, not injected: an index made by hand under the name
    0003 creates makes 0003 fail after 0002 has added, filled and altered its
    column (and, on Postgres, after 0003's own ALTER COLUMNs).
    """
    db.migrate(empty_url, "0001")
    _execute(empty_url, _INSERT_ROW.format(id="s-1", day="mon"),
             "CREATE INDEX ix_task_dispatch_scheduled_at ON task_dispatch (worker_id)")
    before = _schema(empty_url)
    with pytest.raises(Exception, match="ix_task_dispatch_scheduled_at"):
        db.migrate(empty_url)
    assert _schema(empty_url) == before
    _execute(empty_url, "DROP INDEX ix_task_dispatch_scheduled_at")
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
            db.downgrade(empty_url, "0002")
            with engine.connect() as conn:
                assert {row[1] for row in conn.execute(query)} == {None}
    finally:
        engine.dispose()


def test_policies_column_keeps_old_rows_and_its_downgrade_serves_rows_without_them(
    empty_url: str,
) -> None:
    """0005: rows stored before it keep their wire bytes; going down, rows lose their policies
    in the wire JSON too, so what 0004's code serves agrees with what it stores."""
    db.migrate(empty_url, "0004")
    old = LocalSchedule.model_validate({
        "id": "old-1", "name": "x", "action": "backup", "miss_policy": "skip", "enabled": True,
        "schedule": {"days": ["mon"], "hours": ["2"], "minute": "30"}, "version": 4})
    engine = db.make_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO agent_schedule (node, id, name, repo_id, action, storage, schedule,"
                " miss_policy, enabled, params, version, wire, updated_at) VALUES ('n', 'old-1',"
                " 'x', '', 'backup', '', :schedule, 'skip', true, NULL, 4, :wire,"
                " CURRENT_TIMESTAMP)"),
                {"schedule": '{"days": ["mon"], "hours": ["2"], "minute": "30"}',
                 "wire": old.model_dump_json()})
            conn.execute(text(
                "INSERT INTO node_revision (node, epoch, revision) VALUES ('n', 'e', 1)"))
        db.migrate(empty_url, "0005")
        with Session(engine) as session:
            assert schedules.list_wire(session, "n")[0] == [old.model_dump_json()]
            with_policies = _put_before_0008(engine, "n", LocalSchedule.model_validate({
                **old.model_dump(mode="json"), "id": "new-1",
                "paused": {"note": "n"}, "jitter": 60}))
        assert '"paused"' in with_policies.model_dump_json()
        db.downgrade(empty_url, "0004")
        with engine.connect() as conn:
            wires = dict(conn.execute(text("SELECT id, wire FROM agent_schedule")).all())
            assert "policies" not in {c["name"] for c in inspect(conn).get_columns(
                "agent_schedule")}
        assert wires["old-1"] == old.model_dump_json()
        assert wires["new-1"] == with_policies.model_copy(
            update={"paused": None, "jitter": 0}).model_dump_json()
        _back_to_head(empty_url)
    finally:
        engine.dispose()


def test_node_reports_and_pulls_migration_up_and_down(empty_url: str) -> None:
    """0006: the fleet's tables come and go; the schedules stay; history is pruned per node."""
    db.migrate(empty_url, "0005")
    engine = db.make_engine(empty_url)
    row = LocalSchedule.model_validate({
        "id": "s-1", "name": "x", "action": "backup", "miss_policy": "skip", "enabled": True,
        "schedule": {"days": ["mon"], "hours": ["2"], "minute": "30"}})
    at = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)
    try:
        _put_before_0008(engine, "n", row)
        db.migrate(empty_url)  # today's code writes node_seen (0008) with each report
        with Session(engine) as session:
            for index in range(4):
                nodes.record_report(session, "n", {"i": index}, received_at=at, keep=2)
            nodes.record_report(session, "other", {"i": 9}, received_at=at, keep=2)
            nodes.record_pulls(session, [nodes.Pull("n", at, "304", "e-1")])
            assert [r.report for r in nodes.report_history(session, "n", limit=10)] == [
                {"i": 3}, {"i": 2}]
            assert nodes.latest_reports(session)["n"].report == {"i": 3}
            assert nodes.report_history(session, "other", limit=10)[0].report == {"i": 9}
            assert nodes.latest_pulls(session)["n"].status == "304"
        db.downgrade(empty_url, "0005")
        assert _tables(empty_url) == TABLES - {"node_report", "node_report_history", "node_pull",
                                               "revoked_session", *MORNING_TABLES}
        with Session(engine) as session:
            assert [r.id for r in schedules.list_schedules(session, "n")[0]] == ["s-1"]
    finally:
        engine.dispose()


def test_0008_gives_each_existing_row_its_version_from_its_last_write(empty_url: str) -> None:
    """0008: a row stored before keeps its bytes and gets one version, in force from its
    ``updated_at``; later writes close it; the four tables go on downgrade."""
    db.migrate(empty_url, "0007")
    engine = db.make_engine(empty_url)
    row = LocalSchedule.model_validate({
        "id": "s-1", "name": "x", "action": "backup", "miss_policy": "skip", "enabled": True,
        "schedule": {"days": ["mon"], "hours": ["2"], "minute": "30"}})
    try:
        _put_before_0008(engine, "n", row)
        with engine.begin() as conn:
            conn.execute(text("UPDATE agent_schedule SET updated_at = :at"),
                         {"at": datetime(2026, 11, 2, 3, 4, 5)})
        db.migrate(empty_url, "0008")
        since, until = datetime(2026, 1, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)
        with Session(engine) as session:
            (only,) = schedules.versions_between(session, since, until)["n"]["s-1"]
            assert only.valid_from == datetime(2026, 11, 2, 3, 4, 5, tzinfo=UTC)
            assert only.valid_until is None and only.row.version == 1
            later = datetime(2026, 12, 1, tzinfo=UTC)
            schedules.put_schedule(session, "n", row, now=later)
            first, second = schedules.versions_between(session, since, until)["n"]["s-1"]
            assert (first.valid_until, second.valid_from, second.row.version) == (later, later, 2)
        db.downgrade(empty_url, "0007")
        assert _tables(empty_url) == TABLES - MORNING_TABLES
        _back_to_head(empty_url)
    finally:
        engine.dispose()


def test_revoked_sessions_migration_up_and_down(empty_url: str) -> None:
    """0007: the table of logged-out sessions comes and goes; the rest stays."""
    db.migrate(empty_url, "0006")
    assert _tables(empty_url) == TABLES - {"revoked_session"} - MORNING_TABLES
    db.migrate(empty_url)
    assert _tables(empty_url) == TABLES
    db.downgrade(empty_url, "0006")
    assert _tables(empty_url) == TABLES - {"revoked_session"} - MORNING_TABLES


def test_the_watch_turn_migration_up_and_down(empty_url: str) -> None:
    """0009: the fleet watch's turn comes and goes; 0008's tables stay."""
    db.migrate(empty_url, "0008")
    later = {"watch_turn", "node_contract", "login_failure"}
    assert _tables(empty_url) == TABLES - later
    db.migrate(empty_url, "0009")
    assert _tables(empty_url) == (TABLES - later) | {"watch_turn"}
    db.downgrade(empty_url, "0008")
    assert _tables(empty_url) == TABLES - later
    _back_to_head(empty_url)


def test_the_node_contract_migration_up_and_down(empty_url: str) -> None:
    """0010: the nodes' published action tables come and go; 0009's tables stay."""
    db.migrate(empty_url, "0009")
    assert _tables(empty_url) == TABLES - {"node_contract", "login_failure"}
    db.migrate(empty_url, "0010")
    assert _tables(empty_url) == TABLES - {"login_failure"}
    db.downgrade(empty_url, "0009")
    assert _tables(empty_url) == TABLES - {"node_contract", "login_failure"}
    _back_to_head(empty_url)


def test_the_login_failures_migration_up_and_down(empty_url: str) -> None:
    """0011: the login limit's failures come and go; 0010's tables stay."""
    db.migrate(empty_url, "0010")
    assert _tables(empty_url) == TABLES - {"login_failure"}
    db.migrate(empty_url)
    assert _tables(empty_url) == TABLES
    db.downgrade(empty_url, "0010")
    assert _tables(empty_url) == TABLES - {"login_failure"}
    _back_to_head(empty_url)
