"""The controller's HTTP app: the routers assembled, errors mapped to answers, the task routes.

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
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
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
from controller.api.access import Auth
from controller.api.access_log import AccessLogMiddleware
from controller.api.client import RealClientMiddleware
from controller.api.fleet import FleetApi, fleet_router
from controller.api.headers import SecurityHeadersMiddleware
from controller.api.jsonbody import (
    check_name,
    read_model,
    validation_entries,
)
from controller.api.login_limit import LoginLimit
from controller.api.openapi import install_openapi, json_body
from controller.api.page import FleetApiSource, SessionRevocations, page_router
from controller.api.pull import PULL_CACHE_BYTES, PullCache
from controller.api.report_rate import ReportRate
from controller.api.request_guard import RequestGuard
from controller.api.rows import schedule_router
from controller.api.vouch import VoucherRequest, voucher_router
from controller.api.wait import wait_router
from controller.auth import Tokens
from controller.errors import BodyTooLarge, ClientGone, InvalidInput, NotFound
from controller.events import NoEvents, ScheduleEvents
from controller.fleet import FleetSettings
from controller.logtext import printable
from controller.models import NodeRevision, ScheduledTask, TaskIn, utc_now
from controller.nodes import PullRecorder
from controller.report_in import NodeReportIn
from controller.settings import Network
from controller.waits import EtagReads, NodeWaits
from sched_core.model import LocalSchedule

log = logging.getLogger("controller.api")

T = TypeVar("T")

DB_RETRY_AFTER_S = 5
"""The ``Retry-After`` of a 503 answered because the database is unavailable (seconds)."""


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


def _task_json(task: ScheduledTask) -> dict[str, Any]:
    """Return a stored task as JSON-ready data (called inside its session)."""
    data: dict[str, Any] = task.model_dump(mode="json")
    return data


def task_router(
    in_session: Callable[[Callable[[Session], Any]], Any],
    auth: Auth,
    on_task_saved: Callable[[str], None] | None,
) -> APIRouter:
    """Return the routes of the central tasks (admin only) and their dispatch records."""
    router = APIRouter(dependencies=[Depends(auth.admin)])

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

    _task_write_routes(router, in_session, on_task_saved)
    return router


def _task_write_routes(
    router: APIRouter,
    in_session: Callable[[Callable[[Session], Any]], Any],
    on_task_saved: Callable[[str], None] | None,
) -> None:
    """Add PUT and DELETE of a task (the router's dependency: admin only)."""

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


def _health_route(app: FastAPI, in_session: Callable[[Callable[[Session], Any]], Any]) -> None:
    """Add ``GET /healthz`` (no token): 200 when the database answers, else 503."""

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


def _session_runner(engine: Engine) -> Callable[[Callable[[Session], T]], T]:
    """Return ``in_session(work)``: work run in a session of its own, committed after."""

    def in_session(work: Callable[[Session], T]) -> T:
        with Session(engine) as session:
            result = work(session)
            session.commit()
            return result

    return in_session


def _wait_routes(app: FastAPI, engine: Engine, auth: Auth, waits: NodeWaits,
                 fleet_api: FleetApi) -> None:
    """Add the nodes' long poll, its ETags read in batches (``app.state.etag_reads``)."""

    def read_etags(nodes: list[str]) -> dict[str, str]:
        with engine.connect() as connection:
            return schedules.node_etags(connection, nodes)

    app.state.etag_reads = etag_reads = EtagReads(read_etags)
    app.include_router(wait_router(etag_reads, auth.node_reader, waits,
                                   lambda node, etag: fleet_api.record_pull(node, 304, etag)))


def _install_middleware(app: FastAPI, trusted_proxies: Sequence[Network]) -> None:
    """The middleware, innermost first; the last added is the outermost."""
    app.add_middleware(AccessLogMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(RealClientMiddleware, proxies=tuple(trusted_proxies))
    app.add_middleware(RequestGuard)  # outermost: the connection guard's side of the app


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
    trusted_proxies: Sequence[Network] = (),
    report_rate: ReportRate | None = None,
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
    ``trusted_proxies`` are believed when they forward a client's address
    (:mod:`controller.api.client`; none by default). ``report_rate`` bounds each node's
    reports (:mod:`controller.api.report_rate`; default: its defaults).
    """
    # No /docs: FastAPI's page loads its assets from a CDN (see controller.api.openapi).
    app = FastAPI(title="sched controller", version="1", docs_url=None, redoc_url=None)
    _install_middleware(app, trusted_proxies)
    _install_error_handlers(app)
    install_openapi(app, [LocalSchedule, TaskIn, NodeReportIn, VoucherRequest])
    auth = Auth(tokens)
    in_session = _session_runner(engine)
    _health_route(app, in_session)
    recorder = PullRecorder(engine, clock=clock) if record_pulls else None
    app.state.pull_recorder = recorder
    waits = waits or NodeWaits()
    app.state.waits = waits
    fleet_api = FleetApi(
        in_session, settings=fleet_settings or FleetSettings(), events=events or NoEvents(),
        recorder=recorder, clock=clock, waits=waits, report_rate=report_rate or ReportRate(),
    )
    app.include_router(schedule_router(in_session, auth, PullCache(pull_cache_bytes), fleet_api))
    app.include_router(fleet_router(fleet_api, auth))

    _wait_routes(app, engine, auth, waits, fleet_api)
    app.include_router(task_router(in_session, auth, on_task_saved))
    app.include_router(voucher_router(auth, clock))
    app.include_router(page_router(tokens, FleetApiSource(fleet_api), clock=clock,
                                   revocations=SessionRevocations(in_session),
                                   login_limit=LoginLimit(in_session)))
    return app
