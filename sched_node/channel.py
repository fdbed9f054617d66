"""The node's one connection to the center, and the control checks it wakes (a thread).

Which connection (rule of :mod:`sched_node.control`): the controller's long poll when the
node pulls from a controller, else one websocket on Prefect's event stream; a node
that pulls a file also watches it (a change is pulled within :data:`FILE_WATCH_S`).
The same thread is the node as its pool's worker: a heartbeat every ``worker_heartbeat``,
a poll of its queue every ``worker_poll`` (:meth:`sched_node.control.Control.poll`), and on
a wake a poll and a look at its runs (:meth:`sched_node.control.Control.check`); a look
that finds Prefect away is tried again after :data:`CONTROL_RETRY_S`. Every reconcile looks
too (``reconcile_interval``, :mod:`sched_node.reconcile`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sched_node.control import ControllerWait, PrefectStream
from sched_node.node_report import controller_url
from sched_node.prefect_api import PrefectUnavailable
from sched_node.reconcile import FIRST_SPREAD

if TYPE_CHECKING:
    from sched_node.control import Control
    from sched_node.registration import Deployments
    from sched_node.settings import AgentSettings

log = logging.getLogger("sched_node.node")

CONTROL_RETRY_S = 5.0
"""How soon a wake for an ad hoc run or a cancel is tried again when Prefect did not answer."""
FILE_WATCH_S = 2.0
"""How often a node that pulls a file looks whether it changed."""


class NodeChannel:
    """The node's channel from the center (the module's rules)."""

    def __init__(self, settings: AgentSettings, *, control: Control, deployments: Deployments,
                 api_url: str, etag: Callable[[], str | None],
                 changed: Callable[[str], None]) -> None:
        """``etag``: the cached list's (the long poll's); ``changed``: asks for a reconcile,
        with its reason."""
        self.settings, self.node, self.control = settings, settings.node_name, control
        self.deployments, self.api_url = deployments, api_url
        self._etag, self._changed = etag, changed
        self.wait: ControllerWait | None = None
        self.stream: PrefectStream | None = None
        self._control_wake = threading.Event()
        self._stopping = threading.Event()

    def takes_start_check(self) -> bool:
        """Return whether the controller's long poll decides the start's control check
        (:class:`sched_node.control.ControllerWait`): the node pulls from a controller and
        listens; else the start's reconcile checks."""
        return bool(self.settings.listen and controller_url(self.settings, "wait"))

    def covered(self) -> bool:
        """Return whether the controller's long poll is open (it is the node's heartbeat)."""
        return bool(self.wait and self.wait.connected.is_set())

    def start(self) -> None:
        """Open the channel, watch a pull file, and start the control checks."""
        settings = self.settings
        if settings.pull_url.startswith("file://"):
            threading.Thread(target=self._watch_file, name="pull-file-watch",
                             daemon=True).start()
        url = controller_url(settings, "wait") if settings.listen else None
        if url is not None:
            self.wait = ControllerWait(
                url, token=settings.bearer_token, etag=self._etag, heartbeat=settings.heartbeat,
                on_schedules=lambda: self._changed("controller"),
                on_prefect=self.wake_control, on_unsupported=self._stream).start()
        elif settings.listen:
            self._stream()
        threading.Thread(target=self._control_main, name="control", daemon=True).start()

    def stop(self) -> None:
        """Close the channel and stop the control checks."""
        self._stopping.set()
        self._control_wake.set()
        if self.wait is not None:
            self.wait.stop()
        if self.stream is not None:
            self.stream.stop()

    def _watch_file(self) -> None:
        path = Path(urlsplit(self.settings.pull_url).path)

        def stamp() -> tuple[int, int] | None:
            try:
                info = path.stat()
            except OSError:
                return None
            return info.st_mtime_ns, info.st_size

        seen = stamp()
        while not self._stopping.wait(FILE_WATCH_S):
            now = stamp()
            if now != seen:
                seen = now
                log.info("the pull file changed: pulling now", extra={"node": self.node})
                self._changed("the pull file changed")

    def _stream(self) -> None:
        self.stream = PrefectStream(
            node=self.node, api_url=self.api_url,
            deployment_ids=lambda: list(self.deployments.get().values()),
            on_schedules=lambda: self._changed("event"),
            on_prefect=self.wake_control).start()

    def wake_control(self) -> None:
        """Ask Prefect now for ad hoc runs and cancels (a wake from the controller or Prefect)."""
        self._control_wake.set()

    def _control_main(self) -> None:
        """The node as its pool's worker: a heartbeat every ``worker_heartbeat``, a poll of its
        queue every ``worker_poll``, and a poll and a look at its runs when woken (a failed
        one is tried again after CONTROL_RETRY_S)."""
        settings = self.settings
        poll_s = settings.worker_poll.total_seconds()
        beat_s = settings.worker_heartbeat.total_seconds()
        # A restart asks Prefect nothing at once (a fleet-wide restart is every node at once):
        # the pool still counts the node as its worker and its deployments Ready for a while
        # (three heartbeats; the server's poll timeout), so the first heartbeat and poll come
        # at a random point of their interval's second half. A first start (no deployments
        # kept from an earlier one) looks at once.
        now = time.monotonic()
        kept = self.deployments.cache_path
        spread = 1.0 if kept is not None and kept.exists() else 0.0
        next_poll = now + spread * poll_s * (1 - FIRST_SPREAD * random.random())
        next_beat = now + spread * beat_s * (1 - FIRST_SPREAD * random.random())
        woken = False
        while not self._stopping.is_set():
            now = time.monotonic()
            try:
                if now >= next_beat:
                    self.control.heartbeat()
                    next_beat = now + beat_s
                if woken:
                    self.control.check()
                    next_poll = time.monotonic() + poll_s
                elif now >= next_poll:
                    self.control.poll()
                    next_poll = time.monotonic() + poll_s
                woken = False
            except PrefectUnavailable as exc:
                log.info("no look at Prefect now (trying again in %g s): %s", CONTROL_RETRY_S,
                         exc)
                next_poll = min(next_poll, time.monotonic() + CONTROL_RETRY_S)
                next_beat = min(next_beat, time.monotonic() + CONTROL_RETRY_S)
            except Exception:
                log.exception("the look at Prefect failed")
                next_poll = time.monotonic() + CONTROL_RETRY_S
            left = max(min(next_poll, next_beat) - time.monotonic(), 0.05)
            woken = self._control_wake.wait(left) or woken
            self._control_wake.clear()
