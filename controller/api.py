"""The controller's HTTP API: the schedules agents pull, CRUD for schedules and tasks.

Rule: authentication runs before anything reads the request body, and every
answer about schedules is built from ``LocalSchedule.model_dump_json()`` (the
pull answer from each row's stored output of it, see :mod:`controller.schedules`),
so the bytes on the wire are the Go kit's JSON.

Endpoints (every ``/api`` one needs ``Authorization: Bearer <token>``):

====== ================================== =============== ===========================
method path                               who             answer
====== ================================== =============== ===========================
GET    /healthz                           anyone          ``{"status": "ok"}`` or 503
GET    /api/schedules?node=N              admin, node N   ``{"schedules": [...]}`` + ETag
GET    /api/nodes                         admin           ``{"nodes": [...]}``
GET    /api/nodes/{node}/schedules        admin, node     as ``/api/schedules?node=``
GET    /api/nodes/{node}/schedules/{id}   admin, node     one row, or 404
PUT    /api/nodes/{node}/schedules/{id}   admin           the stored row (version bumped)
DELETE /api/nodes/{node}/schedules/{id}   admin           204, or 404
GET    /api/tasks                         admin           ``{"tasks": [...]}``
GET    /api/tasks/{name}                  admin           one task, or 404
PUT    /api/tasks/{name}                  admin           the stored task
DELETE /api/tasks/{name}                  admin           204, or 404
====== ================================== =============== ===========================

A missing or unknown token gets 401 with ``WWW-Authenticate: Bearer``; a node
token outside its node, or on a write, gets 403. An invalid body gets 422 with
``{"detail": [{"field": "schedule", "loc": [...], "msg": "...", "type": "..."}]}``,
and so does a node name, schedule id or task name that no database column holds
(over 200 characters, or with a NUL), on every path that takes one, so SQLite
and Postgres answer alike. A body is JSON as Go's ``encoding/json`` reads it: no
``NaN``/``Infinity`` and no number beyond a float64, nested at most 100 deep,
and its text fields hold no NUL (Postgres text cannot) and nothing but UTF-8.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller import claims, tasks
from controller import schedules as schedule_store
from controller.auth import Principal, Tokens, bearer_token
from controller.models import NodeRevision, TaskIn
from sched_core.model import LocalSchedule

log = logging.getLogger("controller.api")
access_log = logging.getLogger("controller.access")

MAX_BODY_BYTES = 1 << 20
"""A schedule or task body larger than this is refused with 413."""

MAX_NAME_LENGTH = 200
"""The longest node name, schedule id or task name: their columns are ``varchar(200)``."""

MAX_JSON_DEPTH = 100
"""The deepest nesting of a body (``params`` is level 2); pydantic serializes ~250 at most."""

_DRAIN_LIMIT = 16 * MAX_BODY_BYTES

PULL_CACHE_BYTES = 64 << 20
"""The default size of the in-process cache of pull answers (0 turns it off)."""

T = TypeVar("T")

_LOCATIONS = ("body", "query", "path", "header", "cookie")


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """Return the dotted field name of a validation error location, without its source."""
    parts = [str(part) for part in loc]
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    return ".".join(parts)


def _error_entry(
    loc: tuple[Any, ...] | list[Any], msg: str, kind: str, value: Any = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "field": _field_name(loc),
        "loc": list(loc),
        "msg": msg.removeprefix("Value error, "),
        "type": kind,
    }
    # Echo a bad scalar so the answer names the value too; never a whole object.
    if isinstance(value, str | int | float | bool) and len(str(value)) <= 200:
        entry["input"] = value
    return entry


def _body_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Return a pydantic error as 422 entries located in the body (no input echoed)."""
    return [
        _error_entry(("body", *err["loc"]), err["msg"], err["type"], err.get("input"))
        for err in exc.errors(include_url=False, include_context=False)
    ]


def _unprocessable(loc: tuple[str, ...], msg: str, kind: str = "value_error") -> JSONResponse:
    return JSONResponse({"detail": [_error_entry(loc, msg, kind)]}, status_code=422)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (Go's encoding/json refuses it too)")


def _out_of_range(text: str) -> ValueError:
    shown = text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"
    return ValueError(f"number {shown} is beyond a float64 (Go's encoding/json refuses it too)")


def _finite_float(text: str) -> float:
    """Return the JSON number text as a float; one beyond a float64 is a ValueError."""
    value = float(text)
    if not math.isfinite(value):
        raise _out_of_range(text)
    return value


def _float64_int(text: str) -> int:
    """Return the JSON integer text as an int; one beyond a float64 (Go's) is a ValueError."""
    # float() first: it rounds as Go does, and never hits int()'s 4,300-digit limit.
    if not math.isfinite(float(text)):
        raise _out_of_range(text)
    return int(text)


def _is_utf8(text: str) -> bool:
    """Return whether text encodes as UTF-8 (a JSON ``\\ud800`` decodes to one that does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NUL = "contains a NUL character, which PostgreSQL text cannot hold"
_SURROGATE = "contains an unpaired UTF-16 surrogate, which is not UTF-8 text"


def _name_problem(name: str, *, storing: bool) -> tuple[str, str] | None:
    """Return (message, type) if name cannot be a node name, schedule id or task name.

    The length limit applies to names being stored (a PUT): reading or deleting
    by a longer name is just not found, and a row stored on SQLite before the
    limit existed stays readable and deletable.
    """
    if storing and len(name) > MAX_NAME_LENGTH:
        return f"is {len(name)} characters long; the most is {MAX_NAME_LENGTH}", "string_too_long"
    if "\x00" in name:
        return _NUL, "string_nul"
    if not _is_utf8(name):
        return _SURROGATE, "string_unicode"
    return None


def check_name(loc: tuple[str, str], name: str, *, storing: bool = False) -> None:
    """Raise a 422 naming loc's field when name cannot be used (see :func:`_name_problem`)."""
    problem = _name_problem(name, storing=storing)
    if problem is not None:
        message, kind = problem
        raise HTTPException(422, [_error_entry(loc, f"{loc[-1]} {message}", kind)])


def _body_problem(data: dict[str, Any]) -> tuple[tuple[Any, ...], str, str] | None:
    """Return (loc, message, type) of the first part of a parsed body no database can store.

    Every string, key or value, must be UTF-8; a top-level string (a text
    column) must hold no NUL (JSON columns escape it); no object or array may
    nest deeper than MAX_JSON_DEPTH, the body itself being level 1.
    """
    for key, value in data.items():
        if isinstance(value, str) and "\x00" in value and _is_utf8(key):
            return ("body", key), f"{key} {_NUL}", "string_nul"
    # Iterative, so that any depth is a 422 here and never a RecursionError.
    stack: list[tuple[tuple[Any, ...], Any]] = [(("body",), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return loc, f"{_field_name(loc) or 'body'} {_SURROGATE}", "string_unicode"
            continue
        if isinstance(value, dict | list) and len(loc) > MAX_JSON_DEPTH:
            return loc[:2], f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_invalid"
        if isinstance(value, dict):
            for key in value:
                if not _is_utf8(key):
                    shown = key.encode("utf-8", "backslashreplace").decode()
                    return (*loc, shown), f"key {shown!r} {_SURROGATE}", "string_unicode"
            stack.extend(((*loc, key), item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend(((*loc, index), item) for index, item in enumerate(value))
    return None


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


def _printable(text: str) -> str:
    """Return text with control characters escaped, so a request cannot forge log lines."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


class AccessLogMiddleware:
    """Log one line per request: method, path, node, principal, status, duration.

    Headers are never logged, so neither is the ``Authorization`` header.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        state: dict[str, Any] = scope.setdefault("state", {})

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            principal = state.get("principal")
            node = _printable(str(state.get("node", "-")))
            path = _printable(scope["path"])
            who = principal.label if isinstance(principal, Principal) else "-"
            elapsed_ms = (time.perf_counter() - started) * 1000
            access_log.info(
                "%s %s node=%s principal=%s status=%d %.1fms",
                scope["method"], path, node, who, status, elapsed_ms,
                extra={
                    "method": scope["method"], "path": path, "node": node,
                    "principal": who, "status": status, "duration_ms": round(elapsed_ms, 3),
                },
            )


def create_app(
    engine: Engine,
    tokens: Tokens,
    *,
    on_task_saved: Callable[[str], None] | None = None,
    pull_cache_bytes: int = PULL_CACHE_BYTES,
) -> FastAPI:
    """Return the API app over engine, authenticating with tokens.

    A pull first reads only the node's ETag: a matching ``If-None-Match`` gets
    304, and an unchanged list is answered from an in-process cache of up to
    ``pull_cache_bytes``; only a changed list reads its rows' stored wire JSON.

    ``on_task_saved(name)`` is called after a task is saved, so an in-process
    central scheduler can wake without waiting for its poll (SQLite has no NOTIFY).
    """
    app = FastAPI(title="sched controller", version="1", docs_url="/docs", redoc_url=None)
    app.add_middleware(AccessLogMiddleware)
    pull_cache = PullCache(pull_cache_bytes)

    def in_session(work: Callable[[Session], T]) -> T:
        with Session(engine) as session:
            result = work(session)
            session.commit()
            return result

    def authenticate(request: Request) -> Principal:
        token = bearer_token(request.headers.get("authorization"))
        principal = tokens.authenticate(token)
        if principal is None:
            detail = "missing bearer token" if token is None else "invalid bearer token"
            challenge = "Bearer" if token is None else 'Bearer error="invalid_token"'
            raise HTTPException(401, detail, headers={"WWW-Authenticate": challenge})
        request.state.principal = principal
        return principal

    def require_admin(request: Request) -> Principal:
        principal = authenticate(request)
        if not principal.is_admin:
            raise HTTPException(403, "this endpoint needs the admin token")
        return principal

    def require_node(request: Request, node: str) -> Principal:
        request.state.node = node
        principal = authenticate(request)
        if not principal.may_read_node(node):
            raise HTTPException(403, f"this token may not read the schedules of node {node!r}")
        return principal

    def check_schedule_key(node: str, schedule_id: str, *, storing: bool = False) -> None:
        check_name(("path", "node"), node, storing=storing)
        check_name(("path", "id"), schedule_id, storing=storing)

    async def read_object(request: Request, key: str, value: str) -> dict[str, Any] | Response:
        """Return the JSON object body with key defaulted to value, or a 413/422 answer."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                chunks.append(chunk)
            elif size > _DRAIN_LIMIT:
                break
            # Past the limit the rest is read and dropped (never buffered), so the
            # client gets its 413 instead of a reset connection.
        if size > MAX_BODY_BYTES:
            return JSONResponse({"detail": f"body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        try:
            data = json.loads(b"".join(chunks), parse_constant=_reject_constant,
                              parse_float=_finite_float, parse_int=_float64_int)
        except (ValueError, UnicodeDecodeError) as exc:
            return _unprocessable(("body",), f"invalid JSON: {exc}", "json_invalid")
        except RecursionError:
            return _unprocessable(
                ("body",), f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_invalid"
            )
        if not isinstance(data, dict):
            return _unprocessable(("body",), "expected a JSON object", "model_type")
        problem = _body_problem(data)
        if problem is not None:
            return _unprocessable(*problem)
        data.setdefault(key, value)
        if data[key] != value:
            return _unprocessable(
                ("body", key), f"{key} {data[key]!r} differs from the path's {value!r}"
            )
        return data

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            _error_entry(tuple(err.get("loc", ())), str(err.get("msg", "")), str(err.get("type")))
            for err in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        try:
            # Reading a controller table also proves the migrations have run.
            in_session(lambda session: session.execute(select(NodeRevision.node).limit(1)).all())
        except Exception as exc:
            # The message may carry a connection string: log its type, answer generically.
            log.warning("health check failed", extra={"error": type(exc).__name__})
            return JSONResponse({"status": "unavailable", "database": "error"}, status_code=503)
        return JSONResponse({"status": "ok", "database": "ok"})

    def pull_answer(request: Request, node: str, source: str = "path") -> Response:
        require_node(request, node)
        check_name((source, "node"), node)
        if_none_match = request.headers.get("if-none-match")
        etag = in_session(lambda session: schedule_store.node_etag(session, node))
        body = pull_cache.get(node, etag)
        if body is None and not etag_matches(if_none_match, etag):
            wires, value = in_session(lambda s: schedule_store.list_wire(s, node))
            # The list may have changed since the ETag read: answer with its own ETag.
            etag = etag_header(value)
            body = wire_body(wires)
            pull_cache.put(node, etag, body)
        headers = {"ETag": etag, "Cache-Control": "private, no-cache", "Vary": "Authorization"}
        if etag_matches(if_none_match, etag):
            return Response(status_code=304, headers=headers)
        return Response(body, media_type="application/json", headers=headers)

    @app.get("/api/schedules")
    def list_schedules(request: Request, node: str | None = None) -> Response:
        # node is checked here, not by FastAPI, so that a missing token is a 401 first.
        authenticate(request)
        if not node:
            return _unprocessable(("query", "node"), "node is required (?node=NAME)", "missing")
        return pull_answer(request, node, "query")

    @app.get("/api/nodes")
    def list_nodes(request: Request) -> JSONResponse:
        require_admin(request)
        return JSONResponse({"nodes": in_session(schedule_store.list_nodes)})

    @app.get("/api/nodes/{node}/schedules")
    def list_node_schedules(request: Request, node: str) -> Response:
        return pull_answer(request, node)

    @app.get("/api/nodes/{node}/schedules/{schedule_id}")
    def get_schedule(request: Request, node: str, schedule_id: str) -> Response:
        require_node(request, node)
        check_schedule_key(node, schedule_id)
        row = in_session(lambda s: schedule_store.get_schedule(s, node, schedule_id))
        if row is None:
            raise HTTPException(404, f"no schedule {schedule_id!r} on node {node!r}")
        return Response(row.model_dump_json(), media_type="application/json")

    @app.put("/api/nodes/{node}/schedules/{schedule_id}")
    async def put_schedule(request: Request, node: str, schedule_id: str) -> Response:
        request.state.node = node
        require_admin(request)
        check_schedule_key(node, schedule_id, storing=True)
        data = await read_object(request, "id", schedule_id)
        if isinstance(data, Response):
            return data
        try:
            row = LocalSchedule.model_validate(data)
        except ValidationError as exc:
            return JSONResponse({"detail": _body_errors(exc)}, status_code=422)
        stored = await run_in_threadpool(
            in_session, lambda s: schedule_store.put_schedule(s, node, row)
        )
        log.info("schedule saved", extra={"node": node, "schedule_id": schedule_id,
                                           "version": stored.version})
        return Response(stored.model_dump_json(), media_type="application/json")

    @app.delete("/api/nodes/{node}/schedules/{schedule_id}", status_code=204)
    def delete_schedule(request: Request, node: str, schedule_id: str) -> Response:
        request.state.node = node
        require_admin(request)
        check_schedule_key(node, schedule_id)
        if not in_session(lambda s: schedule_store.delete_schedule(s, node, schedule_id)):
            raise HTTPException(404, f"no schedule {schedule_id!r} on node {node!r}")
        log.info("schedule deleted", extra={"node": node, "schedule_id": schedule_id})
        return Response(status_code=204)

    @app.get("/api/tasks")
    def list_tasks(request: Request) -> JSONResponse:
        require_admin(request)
        found = in_session(lambda s: [_task_json(t) for t in tasks.list_tasks(s)])
        return JSONResponse({"tasks": found})

    @app.get("/api/tasks/{name}")
    def get_task(request: Request, name: str) -> JSONResponse:
        require_admin(request)
        check_name(("path", "name"), name)
        found = in_session(lambda s: _optional_task_json(tasks.get_task(s, name)))
        if found is None:
            raise HTTPException(404, f"no task {name!r}")
        return JSONResponse(found)

    @app.get("/api/tasks/{name}/dispatches")
    def list_task_dispatches(
        request: Request, name: str, limit: int = Query(100, ge=1, le=1000)
    ) -> JSONResponse:
        require_admin(request)
        check_name(("path", "name"), name)

        def read(session: Session) -> list[dict[str, Any]] | None:
            if tasks.get_task(session, name) is None:
                return None
            return [r.model_dump(mode="json")
                    for r in claims.list_dispatches(session, name, newest=limit)]

        found = in_session(read)
        if found is None:
            raise HTTPException(404, f"no task {name!r}")
        return JSONResponse({"dispatches": found})

    @app.put("/api/tasks/{name}")
    async def put_task(request: Request, name: str) -> Response:
        require_admin(request)
        check_name(("path", "name"), name, storing=True)
        data = await read_object(request, "name", name)
        if isinstance(data, Response):
            return data
        try:
            task = TaskIn.model_validate(data)
        except ValidationError as exc:
            return JSONResponse({"detail": _body_errors(exc)}, status_code=422)
        stored = await run_in_threadpool(
            in_session, lambda s: _task_json(tasks.save_task(s, task))
        )
        log.info("task saved", extra={"task": name})
        if on_task_saved is not None:
            on_task_saved(name)
        return JSONResponse(stored)

    @app.delete("/api/tasks/{name}", status_code=204)
    def delete_task(request: Request, name: str) -> Response:
        require_admin(request)
        check_name(("path", "name"), name)
        if not in_session(lambda s: tasks.delete_task(s, name)):
            raise HTTPException(404, f"no task {name!r}")
        log.info("task deleted", extra={"task": name})
        return Response(status_code=204)

    return app


def _task_json(task: Any) -> dict[str, Any]:
    """Return a stored task as JSON-ready data (called inside its session)."""
    data: dict[str, Any] = task.model_dump(mode="json")
    return data


def _optional_task_json(task: Any) -> dict[str, Any] | None:
    return None if task is None else _task_json(task)
