"""Fixtures for a real PostgreSQL: one pgserver per session, or SCHED_TEST_DATABASE_URL.

- ``pg_admin_url``: session; a SQLAlchemy URL of a database on a server where
  we may ``CREATE DATABASE`` (pgserver's ``postgres`` database, or
  ``SCHED_TEST_DATABASE_URL``). A pgserver started here is stopped and its
  data folder deleted at the end of the session.
- ``postgres_url``: per test, a fresh database migrated to head, cloned from a
  session template database (``CREATE DATABASE ... TEMPLATE``); dropped after.
- ``postgres_empty_url``: per test, a fresh database with no tables.
- ``sqlite_url``: per test, a fresh SQLite file migrated to head.
- ``database_url``: ``sqlite_url`` and ``postgres_url``, parametrized.

And, for fixtures of any scope (a context manager, not a fixture): ``sqlite_engine``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session

from controller import db

TEST_DATABASE_URL_ENV = "SCHED_TEST_DATABASE_URL"
_counter = itertools.count()


def _start_pgserver() -> tuple[Any, str]:
    """Start a pgserver in a temporary folder; return (server, folder)."""
    folder = tempfile.mkdtemp(prefix="sched-pg-")
    with warnings.catch_warnings():
        # platformdirs warns about XDG_RUNTIME_DIR under root; it is harmless here.
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
        import pgserver

        server = pgserver.get_server(Path(folder) / "data", cleanup_mode="delete")
        return server, folder


def _stop_pgserver(server: Any, folder: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
        server._cleanup()
    shutil.rmtree(folder, ignore_errors=True)


def admin_execute(admin_url: str, *statements: str) -> None:
    """Run statements in autocommit on the admin database (CREATE/DROP DATABASE)."""
    with psycopg.connect(db.libpq_conninfo(admin_url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """Yield the admin database URL of a real PostgreSQL for this session."""
    given = os.environ.get(TEST_DATABASE_URL_ENV)
    if given:
        yield str(db.database_url(given).render_as_string(hide_password=False))
        return
    server, folder = _start_pgserver()
    try:
        uri = server.get_uri("postgres")
        yield db.database_url(uri).render_as_string(hide_password=False)
    finally:
        _stop_pgserver(server, folder)


def _database(admin_url: str, name: str) -> str:
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> Iterator[str]:
    """Yield the name of a template database migrated to head, made once per session."""
    name = f"sched_tmpl_{os.getpid()}"
    admin_execute(pg_admin_url, f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}")
    db.migrate(_database(pg_admin_url, name))
    try:
        yield name
    finally:
        admin_execute(pg_admin_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _fresh_database(admin_url: str, template: str | None) -> Iterator[str]:
    name = f"sched_t_{os.getpid()}_{next(_counter)}"
    clone = f" TEMPLATE {template}" if template else ""
    admin_execute(admin_url, f"CREATE DATABASE {name}{clone}")
    try:
        yield _database(admin_url, name)
    finally:
        # FORCE ends any session a failed test left behind.
        admin_execute(admin_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def postgres_url(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    """Yield the URL of a fresh Postgres database migrated to head."""
    yield from _fresh_database(pg_admin_url, pg_template)


@pytest.fixture
def postgres_empty_url(pg_admin_url: str) -> Iterator[str]:
    """Yield the URL of a fresh, empty Postgres database."""
    yield from _fresh_database(pg_admin_url, None)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """Return the URL of a fresh SQLite file migrated to head."""
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    db.migrate(url)
    return url


@contextmanager
def sqlite_engine(folder: Path) -> Iterator[Engine]:
    """Yield an engine on folder/controller.db, migrated to head; dispose of it after."""
    url = db.database_url(f"sqlite:///{folder}/controller.db")
    db.migrate(url, "head")
    engine = db.make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Return a fresh migrated database URL: once for SQLite, once for Postgres."""
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    return str(request.getfixturevalue("sqlite_url"))


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """Yield an engine on a fresh migrated database (SQLite, then Postgres)."""
    made = db.make_engine(database_url, application_name="sched-test-store")
    try:
        yield made
    finally:
        made.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    """Yield a session on that database."""
    with Session(engine) as opened:
        yield opened


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """Yield a temporary folder readable by other processes (spawned schedulers)."""
    folder = Path(tempfile.mkdtemp(prefix="sched-test-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
