"""The controller's SQLite database is its owner's alone (issue 36, point 13).

Made under a umask of 022, as a shell's default: before, the database, its WAL and its shared
memory were 0644, readable by every local user (the schedules, the nodes' reports, the
revoked sessions). Now new files are 0600 and an existing 0644 one is made 0600 when the
controller opens it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from controller import db


@pytest.fixture
def shell_umask() -> Iterator[None]:
    """The usual umask of 022, whatever the test process was given."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}


def _write_through_an_engine(url: str) -> dict[str, int]:
    """Migrate, write a row and return the folder's modes while the connection is open (the
    WAL and shared memory exist only then)."""
    db.migrate(url)
    engine = db.make_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("INSERT INTO node_revision (node, epoch, revision)"
                              " VALUES ('n', 'e', 1)"))
            conn.commit()
            return _modes(Path(db.database_url(url).database or "").parent)
    finally:
        engine.dispose()


@pytest.mark.usefixtures("shell_umask")
def test_the_embedded_default_database_and_its_folder_are_private(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SCHED_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    modes = _write_through_an_engine(str(db.database_url()))
    assert modes == {"controller.db": 0o600, "controller.db-wal": 0o600,
                     "controller.db-shm": 0o600}
    assert stat.S_IMODE((tmp_path / db.DATA_DIR_NAME).stat().st_mode) == 0o700


@pytest.mark.usefixtures("shell_umask")
def test_an_existing_readable_database_is_made_private_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    url = f"sqlite:///{path}"
    db.migrate(url)
    for suffix in ("", "-wal", "-journal"):  # as a controller before this change left them
        Path(f"{path}{suffix}").touch()
        Path(f"{path}{suffix}").chmod(0o644)
    (tmp_path / "other.txt").write_text("not the database's")
    modes = _write_through_an_engine(url)
    assert {name: mode for name, mode in modes.items() if name.startswith("old.db")} == {
        "old.db": 0o600, "old.db-wal": 0o600, "old.db-shm": 0o600, "old.db-journal": 0o600}
    assert modes["other.txt"] == 0o644
