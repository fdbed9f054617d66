"""Alembic environment for the controller's tables (configured by controller.db)."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection
from sqlmodel import SQLModel

from controller import models  # noqa: F401  (registers the tables on SQLModel.metadata)
from controller.db import make_migration_engine

config = context.config
target_metadata = SQLModel.metadata


def _run(connection: Connection, *, transactional_ddl: bool | None = None) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: later migrations copy tables in a batch.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        transactional_ddl=transactional_ddl,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on config.attributes["connection"], or on a fresh engine.

    On the fresh engine (:func:`controller.db.make_migration_engine`) the whole
    upgrade is one transaction on SQLite as on Postgres: reading the current
    revision included, so a failure anywhere leaves the database as it was and
    a concurrent migrator waits, then finds the work done. Alembic would
    otherwise commit SQLite migrations one by one, thinking its DDL autocommits.
    """
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_migration_engine(config.attributes.get("url"))
    try:
        with engine.connect() as conn:
            _run(conn, transactional_ddl=True)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported")
run_migrations_online()
