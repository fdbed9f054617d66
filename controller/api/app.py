"""The controller's HTTP app: routers for schedules and tasks, auth as dependencies.

Rule: authentication runs before anything reads the request body (it is a
dependency; bodies are read inside the endpoints), and every answer about
schedules is built from ``LocalSchedule.model_dump_json()`` (the pull answer
from each row's stored output of it, see :mod:`controller.schedules`), so the
bytes on the wire are the Go kit's JSON. Errors are raised as
:mod:`controller.errors` and mapped to their status in one place
(:func:`_install_error_handlers`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeoutError
from sqlmodel import Session, select
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller import claims, schedules, tasks
from controller.api.access_log import AccessLogMiddleware
from controller.api.fleet import FleetApi, fleet_router, row_from_body
from controller.api.headers import SecurityHeadersMiddleware
from controller.api.jsonbody import (
    _unprocessable,
    check_name,
    check_node,
    read_model,
    read_object,
    validation_entries,
)
from controller.api.openapi import install_openapi, json_body
from controller.api.page import FleetApiSource, SessionRevocations, page_router
from controller.api.pull import PULL_CACHE_BYTES, PullCache, pull_response
from controller.api.wait import wait_router
from controller.auth import Principal, Tokens, bearer_token
from controller.errors import BodyTooLarge, ClientGone, InvalidInput, NotFound
from controller.events import NoEvents, ScheduleEvents
from controller.fleet import FleetSettings
from controller.logtext import printable
from controller.models import NodeRevision, ScheduledTask, TaskIn, utc_now
from controller.nodes import NodeReportIn, PullRecorder
from controller.waits import NodeWaits
from sched_core.model import LocalSchedule

log = logging.getLogger("controller.api")

T = TypeVar("T")

DB_RETRY_AFTER_S = 5
"""The ``Retry-After`` of a 503 answered because the database is unavailable (seconds)."""


class Auth:
    """Who is calling, as FastAPI dependencies: ``Depends(auth.require_admin)`` and friends.

    A missing or unknown token is a 401 with ``WWW-Authenticate: Bearer``; a
    node token outside its node, or on a write, is a 403. The principal (and
    the node, when the path names one) go on ``request.state`` for the access log.
    """

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def authenticate(self, request: Request) -> Principal:
        """Return the caller's principal; 401 when the token is missing or unknown."""
        token = bearer_token(request.headers.get("authorization"))
        principal = self.tokens.authenticate(token)
        if principal is None:
            detail = "missing bearer token" if token is None else "invalid bearer token"
            challenge = "Bearer" if token is None else 'Bearer error="invalid_token"'
            raise HTTPException(401, detail, headers={"WWW-Authenticate": challenge})
        request.state.principal = principal
        return principal

    def require_admin(self, request: Request) -> Principal:
        """Return the admin principal; 403 for a node token."""
        principal = self.authenticate(request)
        if not principal.is_admin:
            raise HTTPException(403, "this endpoint needs the admin token")
        return principal

    def require_admin_on_node(self, request: Request, node: str) -> Principal:
        """Return the admin principal of a write to node's schedules (node logged either way)."""
        request.state.node = node
        return self.require_admin(request)

    def is_own(self, principal: Principal, node: str) -> bool:
        """Return whether principal is node itself: its own token (or any caller when
        serving without tokens, where nobody can be told apart)."""
        return principal.node == node or self.tokens.insecure

    def require_node(self, request: Request, node: str) -> Principal:
        """Return a principal that may read node's schedules (the admin, or node itself)."""
        request.state.node = node
        principal = self.authenticate(request)
        if not principal.may_read_node(node):
            raise HTTPException(403, f"this token may not read the schedules of node {node!r}")
        return principal


def _install_error_handlers(app: FastAPI) -> None:
    """Map the controller's errors, and FastAPI's validation errors, to their answers."""

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_entries(list(exc.errors()))}, status_code=422)

    @app.exception_handler(InvalidInput)
    async def _invalid(request: Request, exc: InvalidInput) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=422)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=413)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette names the methods of the first route matching the path only,
            # and each of ours has one method: name every method the path has.
            allowed = allowed_methods(request.app, request.url.path) or [
                m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
            return JSONResponse({"detail": f"method {request.method} is not allowed here; "
                                 f"this path takes {', '.join(allowed)}"},
                                status_code=405, headers={"allow": ", ".join(allowed)})
        return await http_exception_handler(request, exc)

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(SQLAlchemyTimeoutError)
    async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # The database did not answer (down, unreachable, its pool exhausted): a 503
        # naming that, never the error's text (it may carry the connection string).
        kind = type(getattr(exc, "orig", None) or exc).__name__
        log.warning("database unavailable; answered 503",
                    extra={"error": kind, "path": printable(request.url.path)})
        return JSONResponse(
            {"detail": f"the database is unavailable ({kind}); try again shortly"},
            status_code=503, headers={"retry-after": str(DB_RETRY_AFTER_S)})

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        # Nobody reads this answer (the connection is closed, or was answered 408 by
        # the connection guard); it only gives the access log its status.
        return Response(status_code=408, headers={"connection": "close"})


_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Return the methods the OpenAPI document gives path, in a fixed order (a 405's Allow).

    The document is the contract a generated client follows, so the Allow of a
    405 names exactly its methods for that path ([] for a path it does not list).
    """
    found: set[str] = set()
    for template, operations in app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]*?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            found.update(method.upper() for method in operations)
    return sorted(found, key=lambda m: (_METHOD_ORDER.index(m) if m in _METHOD_ORDER else 99, m))


def _check_schedule_key(node: str, schedule_id: str, *, storing: bool = False) -> None:
    check_node(("path", "node"), node, storing=storing)
    check_name(("path", "id"), schedule_id, storing=storing)


def _task_json(task: ScheduledTask) -> dict[str, Any]:
    """Return a stored task as JSON-ready data (called inside its session)."""
    data: dict[str, Any] = task.model_dump(mode="json")
    return data


def schedule_router(
    in_session: Callable[[Callable[[Session], Any]], Any], auth: Auth, pull_cache: PullCache,
    fleet_api: FleetApi,
) -> APIRouter:
    """Return the routes of the agents' schedules: the pull, and CRUD per node."""
    router = APIRouter()
    admin = Depends(auth.require_admin)
    admin_on_node = Depends(auth.require_admin_on_node)
    reader = Depends(auth.require_node)

    def pull_answer(request: Request, node: str, source: str = "path") -> Response:
        principal = auth.require_node(request, node)
        check_name((source, "node"), node)
        own = auth.is_own(principal, node)

        def recorded(name: str, status: int, etag: str) -> None:
            fleet_api.record_pull(name, status, etag, own=own)

        return pull_response(in_session, pull_cache, node, request.headers.get("if-none-match"),
                             recorded)

    @router.get("/api/schedules", dependencies=[Depends(auth.authenticate)])
    def list_schedules(request: Request, node: str | None = None) -> Response:
        # node is checked here, not by FastAPI, so that a missing token is a 401 first.
        if not node:
            raise _unprocessable(("query", "node"), "node is required (?node=NAME)", "missing")
        return pull_answer(request, node, "query")

    @router.get("/api/nodes", dependencies=[admin])
    def list_nodes() -> JSONResponse:
        return JSONResponse({"nodes": in_session(schedules.list_nodes)})

    @router.get("/api/nodes/{node}/schedules", dependencies=[reader])
    def list_node_schedules(request: Request, node: str) -> Response:
        return pull_answer(request, node)

    @router.get("/api/nodes/{node}/schedules/{schedule_id}", dependencies=[reader])
    def get_schedule(node: str, schedule_id: str) -> Response:
        _check_schedule_key(node, schedule_id)
        row = in_session(lambda s: schedules.get_schedule(s, node, schedule_id))
        if row is None:
            raise NotFound(f"no schedule {schedule_id!r} on node {node!r}")
        return Response(row.model_dump_json(), media_type="application/json")

    @router.put(
        "/api/nodes/{node}/schedules/{schedule_id}", dependencies=[admin_on_node],
        openapi_extra=json_body(
            LocalSchedule, "The row in the agents' wire format; `id` may be left out "
            "(the path's), `version` is ignored (the stored one is bumped)."
        ),
    )
    async def put_schedule(request: Request, node: str, schedule_id: str) -> Response:
        _check_schedule_key(node, schedule_id, storing=True)
        row = row_from_body(await read_object(request, "id", schedule_id))
        stored = await run_in_threadpool(
            in_session, lambda s: schedules.put_schedule(s, node, row, now=fleet_api.clock())
        )
        # Both are identifiers by now (the node's path rule, the row's id rule).
        log.info("schedule saved", extra={"node": node, "schedule_id": schedule_id,
                                           "version": stored.version})
        return await run_in_threadpool(fleet_api.written, node, stored, "put")

    @router.delete(
        "/api/nodes/{node}/schedules/{schedule_id}", status_code=204,
        dependencies=[admin_on_node],
    )
    def delete_schedule(node: str, schedule_id: str) -> Response:
        _check_schedule_key(node, schedule_id)
        if not in_session(lambda s: schedules.delete_schedule(s, node, schedule_id,
                                                             now=fleet_api.clock())):
            raise NotFound(f"no schedule {schedule_id!r} on node {node!r}")
        log.info("schedule deleted", extra={"node": printable(node),
                                             "schedule_id": printable(schedule_id)})
        fleet_api.announce(node, schedule_id, None, "delete")
        return Response(status_code=204)

    return router


def task_router(
    in_session: Callable[[Callable[[Session], Any]], Any],
    auth: Auth,
    on_task_saved: Callable[[str], None] | None,
) -> APIRouter:
    """Return the routes of the central tasks (admin only) and their dispatch records."""
    router = APIRouter(dependencies=[Depends(auth.require_admin)])

    @router.get("/api/tasks")
    def list_tasks() -> JSONResponse:
        found = in_session(lambda s: [_task_json(t) for t in tasks.list_tasks(s)])
        return JSONResponse({"tasks": found})

    @router.get("/api/tasks/{name}")
    def get_task(name: str) -> JSONResponse:
        check_name(("path", "name"), name)

        def read(session: Session) -> dict[str, Any] | None:
            task = tasks.get_task(session, name)
            return None if task is None else _task_json(task)

        found = in_session(read)
        if found is None:
            raise NotFound(f"no task {name!r}")
        return JSONResponse(found)

    @router.get("/api/tasks/{name}/dispatches")
    def list_task_dispatches(
        name: str, limit: int = Query(100, ge=1, le=1000)
    ) -> JSONResponse:
        check_name(("path", "name"), name)

        def read(session: Session) -> list[dict[str, Any]] | None:
            if tasks.get_task(session, name) is None:
                return None
            return [r.model_dump(mode="json")
                    for r in claims.list_dispatches(session, name, newest=limit)]

        found = in_session(read)
        if found is None:
            raise NotFound(f"no task {name!r}")
        return JSONResponse({"dispatches": found})

    @router.put(
        "/api/tasks/{name}",
        openapi_extra=json_body(TaskIn, "The task; `name` may be left out (the path's)."),
    )
    async def put_task(request: Request, name: str) -> Response:
        check_name(("path", "name"), name, storing=True)
        task = await read_model(request, TaskIn, "name", name)
        stored = await run_in_threadpool(
            in_session, lambda s: _task_json(tasks.save_task(s, task))
        )
        log.info("task saved", extra={"task": printable(name)})
        if on_task_saved is not None:
            on_task_saved(name)
        return JSONResponse(stored)

    @router.delete("/api/tasks/{name}", status_code=204)
    def delete_task(name: str) -> Response:
        check_name(("path", "name"), name)
        if not in_session(lambda s: tasks.delete_task(s, name)):
            raise NotFound(f"no task {name!r}")
        log.info("task deleted", extra={"task": printable(name)})
        return Response(status_code=204)

    return router


def create_app(
    engine: Engine,
    tokens: Tokens,
    *,
    on_task_saved: Callable[[str], None] | None = None,
    pull_cache_bytes: int = PULL_CACHE_BYTES,
    events: ScheduleEvents | None = None,
    fleet_settings: FleetSettings | None = None,
    record_pulls: bool = True,
    clock: Callable[[], datetime] = utc_now,
    waits: NodeWaits | None = None,
) -> FastAPI:
    """Return the API app over engine, authenticating with tokens.

    A pull first reads only the node's ETag: a matching ``If-None-Match`` gets
    304, and an unchanged list is answered from an in-process cache of up to
    ``pull_cache_bytes``; only a changed list reads its rows' stored wire JSON.

    ``on_task_saved(name)`` is called after a task is saved, so an in-process
    central scheduler can wake without waiting for its poll (SQLite has no NOTIFY).

    ``events`` announce each write of a node's schedules (default: none, said in
    every write's answer); every pull answered is recorded (``record_pulls``),
    written behind in batches (``app.state.pull_recorder``: close it on shutdown).
    ``clock`` is the fleet's now (status, upcoming, propagation). ``waits`` are the
    nodes' long polls (``app.state.waits``; a relay from Prefect pokes them, see
    :mod:`controller.waits`); a write of a node's schedules wakes its waits.
    """
    # No /docs: FastAPI's page loads its assets from a CDN (see controller.api.openapi).
    app = FastAPI(title="sched controller", version="1", docs_url=None, redoc_url=None)
    app.add_middleware(AccessLogMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)
    _install_error_handlers(app)
    install_openapi(app, [LocalSchedule, TaskIn, NodeReportIn])
    auth = Auth(tokens)

    def in_session(work: Callable[[Session], T]) -> T:
        with Session(engine) as session:
            result = work(session)
            session.commit()
            return result

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

    recorder = PullRecorder(engine, clock=clock) if record_pulls else None
    app.state.pull_recorder = recorder
    waits = waits or NodeWaits()
    app.state.waits = waits
    fleet_api = FleetApi(
        in_session, settings=fleet_settings or FleetSettings(), events=events or NoEvents(),
        recorder=recorder, clock=clock, waits=waits,
    )
    app.include_router(schedule_router(in_session, auth, PullCache(pull_cache_bytes), fleet_api))
    app.include_router(fleet_router(fleet_api, auth))
    app.include_router(wait_router(in_session, auth.require_node, waits,
                                   lambda node, etag: fleet_api.record_pull(node, 304, etag)))
    app.include_router(task_router(in_session, auth, on_task_saved))
    app.include_router(page_router(tokens, FleetApiSource(fleet_api), clock=clock,
                                   revocations=SessionRevocations(in_session)))
    return app
