"""Engines, URLs and migrations for the controller's database.

Rule: every engine the controller opens is made here, by :func:`make_engine`,
so every connection carries an ``application_name`` (Postgres) and SQLite gets
the same settings (WAL, a busy timeout, foreign keys) in every process. The
migrations run on :func:`make_migration_engine`'s, whose SQLite transactions
cover DDL too, so a failed upgrade leaves the database as it found it.

The embedded default is a SQLite file, ``.data/controller.db`` under the
working directory (``make run`` and the tests run from the checkout), never
under the installed package, which in a wheel would be ``site-packages``;
``SCHED_DATABASE_URL`` selects another database, e.g.
``postgresql+psycopg://user:pw@host:5432/sched``. A SQLite file (this one or
any other) is its owner's alone: made 0600 (its ``-wal`` and ``-shm`` follow
it), and an existing one with group or other permissions is made so when an
engine is made for it, as is a folder made for it (0700).

Sessions: :func:`transaction` is the one commit-or-rollback of every write, and
:func:`db_now` the time authority's clock.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, func, select, text, type_coerce
from sqlalchemy.engine import URL, Engine, make_url
from sqlmodel import Session, create_engine

from controller.models import UtcDateTime, utc_now
from controller.settings import ControllerSettings
from sched_core.errors import ConfigError

log = logging.getLogger(__name__)

DATA_DIR_NAME = ".data"
"""The data folder of the embedded default, under the working directory (git-ignored)."""


def default_sqlite_path() -> Path:
    """Return where the embedded default database lives: ``./.data/controller.db``.

    Resolved against the working directory when called, so an installed
    controller keeps its data where it is run, not inside its package.
    """
    return Path.cwd() / DATA_DIR_NAME / "controller.db"


DATABASE_URL_ENV = ControllerSettings.env_name("database_url")
"""The environment variable naming the database URL."""

APPLICATION_NAME = "sched-controller"
"""The default Postgres ``application_name`` for controller connections."""

_MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def database_url(url: str | URL | None = None) -> URL:
    """Return the database URL: url, else ``SCHED_DATABASE_URL``, else the SQLite default.

    A ``postgresql://`` or ``postgres://`` URL is given the psycopg 3 driver.
    """
    text = url if url is not None else ControllerSettings.read().database_url
    if not text:
        return make_url(f"sqlite:///{default_sqlite_path()}")
    parsed = make_url(text)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def is_postgres(url: str | URL | Engine) -> bool:
    """Return True when url (or the engine's URL) is a PostgreSQL one."""
    if isinstance(url, Engine):
        return url.dialect.name == "postgresql"
    return make_url(url).get_backend_name() == "postgresql"


def safe_url(url: str | URL | Engine) -> str:
    """Return url as text with any password masked, fit for logs and errors."""
    if isinstance(url, Engine):
        url = url.url
    return make_url(url).render_as_string(hide_password=True)


def libpq_conninfo(url: str | URL) -> str:
    """Return a libpq URI for a SQLAlchemy Postgres URL (for a raw psycopg connection)."""
    parsed = database_url(url)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long a SQLite connection waits for another's lock before it fails."""


def _sqlite_wal(cursor: Any, *, timeout_s: float = SQLITE_BUSY_TIMEOUT_S) -> None:
    """Turn on WAL, asking again while another connection holds the lock.

    The change needs the file's exclusive lock, and SQLite answers "database
    is locked" at once, without its busy timeout, when another connection
    holds the write lock or is making the same change (it would be a deadlock
    to wait): several processes opening a new file together hit that. Once
    the file is in WAL the statement only reads, so this loops at most while
    a new file is being set up.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


SQLITE_COMPANIONS = ("", "-wal", "-shm", "-journal")
"""The suffixes of a SQLite database's files: the database, its WAL, its shared memory and its
rollback journal."""


def _private_sqlite_file(path: Path) -> None:
    """Make the SQLite file at path (and its folder, if missing) its owner's alone.

    1. Make the folder (0700) and the file (0600) if they are missing: SQLite gives the
       ``-wal``, ``-shm`` and journal files it makes later the database file's mode.
    2. Take group and other permissions off each of the files that exists (a database made
       before, under a umask of 022, was 0644: readable by every local user); one that is
       not ours is left as it is, and said so.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
    for suffix in SQLITE_COMPANIONS:
        companion = Path(f"{path}{suffix}")
        try:
            mode = stat.S_IMODE(companion.stat().st_mode)
            if mode & 0o077:
                companion.chmod(mode & 0o700)
        except FileNotFoundError:
            continue
        except PermissionError:
            log.warning("cannot make the database file private (not its owner)",
                        extra={"path": str(companion)})


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the one writer; several scheduler processes share the file.
    _sqlite_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def connection_options(extra: str | None = None) -> str:
    """Return the libpq ``options`` of every controller connection to Postgres, plus extra.

    ``TimeZone=UTC``: the controller reads and writes instants only, and with
    the session in UTC the driver hands back timestamps already in
    ``datetime.UTC`` (whatever the server's default zone), so the claim loop
    has nothing to convert.
    """
    return "-c TimeZone=UTC" + (f" {extra}" if extra else "")


def make_engine(
    url: str | URL | None = None,
    *,
    application_name: str = APPLICATION_NAME,
    pool_size: int = 5,
    max_overflow: int = 5,
    pool_pre_ping: bool = True,
    options: str | None = None,
    **kwargs: Any,
) -> Engine:
    """Return a new engine for url (see :func:`database_url`); the caller disposes it.

    On SQLite the file and its folder are created (0600 and 0700; an existing file is
    made 0600), and every connection gets WAL mode, foreign keys and a 30 s busy
    timeout. On Postgres every connection carries ``application_name`` so
    ``pg_stat_activity`` can count them, and the pool holds at most
    ``pool_size + max_overflow`` connections; ``options`` are more server settings
    for every connection (libpq ``options``, e.g. ``"-c synchronous_commit=off"``),
    after :func:`connection_options`' own.
    """
    parsed = database_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            _private_sqlite_file(Path(database))
        engine = create_engine(
            parsed,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
            **kwargs,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(
            parsed,
            connect_args={"application_name": application_name,
                          "options": connection_options(options)},
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_pre_ping=pool_pre_ping,
            **kwargs,
        )
    return create_engine(parsed, **kwargs)


def _sqlite_driver_autocommit(dbapi_connection: Any, _record: Any) -> None:
    # Python 3.11's sqlite3 opens a transaction only before INSERT/UPDATE/DELETE,
    # so ALTER TABLE would commit on its own: hand transactions to SQLAlchemy.
    dbapi_connection.isolation_level = None


def _sqlite_begin(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def make_migration_engine(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """Return a :func:`make_engine` engine for migrations; the caller disposes it.

    On SQLite every transaction is a real one that DDL joins (SQLAlchemy's
    pysqlite recipe), so a failed upgrade rolls back whole, schema and
    ``alembic_version`` alike, as it does on Postgres. It begins ``IMMEDIATE``
    (the write lock first), so a second migrator waits for the first and then
    finds the work done: with a plain ``BEGIN`` it failed with "database is
    locked" as soon as both had read the current revision. The runtime
    engines keep the driver's own transaction handling.
    """
    engine = make_engine(url, application_name="sched-migrate", **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_driver_autocommit)
        event.listen(engine, "begin", _sqlite_begin)
    return engine


def alembic_config(url: str | URL | None = None) -> Config:
    """Return an Alembic config for the controller's migrations, programmatically built."""
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.attributes["url"] = database_url(url)
    return config


def _current_heads(url: str | URL | None) -> set[str]:
    """Return the revisions the database at url is at (read on an engine of its own)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()


def _already_at(config: Config, current: set[str], revision: str) -> bool:
    """Return True when current (the database's revisions, read without a write lock) is
    exactly revision."""
    script = ScriptDirectory.from_config(config)
    if revision == "head":
        targets = set(script.get_heads())
    else:
        found = script.get_revision(revision)
        if found is None:
            return False
        targets = {found.revision}
    return current == targets


def schema_problem(url: str | URL | None = None) -> str | None:
    """Return why the database at url is not at the latest schema, or None when it is.

    A database that cannot be reached is not a schema problem (the controller
    waits for it like for any outage): this raises the driver's error instead.
    """
    config = alembic_config(url)
    heads = set(ScriptDirectory.from_config(config).get_heads())
    current = _current_heads(url)
    if current == heads:
        return None
    if unknown := _unknown_revisions(config, current):
        return _unknown_text(url, unknown)
    where = safe_url(database_url(url))
    now = ", ".join(sorted(current)) or "no schema at all"
    return (f"the database {where} is at {now}, and this controller needs "
            f"{', '.join(sorted(heads))}: run `sched controller migrate` first")


def migrate(url: str | URL | None = None, revision: str = "head") -> None:
    """Upgrade the database at url (default: see :func:`database_url`) to revision.

    A database already there is only read: on SQLite the upgrade itself takes
    the write lock first, which a routine ``migrate`` at deploy time must not
    wait for behind a running controller's writes.
    """
    config = alembic_config(url)
    current = _current_heads(url)
    if _already_at(config, current, revision):
        return
    if unknown := _unknown_revisions(config, current):
        raise ConfigError(_unknown_text(url, unknown))
    command.upgrade(config, revision)


def _unknown_revisions(config: Config, current: set[str]) -> list[str]:
    """Return the revisions of current (the database's) that these migrations do not have."""
    script = ScriptDirectory.from_config(config)
    known = {rev.revision for rev in script.walk_revisions()}
    return sorted(current - known)


def _unknown_text(url: str | URL | None, unknown: list[str]) -> str:
    return (f"the database {safe_url(database_url(url))} is at {', '.join(unknown)}, a schema "
            "this controller does not know (a pre-release one, or a newer controller's): keep "
            "using the controller that made it, or start from a new, empty database")


def downgrade(url: str | URL | None = None, revision: str = "base") -> None:
    """Downgrade the database at url to revision (default: drop everything we made)."""
    command.downgrade(alembic_config(url), revision)


@contextmanager
def transaction(session: Session, *, commit: bool = True) -> Iterator[Session]:
    """Run the block as one transaction of session: commit after it, roll back if it raises.

    ``commit=False`` is for a statement run on an autocommit driver connection,
    which committed itself: the session then keeps its connection.
    """
    try:
        yield session
        if commit:
            session.commit()
    except BaseException:
        session.rollback()
        raise


def db_now(session: Session) -> datetime:
    """Return the time authority's now: Postgres ``now()``, or this host's clock on SQLite."""
    if session.get_bind().dialect.name == "postgresql":
        value = session.execute(select(type_coerce(func.now(), UtcDateTime))).scalar_one()
        assert isinstance(value, datetime)
        return value
    return utc_now()


def server_version(session: Session) -> str:
    """Return the database server's version text (for logs and benchmarks)."""
    if session.get_bind().dialect.name == "postgresql":
        return str(session.execute(text("SHOW server_version")).scalar_one())
    return "sqlite " + str(session.execute(text("select sqlite_version()")).scalar_one())
