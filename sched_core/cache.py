"""State files on disk: atomic, locked, and never lost to a bad byte.

Rules:
1. Every write goes to a temporary file in the same folder, is fsynced, then
   ``os.replace``d over the target (and the folder fsynced), with mode 0600,
   so a crash leaves either the old file or the new one, never half of one.
2. Every read-modify-write happens under an exclusive ``flock`` on a sibling
   ``.lock`` file, so several processes (several Prefect flow runs) can share
   one state file without losing an update.
3. A file that cannot be read or parsed is moved aside (``.corrupt-<time>``),
   never deleted, and the caller starts empty.
4. A cache file that parses is salvaged, not thrown away: a bad row, a bad
   time entry or a bad ETag is dropped on its own with a warning naming it,
   and everything else is kept, so one bad byte never costs the schedules.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sched_core.model import Cache, LocalSchedule, format_go_time, go_escape, parse_go_time

log = logging.getLogger(__name__)

_ROWS: TypeAdapter[list[LocalSchedule]] = TypeAdapter(list[LocalSchedule])


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many objects at once.

    Validating 100,000 rows allocates millions of objects; the collector's
    repeated passes over them cost more than the validation itself.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


def move_aside(path: Path, now: datetime, reason: str) -> Path:
    """Rename a bad state file out of the way and return its new path."""
    target = path.with_name(f"{path.name}.corrupt-{now.strftime('%Y%m%dT%H%M%S%f')}")
    os.replace(path, target)
    log.error(
        "moved unreadable state file %s aside to %s: %s", path, target, reason,
        extra={"path": str(path), "moved_to": str(target), "reason": reason},
    )
    return target


def copy_aside(path: Path, now: datetime, reason: str) -> Path:
    """Copy a state file whose content is about to be dropped out of the way; return the copy."""
    target = path.with_name(f"{path.name}.corrupt-{now.strftime('%Y%m%dT%H%M%S%f')}")
    shutil.copyfile(path, target)
    os.chmod(target, 0o600)
    log.error(
        "kept a copy of state file %s at %s: %s", path, target, reason,
        extra={"path": str(path), "copied_to": str(target), "reason": reason},
    )
    return target


@dataclass(frozen=True)
class FileStamp:
    """What tells one version of a file from another without reading it."""

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


def read_json_file(path: Path, *, now: datetime) -> Any | None:
    """Return the parsed JSON at path; None when missing; a bad file is moved aside (None)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        move_aside(path, now, f"unreadable: {exc}")
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        move_aside(path, now, f"invalid JSON: {exc}")
        return None


def validate_rows(
    rows: list[Any], *, source: str, warn: bool = True
) -> tuple[list[LocalSchedule], list[tuple[str, str]]]:
    """Validate schedule rows; return the good ones and (id, reason) for each bad one.

    Each bad row is logged as a warning naming it, unless warn is False (for a
    caller that reports the reasons itself).
    """
    try:
        with gc_paused():
            return _ROWS.validate_python(rows), []  # the common case, in one pass
    except ValidationError:
        pass
    good: list[LocalSchedule] = []
    bad: list[tuple[str, str]] = []
    for position, row in enumerate(rows):
        row_id = row.get("id") if isinstance(row, dict) else None
        label = row_id if isinstance(row_id, str) and row_id else f"row {position}"
        try:
            good.append(LocalSchedule.model_validate(row))
        except ValidationError as exc:
            reason = describe_validation_error(exc)
            bad.append((label, reason))
            if warn:
                log.warning(
                    "dropped invalid schedule %s from %s: %s", label, source, reason,
                    extra={"schedule_id": label, "reason": reason, "source": source},
                )
    return good, bad


def describe_validation_error(exc: ValidationError) -> str:
    """Return a one-line reason naming each bad field."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "row"
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def load_cache(path: Path, *, now: datetime) -> Cache:
    """Load the cache file; missing means empty; unparsable is moved aside and means empty.

    Only a file that is not JSON, or whose top level is not an object, is moved
    aside. In any other file each bad part is dropped on its own, with a
    warning naming it, and the rest is kept (see :func:`salvage_fields`): an
    invalid row, a ``last_fired_at`` or ``first_seen_at`` entry that is not an
    RFC 3339 time with an offset, a bad ``last_fetched_at`` (treated as never),
    a bad ``etag`` or ``etag_url`` (both treated as absent). A ``schedules``
    field that is not a list means no rows; the file is first copied aside.
    """
    return load_cache_report(path, now=now)[0]


def load_cache_report(path: Path, *, now: datetime) -> tuple[Cache, list[str]]:
    """Return :func:`load_cache`'s cache and the parts of the file it dropped.

    A caller holding the lock rewrites the file when anything was dropped, so
    the warnings and the copy aside happen once, not at every load.
    """
    with gc_paused():
        data = read_json_file(path, now=now)
    if data is None:
        return Cache(), []
    if not isinstance(data, dict):
        move_aside(path, now, f"expected a JSON object, got {type(data).__name__}")
        return Cache(), []
    dropped: list[str] = []
    rows = data.get("schedules") or []
    if not isinstance(rows, list):
        copy_aside(
            path, now,
            f"schedules is {json_type(rows)}, not a list: starting with no schedules "
            "and keeping the fire history",
        )
        dropped.append("schedules")
        rows = []
    good, bad = validate_rows(rows, source=str(path))
    dropped += [f"schedules[{label!r}]" for label, _ in bad]
    fields = {**data, "schedules": []}
    try:
        cache = Cache.model_validate(fields)  # the common case: every field is good
    except ValidationError:
        salvaged, bad_fields = salvage_fields(fields, source=str(path))
        cache = Cache.model_validate(salvaged)
        dropped += bad_fields
    cache.schedules = good
    return cache, dropped


_TIME_MAPS = ("last_fired_at", "first_seen_at")


def salvage_fields(data: dict[str, Any], *, source: str) -> tuple[dict[str, Any], list[str]]:
    """Return the cache fields of data with each bad entry dropped, and what was dropped.

    Each dropped entry is logged as a warning. Times are parsed exactly as
    :class:`Cache` parses them (Go's zero time means never), so the fields
    returned always validate.
    """
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for name in _TIME_MAPS:
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            dropped.append(_warn_dropped(
                source, name, None, value, "expected an object of schedule id to time"
            ))
            continue
        times: dict[str, datetime] = {}
        for key, item in value.items():
            try:
                parsed = parse_go_time(item)
            except ValueError as exc:
                dropped.append(_warn_dropped(source, name, key, item, str(exc)))
                continue
            if parsed is not None:
                times[key] = parsed
        out[name] = times
    try:
        out["last_fetched_at"] = parse_go_time(data.get("last_fetched_at"))
    except ValueError as exc:
        dropped.append(_warn_dropped(
            source, "last_fetched_at", None, data.get("last_fetched_at"), str(exc)
        ))
    etag, etag_url = data.get("etag"), data.get("etag_url")
    for name, value in (("etag", etag), ("etag_url", etag_url)):
        if value is not None and not isinstance(value, str):
            dropped.append(_warn_dropped(
                source, name, None, value, "expected a string; the ETag is not used"
            ))
            etag = etag_url = None
    out["etag"], out["etag_url"] = etag, etag_url
    return out, dropped


def _warn_dropped(source: str, name: str, key: str | None, value: object, reason: str) -> str:
    """Log one dropped part of a cache file, naming the field, the key and the bad value.

    Return the part's name, e.g. ``last_fired_at['b']``.
    """
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    where = name if key is None else f"{name}[{key!r}]"
    log.warning(
        "dropped invalid %s = %s from %s: %s", where, shown, source, reason,
        extra={"source": source, "field": name, "schedule_id": key, "value": shown,
               "reason": reason},
    )
    return where


def json_type(value: object) -> str:
    """Return the JSON name of value's type, with an article, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def dump_rows(rows: list[LocalSchedule]) -> str:
    """Return the wire-format JSON array of rows."""
    return go_escape(_ROWS.dump_json(rows).decode())


def _dump_times(times: dict[str, datetime]) -> str:
    body = {key: format_go_time(times[key]) for key in sorted(times)}
    return go_escape(json.dumps(body, separators=(",", ":"), ensure_ascii=False))


def dump_cache(cache: Cache, rows_json: str | None = None) -> str:
    """Return ``cache.model_dump_json()``, reusing the rows' JSON when it is given.

    A tick changes only the last fired times, so the scheduler keeps the rows'
    JSON from the last change of the list instead of encoding every row again.
    """
    text = (
        '{"schedules":' + (rows_json if rows_json is not None else dump_rows(cache.schedules))
        + ',"last_fired_at":' + _dump_times(cache.last_fired_at)
        + ',"last_fetched_at":"' + format_go_time(cache.last_fetched_at) + '"'
    )
    if cache.first_seen_at:
        text += ',"first_seen_at":' + _dump_times(cache.first_seen_at)
    if cache.etag is not None:
        text += ',"etag":' + go_escape(json.dumps(cache.etag, ensure_ascii=False))
        text += ',"etag_url":' + go_escape(json.dumps(cache.etag_url, ensure_ascii=False))
    return text + "}"


def save_cache(path: Path, cache: Cache, rows_json: str | None = None) -> None:
    """Write the cache atomically (the caller holds the lock)."""
    write_atomic(path, dump_cache(cache, rows_json).encode())
