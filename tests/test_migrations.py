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
