"""Dispatchers: how the central scheduler hands one claimed (task, scheduled time) on.

A dispatcher (:class:`TaskDispatcher`) is any callable taking a
:class:`controller.claims.Claim`; it
returns normally when the hand-over succeeded and raises on failure (the
scheduler then records the error and retries after a delay). Every dispatch
carries the claim's idempotency key, ``"<task>:<scheduled time>"``, so a
retry after a crash cannot start the same job twice.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Protocol

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

        with get_client(sync_client=True) as client:
            # The client raises on a refused connection or an error status.
            client.request("POST", "/events", json=[task_event(claim)])

    def _run_deployment(self, claim: Claim) -> None:
        from prefect.deployments import run_deployment
        from prefect.exceptions import ObjectNotFound

        try:
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
                f"deployment {claim.deployment!r} not found on {prefect_api_url()} "
                "(expected <flow name>/<deployment name>, as `prefect deployment ls` shows)"
            ) from None
