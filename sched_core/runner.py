"""The background loops behind ``Scheduler.start``: a fire loop and a pull loop.

Rules:
1. The loops only call what they are given (the scheduler's ``tick``, ``pull``
   and ``missed_run_check``, each reading the clock itself), so every decision
   stays in code that takes ``now``.
2. A loop survives any failure of one round: it logs it and goes on, so a
   node keeps firing while the controller, the disk or a fire is failing.
3. ``stop`` wakes both loops at once and waits for them; it is idempotent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from sched_core.clock import utcnow
from sched_core.errors import PullError

log = logging.getLogger(__name__)


class Runner:
    """Runs tick every fire_interval, and pull then missed_run_check every pull_interval."""

    def __init__(
        self,
        *,
        tick: Callable[[], object],
        pull: Callable[[], object],
        missed_run_check: Callable[[], object],
        fire_interval: timedelta,
        pull_interval: timedelta,
        node_name: str,
    ) -> None:
        self._tick = tick
        self._pull = pull
        self._missed_run_check = missed_run_check
        self._fire_interval = fire_interval.total_seconds()
        self._pull_interval = pull_interval.total_seconds()
        self._node = node_name
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the fire loop and the pull loop (an initial pull and missed-run check first)."""
        if self.threads:
            return
        self.stop_event.clear()
        self.threads = [
            threading.Thread(target=self._fire_loop, name="sched-fire", daemon=True),
            threading.Thread(target=self._pull_loop, name="sched-pull", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """Stop the loops and wait for them; safe to call more than once."""
        self.stop_event.set()
        for thread in self.threads:
            thread.join()
        self.threads = []

    def _fire_loop(self) -> None:
        interval = self._fire_interval
        while not self.stop_event.is_set():
            if interval == 60:
                # Tick just after each minute boundary, so a window is never late by a minute.
                now = utcnow()
                wait = 60 - (now.second + now.microsecond / 1e6) + 0.05
            else:
                wait = interval
            if self.stop_event.wait(wait):
                return
            try:
                self._tick()
            except Exception:
                log.exception("tick failed", extra={"node": self._node})

    def _pull_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._pull()
            except PullError:
                pass  # logged by pull; the cache keeps firing
            except Exception:
                log.exception("pull failed", extra={"node": self._node})
            try:
                self._missed_run_check()
            except Exception:
                log.exception("missed-run check failed", extra={"node": self._node})
            if self.stop_event.wait(self._pull_interval):
                return
