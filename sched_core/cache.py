"""The cache file's format: load it (salvaging what is good), dump it.

Rules (the file itself is written and locked by :mod:`sched_core.statefile`):

1. The file is the Go kit's cache plus fields Go ignores: ``first_seen_at``,
   the controller's ``etag`` and ``etag_url``, and ``generation``, a counter
   written first in the file and raised by every save, so a process sharing the
   file knows from its first bytes whether to reload (an inode and a
   modification time can repeat; a generation under the lock cannot).
2. It is read with :mod:`sched_core.jsonwire`'s rules. A file that is not JSON,
   not a JSON object, or nests past the parser's reach is moved aside. In any
   other file each bad part is dropped on its own, with a warning naming it,
   and the rest is kept, so one bad byte never costs the schedules: a row that
   breaks a wire rule (a lone surrogate, ``NaN``, ``1e400``, a 5,000-digit
   number, nesting deeper than :data:`~sched_core.jsonwire.MAX_LIST_DEPTH`) or
   the model's rules; a time entry that is not an RFC 3339 time with an
   offset; a bad ``last_fetched_at`` (read as never), ``etag`` or ``etag_url``
   (not used).
3. Whatever loads can be written back: every value that breaks a wire rule is
   dropped before it reaches the :class:`~sched_core.model.Cache`.
"""

from __future__ import annotations

import gc
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from sched_core.jsonwire import MAX_LIST_DEPTH, find_problem, is_utf8
from sched_core.model import Cache, LocalSchedule
from sched_core.statefile import (  # re-exported: the old home of the state-file shell
    FileStamp,
    copy_aside,
    locked,
    move_aside,
    read_head,
    read_json_file,
    read_state,
    stamp_of,
    write_atomic,
)
from sched_core.values import format_go_time, go_escape, parse_go_time

__all__ = [
    "FUTURE_SLACK",
    "MAX_ETAG_LENGTH",
    "FileStamp",
    "LoadedCache",
    "clamp_future",
    "copy_aside",
    "describe_validation_error",
    "dump_cache",
    "dump_rows",
    "json_type",
    "load_cache",
    "load_cache_file",
    "load_cache_report",
    "locked",
    "move_aside",
    "read_generation",
    "read_json_file",
    "salvage_fields",
    "save_cache",
    "stamp_of",
    "usable_etag",
    "validate_rows",
    "write_atomic",
]

log = logging.getLogger(__name__)

_ROWS: TypeAdapter[list[LocalSchedule]] = TypeAdapter(list[LocalSchedule])

MAX_ETAG_LENGTH = 1024
"""The longest ETag kept and sent back; a longer one is not used (every pull is a full one)."""

FUTURE_SLACK = timedelta(hours=24)
"""How far in the future a last fire or first-seen time may be before it is clamped to now.

Processes sharing a cache stamp with their own clocks and their runs' logical
times, which may be ahead of a reader's ``now``; clamping such a stamp would
make its window fire again. A time more than a day ahead was never a real
fire (a bad clock, a hand edit) and would stop the schedule until then, so it
is clamped; one within the day delays the schedule by less than the miss
policy's lookback.
"""


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

    See the module's rule 2 for what is salvaged and what is moved aside. A
    ``schedules`` field that is not a list means no rows; the file is first
    copied aside.
    """
    return load_cache_file(path, now=now).cache


def load_cache_report(path: Path, *, now: datetime) -> tuple[Cache, list[str]]:
    """Return :func:`load_cache`'s cache and the parts of the file it dropped."""
    loaded = load_cache_file(path, now=now)
    return loaded.cache, loaded.dropped


@dataclass
class LoadedCache:
    """A loaded cache, the parts of the file it dropped, and the file's generation.

    A caller holding the lock rewrites the file when anything was dropped, so
    the warnings and the copy aside happen once, not at every load.
    """

    cache: Cache
    dropped: list[str] = field(default_factory=list)
    generation: int | None = None


def load_cache_file(path: Path, *, now: datetime) -> LoadedCache:
    """Load the cache file as :func:`load_cache` does, with what was dropped and its generation."""
    with gc_paused():
        loaded = read_state(path, now=now, max_depth=MAX_LIST_DEPTH)
    if loaded is None:
        return LoadedCache(Cache())
    data, clean = loaded
    if not isinstance(data, dict):
        move_aside(path, now, f"expected a JSON object, got {json_type(data)}")
        return LoadedCache(Cache())
    source = str(path)
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
    fields = {**data, "schedules": []}
    if not clean:
        rows = _drop_rows_breaking_wire_rules(rows, source, dropped)
        fields = _drop_fields_breaking_wire_rules(fields, source, dropped)
    good, bad = validate_rows(rows, source=source)
    dropped += [f"schedules[{label!r}]" for label, _ in bad]
    try:
        cache = Cache.model_validate(fields)  # the common case: every field is good
        if cache.etag is not None and not usable_etag(cache.etag):
            raise ValueError("etag")
    except (ValidationError, ValueError):
        salvaged, bad_fields = salvage_fields(fields, source=source)
        cache = Cache.model_validate(salvaged)
        dropped += bad_fields
    cache.schedules = good
    generation = data.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        generation = None
    return LoadedCache(cache, dropped, generation)


def _shown(text: str) -> str:
    """Return text with unpaired surrogates escaped, safe for any log handler."""
    return text.encode("utf-8", "backslashreplace").decode()


def _row_label(row: Any, position: int) -> str:
    row_id = row.get("id") if isinstance(row, dict) else None
    if isinstance(row_id, str) and row_id:
        return _shown(row_id)
    return f"row {position}"


def _drop_rows_breaking_wire_rules(rows: list[Any], source: str, dropped: list[str]) -> list[Any]:
    """Return the rows that keep every wire rule; warn about and record each other one."""
    kept: list[Any] = []
    for position, row in enumerate(rows):
        problem = find_problem(row, max_depth=MAX_LIST_DEPTH, base=("schedules", position))
        if problem is None:
            kept.append(row)
            continue
        label = _row_label(row, position)
        log.warning(
            "dropped invalid schedule %s from %s: %s", label, source, problem,
            extra={"schedule_id": label, "reason": str(problem), "source": source},
        )
        dropped.append(f"schedules[{label!r}]")
    return kept


_TIME_MAPS = ("last_fired_at", "first_seen_at")
_SCALARS = ("last_fetched_at", "etag", "etag_url")


def _drop_fields_breaking_wire_rules(
    fields: dict[str, Any], source: str, dropped: list[str]
) -> dict[str, Any]:
    """Return the cache fields without the entries that break a wire rule, each one warned."""
    out = dict(fields)
    for name in _TIME_MAPS:
        value = out.get(name)
        if isinstance(value, dict):
            times: dict[str, Any] = {}
            for key, item in value.items():
                problem = find_problem(item, max_depth=MAX_LIST_DEPTH, base=(name, key))
                if problem is None and not is_utf8(key):
                    problem = find_problem({key: None}, base=(name,))
                if problem is None:
                    times[key] = item
                else:
                    dropped.append(_warn_dropped(source, name, _shown(key), item, problem.reason))
            out[name] = times
        elif find_problem(value, max_depth=MAX_LIST_DEPTH, base=(name,)) is not None:
            dropped.append(_warn_dropped(source, name, None, value, "breaks a JSON wire rule"))
            out.pop(name)
    for name in _SCALARS:
        problem = find_problem(out.get(name), max_depth=MAX_LIST_DEPTH, base=(name,))
        if problem is not None:
            dropped.append(_warn_dropped(source, name, None, out.pop(name), problem.reason))
            if name in ("etag", "etag_url"):
                out.pop("etag", None)
                out.pop("etag_url", None)
    return out


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
    if isinstance(etag, str) and not usable_etag(etag):
        dropped.append(_warn_dropped(
            source, "etag", None, etag,
            f"not a header value (visible ASCII or Latin-1, at most {MAX_ETAG_LENGTH} "
            "characters); the ETag is not used",
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


def dump_cache(cache: Cache, rows_json: str | None = None, generation: int | None = None) -> str:
    """Return ``cache.model_dump_json()``, reusing the rows' JSON when it is given.

    A start changes only the last fired times, so the scheduler keeps the rows'
    JSON from the last change of the list instead of encoding every row again.
    With a generation, ``{"generation":N,`` opens the file (see the module's rule 1).
    """
    text = '{"generation":' + str(generation) + "," if generation is not None else "{"
    text += (
        '"schedules":' + (rows_json if rows_json is not None else dump_rows(cache.schedules))
        + ',"last_fired_at":' + _dump_times(cache.last_fired_at)
        + ',"last_fetched_at":"' + format_go_time(cache.last_fetched_at) + '"'
    )
    if cache.first_seen_at:
        text += ',"first_seen_at":' + _dump_times(cache.first_seen_at)
    if cache.etag is not None:
        text += ',"etag":' + go_escape(json.dumps(cache.etag, ensure_ascii=False))
        text += ',"etag_url":' + go_escape(json.dumps(cache.etag_url, ensure_ascii=False))
    return text + "}"


def save_cache(
    path: Path, cache: Cache, rows_json: str | None = None, generation: int | None = None
) -> None:
    """Write the cache atomically (the caller holds the lock)."""
    write_atomic(path, dump_cache(cache, rows_json, generation).encode())


_GENERATION = re.compile(rb'\{"generation":(\d{1,19}),')


def read_generation(path: Path) -> int | None:
    """Return the generation the cache file opens with; None without one (or no file)."""
    head = read_head(path, 40)
    match = _GENERATION.match(head) if head else None
    return int(match.group(1)) if match else None


def usable_etag(value: str) -> bool:
    """Return whether value can be sent back as an ``If-None-Match`` header value.

    RFC 7232 allows visible ASCII and obs-text (bytes 0x80-0xFF, kept as the
    Latin-1 characters they decode to), so the value round-trips byte for byte.
    """
    return 0 < len(value) <= MAX_ETAG_LENGTH and all(
        "\x21" <= char <= "\x7e" or "\x80" <= char <= "\xff" for char in value
    )


def clamp_future(cache: Cache, *, now: datetime, source: str) -> list[str]:
    """Clamp last fires and first-seen times later than now + FUTURE_SLACK to now.

    Return the entries clamped (``last_fired_at['a']``), each one warned. A
    last fire in 2099 would otherwise stop its schedule until 2099.
    """
    limit = now + FUTURE_SLACK
    clamped: list[str] = []
    for name in _TIME_MAPS:
        times: dict[str, datetime] = getattr(cache, name)
        for key, value in times.items():
            if value > limit:
                times[key] = now
                where = f"{name}[{key!r}]"
                clamped.append(where)
                log.warning(
                    "clamped %s = %s from %s to now (%s): it was in the future",
                    where, format_go_time(value), source, format_go_time(now),
                    extra={"source": source, "field": name, "schedule_id": key,
                           "value": format_go_time(value), "clamped_to": format_go_time(now)},
                )
    return clamped
