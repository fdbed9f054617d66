"""State files on disk: atomic, locked, never lost to a bad byte, no temporaries left.

The shell under the cache (:mod:`sched_core.cache`), the chain's markers
(:mod:`sched_core.chain`) and the flows' own state files. Rules:

1. Every write goes to a temporary file in the same folder
   (``<name>.<8 random characters>.tmp``), is fsynced, then ``os.replace``d over
   the target (and the folder fsynced), with mode 0600, so a crash leaves
   either the old file or the new one, never half of one.
2. Every read-modify-write happens under an exclusive ``flock`` on a sibling
   ``<name>.lock`` file, so several processes (several Prefect flow runs) can
   share one state file without losing an update.
3. A file that cannot be read, or is not JSON by :mod:`sched_core.jsonwire`'s
   rules, is moved aside (``<name>.corrupt-<time>``), never deleted, and the
   caller starts empty.
4. A writer killed between steps 1's write and rename leaves its temporary
   file behind: :func:`remove_stale_temporaries` removes a state file's own
   temporaries (that exact name pattern, regular files only) once they are
   older than :data:`STALE_AFTER`, under the file's lock, so a live writer's
   file is never touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sched_core.clock import utcnow
from sched_core.errors import WireError
from sched_core.jsonwire import find_problem, loads

log = logging.getLogger(__name__)

STALE_AFTER = timedelta(seconds=60)
"""How old a temporary file must be before a start removes it (no write takes this long)."""


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for the state file at path (on ``path.lock``)."""
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def write_atomic(path: Path, data: bytes) -> None:
    """Replace path with data: temporary file, fsync, rename, folder fsync; mode 0600."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _temporary_pattern(path: Path) -> re.Pattern[str]:
    # tempfile.mkstemp's names: the prefix, 8 characters of [a-z0-9_], the suffix.
    return re.compile(re.escape(path.name) + r"\.[a-z0-9_]{8}\.tmp")


def remove_stale_temporaries(path: Path, *, older_than: timedelta = STALE_AFTER) -> list[Path]:
    """Remove the temporary files a killed writer of path left; return the ones removed.

    Only path's own temporaries (``<name>.<8 characters>.tmp`` in its folder,
    regular files, not symlinks) older than older_than are removed: the caller
    holds path's lock, and the age protects a writer that does not take it.
    Age is measured against the wall clock, as file times are.
    """
    pattern = _temporary_pattern(path)
    cutoff = (utcnow() - older_than).timestamp()
    removed: list[Path] = []
    try:
        names = os.listdir(path.parent)
    except OSError as exc:
        log.warning("could not list %s for stale temporary files: %r", path.parent, exc,
                    extra={"path": str(path), "error": repr(exc)})
        return removed
    for name in names:
        if not pattern.fullmatch(name):
            continue
        candidate = path.with_name(name)
        try:
            info = candidate.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_mtime > cutoff:
                continue
            candidate.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not remove stale temporary file %s: %r", candidate, exc,
                        extra={"path": str(candidate), "error": repr(exc)})
            continue
        removed.append(candidate)
    if removed:
        log.warning(
            "removed %d stale temporary files of %s left by a killed write: %s",
            len(removed), path, ", ".join(p.name for p in removed),
            extra={"path": str(path), "removed": [p.name for p in removed]},
        )
    return removed


def _aside_path(path: Path, now: datetime) -> Path:
    return path.with_name(f"{path.name}.corrupt-{now.strftime('%Y%m%dT%H%M%S%f')}")


def move_aside(path: Path, now: datetime, reason: str) -> Path:
    """Rename a bad state file out of the way and return its new path."""
    target = _aside_path(path, now)
    os.replace(path, target)
    log.error(
        "moved unreadable state file %s aside to %s: %s", path, target, reason,
        extra={"path": str(path), "moved_to": str(target), "reason": reason},
    )
    return target


def copy_aside(path: Path, now: datetime, reason: str) -> Path:
    """Copy a state file whose content is about to be dropped out of the way; return the copy."""
    target = _aside_path(path, now)
    shutil.copyfile(path, target)
    os.chmod(target, 0o600)
    log.error(
        "kept a copy of state file %s at %s: %s", path, target, reason,
        extra={"path": str(path), "copied_to": str(target), "reason": reason},
    )
    return target


@dataclass(frozen=True)
class FileStamp:
    """What tells one version of a file from another without reading it (not always enough)."""

    inode: int
    mtime_ns: int
    size: int


def stamp_of(path: Path) -> FileStamp | None:
    """Return the file's stamp, or None when it does not exist."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return FileStamp(st.st_ino, st.st_mtime_ns, st.st_size)


def read_head(path: Path, size: int) -> bytes | None:
    """Return the first size bytes of path, or None when it is missing or unreadable."""
    try:
        with path.open("rb") as handle:
            return handle.read(size)
    except OSError:
        return None


def read_state(path: Path, *, now: datetime, max_depth: int) -> tuple[Any, bool] | None:
    """Return :func:`sched_core.jsonwire.loads` of the file: (document, clean).

    None when the file is missing; a file that cannot be read, or is not JSON
    (or nests past the parser's reach), is moved aside and is None too.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        move_aside(path, now, f"unreadable: {exc}")
        return None
    try:
        return loads(raw, max_depth=max_depth)
    except WireError as exc:
        move_aside(path, now, exc.reason)
        return None


def read_json_file(path: Path, *, now: datetime, max_depth: int) -> Any | None:
    """Return the parsed JSON at path if it keeps every wire rule; None when missing.

    A file that cannot be read, is not JSON or breaks a rule of
    :mod:`sched_core.jsonwire` is moved aside (None).
    """
    loaded = read_state(path, now=now, max_depth=max_depth)
    if loaded is None:
        return None
    data, clean = loaded
    if not clean:
        problem = find_problem(data, max_depth=max_depth, root=path.name)
        if problem is not None:
            move_aside(path, now, str(problem))
            return None
    return data
