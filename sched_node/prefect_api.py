"""The node's one way to the Prefect server: Prefect's own client and schemas, with two failures.

Every request the node sends goes through one ``SyncPrefectClient`` (Prefect's client: its
auth, TLS, CSRF and headers) and carries Prefect's schemas (``StateCreate`` through
``prefect.states``, ``LogCreate``, ``ArtifactCreate``, ``DeploymentFlowRunCreate``,
``Event``, the filters). Where the server is and how to authenticate are Prefect's settings
(``PREFECT_API_URL``, ``PREFECT_API_AUTH_STRING`` or ``PREFECT_API_KEY``, the TLS ones),
from the environment or the active profile.

Two kinds of failure, and nothing else (:class:`PrefectUnavailable`,
:class:`PrefectRefused`):

1. the server cannot be reached or is not answering well: a refused or timed-out
   connection, a 5xx, a 408 or a 429, or a 401/403 (the node's credentials are not the
   server's: fixing them is an operator's change, not the record's). The caller keeps what
   it was sending and tries again later: nothing is lost, only delayed;
2. the server refused the request itself (any other 4xx): trying again the same way will
   not help; the caller logs it and moves on.

Why the client's own retries are off here (``PREFECT_CLIENT_MAX_RETRIES=0`` for the node's
calls only): a client that connected once retries a lost server for about 68 s with
back-offs of 2 to 32 s (measured, ``../shared/PREFECT.md``), and the node's recorder,
planner and control loop each have their own back-off and must not sit in one request for a
minute. A server too busy to do anything (429, 503: SQLite's "database is locked") is asked
again at once, a few times (:data:`BUSY_RETRY_DELAYS`), as the client would.

Reads answer the JSON form of Prefect's objects (``model_dump(mode="json")``), as the
node's files keep them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from sched_core import ConfigError, SchedError
from sched_core.values import retry_after_seconds

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import ArtifactCreate, DeploymentFlowRunCreate, LogCreate
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter
    from prefect.client.schemas.objects import State
    from prefect.events import Event

log = logging.getLogger(__name__)

T = TypeVar("T")

TIMEOUT_S = 10.0
"""The longest one request may take (connect, send, answer) before it counts as unreachable."""
RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
"""Answers that mean "not now": the same request may succeed later."""
BUSY = frozenset({429, 503})
"""Answers of a server too busy to do anything (a SQLite server's "database is locked" is a
503): asked again at once, a few times."""
BUSY_RETRY_DELAYS = (0.1, 0.3, 1.0)
PAGE = 200
"""Runs per page when filtering (the server's default and maximum)."""
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


class PrefectUnavailable(SchedError, ConnectionError):
    """The Prefect server could not be reached or did not answer well: try again later.

    ``retry_after``: the seconds a busy answer's ``Retry-After`` asked for (the scaled
    layout's balancer sends one with its 503s), None when it gave none.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


MAX_RETRY_AFTER_S = 600.0
"""The longest ``Retry-After`` believed (a larger one is cut to this)."""


class PrefectRefused(SchedError, ValueError):
    """The Prefect server refused the request (a 4xx other than 408/425/429)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _profile_url() -> str:
    """Return the API URL of Prefect's active profile ("" when none; imports its settings)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else ""


def shown(url: str) -> str:
    """Return a URL without any ``user:password@`` part (for logs and errors)."""
    parts = httpx.URL(url)
    return str(parts.copy_with(username=None, password=None)) if parts.userinfo else url


class PrefectApi:
    """Prefect's client for the node (the module's rules).

    ``url`` (else ``PREFECT_API_URL``), ``auth_string`` and ``api_key`` (else Prefect's
    settings); ``httpx_settings`` go to the client (tests add event hooks). Every method
    raises :class:`PrefectUnavailable` or :class:`PrefectRefused`, never an httpx error.
    """

    def __init__(self, url: str | None = None, *, auth_string: str | None = None,
                 api_key: str | None = None,
                 httpx_settings: Mapping[str, Any] | None = None) -> None:
        # Prefect is imported (about 1.5 s) by the first request, in the thread that sends it,
        # not here: a node that restarts fires its due windows before that (docs/agent.md).
        # Only a URL missing from the environment is looked up in Prefect's profile at once.
        url = url or os.environ.get("PREFECT_API_URL") or _profile_url()
        if not url:
            raise ConfigError(
                "no Prefect API: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api); the node "
                "records every job there, and fires its windows whether it answers or not")
        self.url = url.rstrip("/")
        self.shown_url = shown(self.url)
        self.requests = 0
        """Requests sent (for the node's log and the benchmarks)."""
        self.busy = 0
        """Answers of a server too busy to do anything (429, 503), each asked again."""
        self._auth = (auth_string, api_key)
        self._httpx_settings = dict(httpx_settings or {})
        self._hooks: list[Callable[[httpx.Request], None]] = []
        self._made: SyncPrefectClient | None = None
        self._making = threading.Lock()
        self._settings: Any = None
        self._profile: Any = None
        self._closed = False

    def _make(self) -> SyncPrefectClient:
        """Build Prefect's client and the settings its calls run in (once)."""
        with self._making:
            if self._made is not None:
                return self._made
            if self._closed:
                raise PrefectUnavailable("the node's Prefect client is closed")
            from prefect.client.orchestration import SyncPrefectClient
            from prefect.context import get_settings_context
            from prefect.settings import (
                PREFECT_API_AUTH_STRING,
                PREFECT_API_KEY,
                PREFECT_API_URL,
                PREFECT_CLIENT_MAX_RETRIES,
                get_current_settings,
            )

            current = get_current_settings()
            auth_string, api_key = self._auth
            if auth_string is None and api_key is None:
                auth, key = current.api.auth_string, current.api.key
                auth_string = auth.get_secret_value() if auth else None
                api_key = key.get_secret_value() if key else None
            given = self._httpx_settings
            hooks = dict(given.get("event_hooks") or {})
            hooks["request"] = [*hooks.get("request", []), self._counted, *self._hooks]
            settings = {
                "timeout": TIMEOUT_S,
                # One connection, whichever of the node's threads asks: the others wait for
                # it (at most the pool part of TIMEOUT_S, then the server counts as away).
                # Between bursts the server closes it (its keep-alive is a few seconds).
                "limits": httpx.Limits(max_connections=1, max_keepalive_connections=1,
                                       keepalive_expiry=30.0),
                "headers": {"User-Agent": "sched-agent"},
                **given, "event_hooks": hooks}
            # Prefect's helpers called in this context reach this server, without retries.
            updates: dict[Any, Any] = {PREFECT_CLIENT_MAX_RETRIES: 0, PREFECT_API_URL: self.url}
            if auth_string:
                updates[PREFECT_API_AUTH_STRING] = auth_string
            if api_key:
                updates[PREFECT_API_KEY] = api_key
            self._settings = current.copy_with_update(updates=updates)
            self._profile = get_settings_context().profile
            with self._context():
                client = SyncPrefectClient(self.url, auth_string=auth_string, api_key=api_key,
                                           httpx_settings=settings)
                client.__enter__()
            self._made = client
            return client

    def _counted(self, request: httpx.Request) -> None:
        self.requests += 1

    def watch(self, hook: Callable[[httpx.Request], None]) -> None:
        """Call hook with every request sent from now on (tests and benchmarks count them)."""
        with self._making:
            if self._made is None:
                self._hooks.append(hook)
                return
        self._made._client.event_hooks["request"].append(hook)

    def _context(self) -> Any:
        from prefect.context import SettingsContext

        return SettingsContext(profile=self._profile, settings=self._settings)

    def close(self) -> None:
        """Close the client (if it was made)."""
        with self._making:
            self._closed = True
            made, self._made = self._made, None
        if made is not None:
            made.__exit__(None, None, None)

    @property
    def client(self) -> SyncPrefectClient:
        """Prefect's client itself (call it through :meth:`call`)."""
        return self._make()

    def call(self, work: Callable[[SyncPrefectClient], T], what: str) -> T:
        """Run work with the client, busy answers asked again; the module's two failures."""
        from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

        client = self._make()
        for delay in (*BUSY_RETRY_DELAYS, None):
            try:
                with self._context():
                    return work(client)
            except ObjectNotFound as exc:
                raise PrefectRefused(f"the Prefect API at {self.shown_url} has no such object: "
                                     f"{what} ({exc})", 404) from None
            except httpx.HTTPStatusError as exc:
                status = exc.response.status_code
                later = (retry_after_seconds(exc.response.headers.get("retry-after"),
                                             most=MAX_RETRY_AFTER_S) if status in BUSY else None)
                # The server (or its balancer) says when: not at once. (Prefect's client has
                # slept that long once already, even with its retries off.)
                if later is not None:
                    self.busy += 1
                    raise PrefectUnavailable(
                        f"the Prefect API at {self.shown_url} is busy ({status}) to {what}: "
                        f"asked to come back in {later:g} s", later) from None
                if status in BUSY and delay is not None:
                    self.busy += 1
                    time.sleep(delay)  # the server was busy and did nothing: ask again
                    continue
                raise self._failure(status, what, exc.response.text) from None
            except httpx.HTTPError as exc:
                raise PrefectUnavailable(
                    f"cannot reach the Prefect API at {self.shown_url} "
                    f"({type(exc).__name__}: {exc})") from None
            except PrefectHTTPStatusError as exc:  # pragma: no cover (an httpx error too)
                raise self._failure(exc.response.status_code, what, exc.response.text) from None
        raise AssertionError("unreachable")

    def _failure(self, status: int, what: str, text: str) -> SchedError:
        if status in (401, 403):
            return PrefectUnavailable(
                f"the Prefect API at {self.shown_url} refused the node's credentials "
                f"({status}) to {what}: set PREFECT_API_AUTH_STRING (or PREFECT_API_KEY) to "
                "the server's; the node keeps its records until then")
        if status in RETRYABLE:
            return PrefectUnavailable(
                f"the Prefect API at {self.shown_url} answered {status} to {what}: {text[:200]}")
        return PrefectRefused(f"the Prefect API at {self.shown_url} refused {what} ({status}): "
                              f"{text[:500]}", status)

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise PrefectUnavailable(f"the Prefect API at {self.shown_url} answered something "
                                     f"that is not JSON: {response.text[:200]}") from None

    # -- the server ------------------------------------------------------------------

    def health(self) -> bool:
        """Return whether the server answers its health check (never raises)."""
        try:
            return self.call(lambda c: c.api_healthcheck() is None, "GET /health")
        except SchedError:
            return False

    # -- deployments and runs --------------------------------------------------------

    def deployment_by_name(self, flow: str, name: str) -> dict[str, Any] | None:
        """Return the deployment ``flow/name``, or None when there is none."""
        try:
            found = self.call(lambda c: c.read_deployment_by_name(f"{flow}/{name}"),
                              f"read deployment {flow}/{name}")
        except PrefectRefused as exc:
            if exc.status == 404:
                return None
            raise
        return dict(found.model_dump(mode="json"))

    def read_deployments(self, ids: Iterable[str]) -> list[dict[str, Any]]:
        """Return the deployments with these ids that exist."""
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        wanted = [uuid.UUID(item) for item in ids]
        found = self.call(lambda c: c.read_deployments(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=wanted)),
            limit=len(wanted)), "read the node's deployments")
        return [item.model_dump(mode="json") for item in found]

    def create_runs(self, deployment_id: str,
                    runs: Sequence[DeploymentFlowRunCreate]) -> list[dict[str, Any]]:
        """Create up to 100 runs of a deployment at once; return the server's result per run.

        A run whose idempotency key exists comes back as that run (Prefect's rule).
        """
        # The client has no method for the bulk route (Prefect 3.9.1): its own schema, its
        # own HTTP client.
        body = [run.model_dump(mode="json", exclude_unset=True) for run in runs]
        response = self.call(lambda c: c.request(
            "POST", "/deployments/{id}/create_flow_run/bulk",  # type: ignore[arg-type]
            path_params={"id": deployment_id}, json=body), "create planned runs")
        results: list[dict[str, Any]] = self._json(response)["results"]
        return results

    def create_run(self, deployment_id: str, run: DeploymentFlowRunCreate) -> dict[str, Any]:
        """Create one run of a deployment (or get the run with its idempotency key)."""
        body = run.model_dump(mode="json", exclude_unset=True)
        response = self.call(lambda c: c.request(
            "POST", "/deployments/{id}/create_flow_run",
            path_params={"id": deployment_id}, json=body), "create a run")
        data: dict[str, Any] = self._json(response)
        return data

    def read_run(self, run_id: str) -> dict[str, Any] | None:
        """Return a flow run, or None when it does not exist."""
        try:
            found = self.call(lambda c: c.read_flow_run(uuid.UUID(run_id)),
                              f"read flow run {run_id}")
        except PrefectRefused as exc:
            if exc.status == 404:
                return None
            raise
        return dict(found.model_dump(mode="json"))

    def run_states(self, run_id: str) -> list[dict[str, Any]]:
        """Return a flow run's states, oldest first."""
        found = self.call(lambda c: c.read_flow_run_states(uuid.UUID(run_id)),
                          f"read the states of flow run {run_id}")
        return sorted((item.model_dump(mode="json") for item in found),
                      key=lambda item: str(item.get("timestamp")))

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Change a flow run's fields (``name``, ``tags``, ``empirical_policy``, ...)."""
        self.call(lambda c: c.update_flow_run(uuid.UUID(run_id), **fields),
                  f"update flow run {run_id}")

    def set_state(self, run_id: str, state: State[Any], *, force: bool) -> str:
        """Propose (or with force, set) a flow run's state; return ACCEPT, REJECT, WAIT or ABORT."""
        result = self.call(lambda c: c.set_flow_run_state(run_id, state, force=force),
                           f"set the state of flow run {run_id}")
        return str(result.status.value)

    def delete_run(self, run_id: str) -> bool:
        """Delete a flow run; return False when it was already gone."""
        try:
            self.call(lambda c: c.delete_flow_run(uuid.UUID(run_id)), f"delete flow run {run_id}")
        except PrefectRefused as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def filter_runs(self, flow_runs: FlowRunFilter, *, sort: str | None = None,
                    limit: int = PAGE, offset: int = 0) -> list[dict[str, Any]]:
        """Return one page of the flow runs a filter selects."""
        from prefect.client.schemas.sorting import FlowRunSort

        order = FlowRunSort(sort) if sort else None
        found = self.call(lambda c: c.read_flow_runs(flow_run_filter=flow_runs, sort=order,
                                                     limit=limit, offset=offset),
                          "read flow runs")
        return [item.model_dump(mode="json") for item in found]

    # -- task runs -------------------------------------------------------------------

    def create_task_run(self, task: Any, *, flow_run_id: str, dynamic_key: str, name: str,
                        state: State[Any]) -> str:
        """Create a task run of task (a flow's ``@task``) in its first state; return its id.

        Created by flow run, task key and dynamic key: a create sent twice gives the same
        task run.
        """
        found = self.call(lambda c: c.create_task_run(
            task, uuid.UUID(flow_run_id), dynamic_key, name=name, state=state),
            "create a task run")
        return str(found.id)

    def set_task_state(self, task_run_id: str, state: State[Any]) -> str:
        """Set a task run's state (forced: the node is the only one that runs it)."""
        result = self.call(lambda c: c.set_task_run_state(uuid.UUID(task_run_id), state,
                                                          force=True),
                           f"set the state of task run {task_run_id}")
        return str(result.status.value)

    # -- logs, artifacts, events -----------------------------------------------------

    def send_logs(self, logs: Sequence[LogCreate]) -> None:
        """Send log records (each with its own timestamp, flow run and task run)."""
        if logs:
            self.call(lambda c: c.create_logs(logs), "send logs")

    def filter_logs(self, logs: LogFilter, *, limit: int = PAGE,
                    ascending: bool = True) -> list[dict[str, Any]]:
        """Return the log records a filter selects (oldest first unless told otherwise)."""
        from prefect.client.schemas.sorting import LogSort

        sort = LogSort.TIMESTAMP_ASC if ascending else LogSort.TIMESTAMP_DESC
        found = self.call(lambda c: c.read_logs(log_filter=logs, limit=limit, sort=sort),
                          "read logs")
        return [item.model_dump(mode="json") for item in found]

    def create_artifact(self, artifact: ArtifactCreate) -> str:
        """Create an artifact; return its id.

        Sent through the client's own request with Prefect's schema, not its
        ``create_artifact``: that one also emits ``prefect.artifact.created`` through
        Prefect's events worker, whose websocket then stays open for the life of the process
        (a second connection to the server, always). The job's own event names its run."""
        from prefect.client.schemas.objects import Artifact

        body = artifact.model_dump(mode="json", exclude_unset=True)
        answer = self.call(lambda c: c.request("POST", "/artifacts/", json=body),
                           "create an artifact")
        return str(Artifact.model_validate(answer.json()).id)

    def run_artifacts(self, run_id: str) -> list[dict[str, Any]]:
        """Return the artifacts of a flow run."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        found = self.call(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[uuid.UUID(run_id)]))),
            f"read the artifacts of flow run {run_id}")
        return [item.model_dump(mode="json") for item in found]

    def emit_events(self, events: Sequence[Event | Mapping[str, Any]]) -> None:
        """Send events (each with its own id and ``occurred``); the server keeps one per id.

        An event kept as JSON (the outbox's) is read as Prefect's ``Event`` first: one that
        is not one is a ValueError, naming what is wrong, and nothing is sent.
        """
        from prefect.events import Event

        # The client has no method to post events (Prefect 3.9.1; its engine streams them over
        # a websocket the node would hold open): the route of its own events client, its schema.
        if events:
            body = [(event if isinstance(event, Event) else Event.model_validate(event))
                    .model_dump(mode="json") for event in events]
            self.call(lambda c: c.request("POST", "/events", json=body), "send events")


def new_state(kind: str, *, name: str | None = None, message: str | None = None,
              scheduled_time: Any = None) -> State[Any]:
    """Return a state to send: its type (``RUNNING``), name, message and scheduled time."""
    from prefect.client.schemas.objects import State, StateDetails, StateType

    details = StateDetails(scheduled_time=scheduled_time) if scheduled_time else StateDetails()
    found: State[Any] = State(type=StateType(kind), name=name,
                              message=message[:5000] if message else None,
                              state_details=details)
    return found
