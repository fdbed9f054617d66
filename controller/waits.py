"""Nodes' long polls: wake a node when its schedules change or Prefect has a run for it.

Each node holds one long poll, ``GET /api/nodes/<node>/wait`` (:mod:`controller.api.wait`),
answered when there is something for the node, so a node needs no connection of its own to
the Prefect server between its windows.

Rules:

1. A write of a node's schedules through this process wakes its waits at once
   (:meth:`NodeWaits.poke` with ``schedules``); a write through another instance reaches
   this one as the write's Prefect event, or when the wait times out.
2. The relay (:class:`PrefectRelay`) follows Prefect's event stream once for the whole
   fleet and pokes ``prefect`` for a run of the node's deployments created, retried
   (AwaitingRetry) or asked to cancel, leaving out the node's own runs (a ``trigger:`` tag)
   and its own retries.
3. A wait's answer carries the node's counter: the time of the newest ``prefect`` poke this
   process saw for it (microseconds, ``0`` for none). Every instance follows the same
   events, so every instance gives a node the same counter. A wait whose ``seen`` is older
   is answered at once; a first wait (no ``seen``) is answered at once when the counter is
   not 0, so a node back from a restart looks for the runs made while it was away.
4. The waits live in this process's event loop; pokes come from any thread.
5. A wait reads its node's ETag when it starts and when it answers; the reads asked for
   within :data:`ETAG_READ_WINDOW_S` of each other are one statement (:class:`EtagReads`),
   each of the database as it is then.
6. One wait per (node, holder): a new wait answers the one it replaces at once, so one token
   cannot hold more than one connection waiting. The node's token and the admin's are two
   holders.
7. A (node, holder) replaces its wait at most :data:`REPLACE_BURST` times at once and one more
   every :data:`REPLACE_EVERY_S` (a node restarted or reconnected replaces its dead wait once);
   past that, a new wait is refused at once (``429``, :meth:`NodeWaits.refused_s`) and the held
   one stays, so one token sent in a loop costs a refusal per request, not a replacement, an
   ETag read and a heartbeat record each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from starlette.concurrency import run_in_threadpool

from controller.rate import Buckets
from sched_core.reconnect import Follower, Reconnecting

log = logging.getLogger(__name__)

REPLACE_BURST = 10
"""Replacements of a held wait one (node, holder) may make at once (rule 7)."""
REPLACE_EVERY_S = 6.0
"""One more replacement is allowed every this many seconds, up to REPLACE_BURST (rule 7)."""
MAX_BUCKETS = 100_000
"""Replacement budgets kept at most (the least recently used forgotten first)."""

NODE_TRIGGERS = ("trigger:schedule", "trigger:schedule-recovery", "trigger:chain-",
                 "trigger:reconcile")
"""Tags of the runs a node makes itself (rule 2): their events wake nobody."""
NODE_FLOWS = frozenset({"run-job", "reconcile", "chain"})
NODE_RETRY = "try "
"""How the node's own AwaitingRetry states begin (``try 1 ended at ...``): its retries between
two tries wake nobody; the UI's Retry ("Retry from the UI") wakes the node."""
WAKING_EVENTS = ("prefect.flow-run.Scheduled", "prefect.flow-run.Cancelling",
                 "prefect.flow-run.AwaitingRetry", "sched.schedules.updated")
"""The events the relay follows (rule 2)."""


class NodeWaits:
    """The nodes' waits in this process (the module's rules 1, 3 and 4)."""

    def __init__(self) -> None:
        self.relay = False
        """True while the Prefect relay follows the event stream (a wait's answer says it)."""
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}
        """Per node, the newest Prefect event's time (µs since the epoch) that poked it."""
        self._waits: dict[str, set[_Wait]] = {}
        """The waits held per node (each set in the loop only)."""
        self._held: dict[tuple[str, str], _Wait] = {}
        """Per (node, holder), its held wait (rule 6)."""
        self.replaced = 0
        self._budget = Buckets(REPLACE_BURST, REPLACE_EVERY_S, max_keys=MAX_BUCKETS)
        """Per (node, holder), its replacements (rule 7)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.waiting = 0
        self.pokes = 0

    def close(self) -> None:
        """Answer every wait now and every later one at once (the server is stopping)."""
        self.closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._release_all)
            except RuntimeError:
                pass

    def _release_all(self) -> None:
        for node in list(self._waits):
            self._release(node)

    def token(self, node: str) -> str:
        """Return the node's Prefect counter as a wait's answer gives it (rule 3)."""
        with self._lock:
            return str(self._newest.get(node, 0))

    def newer(self, node: str, seen: str) -> bool:
        """Return whether this process knows of a poke of node newer than ``seen`` (a wait's
        counter; one of another form, an older controller's, is taken as older)."""
        with self._lock:
            newest = self._newest.get(node, 0)
        return not seen.isdigit() or newest > int(seen)

    def holds(self, node: str) -> bool:
        """Return whether a wait of node is held in this process now (a write answers it)."""
        return bool(self._waits.get(node))

    def poked(self, node: str) -> bool:
        """Return whether this process saw a Prefect event for node since it started."""
        with self._lock:
            return node in self._newest

    def poke(self, node: str, kind: str, at: datetime | None = None) -> None:
        """Wake node's waits; kind ``prefect`` also moves its counter to at (its event's
        time; now when None or later: an event dated in the future, which anyone with the
        Prefect API can post, would hold the counter there and every genuine event after it
        would wake nobody) if that is newer (any thread)."""
        with self._lock:
            if kind == "prefect":
                now = datetime.now(UTC)
                micros = int(min(at or now, now).timestamp() * 1_000_000)
                self._newest[node] = max(self._newest.get(node, 0), micros)
            self.pokes += 1
            loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._release, node)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass

    def _release(self, node: str, why: str = "poked") -> None:
        for held in self._waits.pop(node, ()):
            held.answer(why)

    def refused_s(self, node: str, holder: str) -> int:
        """Return 0 when a new wait of (node, holder) may be held now, else the seconds until
        it may (rule 7: it would replace a held one past the budget)."""
        if (node, holder) not in self._held:
            return 0
        return self._budget.wait_s((node, holder))

    async def wait(self, node: str, timeout: float, *, holder: str | None = None) -> str:
        """Wait for a poke of node, at most timeout s: ``poked``, ``timeout`` or ``replaced``.

        Rule 6: one held wait per (node, holder); a new one answers the one it
        replaces at once (``replaced``). None holds nothing (never replaced).
        """
        self._loop = asyncio.get_running_loop()
        if self.closed:
            return "timeout"
        mine = _Wait()
        self._waits.setdefault(node, set()).add(mine)
        if holder is not None:
            older = self._held.get((node, holder))
            if older is not None:
                self.replaced += 1
                self._budget.take((node, holder))
                older.answer("replaced")
            self._held[(node, holder)] = mine
        self.waiting += 1
        try:
            await asyncio.wait_for(mine.event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self.waiting -= 1
            if holder is not None and self._held.get((node, holder)) is mine:
                del self._held[(node, holder)]
            held = self._waits.get(node)
            if held is not None:
                held.discard(mine)
                if not held:
                    del self._waits[node]
        return mine.why


class _Wait:
    """One held wait: set once, with why (``poked`` or ``replaced``)."""

    __slots__ = ("event", "why")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.why = "timeout"

    def answer(self, why: str) -> None:
        if not self.event.is_set():
            self.why = why
            self.event.set()


ETAG_READ_WINDOW_S = 0.02
"""How long a wait's ETag read waits for others to read with (rule 5)."""
ETAG_READ_MAX = 500
"""The most nodes one ETag read asks for; a batch this full is read at once."""


class EtagReads:
    """The nodes' waits' ETag reads, many nodes in one statement (the module's rule 5).

    ``read_many(nodes)`` returns each node's ETag (every node asked for) and
    runs in a worker thread; :meth:`etag` is awaited in the event loop. A
    failed read fails every wait of its batch with its error (the API answers
    each one as it would its own failed read).
    """

    def __init__(self, read_many: Callable[[list[str]], dict[str, str]], *,
                 window: float = ETAG_READ_WINDOW_S, max_batch: int = ETAG_READ_MAX) -> None:
        self.read_many = read_many
        self.window = window
        self.max_batch = max_batch
        self._pending: dict[str, list[asyncio.Future[str]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._reads: set[asyncio.Task[None]] = set()
        self.reads = 0
        """Statements run (a batch each); with ``nodes_read``, what the batching saves."""
        self.nodes_read = 0

    async def etag(self, node: str) -> str:
        """Return node's list ETag as the database has it now (at most ``window`` s from now)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        self._pending.setdefault(node, []).append(future)
        if len(self._pending) >= self.max_batch:
            self._start()
        elif self._timer is None:
            self._timer = loop.call_later(self.window, self._start)
        return await future

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, {}
        if batch:
            task = asyncio.get_running_loop().create_task(self._read(batch))
            self._reads.add(task)
            task.add_done_callback(self._reads.discard)

    async def _read(self, batch: dict[str, list[asyncio.Future[str]]]) -> None:
        self.reads += 1
        self.nodes_read += len(batch)
        try:
            found = await run_in_threadpool(self.read_many, list(batch))
        except Exception as exc:  # every wait of the batch answers the error
            for futures in batch.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        for node, futures in batch.items():
            value = found.get(node)
            for future in futures:
                if future.done():  # a wait whose client went away is cancelled
                    continue
                if value is None:
                    future.set_exception(LookupError(f"no ETag read for node {node!r}"))
                else:
                    future.set_result(value)


def node_of(event: Any) -> tuple[str, str] | None:
    """Return (node, kind) a Prefect event wakes, or None (rule 2; pure over the event);
    the poke's time is the event's ``occurred``."""
    name = str(getattr(event, "event", ""))
    if name == "sched.schedules.updated":
        node = event.resource.get("prefect.resource.name") or str(event.resource.id).removeprefix(
            "sched.agent.")
        return (str(node), "schedules") if node else None
    flow = deployment = None
    tags: list[str] = []
    for related in event.related:
        role = related.role
        if role == "flow":
            flow = related.get("prefect.resource.name")
        elif role == "deployment":
            deployment = related.get("prefect.resource.name")
        elif role == "tag":
            tags.append(str(related.id).removeprefix("prefect.tag."))
    if flow not in NODE_FLOWS or not deployment:
        return None
    if name == "prefect.flow-run.Scheduled" and any(tag.startswith(NODE_TRIGGERS) for tag in tags):
        return None  # a run the node made (its plan, its records)
    if name == "prefect.flow-run.AwaitingRetry" and _state_message(event).startswith(NODE_RETRY):
        return None  # the node's own retry between two tries of a job
    return str(deployment), "prefect"


def _state_message(event: Any) -> str:
    """Return the message of the state a flow-run event reports ("" when none)."""
    payload = getattr(event, "payload", None) or {}
    state = payload.get("validated_state") if isinstance(payload, dict) else None
    return str((state or {}).get("message") or "") if isinstance(state, dict) else ""


class PrefectRelay(Follower):
    """Follow Prefect's event stream for the whole fleet and poke the nodes' waits (rule 2)."""

    def __init__(self, waits: NodeWaits, api_url: str) -> None:
        self.waits = waits
        self.api_url = api_url
        self._thread = Reconnecting("prefect-relay", self._follow, self._lost)
        self.events = 0

    def _lost(self, exc: BaseException, wait_s: float) -> None:
        self.waits.relay = False
        log.warning("no Prefect event stream for the nodes' waits (%s: %s); trying again in "
                    "%.0f s", type(exc).__name__, str(exc)[:200], wait_s)

    async def _follow(self) -> None:
        from prefect.events.clients import PrefectEventSubscriber
        from prefect.events.filters import EventFilter, EventNameFilter

        event_filter = EventFilter(event=EventNameFilter(name=list(WAKING_EVENTS)))
        async with PrefectEventSubscriber(api_url=self.api_url, filter=event_filter,
                                          reconnection_attempts=2,
                                          reconnect_on_clean_close=True) as subscriber:
            self.waits.relay = True
            log.info("following Prefect's events for the nodes' waits")
            async for event in subscriber:
                self.events += 1
                found = node_of(event)
                if found is not None:
                    occurred = getattr(event, "occurred", None)
                    self.waits.poke(*found, at=occurred if isinstance(occurred, datetime)
                                    else None)
