"""``sched.schedules.updated``: the Prefect event a write of a node's schedules sends.

Every PUT, PATCH or DELETE of a node's row sends one event, resource
``sched.agent.<node>``, payload ``{"node", "schedule_id", "version", "op"}``;
every controller instance's relay follows it (:mod:`controller.waits`) and wakes the
node's long poll, and a node that follows Prefect's events itself sees it there, so the
node pulls within seconds, not at its next periodic pull.

Rules:

1. An event goes through Prefect's client to the server named by
   ``PREFECT_API_URL`` (:func:`controller.dispatch.prefect_api_url`), never to
   a temporary server of the client's own. Without one, nothing is sent: the
   controller says so once at start-up (a WARNING) and in every write's
   answer, and the nodes' periodic pull is the fallback.
2. A write's answer says whether the server accepted the event
   (:class:`Announced`), but never waits for it more than ``wait_s``: the
   event is posted from a small pool of sender threads, so a slow or
   unreachable server costs a write at most that long. An event still in
   flight when the answer goes is sent anyway (its outcome logged); at most
   ``max_pending`` events wait, beyond which a write's event is dropped with
   a WARNING (the periodic pull still brings the change).
3. Each event gets a fresh Prefect client (with the auth string or key and
   the TLS settings the dispatcher's would have): a client that has never
   connected fails at once on a refused connection, where a long-lived one
   retries it for about a minute, and its transport does not retry connects.
"""

from __future__ import annotations

import logging
import ssl
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from controller.logtext import printable
from controller.models import utc_now

log = logging.getLogger(__name__)

EVENT_SCHEDULES_UPDATED = "sched.schedules.updated"
"""The event every write of a node's schedules sends (flows.runtime names the same)."""

NO_PREFECT_API = (
    "the controller has no Prefect API (PREFECT_API_URL is not set), so it sends no "
    f"{EVENT_SCHEDULES_UPDATED} event: the node sees the change at its next periodic pull"
)


@dataclass(frozen=True)
class Announced:
    """What became of a write's event: accepted by the server or not, and why, in words."""

    sent: bool
    reason: str


class ScheduleEvents(Protocol):
    """Announces a write of a node's schedules (a Prefect event, or nothing)."""

    @property
    def configured(self) -> bool:
        """True when events are sent at all."""
        ...

    def announce(self, node: str, schedule_id: str, version: int | None, op: str) -> Announced:
        """Send the write's event; say whether the server accepted it (waiting a bounded time)."""
        ...

    def close(self) -> None:
        """Stop sending (what is in flight finishes)."""
        ...


class NoEvents:
    """No Prefect API: no event, and every answer says why (rule 1)."""

    configured = False

    def __init__(self, reason: str = NO_PREFECT_API) -> None:
        self.reason = reason

    def announce(self, node: str, schedule_id: str, version: int | None, op: str) -> Announced:
        return Announced(False, self.reason)

    def close(self) -> None:
        return None


def schedules_event(
    node: str, schedule_id: str, version: int | None, op: str, *, occurred: datetime
) -> dict[str, Any]:
    """Return the write's Prefect event as JSON data (a fresh id: one event per write)."""
    from prefect.events import Event

    event = Event(
        event=EVENT_SCHEDULES_UPDATED,
        resource={"prefect.resource.id": f"sched.agent.{node}", "prefect.resource.name": node},
        occurred=occurred,
        payload={"node": node, "schedule_id": schedule_id, "version": version, "op": op},
        id=uuid.uuid4(),
    )
    data: dict[str, Any] = event.model_dump(mode="json")
    return data


def tls_context() -> ssl.SSLContext:
    """Return the TLS context Prefect's own client would use (its CA file, or no checks)."""
    import certifi
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    if PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())


def _import_client() -> None:
    import prefect.client.orchestration  # noqa: F401


class PrefectEvents:
    """Send each write's event to the Prefect server at api_url (rules 2 and 3)."""

    configured = True

    def __init__(
        self, api_url: str, *, wait_s: float = 2.0, timeout_s: float = 5.0,
        max_pending: int = 200, senders: int = 2,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        from controller.dispatch import shown_url

        self.shown = shown_url(self.api_url)
        """The URL for logs and answers: without a user or password."""
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=senders, thread_name_prefix="sched-events")
        self._pending = 0
        self._lock = threading.Lock()
        self._tls = tls_context()
        # Prefect's client takes 1-3 s to import: at start, so the first write's event is not
        # late for its answer (wait_s) on a busy machine.
        self._pool.submit(_import_client)

    @classmethod
    def from_settings(cls, **kwargs: Any) -> ScheduleEvents:
        """Return events to the configured Prefect API, else :class:`NoEvents` (logged)."""
        from controller.dispatch import prefect_api_url
        from sched_core.errors import ConfigError

        try:
            url = prefect_api_url()
        except ConfigError:
            log.warning(NO_PREFECT_API + "; set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)",
                        extra={"event": EVENT_SCHEDULES_UPDATED})
            return NoEvents()
        from controller.dispatch import shown_url

        log.info("schedule writes send events to Prefect", extra={"prefect_api": shown_url(url)})
        return cls(url, **kwargs)

    def announce(self, node: str, schedule_id: str, version: int | None, op: str) -> Announced:
        event = schedules_event(node, schedule_id, version, op, occurred=utc_now())
        with self._lock:
            if self._pending >= self.max_pending:
                log.warning(
                    "schedule event dropped: too many events waiting for Prefect",
                    extra={"node": printable(node), "schedule_id": printable(schedule_id),
                           "prefect_api": self.shown,
                           "pending": self._pending},
                )
                return Announced(False, f"{self._pending} events are already waiting for "
                                        f"Prefect at {self.shown}; this one was dropped")
            self._pending += 1
        future = self._pool.submit(self._send, event)
        future.add_done_callback(self._done)
        try:
            future.result(timeout=self.wait_s)
        except FutureTimeout:
            return Announced(False, f"Prefect at {self.shown} did not accept the event within "
                                    f"{self.wait_s:g} s (it is still being sent)")
        except Exception as exc:
            return Announced(False, f"Prefect at {self.shown} refused the event: "
                                    f"{self._scrub(str(exc))}")
        return Announced(True, f"event {EVENT_SCHEDULES_UPDATED} accepted by {self.shown}")

    def send(self, event: dict[str, Any]) -> None:
        """Send one event (JSON data) now, in the calling thread; raise if not accepted.

        The fleet's alerts go this way (:mod:`controller.watch`): their sender
        retries, so nothing waits in the pool.
        """
        try:
            with self._new_client() as client:
                client.request("POST", "/events", json=[event])
        except Exception as exc:
            raise RuntimeError(f"Prefect at {self.shown} did not accept the event: "
                               f"{self._scrub(str(exc))[:300]}") from None

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._pending -= 1
        error = future.exception()
        if error is not None:
            log.warning("could not send a schedule event to Prefect",
                        extra={"prefect_api": self.shown,
                               "error": self._scrub(repr(error))[:500]})

    def _send(self, event: dict[str, Any]) -> None:
        with self._new_client() as client:
            client.request("POST", "/events", json=[event])

    def _scrub(self, text: str) -> str:
        """Return text with the API URL's user and password taken out."""
        return text.replace(self.api_url, self.shown)

    def _new_client(self) -> Any:
        """Return a fresh Prefect client (rule 3): connects are neither pooled nor retried."""
        import httpx
        from prefect.client.orchestration import SyncPrefectClient
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY

        return SyncPrefectClient(
            self.api_url,
            auth_string=PREFECT_API_AUTH_STRING.value(),
            api_key=PREFECT_API_KEY.value(),
            httpx_settings={
                "timeout": httpx.Timeout(self.timeout_s),
                "verify": self._tls,
                "transport": httpx.HTTPTransport(retries=0, verify=self._tls),
            },
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
