"""The fleet page at ``/``: read-only, server-rendered, for the admin.

Who may see it: the admin, by ``Authorization: Bearer <admin token>`` (scripts,
proxies) or by the login form. The form's token travels in a POST body (never a
URL, so never an access-log line or a browser history entry); the answer sets a
session cookie that holds an expiry and an HMAC of it keyed by the token's
SHA-256 digest (:func:`controller.auth.sign`), never the token or its digest.
Any controller instance sharing the tokens accepts it, it ends after
:data:`SESSION_S`, and removing the token from the configuration ends it at
once. Log out ends the session on every instance at once: the cookie's digest
is stored in the database (:class:`SessionRevocations`) and refused from then
on. The cookie is ``HttpOnly``, ``SameSite=Strict``, and ``Secure`` over
HTTPS. A node token sees a 403.

Where the data come from: a :class:`FleetSource`, the API's shapes
(FLEET-CONTRACT.md) read in-process. :class:`FleetApiSource` (what the
controller serves) reads them as the fleet API does: pulls, reports, job
outcomes, windows in each node's zone.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import Table, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from controller import schedules
from controller.api.client import client_key
from controller.api.login_limit import LOGIN_BODY_S, InFlight, LoginLimit
from controller.api.request_guard import connection_of
from controller.auth import Principal, Tokens, bearer_token, sign
from controller.fleetpage import (
    AHEAD,
    FleetView,
    render_forbidden,
    render_login,
    render_page,
)
from controller.logtext import printable
from controller.models import RevokedSession

log = logging.getLogger("controller.page")

COOKIE = "sched_fleet_session"
SESSION_S = 12 * 3600
"""How long a login lasts (seconds)."""
MAX_FORM = 4096
"""The largest login form body read (bytes)."""
_SESSION_CONTEXT = b"sched-fleet-page|v1|"

Clock = Callable[[], datetime]


class FleetSource(Protocol):
    """The fleet in the API's shapes: ``/api/status``, each node's status, ``/api/upcoming``."""

    def view(self, now: datetime) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]],
                                           list[dict[str, Any]], str]:
        """Return (status rows, schedules per node, windows of the next 24 h, a notice)."""
        ...


class FleetApiSource:
    """The fleet as the fleet API serves it: pulls, reports, outcomes, windows in node zones.

    The same module functions as ``GET /api/status``, ``GET /api/nodes/{node}/status``
    and ``GET /api/upcoming`` (:mod:`controller.fleet`, :mod:`controller.nodes`), read
    in one session, for every node at once (the latest report only, no history).
    """

    def __init__(self, api: Any) -> None:
        self.api = api  # controller.api.fleet.FleetApi

    def view(self, now: datetime) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]],
                                           list[dict[str, Any]], str]:
        from controller import fleet, jobs, nodes

        settings = self.api.settings

        def read(session: Session) -> dict[str, Any]:
            rows = schedules.all_schedules(session)
            reports = nodes.latest_reports(session, None)
            return {"rows": rows, "pulls": nodes.latest_pulls(session, None),
                    "reports": reports, "versions": nodes.list_versions(session, None),
                    "seen": nodes.latest_seen(session, None),
                    "records": jobs.latest_jobs(session, None)}

        self.api.flush_pulls()
        found = self.api.in_session(read)
        rows, reports = found["rows"], found["reports"]
        names = sorted(set(found["pulls"]) | set(reports) | set(rows) | set(found["seen"]))
        status, per_node, windows = [], {}, []
        for name in names:
            mine = rows.get(name, [])
            report = reports.get(name)
            records = found["records"].get(name, {})
            status.append(fleet.node_row(
                name, schedules=len(mine), schedule_ids=[row.id for row in mine],
                pull=found["pulls"].get(name), report=report,
                version=found["versions"].get(name), now=now, settings=settings,
                seen=found["seen"].get(name), records=records))
            tz = fleet.node_zone(report, settings)
            reported = fleet._reported(report)
            # The latest job per schedule (the latest report's and job record): no history
            # per node, so the page costs a fixed number of queries however many nodes.
            per_node[name] = [fleet.schedule_view(
                row, node=name, tz=tz, reported=reported.get(row.id), recent=[], now=now,
                record=records.get(row.id))
                for row in mine]
            windows.extend(fleet.upcoming_windows(
                mine, node=name, tz=tz, now=now, until=now + AHEAD,
                last_fired=fleet.last_fires(report)))
        listed, _cut = fleet.sort_windows(windows, 10_000)
        for row in status:
            if not row.get("timezone"):  # never reported: its windows are in the default zone
                row.update(timezone=settings.default_timezone, timezone_default=True)
        unseen = [row["node"] for row in status if row["status"] == "never-seen"]
        notice = (f"Never seen (no pull or report with its own token): {', '.join(unseen)} "
                  f"(their windows are in the controller's default zone, "
                  f"{settings.default_timezone})." if unseen else "")
        return status, per_node, listed, notice


    def report(self, now: datetime) -> dict[str, Any]:
        """Return ``GET /api/report``'s answer for the default range (since yesterday 18:00)."""
        from controller import ledger

        return dict(self.api.in_session(lambda session: ledger.fleet_report(
            session, settings=self.api.settings, now=now)))


def session_cookie(token: str, now: float) -> str:
    """Return a session cookie value for token, valid for SESSION_S from now (epoch seconds).

    ``v2.<expiry>.<nonce>.<signature>``: the random nonce makes every login's
    cookie its own, so logging one out (:class:`SessionRevocations`) ends that
    session only, and a new login at once gets a cookie that works.
    """
    expiry = int(now) + SESSION_S
    nonce = secrets.token_urlsafe(12)
    signature = sign(token, _SESSION_CONTEXT + f"{expiry}.{nonce}".encode())
    return f"v2.{expiry}.{nonce}.{base64.urlsafe_b64encode(signature).decode().rstrip('=')}"


def _cookie_parts(value: str | None) -> tuple[int, bytes, bytes] | None:
    """Return (expiry, signed message, signature) of a well-formed cookie (v1 or v2), or None."""
    if not value or len(value) > 200:
        return None
    version, _, rest = value.partition(".")
    if version == "v1":  # a cookie from before nonces: <expiry>.<signature>
        expiry_text, _, signature_text = rest.partition(".")
        signed = expiry_text
    elif version == "v2":
        expiry_text, _, rest = rest.partition(".")
        nonce, _, signature_text = rest.partition(".")
        if not nonce.isascii() or not nonce.replace("-", "").replace("_", "").isalnum():
            return None
        signed = f"{expiry_text}.{nonce}"
    else:
        return None
    if not expiry_text.isdigit() or not signature_text or not expiry_text.isascii():
        return None
    try:
        signature = base64.urlsafe_b64decode(signature_text + "=" * (-len(signature_text) % 4))
    except ValueError:
        return None
    return int(expiry_text), _SESSION_CONTEXT + signed.encode(), signature


def cookie_principal(tokens: Tokens, value: str | None, now: float) -> Principal | None:
    """Return the principal a session cookie was signed for, or None (bad, expired, revoked).

    Revoked here means its token was removed from the configuration; a cookie
    ended by Log out is refused by :class:`SessionRevocations` on top of this.
    """
    parts = _cookie_parts(value)
    if parts is None or parts[0] <= now:
        return None
    _, message, signature = parts
    return tokens.signer(message, signature)


def cookie_digest(value: str) -> str:
    """Return the key a logged-out cookie is remembered by: SHA-256 (hex) of the cookie."""
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


_REVOKED: Table = RevokedSession.__table__  # type: ignore[attr-defined]


class SessionRevocations:
    """Session cookies ended by Log out, in the database every controller instance shares.

    A cookie is a signed expiry (any instance sharing the tokens accepts it
    without state), so ending one before its time needs state they share:
    Log out stores the cookie's digest with its expiry, and every instance
    refuses a cookie whose digest is stored (one key lookup per page view).
    Rows past their expiry are pruned at each Log out.
    """

    def __init__(self, in_session: Callable[[Callable[[Session], Any]], Any]) -> None:
        self.in_session = in_session

    def revoke(self, value: str, *, now: datetime) -> bool:
        """End the session of a well-formed, unexpired cookie value; False if there was none."""
        parts = _cookie_parts(value)
        if parts is None or parts[0] <= now.timestamp():
            return False
        expires_at = datetime.fromtimestamp(parts[0], UTC)

        def store(session: Session) -> None:
            insert: Any = (pg_insert if session.get_bind().dialect.name == "postgresql"
                           else sqlite_insert)(_REVOKED)
            session.execute(insert.values(digest=cookie_digest(value), expires_at=expires_at)
                            .on_conflict_do_nothing(index_elements=[_REVOKED.c.digest]))
            session.execute(delete(_REVOKED).where(_REVOKED.c.expires_at < now))

        self.in_session(store)
        return True

    def is_revoked(self, value: str) -> bool:
        """Return whether the session of this cookie value was ended by Log out."""
        digest = cookie_digest(value)
        found = self.in_session(lambda session: session.execute(
            select(_REVOKED.c.digest).where(_REVOKED.c.digest == digest)).first())
        return found is not None


def prefect_ui_url() -> str | None:
    """Return the Prefect UI for links: ``PREFECT_UI_URL``, else the API's URL minus ``/api``."""
    try:
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL
    except ImportError:  # pragma: no cover - prefect is a dependency
        return None
    if not PREFECT_API_URL.value():
        return None
    ui = PREFECT_UI_URL.value()
    if ui:
        return str(ui).rstrip("/")
    api = str(PREFECT_API_URL.value()).rstrip("/")
    return api[: -len("/api")] if api.endswith("/api") else api


HTML_HEADERS = {"cache-control": "no-store", "x-frame-options": "DENY",
                "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
                "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'"}
"""The headers of every HTML answer: never cached, never framed, nothing loaded but styles."""


def who(tokens: Tokens, revocations: SessionRevocations | None,
        request: Request) -> tuple[Principal | None, str]:
    """Return (principal, why not) from the Authorization header or the session cookie."""
    if tokens.insecure:
        return tokens.authenticate(None), ""
    header = request.headers.get("authorization")
    if header is not None:
        principal = tokens.authenticate(bearer_token(header))
        return principal, "" if principal else "invalid bearer token"
    cookie = request.cookies.get(COOKIE)
    principal = cookie_principal(tokens, cookie, time.time())
    if principal is not None and cookie and revocations is not None \
            and revocations.is_revoked(cookie):
        principal = None
    if principal is None and cookie:
        return None, "your session has ended: log in again"
    return principal, ""


def fleet_view(request: Request, source: FleetSource, clock: Clock,
               prefect_ui: Callable[[], str | None]) -> FleetView:
    """Return what the page shows now, from the app's source (or source) and clock."""
    # app.state may carry another clock or source (tests pin the time; a richer source).
    now = getattr(request.app.state, "clock", clock)()
    fleet: FleetSource = getattr(request.app.state, "fleet_source", None) or source
    nodes, per_node, windows, notice = fleet.view(now)
    reporter = getattr(fleet, "report", None)
    report = reporter(now) if reporter is not None else None
    ui = getattr(request.app.state, "prefect_ui", None) or prefect_ui()
    return FleetView(now=now, nodes=nodes, schedules=per_node, windows=windows,
                     prefect_ui=ui, notice=notice, report=report)


def login_page(message: str, status_code: int, **headers: str) -> HTMLResponse:
    """Return the login form saying message, with the HTML headers (and headers)."""
    return HTMLResponse(render_login(message), status_code=status_code,
                        headers={**HTML_HEADERS, **headers})


async def read_form(request: Request) -> dict[str, list[str]] | None:
    """Return the login form's fields, or None when its body is over MAX_FORM bytes."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            return None
    return parse_qs(body.decode("utf-8", "replace"), max_num_fields=5)


async def log_in(request: Request, tokens: Tokens, limit: LoginLimit | None,
                 in_flight: InFlight) -> Response:
    """Answer the login form: a session cookie for the admin's token, else the form again.

    The client's in-flight slot and then the limit are asked first, the form read after
    (:mod:`controller.api.login_limit`).
    """
    client = client_key(request.client.host if request.client else "-")
    with in_flight.slot(client) as granted:
        if not granted:  # asked first: it costs no database query, the limit's answer does
            return login_page("logins from your address are already under way: try again in "
                              "a moment", 429, **{"retry-after": "1"})
        wait = 0.0 if limit is None else await run_in_threadpool(limit.wait_s, client)
        if wait > 0:
            retry = max(1, math.ceil(wait))
            log.warning("fleet page login refused: too many failed logins",
                        extra={"client": printable(client), "retry_after_s": retry})
            return login_page(f"too many failed logins from your address: try again in "
                              f"{retry} s", 429, **{"retry-after": str(retry)})
        connection = connection_of(request.scope)
        if connection is not None:  # a form nobody vouched for: its slot may make room
            connection.may_make_room()
        try:
            form = await asyncio.wait_for(read_form(request), LOGIN_BODY_S)
        except TimeoutError:
            return login_page(f"the form did not arrive within {LOGIN_BODY_S:g} s", 408)
        except ClientDisconnect:  # closed to make room (or by the client): nobody to answer
            return Response(status_code=408, headers={"connection": "close"})
        if connection is not None:  # read: it is a request being answered again
            connection.request_started()
    if form is None:
        return login_page("the form is too large", 413)
    token = (form.get("token") or [""])[0]
    principal = await run_in_threadpool(tokens.authenticate, token or None)
    request.state.principal = principal
    if principal is None or not principal.is_admin:
        if limit is not None:
            await run_in_threadpool(limit.failed, client)
        log.info("fleet page login refused", extra={
            "principal": principal.label if principal else "-"})
        return login_page("that token is not the admin's" if principal is not None
                          else "unknown token", 401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, session_cookie(token, time.time()), max_age=SESSION_S,
                        httponly=True, samesite="strict", path="/",
                        secure=request.url.scheme == "https")
    return response


def log_out(request: Request, revocations: SessionRevocations | None) -> Response:
    """End the session (on every instance, with revocations) and delete the browser's cookie."""
    cookie = request.cookies.get(COOKIE)
    if cookie and revocations is not None and revocations.revoke(
            cookie, now=datetime.fromtimestamp(time.time(), UTC)):
        log.info("fleet page session ended (log out)")
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


def page_router(
    tokens: Tokens,
    source: FleetSource,
    *,
    clock: Clock = lambda: datetime.now(UTC),
    prefect_ui: Callable[[], str | None] = prefect_ui_url,
    revocations: SessionRevocations | None = None,
    login_limit: LoginLimit | None = None,
) -> APIRouter:
    """Return the routes of the fleet page: ``GET /``, ``POST /login``, ``POST /logout``.

    With ``revocations``, Log out ends the session on every instance at once
    (the cookie stops working); without, it only deletes the browser's cookie.
    ``login_limit`` counts failed logins (:mod:`controller.api.login_limit`; None: none).
    """
    router = APIRouter(include_in_schema=False)
    in_flight = InFlight()

    @router.get("/", response_class=HTMLResponse)
    def fleet_page(request: Request) -> Response:
        principal, why = who(tokens, revocations, request)
        if principal is None:
            return login_page(why, 401, **{"www-authenticate": "Bearer"})
        request.state.principal = principal
        if not principal.is_admin:
            return HTMLResponse(render_forbidden(), status_code=403, headers=HTML_HEADERS)
        view = fleet_view(request, source, clock, prefect_ui)
        return HTMLResponse(render_page(view, logout=not tokens.insecure), headers=HTML_HEADERS)

    @router.post("/login")
    async def login(request: Request) -> Response:
        return await log_in(request, tokens, login_limit, in_flight)

    @router.post("/logout")
    def logout(request: Request) -> Response:
        return log_out(request, revocations)

    return router
