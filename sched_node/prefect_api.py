"""The node's one way to the Prefect server: its REST API over one pooled HTTP client.

Rule: the node never imports Prefect's engine or client. It records what it did
through the same REST endpoints Prefect's own client calls (flows, deployments,
flow runs and their states, task runs, logs, artifacts, events), so a warm node
records a job with a handful of requests and no new process.

Two kinds of failure, and nothing else (:class:`PrefectUnavailable`,
:class:`PrefectRefused`):

1. the server cannot be reached or is not answering well: a refused or
   timed-out connection, a 5xx, a 408 or a 429, or a 401/403 (the node's
   credentials are not the server's: fixing them is an operator's change, not the
   record's). The caller keeps what it was sending and tries again later: nothing
   is lost, only delayed;
2. the server refused the request itself (any other 4xx): trying again the
   same way will not help; the caller logs it and moves on.

Where the server is and how to authenticate are Prefect's own settings, read
from the environment (``PREFECT_API_URL``, ``PREFECT_API_AUTH_STRING`` or
``PREFECT_API_KEY``, ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY``,
``PREFECT_API_SSL_CERT_FILE``), and from Prefect's profile only when the
environment names no URL.
"""

from __future__ import annotations

import base64
import logging
import os
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from sched_core import ConfigError, SchedError
from sched_core.values import format_go_time

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
"""The longest one request may take (connect, send, answer) before it counts as unreachable."""
RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
"""Answers that mean "not now": the same request may succeed later."""
BUSY = frozenset({429, 503})
"""Answers of a server too busy to do anything (a SQLite server's "database is locked" is a
503): asked again at once, a few times, as Prefect's own client does."""
BUSY_RETRY_DELAYS = (0.1, 0.3, 1.0)
PAGE = 200
"""Runs per page when filtering (the server's default and maximum)."""


class PrefectUnavailable(SchedError, ConnectionError):
    """The Prefect server could not be reached or did not answer well: try again later."""


class PrefectRefused(SchedError, ValueError):
    """The Prefect server refused the request (a 4xx other than 408/425/429)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ApiSettings:
    """Where the Prefect API is and how to reach it."""

    url: str
    auth_string: str | None = None
    api_key: str | None = None
    insecure: bool = False
    cert_file: str | None = None
    extra_headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def shown_url(self) -> str:
        """Return the URL without any ``user:password@`` part (for logs and errors)."""
        parts = httpx.URL(self.url)
        return str(parts.copy_with(username=None, password=None)) if parts.userinfo else self.url

    def headers(self) -> dict[str, str]:
        """Return the authentication headers Prefect's client would send."""
        headers = dict(self.extra_headers)
        if self.auth_string:
            token = base64.b64encode(self.auth_string.encode("utf-8")).decode("ascii")
            headers["Authorization"] = f"Basic {token}"
        elif self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def verify(self) -> ssl.SSLContext | bool:
        """Return the TLS verification Prefect's client would use."""
        if self.insecure:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            return ctx
        if self.cert_file:
            return ssl.create_default_context(cafile=self.cert_file)
        return True


_TRUE = frozenset({"1", "true", "yes", "on"})


def api_settings(environ: Mapping[str, str] | None = None) -> ApiSettings:
    """Return the Prefect API settings from the environment (else Prefect's profile).

    Raises ConfigError when no URL is configured: without one Prefect's own client
    would start a temporary server whose records vanish with it.
    """
    env = os.environ if environ is None else environ
    url = env.get("PREFECT_API_URL", "")
    values: dict[str, Any] = {
        "auth_string": env.get("PREFECT_API_AUTH_STRING") or None,
        "api_key": env.get("PREFECT_API_KEY") or None,
        "insecure": env.get("PREFECT_API_TLS_INSECURE_SKIP_VERIFY", "").lower() in _TRUE,
        "cert_file": env.get("PREFECT_API_SSL_CERT_FILE") or None,
    }
    if not url and environ is None:
        url, values = _profile_settings(values)
    if not url:
        raise ConfigError(
            "no Prefect API: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api); the node "
            "records every job there, and fires its windows whether it answers or not"
        )
    return ApiSettings(url=url.rstrip("/"), **values)


def _profile_settings(values: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Return the URL and auth of Prefect's active profile (imports Prefect's settings once)."""
    try:
        from prefect.settings import (
            PREFECT_API_AUTH_STRING,
            PREFECT_API_KEY,
            PREFECT_API_SSL_CERT_FILE,
            PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
            PREFECT_API_URL,
        )
    except Exception:  # no Prefect installed: the environment is all there is
        return "", values
    auth = PREFECT_API_AUTH_STRING.value()
    key = PREFECT_API_KEY.value()
    return str(PREFECT_API_URL.value() or ""), {
        "auth_string": values["auth_string"] or (auth.get_secret_value() if auth else None),
        "api_key": values["api_key"] or (key.get_secret_value() if key else None),
        "insecure": values["insecure"] or bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value()),
        "cert_file": values["cert_file"] or PREFECT_API_SSL_CERT_FILE.value() or None,
    }


def state_body(
    state_type: str,
    *,
    name: str | None = None,
    message: str | None = None,
    scheduled_time: datetime | None = None,
) -> dict[str, Any]:
    """Return a state as the API takes it (``{"type": "RUNNING", "name": ..., ...}``)."""
    body: dict[str, Any] = {"type": state_type}
    if name:
        body["name"] = name
    if message:
        body["message"] = message[:5000]
    if scheduled_time is not None:
        body["state_details"] = {"scheduled_time": format_go_time(scheduled_time)}
    return body


class PrefectApi:
    """The REST endpoints the node calls, over one pooled ``httpx.Client`` (injectable).

    Every method raises :class:`PrefectUnavailable` or :class:`PrefectRefused`
    (the module's two kinds of failure), never an httpx error.
    """

    def __init__(self, settings: ApiSettings, *, client: httpx.Client | None = None) -> None:
        self.settings = settings
        self._own = client is None
        self._client = client or httpx.Client(
            base_url=settings.url,
            headers={"User-Agent": "sched-agent", **settings.headers()},
            verify=settings.verify(),
            timeout=TIMEOUT_S,
            # Idle connections are kept a while so a burst (one job's records)
            # reuses one; the node holds none while idle.
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=2,
                                keepalive_expiry=30.0),
        )
        self.requests = 0
        """Requests sent (for the node's log and the benchmarks)."""
        self.busy = 0
        """Answers of a server too busy to do anything (429, 503), each asked again."""

    def close(self) -> None:
        """Close the HTTP client if it is this object's own."""
        if self._own:
            self._client.close()

    def _call(self, method: str, path: str, *, json: Any = None,
              params: Mapping[str, Any] | None = None) -> httpx.Response:
        for delay in (*BUSY_RETRY_DELAYS, None):
            self.requests += 1
            try:
                response = self._client.request(method, path, json=json, params=params)
            except httpx.HTTPError as exc:
                raise PrefectUnavailable(
                    f"cannot reach the Prefect API at {self.settings.shown_url} "
                    f"({type(exc).__name__}: {exc})") from None
            if response.status_code not in BUSY:
                break
            self.busy += 1
            if delay is None:
                break
            time.sleep(delay)  # the server was busy and did nothing: ask again
        if response.status_code in (401, 403):
            raise PrefectUnavailable(
                f"the Prefect API at {self.settings.shown_url} refused the node's credentials "
                f"({response.status_code}) to {method} {path}: set PREFECT_API_AUTH_STRING "
                "(or PREFECT_API_KEY) to the server's; the node keeps its records until then")
        if response.status_code in RETRYABLE:
            raise PrefectUnavailable(
                f"the Prefect API at {self.settings.shown_url} answered "
                f"{response.status_code} to {method} {path}: {response.text[:200]}")
        if response.status_code >= 400:
            raise PrefectRefused(
                f"the Prefect API at {self.settings.shown_url} refused {method} {path} "
                f"({response.status_code}): {response.text[:500]}", response.status_code)
        return response

    def call(self, method: str, path: str, *, json: Any = None) -> httpx.Response:
        """Send any request of the API (the module's two failures apply)."""
        return self._call(method, path, json=json)

    # -- flows and deployments -------------------------------------------------------

    def health(self) -> bool:
        """Return whether the server answers its health check (never raises)."""
        try:
            return self._call("GET", "/health").status_code == 200
        except SchedError:
            return False

    def ensure_flow(self, name: str) -> str:
        """Return the id of the flow called name, creating it if needed."""
        return str(self._call("POST", "/flows/", json={"name": name}).json()["id"])

    def ensure_deployment(self, flow_id: str, name: str, **fields: Any) -> str:
        """Create or update the deployment name of flow_id; return its id."""
        body = {"name": name, "flow_id": flow_id, **fields}
        return str(self._call("POST", "/deployments/", json=body).json()["id"])

    def _found(self, path: str) -> dict[str, Any] | None:
        """GET an object; None when the server has none (404)."""
        try:
            data: dict[str, Any] = self._call("GET", path).json()
        except PrefectRefused as exc:
            if exc.status == 404:
                return None
            raise
        return data

    def deployment_by_name(self, flow: str, name: str) -> dict[str, Any] | None:
        """Return the deployment ``flow/name``, or None when there is none."""
        return self._found(f"/deployments/name/{flow}/{name}")

    # -- flow runs -------------------------------------------------------------------

    def create_runs(self, deployment_id: str,
                    runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Create up to 100 runs of a deployment at once; return the server's result per run.

        A run whose idempotency key exists comes back as that run (Prefect's rule).
        """
        response = self._call("POST", f"/deployments/{deployment_id}/create_flow_run/bulk",
                              json=[dict(run) for run in runs])
        results: list[dict[str, Any]] = response.json()["results"]
        return results

    def create_run(self, deployment_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create one run of a deployment (or get the run with its idempotency key)."""
        data: dict[str, Any] = self._call(
            "POST", f"/deployments/{deployment_id}/create_flow_run", json=dict(body)).json()
        return data

    def read_run(self, run_id: str) -> dict[str, Any] | None:
        """Return a flow run, or None when it does not exist."""
        return self._found(f"/flow_runs/{run_id}")

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Change a flow run's fields (``infrastructure_pid``, ``name``, ``tags``, ...)."""
        self._call("PATCH", f"/flow_runs/{run_id}", json=fields)

    def set_state(self, run_id: str, state: Mapping[str, Any], *, force: bool) -> str:
        """Propose (or with force, set) a flow run's state; return ACCEPT, REJECT, WAIT or ABORT."""
        data = self._call("POST", f"/flow_runs/{run_id}/set_state",
                          json={"state": dict(state), "force": force}).json()
        return str(data.get("status", ""))

    def set_state_where(self, flow_runs: Mapping[str, Any], state: Mapping[str, Any], *,
                        force: bool, limit: int = 1) -> list[dict[str, Any]]:
        """Set the state of the flow runs a filter selects (at most limit), in one request.

        Returns the server's result per run it found (``flow_run_id``, ``status``,
        ``state``): none when the filter matches no run.
        """
        data = self._call("POST", "/flow_runs/bulk_set_state",
                          json={"flow_runs": dict(flow_runs), "state": dict(state),
                                "force": force, "limit": limit}).json()
        results: list[dict[str, Any]] = data.get("results") or []
        return results

    def delete_run(self, run_id: str) -> bool:
        """Delete a flow run; return False when it was already gone."""
        try:
            self._call("DELETE", f"/flow_runs/{run_id}")
        except PrefectRefused as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def filter_runs(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Return the flow runs a filter body selects (one page: pass ``limit``/``offset``)."""
        data: list[dict[str, Any]] = self._call("POST", "/flow_runs/filter", json=dict(body)).json()
        return data

    # -- task runs -------------------------------------------------------------------

    def create_task_run(self, body: Mapping[str, Any]) -> str:
        """Create a task run (or get it by flow run, task key and dynamic key); return its id."""
        return str(self._call("POST", "/task_runs/", json=dict(body)).json()["id"])

    def set_task_state(self, task_run_id: str, state: Mapping[str, Any]) -> str:
        """Set a task run's state (forced: the node is the only one that runs it)."""
        data = self._call("POST", f"/task_runs/{task_run_id}/set_state",
                          json={"state": dict(state), "force": True}).json()
        return str(data.get("status", ""))

    # -- logs, artifacts, events -----------------------------------------------------

    def send_logs(self, logs: Sequence[Mapping[str, Any]]) -> None:
        """Send log records (each with its own timestamp, flow run and task run)."""
        if logs:
            self._call("POST", "/logs/", json=[dict(item) for item in logs])

    def filter_logs(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Return the log records a filter body selects."""
        data: list[dict[str, Any]] = self._call("POST", "/logs/filter", json=dict(body)).json()
        return data

    def create_artifact(self, body: Mapping[str, Any]) -> str:
        """Create an artifact; return its id."""
        return str(self._call("POST", "/artifacts/", json=dict(body)).json()["id"])

    def filter_artifacts(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Return the artifacts a filter body selects."""
        data: list[dict[str, Any]] = self._call("POST", "/artifacts/filter", json=dict(body)).json()
        return data

    def emit_events(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Send events (each with its own id and ``occurred``); the server keeps one per id."""
        if events:
            self._call("POST", "/events", json=[dict(item) for item in events])
