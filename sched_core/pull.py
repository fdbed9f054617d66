"""Pulling the schedule list: fetch the bytes, read them strictly, merge them into a cache.

Rules:
1. :func:`fetch` is the only I/O: a ``file://`` read or a GET through an
   ``httpx.Client`` (the caller's, injected, or a short-lived one), at most
   :data:`MAX_PAYLOAD` bytes. httpx is imported only for an HTTP pull.
2. :func:`parse_schedule_list` and :func:`merge_pull` are pure. A list is
   read with :mod:`sched_core.jsonwire`'s rules, so whatever is accepted can be
   written to the cache and read back unchanged.
3. Every refusal is a :class:`~sched_core.errors.PullError` naming what was
   wrong and where; the caller keeps its cache exactly as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from sched_core.cache import json_type, usable_etag
from sched_core.errors import PullError, WireError, format_loc
from sched_core.jsonwire import MAX_LIST_DEPTH, SURROGATE_TEXT, decode
from sched_core.model import Cache, LocalSchedule

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

MAX_PAYLOAD = 16 * 1024 * 1024
"""The largest schedule list a pull accepts, in bytes."""

PULL_TIMEOUT = 30.0
"""Seconds a pull without a client of the caller's waits for the controller."""


@dataclass(frozen=True)
class PullResult:
    """What a pull changed: ids added, removed and changed, and rows rejected with reasons."""

    added: list[str]
    removed: list[str]
    changed: list[str]
    rejected: list[tuple[str, str]]
    kept_last_good: list[str]

    @property
    def changed_anything(self) -> bool:
        """True when the schedule list is different after the pull."""
        return bool(self.added or self.removed or self.changed)


NOT_MODIFIED = PullResult(added=[], removed=[], changed=[], rejected=[], kept_last_good=[])


def redact_url(url: str) -> str:
    """Return url without any user or password in it, for logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def _short(value: object) -> str:
    """Return repr(value), cut to a length a log line or an error can carry."""
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:60]}...{shown[-10:]}"


# -- fetch: the I/O ------------------------------------------------------------------


def fetch(
    url: str, client: httpx.Client | None, *, etag: str | None
) -> tuple[bytes | None, str | None]:
    """Return the raw schedule list (None for a 304 to etag) and the answer's usable ETag.

    Raise PullError for an unreadable file, a failed or non-2xx request, or
    more than MAX_PAYLOAD bytes.
    """
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = Path(unquote(parts.path))
        try:
            with path.open("rb") as handle:
                body = handle.read(MAX_PAYLOAD + 1)
        except OSError as exc:
            raise PullError(f"cannot read schedule file {path}: {exc}") from exc
        if len(body) > MAX_PAYLOAD:
            raise PullError(f"schedule list from {shown} is larger than {MAX_PAYLOAD} bytes")
        return body, None
    import httpx

    if client is None:
        with httpx.Client(timeout=httpx.Timeout(PULL_TIMEOUT)) as own:
            return _get(own, url, shown, etag)
    return _get(client, url, shown, etag)


def _get(
    client: httpx.Client, url: str, shown: str, etag: str | None
) -> tuple[bytes | None, str | None]:
    # The ETag goes back as the bytes it came as (Latin-1 keeps obs-text byte for byte).
    headers = {b"If-None-Match": etag.encode("latin-1")} if etag else {}
    try:
        with client.stream("GET", url, headers=headers) as response:
            if response.status_code == 304 and etag:
                return None, etag
            if not 200 <= response.status_code < 300:
                raise PullError(f"pull from {shown} answered HTTP {response.status_code}")
            chunks: list[bytes] = []
            size = 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_PAYLOAD:
                    raise PullError(
                        f"schedule list from {shown} is larger than {MAX_PAYLOAD} bytes"
                    )
                chunks.append(chunk)
            return b"".join(chunks), _answer_etag(response.headers.raw, shown)
    except PullError:
        raise
    except Exception as exc:  # httpx's errors, and anything a transport raises
        raise PullError(f"pull from {shown} failed: {exc!r}") from exc


def _answer_etag(raw_headers: list[tuple[bytes, bytes]], shown: str) -> str | None:
    """Return the answer's ETag as Latin-1 text if it can be sent back, else None (logged)."""
    for name, value in raw_headers:
        if name.lower() == b"etag":
            text = value.decode("latin-1")
            if usable_etag(text):
                return text
            log.warning(
                "ignored the ETag %s from %s: not a header value that can be sent back",
                _short(text), shown, extra={"url": shown, "etag": _short(text)},
            )
            return None
    return None


# -- parse: pure -----------------------------------------------------------------------


def _describe(exc: WireError) -> str:
    where = format_loc(exc.loc)
    if exc.rule == "surrogate":
        return f"{where or 'the list'} {SURROGATE_TEXT}"
    return f"{where}: {exc.reason}" if where else exc.reason


def parse_schedule_list(body: bytes, source: str) -> list[dict[str, Any]]:
    """Return the raw rows of a pull answer, or raise PullError for a bad payload.

    The answer is ``{"schedules": [...]}`` or a bare array, read with
    :mod:`sched_core.jsonwire`'s rules (the whole list refused, naming where, if
    any value breaks one). Every row must be an object with a non-empty string
    ``id``, and no id may repeat: such a list cannot be diffed against the cache,
    and reading a row as absent would delete its schedule and its history.
    """
    try:
        data = decode(body, max_depth=MAX_LIST_DEPTH, root="list")
    except WireError as exc:
        if exc.rule == "syntax":
            reason = exc.reason.removeprefix("invalid JSON: ")
            raise PullError(f"schedule list from {source} is not valid JSON: {reason}") from None
        raise PullError(f"schedule list from {source}: {_describe(exc)}") from None
    if isinstance(data, dict):
        if "schedules" not in data:
            raise PullError(f"schedule list from {source} has no 'schedules' field")
        data = data["schedules"]
    if not isinstance(data, list):
        raise PullError(f"schedules from {source} must be a JSON list, got {type(data).__name__}")
    seen: set[str] = set()
    for position, row in enumerate(data):
        if not isinstance(row, dict):
            raise PullError(
                f"schedule list from {source}: row {position} is not a JSON object "
                f"(got {json_type(row)})"
            )
        if "id" not in row:
            raise PullError(f"schedule list from {source}: row {position} has no id")
        row_id = row["id"]
        if not isinstance(row_id, str) or not row_id:
            raise PullError(
                f"schedule list from {source}: row {position} has id {_short(row_id)}, "
                "not a non-empty string"
            )
        if row_id in seen:
            raise PullError(f"schedule list from {source} repeats id {_short(row_id)}")
        seen.add(row_id)
    return data


# -- merge: pure -----------------------------------------------------------------------


def merge_pull(
    cache: Cache,
    good: list[LocalSchedule],
    rejected: list[tuple[str, str]],
    *,
    rows: int,
    etag: str | None,
    etag_url: str,
    source: str,
    now: datetime,
) -> tuple[Cache, PullResult]:
    """Return the cache after accepting a pulled list, and what changed; cache is untouched.

    1. If schedules are cached and every one of a non-empty list's ``rows`` is
       invalid, refuse (PullError): a broken controller, not an instruction to
       stop every schedule. On an empty cache the rows are reported rejected.
    2. Otherwise good is the new list; a rejected id that was cached keeps its
       last good version (and its history).
    3. Surviving ids keep their last fire; a new id is first seen now; the
       list was fetched now; the ETag is the answer's (none if it sent none).
    """
    if rows and not good and cache.schedules:
        label, reason = rejected[0]
        raise PullError(
            f"every one of the {rows} rows of the schedule list from {source} "
            f"is invalid (first: {label}: {reason}); keeping the "
            f"{len(cache.schedules)} cached schedules"
        )
    old = {row.id: row for row in cache.schedules}
    new = {row.id: row for row in good}
    kept = [rid for rid, _ in rejected if rid in old and rid not in new]
    for rid in kept:
        new[rid] = old[rid]
    result = PullResult(
        added=sorted(set(new) - set(old)),
        removed=sorted(set(old) - set(new)),
        changed=sorted(rid for rid in set(new) & set(old) if new[rid] != old[rid]),
        rejected=rejected,
        kept_last_good=kept,
    )
    merged = Cache.model_construct(  # every value is valid already: no second validation
        schedules=[new[row.id] for row in good] + [new[rid] for rid in kept],
        last_fired_at={k: v for k, v in cache.last_fired_at.items() if k in new},
        last_fetched_at=now,
        first_seen_at={rid: cache.first_seen_at.get(rid, now) for rid in new},
        etag=etag if etag else None,
        etag_url=etag_url if etag else None,
    )
    return merged, result


def not_modified(cache: Cache, *, now: datetime) -> Cache:
    """Return the cache after a 304: unchanged, but fetched now."""
    return cache.model_copy(update={
        "schedules": list(cache.schedules),
        "last_fired_at": dict(cache.last_fired_at),
        "first_seen_at": dict(cache.first_seen_at),
        "last_fetched_at": now,
    })
