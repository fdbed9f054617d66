"""Dispatchers: how the central scheduler hands one claimed (task, scheduled time) on, and
the ``sched.task.gave-up`` event it sends when it stops retrying one (:func:`emit_gave_up`).

A dispatcher (:class:`TaskDispatcher`) is any callable taking a
:class:`controller.claims.Claim`; it
returns normally when the hand-over succeeded and raises on failure (the
scheduler then records the error and retries after a delay). Every dispatch
carries the claim's idempotency key, ``"<task>:<scheduled time>"``, so a
retry after a crash cannot start the same job twice.

A dispatch that cannot reach Prefect fails naming the Prefect API it tried
(the URL without any password), so the error recorded on the task and logged
says where to look.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import httpx

from controller.claims import Claim
from controller.errors import DeploymentNotFound, DispatchError
from sched_core.errors import ConfigError

log = logging.getLogger(__name__)

_EVENT_ID_NAMESPACE = uuid.UUID("6f1c1a52-1d0e-4f7e-9a43-5b0d1c7e2f10")


class TaskDispatcher(Protocol):
    """Hand one claimed central task on; raise on failure."""

    def __call__(self, claim: Claim) -> None: ...


def prefect_api_url() -> str:
    """Return the Prefect API the controller dispatches to; ConfigError when none is set.

    Without ``PREFECT_API_URL`` (in the environment or the active Prefect
    profile) Prefect's client would start a temporary server of its own and
    every event and run would be sent there, and lost with it.
    """
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(
            "no Prefect API to dispatch to: set PREFECT_API_URL (e.g. "
            "http://127.0.0.1:4200/api for `prefect server start`); without it Prefect "
            "would start a temporary server and every dispatch would be lost with it"
        )
    return str(url)


def shown_url(url: str) -> str:
    """Return url without its user and password, for messages."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "<an invalid URL>"
    if parsed.userinfo:
        parsed = parsed.copy_with(username=None, password=None)
    return str(parsed)


@contextmanager
def naming_prefect_api(action: str) -> Iterator[None]:
    """Turn a failed call to Prefect into a DispatchError naming the API's URL and the action."""
    try:
        yield
    except httpx.HTTPStatusError as exc:
        raise DispatchError(
            f"{action}: the Prefect API at {shown_url(prefect_api_url())} answered "
            f"{exc.response.status_code} to {exc.request.method} {exc.request.url.path}"
        ) from exc
    except httpx.HTTPError as exc:
        raise DispatchError(
            f"{action}: the Prefect API at {shown_url(prefect_api_url())} did not answer "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def check_prefect_api(timeout: float = 5.0) -> str | None:
    """Return why the configured Prefect API does not answer its health check, or None.

    The check goes through Prefect's own client, so it uses the same settings
    as a dispatch (``PREFECT_API_URL``, ``PREFECT_API_AUTH_STRING``, TLS).
    """
    try:
        url = prefect_api_url()
    except ConfigError as exc:
        return str(exc)
    from prefect.client.orchestration import get_client

    try:
        with get_client(httpx_settings={"timeout": timeout}, sync_client=True) as client:
            problem = client.api_healthcheck()
    except Exception as exc:  # a client that cannot even be built
        problem = exc
    if problem is None:
        return None
    if isinstance(problem, httpx.HTTPStatusError):
        detail = f"it answered {problem.response.status_code} to GET /health"
    else:
        detail = f"{type(problem).__name__}: {problem}"
    return f"the Prefect API at {shown_url(url)} does not answer ({detail})"


def warn_if_prefect_unreachable(
    check: Callable[[], str | None] = check_prefect_api,
) -> threading.Thread:
    """Check the Prefect API in a thread and log a warning naming it if it does not answer.

    Start-up does not wait for it: the scheduler retries every failed dispatch anyway.
    """

    def run() -> None:
        problem = check()
        if problem is None:
            log.info("the Prefect API answers", extra={"prefect_api": _safe_api_url()})
        else:
            log.warning("%s; tasks are dispatched once it does (each failure is retried)",
                        problem, extra={"prefect_api": _safe_api_url()})

    thread = threading.Thread(target=run, name="prefect-api-check", daemon=True)
    thread.start()
    return thread


def _safe_api_url() -> str:
    try:
        return shown_url(prefect_api_url())
    except ConfigError:
        return "-"


def event_id(claim: Claim) -> uuid.UUID:
    """Return the Prefect event id of claim: a UUID derived from its idempotency key."""
    return uuid.uuid5(_EVENT_ID_NAMESPACE, claim.idempotency_key)


def task_event(claim: Claim) -> dict[str, Any]:
    """Return the Prefect event (JSON-ready) that dispatches an event task's claim."""
    from prefect.events import Event

    event = Event(
        event=claim.event or "",
        resource={
            "prefect.resource.id": f"sched.task.{claim.name}",
            "prefect.resource.name": claim.name,
        },
        occurred=claim.scheduled_at,
        payload={
            **claim.payload,
            "scheduled_at": claim.scheduled_at.isoformat(),
            "idempotency_key": claim.idempotency_key,
        },
        id=event_id(claim),
    )
    data: dict[str, Any] = event.model_dump(mode="json")
    return data


class PrefectDispatcher:
    """Emit a ``sched.task.*`` Prefect event, or create a deployment run.

    An event task posts ``claim.event`` with resource ``sched.task.<name>``, the
    payload plus ``scheduled_at`` and ``idempotency_key``, ``occurred`` set to
    the scheduled time and an event id derived from the idempotency key, to the
    server's ``POST /api/events`` and returns once the server accepted it. It
    does not use ``prefect.events.emit_event``: that queues the event for a
    background thread and swallows every error, so a dispatch to an unreachable
    server would count as done and the event would be lost. Prefect keeps one
    event per id (its event store skips a known id, and its bus drops an id
    seen in the last 5 minutes), so a repeated dispatch stores nothing new.

    A deployment task calls ``run_deployment(name, parameters=payload,
    timeout=0, idempotency_key=...)``: a repeated key returns the same flow run.

    Without a configured Prefect API (:func:`prefect_api_url`) every dispatch
    fails with a ConfigError naming ``PREFECT_API_URL``, recorded like any
    failed dispatch, instead of going to a temporary server.
    """

    def __call__(self, claim: Claim) -> None:
        prefect_api_url()
        if claim.event:
            self._emit(claim)
        elif claim.deployment:
            self._run_deployment(claim)
        else:
            raise DispatchError(f"task {claim.name!r} has neither an event nor a deployment")

    def _emit(self, claim: Claim) -> None:
        from prefect.client.orchestration import get_client

        with naming_prefect_api(f"event {claim.event!r} of task {claim.name!r}"), \
                get_client(sync_client=True) as client:
            # The client raises on a refused connection or an error status.
            client.request("POST", "/events", json=[task_event(claim)])

    def _run_deployment(self, claim: Claim) -> None:
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        try:
            with naming_prefect_api(f"run of deployment {claim.deployment!r}"):
                run_deployment(
                    claim.deployment or "",
                    parameters=dict(claim.payload),
                    timeout=0,
                    idempotency_key=claim.idempotency_key,
                    as_subflow=False,
                )
        except ObjectNotFound:
            # Prefect's own message is "None": name what is missing, and where.
            raise DeploymentNotFound(
                f"deployment {claim.deployment!r} not found on {shown_url(prefect_api_url())} "
                "(expected <flow name>/<deployment name>, as `prefect deployment ls` shows)"
            ) from None


EVENT_GAVE_UP = "sched.task.gave-up"
"""The Prefect event sent when the scheduler stops retrying a (task, scheduled time)."""
_GAVE_UP_NAMESPACE = uuid.UUID("0b6e3c1e-7f5e-4a59-9d3a-2f4b8c1d5e60")


def emit_gave_up(claim: Claim, message: str, attempts: int) -> None:
    """Send ``sched.task.gave-up`` about claim's task to Prefect; log, never raise, on failure.

    Resource ``sched.task.<name>``; payload: the task, the scheduled time, the
    attempts, the error and what became of the task. The event id comes from
    the claim's idempotency key, so two instances giving up on the same time
    send one event. Best effort: when Prefect is what failed, the event fails
    too, and the ERROR log line (and the task's ``last_error``) remain.
    """
    try:
        prefect_api_url()
    except ConfigError as exc:
        log.warning("the gave-up event was not sent", extra={
            "task_name": claim.name, "scheduled_at": claim.scheduled_at, "error": str(exc)})
        return
    try:
        from prefect.client.orchestration import get_client
        from prefect.events import Event

        event = Event(
            event=EVENT_GAVE_UP,
            resource={"prefect.resource.id": f"sched.task.{claim.name}",
                      "prefect.resource.name": claim.name},
            payload={
                "task": claim.name, "scheduled_at": claim.scheduled_at.isoformat(),
                "attempts": attempts, "error": message,
                "next": "moves on to its next run" if claim.is_recurring else "disabled",
                "idempotency_key": claim.idempotency_key,
            },
            id=uuid.uuid5(_GAVE_UP_NAMESPACE, claim.idempotency_key),
        )
        with get_client(sync_client=True) as client:
            client.request("POST", "/events", json=[event.model_dump(mode="json")])
    except Exception as exc:
        log.error("the gave-up event was not sent", extra={
            "task_name": claim.name, "scheduled_at": claim.scheduled_at,
            "error": f"{type(exc).__name__}: {exc}"})
