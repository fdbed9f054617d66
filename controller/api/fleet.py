"""The fleet's routes: node reports, fleet and node status, upcoming windows, and what a write says.

Endpoints (the fleet contract):

- ``POST /api/nodes/{node}/report`` (admin, node): 204; latest kept, history bounded;
  ``429`` past the node's report rate (:mod:`controller.api.report_rate`).
- ``GET /api/status`` (admin): ``{"stale_after_s", "list_versions", "nodes"}``.
- ``GET /api/nodes/{node}/status`` (admin, node): the node's row and its schedules.
- ``GET /api/upcoming?hours=24[&node=N]`` (admin, node N): ``{"windows": [...]}``.
- ``GET /api/report`` and ``GET /api/nodes/{node}/explain``: the windows behind, and
  why one did what it did.

The writes of a node's rows are :mod:`controller.api.rows`'; :class:`FleetApi` gives
them their answer and announcement (rule 3).

Rules:

1. Pulls are recorded by :class:`controller.nodes.PullRecorder` (written
   behind, flushed before any status read of this process).
2. ``now`` comes from the app's clock (a parameter), never read here.
3. A write (PUT, PATCH, DELETE) announces itself through
   :class:`controller.events.ScheduleEvents`; PUT and PATCH answer the
   stored row plus ``_propagation`` (:func:`controller.fleet.propagation`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from controller import (
    contracts,
    fleet,
    jobs,
    ledger,
    morning,
    nodes,
    report_in,
    schedules,
    watch,
    why,
)
from controller.api.jsonbody import (
    _body_errors,
    _unprocessable,
    check_name,
    check_node,
    read_object,
)
from controller.api.openapi import json_body
from controller.api.report_rate import ReportRate
from controller.errors import InvalidInput, NotFound
from controller.events import Announced, ScheduleEvents
from controller.fleet import FleetSettings
from controller.logtext import printable
from controller.waits import NodeWaits
from sched_core.model import LocalSchedule
from sched_core.values import check_identifier

log = logging.getLogger("controller.api")

T = TypeVar("T")
InSession = Callable[[Callable[[Session], Any]], Any]

MAX_UPCOMING = 10_000
"""The most windows one ``/api/upcoming`` answer lists (``truncated`` says when cut)."""
REFUSAL_LOG_INTERVAL_S = 60.0
"""At most one log line per this many seconds says that node reports were refused."""


class RefusalLog:
    """One WARNING line per interval at most for refused requests of one kind, with a count.

    The first refusal of a quiet period is logged at once; later ones are only
    counted, and the next line (the first refusal after the interval) says how
    many there were. A flood of bad reports costs one short line a minute, not
    a traceback per request.
    """

    def __init__(self, what: str, interval: float = REFUSAL_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.interval = interval
        self.clock = clock
        self.pending = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    def note(self, node: str, entries: list[dict[str, Any]]) -> None:
        """Count one refusal of node's request (its 422 entries); log if the interval passed."""
        now = self.clock()
        with self._lock:
            self.pending += 1
            if self._last is not None and now - self._last < self.interval:
                return
            count, self.pending, self._last = self.pending, 0, now
        first = entries[0] if entries else {}
        field = printable(str(first.get("field", ""))[:200])
        reason = printable(str(first.get("msg", ""))[:300])
        log.warning(
            "%s refused: %d since the last such line (at most one line per %g s); the latest "
            "from node %s: %s: %s", self.what, count, self.interval, printable(node[:200]),
            field, reason, extra={"node": printable(node[:200]), "count": count},
        )


def is_node_name(node: str) -> bool:
    """Return whether node may be stored as a node's name: an identifier (the kit's rule)."""
    try:
        check_identifier(node, "node")
    except ValueError:
        return False
    return True


@dataclass(eq=False)
class FleetApi:
    """The fleet's state the routes share: settings, events, the pull recorder, the clock."""

    in_session: InSession
    _: KW_ONLY
    settings: FleetSettings
    events: ScheduleEvents
    recorder: nodes.PullRecorder | None
    clock: Callable[[], datetime]
    waits: NodeWaits | None = None
    report_rate: ReportRate = dataclasses.field(default_factory=ReportRate)

    def record_pull(self, node: str, status: int, etag: str, *, own: bool = True) -> None:
        """Remember a pull answered (rule 1): 200 or 304, the version served (ETag, unquoted).

        Only the node's own pulls are recorded (``own``: made with its token): an
        admin reading a node's list says nothing about the node. Only a node name
        that is an identifier (the one node-name rule, as a PUT and a report have
        it) is recorded: a pull by any other name is answered (rows stored before
        the rule stay readable) but adds no node to the fleet.
        """
        if self.recorder is not None and own and is_node_name(node):
            self.recorder.record(node, str(status), etag.removeprefix("W/").strip('"'))

    def flush_pulls(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()

    def announce(self, node: str, schedule_id: str, version: int | None, op: str) -> Announced:
        if self.waits is not None:  # the node's long poll answers at once
            self.waits.poke(node, "schedules")
        announced = self.events.announce(node, schedule_id, version, op)
        log.info("schedule write announced" if announced.sent else "schedule write not announced",
                 extra={"node": printable(node), "schedule_id": printable(schedule_id),
                        "version": version, "op": op,
                        "event_sent": announced.sent, "reason": announced.reason})
        return announced

    def written(self, node: str, stored: LocalSchedule, op: str,
                check: dict[str, Any] | None = None) -> Response:
        """Return a PUT's or PATCH's answer: the stored row plus ``_propagation`` (rule 3),
        with what checked the row against its node's action table (``checked``, ``check``:
        :func:`controller.contracts.check_row`)."""
        woken = self.waits is not None and self.waits.holds(node)  # answered by announce
        announced = self.announce(node, stored.id, stored.version, op)
        now = self.clock()

        def facts(session: Session) -> tuple[nodes.Pull | None, nodes.StoredReport | None,
                                             nodes.Seen | None]:
            return (nodes.latest_pulls(session, node).get(node),
                    nodes.latest_reports(session, node).get(node),
                    nodes.latest_seen(session, node).get(node))

        self.flush_pulls()
        pull, report, seen = self.in_session(facts)
        tz = fleet.node_zone(report, self.settings)
        spread = fleet.propagation(
            stored, node=node, tz=tz, now=now, pull=pull, announced=announced,
            settings=self.settings, last_fired=fleet.last_fires(report).get(stored.id),
            seen=seen, woken=woken,
        )
        spread.update(check or {})
        # The row's bytes as GET serves them (the Go kit's JSON), then the one extra key.
        row = stored.model_dump_json()
        body = row[:-1] + ',"_propagation":' + json.dumps(spread, separators=(",", ":")) + "}"
        return Response(body, media_type="application/json")


def fleet_router(api: FleetApi, auth: Any) -> APIRouter:
    """Return the fleet's routes (auth: :class:`controller.api.access.Auth`)."""
    router = APIRouter()
    _report_route(router, api, auth)
    _status_routes(router, api, auth)
    _window_routes(router, api, auth)
    _explain_route(router, api, auth)
    return router


def _over_rate(rate: ReportRate, refused: RefusalLog, node: str) -> JSONResponse | None:
    """Return the 429 of a report over node's rate (controller.api.report_rate), else None."""
    wait = rate.take(node)
    if not wait:
        return None
    refused.note(node, [{"field": "node", "msg": f"over its report rate: {rate.burst} at "
                         f"once, then one every {rate.every:g} s"}])
    return JSONResponse(
        {"detail": f"too many reports from node {node!r}: send it again in {wait} s"},
        status_code=429, headers={"Retry-After": str(wait), "Connection": "close"})


def _report_route(router: APIRouter, api: FleetApi, auth: Any) -> None:
    """Add a node's report (POST): refused ones counted and logged once a minute at most."""
    in_session = api.in_session
    refused_reports = RefusalLog("node reports")
    refused_rate = RefusalLog("node reports (over the report rate)")
    rate = api.report_rate

    @router.post(
        "/api/nodes/{node}/report", status_code=204,
        openapi_extra=json_body(report_in.NodeReportIn, "What the node's agent says about itself."),
    )
    async def post_report(request: Request, node: str) -> Response:
        principal = auth.require_node(request, node)
        check_node(("path", "node"), node, storing=True)
        over = _over_rate(rate, refused_rate, node)  # before the body is read
        if over is not None:
            return over
        received = api.clock()
        own = auth.is_own(principal, node)
        try:
            data = await read_object(request, "node", node)
            try:
                report = report_in.NodeReportIn.model_validate(data)
            except ValidationError as exc:
                raise InvalidInput(_body_errors(exc)) from None
        except InvalidInput as refused:
            refused_reports.note(node, refused.detail)
            if own:  # refused, but the node is alive (its outbox may hold a bad record)
                await run_in_threadpool(api.flush_pulls)  # its pulls first: it may be known
                await run_in_threadpool(in_session, lambda s: nodes.record_refused_report(
                    s, node, at=received))
            raise
        if report.start_error is not None:  # the node cannot start: no sign of life
            error = report.start_error
            await run_in_threadpool(in_session, lambda s: nodes.record_start_error(
                s, node, error, at=received))
            log.warning("node cannot start on its settings", extra={
                "node": printable(node), "error": printable(error)})
            return Response(status_code=204)

        def store(session: Session) -> tuple[int, bool]:
            changed = nodes.record_report(
                session, node, report_in.report_data(report), received_at=received,
                keep=api.settings.report_history, own=own, heartbeat_s=report.heartbeat_s,
                jobs=report.jobs, job_keep=api.settings.job_keep)
            # Only the node itself publishes its table (its own token).
            wanted = own and contracts.note_report(session, node, report.contract_hash,
                                                   report.contract, at=received)
            return changed, wanted

        changed, wanted = await run_in_threadpool(in_session, store)
        log.info("node report", extra={"node": printable(node),
                                       "agent_version": report.agent_version,
                                       "failing": report.failing, "own": own,
                                       "jobs": len(report.jobs), "jobs_changed": changed})
        return Response(status_code=204,
                        headers={contracts.WANTED_HEADER: "wanted"} if wanted else None)


def _status_routes(router: APIRouter, api: FleetApi, auth: Any) -> None:
    """Add the fleet's status and one node's."""
    in_session = api.in_session

    @router.get("/api/status", dependencies=[Depends(auth.admin)])
    def fleet_status() -> JSONResponse:
        api.flush_pulls()
        found = in_session(lambda s: status_rows(api, s, None))
        return JSONResponse({"stale_after_s": api.settings.stale_after_s,
                             "list_versions": found["versions"], "nodes": found["nodes"]})

    @router.get("/api/nodes/{node}/status")
    def node_status(request: Request, node: str) -> JSONResponse:
        auth.require_node(request, node)
        check_name(("path", "node"), node)
        api.flush_pulls()

        def read(session: Session) -> dict[str, Any]:
            found = status_rows(api, session, node)
            found["rows"] = schedules.list_schedules(session, node)[0]
            found["history"] = nodes.report_history(
                session, node, limit=api.settings.report_history)
            return found

        found = in_session(read)
        if not found["nodes"]:
            raise NotFound(f"node {node!r} has no schedules and never pulled nor reported")
        report = found["reports"].get(node)
        tz = fleet.node_zone(report, api.settings)
        reported = fleet._reported(report)
        row = found["nodes"][0]
        records = found["records"].get(node, {})
        row["schedules"] = [
            fleet.schedule_view(
                item, node=node, tz=tz, reported=reported.get(item.id),
                recent=fleet.recent_outcomes(found["history"], item.id), now=found["now"],
                record=records.get(item.id),
            )
            for item in found["rows"]
        ]
        return JSONResponse(row)


def _window_routes(router: APIRouter, api: FleetApi, auth: Any) -> None:
    """Add the windows ahead (upcoming) and behind (the report)."""
    in_session = api.in_session

    @router.get("/api/upcoming")
    def upcoming(
        request: Request,
        hours: float = Query(24, gt=0, le=192),
        node: str | None = None,
    ) -> JSONResponse:
        reader_of(auth, request, node, "list its own node's windows")

        def read(session: Session) -> dict[str, Any]:
            if node is not None:
                rows = {node: schedules.list_schedules(session, node)[0]}
            else:
                rows = schedules.all_schedules(session)
            reports = nodes.latest_reports(session, node)
            return {"rows": rows, "reports": reports}

        found = in_session(read)
        now = api.clock()
        until = now + timedelta(hours=hours)
        windows: list[dict[str, Any]] = []
        for name, rows in found["rows"].items():
            if node is not None and name != node:
                continue
            report = found["reports"].get(name)
            windows.extend(fleet.upcoming_windows(
                rows, node=name, tz=fleet.node_zone(report, api.settings), now=now,
                until=until, last_fired=fleet.last_fires(report),
            ))
        listed, cut = fleet.sort_windows(windows, MAX_UPCOMING)
        return JSONResponse({"windows": listed, "truncated": cut})

    @router.get("/api/report")
    def fleet_report(
        request: Request, since: str | None = None, until: str | None = None,
        node: str | None = None,
    ) -> JSONResponse:
        reader_of(auth, request, node)
        now = api.clock()
        since_at = query_time("since", since)
        until_at = query_time("until", until)
        end = until_at or now
        if since_at is not None and since_at >= end:
            raise _unprocessable(("query", "since"), "since must be before until (or now)")
        start = since_at or end - timedelta(days=2)
        if end - start > morning.MAX_RANGE:
            raise _unprocessable(("query", "since"), f"the range is longer than "
                                 f"{morning.MAX_RANGE.days} days")
        api.flush_pulls()
        found = in_session(lambda s: ledger.fleet_report(
            s, settings=api.settings, now=now, since=since_at, until=until_at, node=node))
        if node is not None and not found["nodes"]:
            raise NotFound(f"node {node!r} has no schedules and never made a request")
        return JSONResponse(found)


def _explain_route(router: APIRouter, api: FleetApi, auth: Any) -> None:
    """Add why one window did what it did."""
    in_session = api.in_session

    @router.get("/api/nodes/{node}/explain")
    def explain_window(
        request: Request, node: str, schedule: str | None = None, window: str | None = None,
    ) -> JSONResponse:
        # The query is checked here, not by FastAPI, so that a missing token is a 401 first.
        auth.require_node(request, node)
        check_name(("path", "node"), node)
        for field, value in (("schedule", schedule), ("window", window)):
            if not value:
                raise _unprocessable(("query", field), f"{field} is required", "missing")
            if len(value) > 200:
                raise _unprocessable(("query", field), f"{field} is longer than 200 "
                                     "characters")
        assert schedule is not None and window is not None
        check_name(("query", "schedule"), schedule)
        now = api.clock()
        try:
            instant, wall = why.parse_window_text(window, schedule)
        except ValueError as exc:
            raise _unprocessable(("query", "window"), str(exc)) from None
        api.flush_pulls()
        found = in_session(lambda s: explain_facts(api, s, node, schedule, instant or wall, now))
        if found is None:
            raise NotFound(f"no schedule {schedule!r} on node {node!r} (now or in the "
                           f"last {schedules.VERSION_RETENTION.days} days)")
        from controller.api.page import prefect_ui_url

        return JSONResponse(why.explain(
            node=node, schedule_id=schedule, text=window, now=now, run_url=prefect_ui_url(),
            **found))


def status_rows(api: FleetApi, session: Session, only: str | None) -> dict[str, Any]:
    ids = nodes.schedule_ids(session, only)
    pulls = nodes.latest_pulls(session, only)
    reports = nodes.latest_reports(session, only)
    versions = nodes.list_versions(session, only)
    seen = nodes.latest_seen(session, only)
    records = jobs.latest_jobs(session, only)
    names = set(pulls) | set(reports) | set(ids) | set(seen)
    now = api.clock()
    return {
        "now": now, "pulls": pulls, "reports": reports, "versions": versions,
        "records": records,
        "nodes": [fleet.node_row(
            name, schedules=len(ids.get(name, [])), schedule_ids=ids.get(name, []),
            pull=pulls.get(name), report=reports.get(name), version=versions.get(name),
            now=now, settings=api.settings, seen=seen.get(name),
            records=records.get(name),
        ) for name in sorted(names)],
    }


def reader_of(auth: Any, request: Request, node: str | None,
              what: str = "read its own node") -> None:
    """Let the admin read the fleet, and a node's token its own node only (403 else)."""
    principal = auth.authenticate(request)
    if node is not None:
        check_name(("query", "node"), node)
        auth.require_node(request, node)
    elif not principal.is_admin:
        raise _forbidden(f"a node token may only {what} (?node=NAME)")


def explain_facts(api: FleetApi, session: Session, node: str, schedule_id: str,
                  near: datetime | None, now: datetime) -> dict[str, Any] | None:
    far = datetime(1970, 1, 1, tzinfo=UTC), datetime(9999, 1, 1, tzinfo=UTC)
    versions = schedules.versions_between(session, *far, node=node,
                                          schedule_id=schedule_id).get(node, {})
    if schedule_id not in versions:
        return None
    assert near is not None
    probe = near if near.tzinfo is not None else near.replace(tzinfo=UTC)
    around = jobs.jobs_between(session, probe - timedelta(days=2), probe + timedelta(days=2),
                               nodes=[node]).get(node, [])
    # A wall time read as UTC is off by the zone's offset: look before any reading of it.
    before = probe if near.tzinfo is not None else probe - timedelta(hours=15)
    previous = jobs.last_windows_before(session, before,
                                        nodes=[node]).get(node, {}).get(schedule_id)
    report = nodes.latest_reports(session, node).get(node)
    seen = nodes.latest_seen(session, node).get(node)
    return {
        "versions": versions[schedule_id],
        "records": {r.key: r for r in around if r.schedule_id == schedule_id},
        "tz": fleet.node_zone(report, api.settings),
        "grace": ledger.node_grace(report, api.settings),
        "previous": previous,
        "liveness": fleet.liveness(seen, now=now, settings=api.settings),
        "silence": fleet.silence_text(node, seen, now=now, settings=api.settings),
        "alerts": watch.alert_facts(session, node),
    }


def query_time(field: str, value: str | None) -> datetime | None:
    """Return a query's RFC 3339 time (with its offset) in UTC; 422 naming the field."""
    if value is None:
        return None
    try:
        return report_in.parse_instant(value)
    except ValueError as exc:
        raise _unprocessable(("query", field), str(exc)) from None


def _forbidden(detail: str) -> Exception:
    from fastapi import HTTPException

    return HTTPException(403, detail)
