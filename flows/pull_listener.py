"""Pull at once when the controller announces a change: the serve process's warm listener.

The controller emits ``sched.schedules.updated`` (resource ``sched.agent.<node>``)
on every write of a node's schedules. The reconcile deployment's trigger turns
that event into a reconcile run, which starts at the serve process's next poll
in a fresh process: 5-30 s (``bench/bench_propagation.py``). The listener
is the short path: a thread of the serve process subscribed to the node's own
events over Prefect's event stream (a websocket), which pulls into the node's
cache as soon as the event arrives, in this already warm process.

1. The pull is the kit's (:meth:`sched_core.Scheduler.pull`): conditional (an
   unchanged list is a 304), atomic, under the cache's lock, so it never races
   the reconcile run's own pull. The start guard reads the cache when a run
   starts, so a pause, an edit or a removal applies from then on.
2. Planning stays with the triggered reconcile run (new windows get their
   runs there, seconds later), which also keeps a node served by a worker
   (``prefect.yaml``, no listener) correct: the listener only makes it sooner.
3. Events that arrive during a pull are folded into one more pull after it.
4. A lost stream (Prefect server down) is retried with a capped backoff
   (1 s doubling to 30 s), forever; Prefect's subscriber also replays the
   minute before each reconnect, so a change sent while it was away is
   pulled on its return. A failed pull is logged; the next event or the
   periodic reconcile pulls again.
5. A pull that changed the list emits ``sched.schedules.changed`` (as the
   reconcile does), with ``"by": "listener"``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from flows.runtime import (
    EVENT_SCHEDULES_CHANGED,
    EVENT_SCHEDULES_UPDATED,
    emit,
    keep_runless_logs_local,
    wall_clock,
)
from flows.settings import AgentSettings
from sched_core import PullResult

log = logging.getLogger("flows.pull_listener")

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
STEADY_AFTER_S = 60.0
"""A stream that stayed up this long before it was lost starts the backoff over."""


def pull_now(settings: AgentSettings) -> PullResult:
    """Pull the node's schedule list into its cache once; raise PullError on failure."""
    from flows.dispatch import pulling_scheduler

    now = wall_clock()
    with pulling_scheduler(settings, now=now) as scheduler:
        return scheduler.pull(now)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


def changed_payload(node: str, result: PullResult) -> dict[str, Any]:
    """Return the ``sched.schedules.changed`` payload of a listener's pull."""
    return {
        "node": node,
        "by": "listener",
        "added": len(result.added),
        "removed": len(result.removed),
        "changed": len(result.changed),
        "rejected": len(result.rejected),
        "added_ids": result.added,
        "removed_ids": result.removed,
        "changed_ids": result.changed,
        "rejected_ids": [{"id": rid, "reason": reason} for rid, reason in result.rejected],
    }


class PullListener:
    """A daemon thread that pulls the node's schedules on each of its ``sched.schedules.updated``.

    ``pull`` is injectable for tests of the loop; ``api_url`` defaults to
    ``PREFECT_API_URL``.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        pull: Callable[[AgentSettings], PullResult] = pull_now,
        api_url: str | None = None,
    ) -> None:
        self.settings = settings
        self.node = settings.node_name
        self._pull = pull
        self._api_url = api_url
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self.connected = threading.Event()
        """Set while the stream is up (for tests and the log)."""
        self.pulls = 0
        """Pulls done (for tests and the log)."""

    def start(self) -> PullListener:
        """Start the thread (once); return self."""
        if self._thread is None:
            keep_runless_logs_local()  # its lines belong to no flow run
            self._thread = threading.Thread(
                target=self._main, name=f"pull-listener-{self.node}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait for it (an open stream is closed)."""
        self._stopping.set()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:  # the tasks are the loop's own: cancel them from its thread
                loop.call_soon_threadsafe(_cancel_all, loop)
            except RuntimeError:  # closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._run())
        except asyncio.CancelledError:
            pass
        finally:
            loop.close()

    async def _run(self) -> None:
        wanted = asyncio.Event()
        puller = asyncio.create_task(self._pulls(wanted))
        try:
            await self._listen(wanted)
        finally:
            puller.cancel()

    async def _listen(self, wanted: asyncio.Event) -> None:
        """Follow the node's events forever, reconnecting with a capped backoff."""
        from prefect.events.clients import PrefectEventSubscriber
        from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

        loop = asyncio.get_running_loop()
        backoff = BACKOFF_MIN_S
        while not self._stopping.is_set():
            started = loop.time()
            event_filter = EventFilter(
                event=EventNameFilter(name=[EVENT_SCHEDULES_UPDATED]),
                resource=EventResourceFilter(id=[f"sched.agent.{self.node}"]),
            )
            try:
                async with PrefectEventSubscriber(
                    api_url=self._api_url, filter=event_filter, reconnection_attempts=2,
                    reconnect_on_clean_close=True,
                ) as subscriber:
                    self.connected.set()
                    log.info("listening for the controller's changes to %s's schedules",
                             self.node, extra={"node": self.node})
                    async for event in subscriber:
                        log.info("the controller changed %s's schedules: pulling now",
                                 self.node, extra={"node": self.node, "event_id": str(event.id)})
                        wanted.set()
                raise ConnectionError("the event stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected.clear()
                if loop.time() - started > STEADY_AFTER_S:
                    backoff = BACKOFF_MIN_S
                log.warning(
                    "lost the event stream (%s: %s); the next reconcile still pulls; "
                    "listening again in %.0f s", type(exc).__name__, str(exc)[:300], backoff,
                    extra={"node": self.node, "error": repr(exc)[:300]})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _pulls(self, wanted: asyncio.Event) -> None:
        """Pull once per burst of events: those arriving during a pull give one more."""
        while True:
            await wanted.wait()
            wanted.clear()
            try:
                result = await asyncio.to_thread(self._pull, self.settings)
            except Exception as exc:  # PullError or worse: the cache stays as it was
                log.warning("the pull on the controller's change failed (the next event or "
                            "reconcile pulls again): %s", str(exc)[:500],
                            extra={"node": self.node, "error": repr(exc)[:300]})
                continue
            self.pulls += 1
            log.info("pulled on the controller's change: %d added, %d removed, %d changed, "
                     "%d rejected", len(result.added), len(result.removed),
                     len(result.changed), len(result.rejected), extra={"node": self.node})
            if result.changed_anything or result.rejected:
                try:
                    emit(EVENT_SCHEDULES_CHANGED, self.node, changed_payload(self.node, result))
                except Exception as exc:  # the cache is written; the event is best effort
                    log.warning("could not emit %s: %r", EVENT_SCHEDULES_CHANGED, exc,
                                extra={"node": self.node})
