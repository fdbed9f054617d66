"""The pull answer agents get: the Go kit's JSON bytes, an ETag, and a cache keyed by it.

Rule: an answer is only ever served for the ETag it was built under, and the
ETag changes in the transaction of any change to the node's list
(:mod:`controller.schedules`), so a stale body cannot be served, whichever API
instance made the change.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastapi import Response
from sqlmodel import Session

from controller import schedules
from sched_core.model import LocalSchedule

PULL_CACHE_BYTES = 64 << 20
"""The default size of the in-process cache of pull answers (0 turns it off)."""


def schedules_body(rows: list[LocalSchedule]) -> bytes:
    """Return the pull answer ``{"schedules":[...]}`` exactly as the Go controller writes it."""
    return wire_body([row.model_dump_json() for row in rows])


def wire_body(wires: list[str]) -> bytes:
    """Return the pull answer from rows' stored wire JSON (as :func:`schedules_body` would)."""
    return ('{"schedules":[' + ",".join(wires) + "]}").encode()


def etag_header(value: str) -> str:
    """Return a store's ETag value as a quoted entity tag (already-quoted values kept)."""
    if value.startswith(('"', 'W/"')):
        return value
    return f'"{value}"'


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """Return whether an ``If-None-Match`` header matches etag (weak comparison, RFC 9110)."""
    if not if_none_match:
        return False
    if if_none_match.strip() == "*":
        return True
    wanted = etag.removeprefix("W/")
    return any(part.strip().removeprefix("W/") == wanted for part in if_none_match.split(","))


class PullCache:
    """The latest pull answer per node, keyed by its ETag; least recently used first out.

    An entry is only ever served for the ETag it was built under, and the ETag
    changes in the transaction of any change to the node's list, so a stale
    body cannot be served, whichever API instance made the change.
    """

    def __init__(self, max_bytes: int = PULL_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, node: str, etag: str) -> bytes | None:
        """Return the body cached for node under etag, or None."""
        with self._lock:
            entry = self._entries.get(node)
            if entry is None or entry[0] != etag:
                return None
            self._entries.move_to_end(node)
            return entry[1]

    def put(self, node: str, etag: str, body: bytes) -> None:
        """Remember body as node's answer under etag, evicting the least recently used."""
        if len(body) > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(node, None)
            if old is not None:
                self._size -= len(old[1])
            self._entries[node] = (etag, body)
            self._size += len(body)
            while self._size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._size -= len(evicted)


def pull_response(
    in_session: Callable[[Callable[[Session], Any]], Any],
    cache: PullCache,
    node: str,
    if_none_match: str | None,
    on_answer: Callable[[str, int, str], None] | None = None,
) -> Response:
    """Return node's pull answer: 304 for a matching ETag, else the (cached) body.

    The ETag is read first (one key lookup); an unchanged list is answered
    from cache; only a changed list reads its rows' stored wire JSON.
    ``on_answer(node, status, etag)`` is told of every answer (the pull record).
    """
    etag: str = in_session(lambda session: schedules.node_etag(session, node))
    body = cache.get(node, etag)
    if body is None and not etag_matches(if_none_match, etag):
        wires, value = in_session(lambda session: schedules.list_wire(session, node))
        # The list may have changed since the ETag read: answer with its own ETag.
        etag = etag_header(value)
        body = wire_body(wires)
        cache.put(node, etag, body)
    headers = {"ETag": etag, "Cache-Control": "private, no-cache", "Vary": "Authorization"}
    status = 304 if etag_matches(if_none_match, etag) else 200
    if on_answer is not None:
        on_answer(node, status, etag)
    if status == 304:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)
