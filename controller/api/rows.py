"""A node's schedules over HTTP: the pull, and create, read, update, patch and delete per node.

Endpoints (who may call each: docs/controller.md's "Endpoints" table):

- ``GET /api/schedules?node=N``, ``GET /api/nodes/{node}/schedules``: the pull (ETag,
  ``If-None-Match`` answered 304, :mod:`controller.api.pull`).
- ``GET /api/nodes``, ``GET /api/nodes/{node}/schedules/{id}``.
- ``PUT /api/nodes/{node}/schedules/{id}``: the row in the Go kit's JSON.
- ``PATCH /api/nodes/{node}/schedules/{id}``: a JSON merge patch (RFC 7386).
- ``DELETE /api/nodes/{node}/schedules/{id}``.

Rules:

1. A write's body is read as Go reads it; a key no row field has is refused at any
   depth, and so is free text over its bound or with control characters
   (:func:`row_from_body`).
2. PUT and PATCH answer the stored row plus ``_propagation``, and every write
   announces itself (:meth:`controller.api.fleet.FleetApi.written`, ``announce``).
3. A PATCH re-reads and re-applies itself when a concurrent write won, up to
   :data:`PATCH_ATTEMPTS` times (the stored version is the compare-and-set).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from controller import contracts, schedules
from controller.api.access import Auth
from controller.api.fleet import FleetApi
from controller.api.jsonbody import (
    _unprocessable,
    check_name,
    check_node,
    read_object,
    unknown_keys,
    validate_as_go,
)
from controller.api.openapi import json_body, merge_patch_body
from controller.api.pull import PullCache, pull_response
from controller.errors import InvalidInput, NotFound
from controller.logtext import printable
from sched_core.model import NOTE_MAX_LENGTH, LocalSchedule
from sched_core.values import NAME_MAX_LENGTH, TEXT_MAX_LENGTH, text_problem

log = logging.getLogger("controller.api")

InSession = Callable[[Callable[[Session], Any]], Any]

PATCH_ATTEMPTS = 5
"""How many times a PATCH re-reads and re-applies itself when a concurrent write won."""



def _check_schedule_key(node: str, schedule_id: str, *, storing: bool = False) -> None:
    check_node(("path", "node"), node, storing=storing)
    check_name(("path", "id"), schedule_id, storing=storing)


def merge_patch(target: Any, patch: Any) -> Any:
    """Return target with the RFC 7386 JSON merge patch applied (neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def refuse_unknown_fields(data: dict[str, Any]) -> None:
    """Raise InvalidInput naming each key of a row body, at any depth, that no row field has.

    The wire model ignores unknown fields (an agent reading a newer controller's
    rows), but a write must not: a misspelt ``pasued`` would be dropped silently,
    and a misspelt ``schedule.interval_minute`` would turn "every 2 minutes"
    into the row's days and hours.
    """
    unknown = unknown_keys(LocalSchedule, data)
    if unknown:
        raise InvalidInput(unknown)


ROW_TEXT = (("name", NAME_MAX_LENGTH), ("storage", TEXT_MAX_LENGTH),
            ("schedule.on", NAME_MAX_LENGTH), ("paused.note", NOTE_MAX_LENGTH))
"""A row's free text a write bounds, and its longest (characters): :func:`check_text`'s rule."""


def refuse_bad_text(row: LocalSchedule) -> LocalSchedule:
    """Return row if its free text (ROW_TEXT) is bounded and printable; else InvalidInput (422).

    Checked on writes only: agents reading rows, and rows stored before the
    rule, are not refused for it (a node never loses a row it has).
    """
    entries = []
    for field, longest in ROW_TEXT:
        value: Any = row
        for part in field.split("."):
            value = getattr(value, part, None)
        if isinstance(value, str):
            problem = text_problem(value, max_length=longest)
            if problem is not None:
                entries.append({"field": field, "loc": ["body", *field.split(".")],
                                "msg": f"{field} {problem}", "type": "value_error"})
    if entries:
        raise InvalidInput(entries)
    return row


def row_from_body(data: dict[str, Any]) -> LocalSchedule:
    """Return a PUT body as a row: unknown fields and Go's types refused, then the row's checks."""
    return refuse_bad_text(validate_as_go(LocalSchedule, data))


def _patched_row(current: LocalSchedule, patch: dict[str, Any]) -> LocalSchedule:
    """Return current with patch applied, validated as a row (422 naming what is wrong)."""
    refuse_unknown_fields(patch)
    for key in ("id", "version"):
        if key in patch and patch[key] != current.model_dump(mode="json")[key]:
            raise _unprocessable(("body", key), f"{key} cannot be changed by a PATCH")
    merged = merge_patch(current.model_dump(mode="json", by_alias=True), patch)
    return refuse_bad_text(validate_as_go(LocalSchedule, merged))


def schedule_router(
    in_session: InSession, auth: Auth, pull_cache: PullCache, fleet_api: FleetApi,
) -> APIRouter:
    """Return the routes of the agents' schedules: the pull, and CRUD per node."""
    router = APIRouter()
    _read_routes(router, in_session, auth, pull_cache, fleet_api)
    _write_routes(router, in_session, auth, fleet_api)
    _patch_route(router, in_session, auth, fleet_api)
    return router


def _read_routes(router: APIRouter, in_session: InSession, auth: Auth, pull_cache: PullCache,
                 fleet_api: FleetApi) -> None:
    """Add the reads: the pull (two paths), the node list, one row."""
    admin = Depends(auth.admin)
    reader = Depends(auth.node_reader)

    def pull_answer(request: Request, node: str, source: str = "path") -> Response:
        principal = auth.require_node(request, node)
        check_name((source, "node"), node)
        own = auth.is_own(principal, node)

        def recorded(name: str, status: int, etag: str) -> None:
            fleet_api.record_pull(name, status, etag, own=own)

        return pull_response(in_session, pull_cache, node, request.headers.get("if-none-match"),
                             recorded)

    @router.get("/api/schedules", dependencies=[Depends(auth.caller)])
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


def _write_routes(router: APIRouter, in_session: InSession, auth: Auth,
                  fleet_api: FleetApi) -> None:
    """Add PUT and DELETE of one row (rules 1 and 2)."""
    admin_on_node = Depends(auth.admin_on_node)

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

        def put(session: Session) -> tuple[LocalSchedule, dict[str, Any]]:
            check = contracts.check_row(session, node, row, now=fleet_api.clock())
            return schedules.put_schedule(session, node, row, now=fleet_api.clock()), check

        stored, check = await run_in_threadpool(in_session, put)
        # Both are identifiers by now (the node's path rule, the row's id rule).
        log.info("schedule saved", extra={"node": node, "schedule_id": schedule_id,
                                           "version": stored.version})
        return await run_in_threadpool(fleet_api.written, node, stored, "put", check)

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


def _patch_route(router: APIRouter, in_session: InSession, auth: Auth,
                 fleet_api: FleetApi) -> None:
    """Add PATCH of one row (rules 1-3)."""

    @router.patch(
        "/api/nodes/{node}/schedules/{schedule_id}",
        openapi_extra=merge_patch_body(
            "A JSON merge patch of the row (RFC 7386): the fields to change, null to remove "
            "one (`{\"paused\": null}` resumes)."),
    )
    async def patch_schedule(request: Request, node: str, schedule_id: str) -> Response:
        auth.require_admin_on_node(request, node)
        check_name(("path", "node"), node)
        check_name(("path", "id"), schedule_id)
        patch = await read_object(request, "id", schedule_id)

        def apply(session: Session) -> tuple[LocalSchedule, dict[str, Any]]:
            for _ in range(PATCH_ATTEMPTS):
                current = schedules.get_schedule(session, node, schedule_id)
                session.commit()
                if current is None:
                    raise NotFound(f"no schedule {schedule_id!r} on node {node!r}")
                row = _patched_row(current, patch)
                check = contracts.check_row(session, node, row, now=fleet_api.clock())
                try:
                    return schedules.put_schedule(session, node, row, if_version=current.version,
                                                  now=fleet_api.clock()), check
                except schedules.VersionConflict:
                    continue  # a concurrent write won: apply the patch to its row
            raise InvalidInput([{"field": "", "loc": ["path", "id"], "type": "conflict",
                                 "msg": f"row {schedule_id!r} kept changing; try again"}])

        stored, check = await run_in_threadpool(in_session, apply)
        log.info("schedule patched", extra={"node": printable(node),
                                            "schedule_id": printable(schedule_id),
                                            "version": stored.version,
                                            "fields": sorted(patch)})
        return await run_in_threadpool(fleet_api.written, node, stored, "patch", check)
