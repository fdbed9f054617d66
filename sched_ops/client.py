"""The controller's HTTP API as the operator's commands use it, and what each failure exits with.

Exit codes a script can trust (:class:`Exit`):

- 0: done;
- 1: the controller refused the request or found nothing (any 4xx: a bad token,
  a node token on an admin endpoint, no such node or schedule, a row it refuses);
- 2: the command line itself is wrong (typer's usage errors; no controller URL;
  a file that is not a JSON object);
- 3: the controller (or Prefect) could not be reached: refused connection,
  unknown host, timeout, TLS failure;
- 4: it answered, but not as the API says (a 5xx, a body that is not JSON);
- 5 (``sched report``): a window of the range failed, and none was missed;
- 6 (``sched report``): a window was missed (no report from the node) or a node
  is silent, whatever else failed.

The token is sent as ``Authorization: Bearer`` and never printed; URLs in
messages are shown without any user or password.
"""

from __future__ import annotations

import json
import sys
from enum import IntEnum
from typing import Any

import httpx

TIMEOUT_S = 15.0
"""Seconds the commands wait for the controller (connect and each read)."""


class Exit(IntEnum):
    """The exit codes of the operator's commands."""

    OK = 0
    REFUSED = 1
    USAGE = 2
    UNREACHABLE = 3
    BAD_ANSWER = 4
    FAILED = 5
    """``sched report``: a window failed (its job Failed or Crashed); nothing was missed."""
    MISSED = 6
    """``sched report``: a window was missed (no report from the node) or a node is silent."""


class OpsError(Exception):
    """A command failed: the message for people, and the exit code for scripts."""

    def __init__(self, message: str, code: Exit, *, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def shown_url(url: str | httpx.URL) -> str:
    """Return url without user and password, for messages."""
    try:
        parsed = httpx.URL(str(url))
    except (httpx.InvalidURL, TypeError):
        return "<an invalid URL>"
    if parsed.userinfo:
        parsed = parsed.copy_with(username=None, password=None)
    return str(parsed)


def check_base_url(url: str | None, what: str = "--controller") -> str:
    """Return the controller's base URL without a trailing slash; USAGE unless an http(s) URL."""
    if not url:
        raise OpsError(
            f"no controller: pass {what} URL or set SCHED_CONTROLLER_URL "
            "(e.g. http://127.0.0.1:8080)", Exit.USAGE,
        )
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        raise OpsError(f"{what} {url!r} is not a URL", Exit.USAGE) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise OpsError(
            f"{what} {shown_url(url)!r} is not an http:// or https:// URL with a host",
            Exit.USAGE,
        )
    return url.rstrip("/")


def _no_such_endpoint(response: httpx.Response) -> bool:
    """True when a 404 or 405 is the router's (no such route), not the API's (no such row).

    The API's refusals name what is missing; the router's bare ``Not Found`` /
    ``Method Not Allowed`` means an older controller without the endpoint.
    """
    if response.status_code not in (404, 405):
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("detail") in ("Not Found", "Method Not Allowed")


def _detail(response: httpx.Response) -> str:
    """Return the controller's explanation of a refusal, in one line."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):  # FastAPI's validation entries: "loc: msg" each
        parts = []
        for entry in detail:
            if isinstance(entry, dict):
                loc = ".".join(str(p) for p in entry.get("loc", []) if p not in ("body",))
                parts.append(f"{loc}: {entry.get('msg', '')}" if loc else str(entry.get("msg")))
            else:
                parts.append(str(entry))
        return "; ".join(parts)
    return str(detail)


class Controller:
    """A controller's API over HTTP: one client, the token as a Bearer header."""

    def __init__(self, base_url: str, token: str | None, *, timeout: float = TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = check_base_url(base_url)
        headers = {"accept": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                    transport=transport, follow_redirects=False)

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                body: Any = None, content_type: str = "application/json") -> httpx.Response:
        """Send one request; return a 2xx answer, else raise OpsError with its exit code."""
        content = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"content-type": content_type}
        where = f"{method} {shown_url(self.base_url)}{path}"
        try:
            response = self._client.request(method, path, params=params, content=content,
                                            headers=headers)
        except httpx.TimeoutException as exc:
            raise OpsError(f"{where}: no answer within {TIMEOUT_S:g} s ({type(exc).__name__})",
                           Exit.UNREACHABLE) from None
        except httpx.TransportError as exc:
            raise OpsError(f"{where}: cannot reach the controller ({type(exc).__name__}: {exc})",
                           Exit.UNREACHABLE) from None
        if response.is_success:
            return response
        status = response.status_code
        if 400 <= status < 500:
            hint = {401: " (check --token / SCHED_TOKEN)",
                    403: " (this needs the admin token)"}.get(status, "")
            if _no_such_endpoint(response):
                hint = (" (this controller has no such endpoint: it is older than this "
                        "sched; upgrade it)")
            raise OpsError(f"{where}: {status} {_detail(response)}{hint}", Exit.REFUSED,
                           status=status)
        raise OpsError(f"{where}: the controller answered {status} {_detail(response)}",
                       Exit.BAD_ANSWER, status=status)

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """Send one request and return its JSON body (BAD_ANSWER when it is not JSON)."""
        response = self.request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise OpsError(f"{method} {path}: the answer is not JSON", Exit.BAD_ANSWER) from None

    # ----------------------------------------------------------- the endpoints

    def status(self) -> dict[str, Any]:
        """``GET /api/status``: one row per node."""
        return self._object(self.json("GET", "/api/status"), "/api/status")

    def node_status(self, node: str) -> dict[str, Any]:
        """``GET /api/nodes/{node}/status``: the node's row and its schedules."""
        path = f"/api/nodes/{_segment(node)}/status"
        return self._object(self.json("GET", path), path)

    def rows(self, node: str) -> list[dict[str, Any]]:
        """``GET /api/nodes/{node}/schedules``: the node's rows in the wire format."""
        path = f"/api/nodes/{_segment(node)}/schedules"
        body = self._object(self.json("GET", path), path)
        rows = body.get("schedules")
        if not isinstance(rows, list):
            raise OpsError(f"GET {path}: no schedules list in the answer", Exit.BAD_ANSWER)
        return [row for row in rows if isinstance(row, dict)]

    def row(self, node: str, schedule_id: str) -> dict[str, Any]:
        """``GET /api/nodes/{node}/schedules/{id}``: one row."""
        path = _row_path(node, schedule_id)
        return self._object(self.json("GET", path), path)

    def voucher(self, node: str, purpose: str, subject: str) -> str | None:
        """``POST /api/nodes/{node}/vouchers``: the controller's word for a run or a cancel;
        None, with a warning, when it gives none (a node without a token there, an older
        controller): a node with ``ad_hoc_runs = "controller"`` then refuses the run."""
        path = f"/api/nodes/{_segment(node)}/vouchers"
        try:
            body = self._object(self.json("POST", path, body={
                "purpose": purpose, "subject": subject}), path)
        except OpsError as exc:
            if exc.status not in (404, 405, 422):
                raise
            print(f"warning: no voucher from the controller ({exc}); a node with ad_hoc_runs "
                  '= "controller" refuses this', file=sys.stderr)
            return None
        voucher = body.get("voucher")
        return voucher if isinstance(voucher, str) else None

    def put(self, node: str, schedule_id: str, row: dict[str, Any]) -> dict[str, Any]:
        """``PUT`` a whole row; return the stored row (with ``_propagation`` when sent)."""
        path = _row_path(node, schedule_id)
        return self._object(self.json("PUT", path, body=row), path)

    def patch(self, node: str, schedule_id: str, patch: dict[str, Any]) -> dict[str, Any]:
        """``PATCH`` a JSON merge patch (RFC 7386); return the stored row."""
        path = _row_path(node, schedule_id)
        return self._object(
            self.json("PATCH", path, body=patch, content_type="application/merge-patch+json"),
            path,
        )

    def delete(self, node: str, schedule_id: str) -> None:
        """``DELETE`` one row."""
        self.request("DELETE", _row_path(node, schedule_id))

    def upcoming(self, hours: float, node: str | None) -> list[dict[str, Any]]:
        """``GET /api/upcoming``: every window across the fleet (or one node) in time order."""
        params: dict[str, Any] = {"hours": f"{hours:g}"}
        if node:
            params["node"] = node
        body = self._object(self.json("GET", "/api/upcoming", params=params), "/api/upcoming")
        windows = body.get("windows")
        if not isinstance(windows, list):
            raise OpsError("GET /api/upcoming: no windows list in the answer", Exit.BAD_ANSWER)
        return [w for w in windows if isinstance(w, dict)]

    def report(self, *, since: str | None = None, until: str | None = None,
               node: str | None = None) -> dict[str, Any]:
        """``GET /api/report``: every window of the range per node, worst first, and a summary."""
        params = {k: v for k, v in (("since", since), ("until", until), ("node", node)) if v}
        body = self._object(self.json("GET", "/api/report", params=params), "/api/report")
        if not isinstance(body.get("nodes"), list) or not isinstance(body.get("summary"), dict):
            raise OpsError("GET /api/report: no nodes or summary in the answer", Exit.BAD_ANSWER)
        return body

    def explain(self, node: str, schedule_id: str, window: str) -> dict[str, Any]:
        """``GET /api/nodes/{node}/explain``: why a window did or did not run."""
        path = f"/api/nodes/{_segment(node)}/explain"
        return self._object(self.json("GET", path, params={
            "schedule": schedule_id, "window": window}), path)

    @staticmethod
    def _object(body: Any, path: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise OpsError(f"{path}: the answer is not a JSON object", Exit.BAD_ANSWER)
        return body


def _segment(value: str) -> str:
    """Return value as one URL path segment (a name never walks the path)."""
    from urllib.parse import quote

    return quote(value, safe="")


def _row_path(node: str, schedule_id: str) -> str:
    return f"/api/nodes/{_segment(node)}/schedules/{_segment(schedule_id)}"
