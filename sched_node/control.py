"""What reaches a node from the center between its windows: changes, ad hoc runs, cancels.

The node is a worker of its work pool (:mod:`sched_node.registration`): it heartbeats to the
pool and polls its own queue (:meth:`Control.poll`, every ``worker_poll`` and when woken),
which keeps its deployments Ready. What it finds there, and what :meth:`Control.look` finds
among its deployments' runs, it takes (Pending, as a worker does) and acts on:

1. a ``run-job`` run in its queue: a job of the cached row it names, started now and
   recorded into that run;
2. a run the UI's Retry put back in AwaitingRetry: that run's job again, recorded into the
   same run;
3. a ``reconcile`` run: a reconcile now, recorded into it;
4. a ``chain`` run: run by Prefect's engine on the node's host, as a process worker would;
5. a Cancelling run: its job is stopped, or the run marked Cancelled when the node has no
   job for it.

The node's own runs (an idempotency key ``<node>:...``), runs whose job the node still has,
and runs in another queue of the pool are never taken.

The node holds at most one idle connection for its wakes: the controller's long poll
(:class:`ControllerWait`, also the node's heartbeat) when it pulls from a controller, else
one websocket on Prefect's event stream (:class:`PrefectStream`). Either only says "look":
the node then polls its queue and looks at its runs. A look also runs at every reconcile,
so a lost wake costs at most ``reconcile_interval``. At the node's start, it looks when the
controller's answer to its first wait carries a poke, says the controller follows no
Prefect events, or fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx

from sched_core.reconnect import Follower, Reconnecting
from sched_core.values import retry_after_seconds
from sched_core.worker import Worker
from sched_node.prefect_api import PAGE, PrefectApi, PrefectRefused, new_state
from sched_node.registration import CHAIN, PLANNED_QUEUE, RECONCILE, RUN_JOB, Deployments
from sched_node.vouch import Vouchers, needs, refused_state

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
DUE_AHEAD = timedelta(seconds=10)
"""An ad hoc run scheduled this soon is taken now (the UI's Run schedules it for now)."""
MAX_WAIT_S = 300.0
"""The longest a controller holds a wait (its ``timeout`` query's bound): a node whose
heartbeat is longer waits this long each time, so its wait stays a long poll."""
TRIGGER_TAGS = ("trigger:schedule", "trigger:schedule-recovery", "trigger:chain-",
                "trigger:reconcile")
"""Tags of the runs the node itself made: their events never wake it."""
RETRY = "AwaitingRetry"
NODE_RETRY = "try "
"""How the node's own AwaitingRetry states begin (``try 1 ended at ...``, record_steps)."""


@dataclass(eq=False)
class Control:
    """The node as its pool's worker: take runs from Prefect and cancels (the module's 1-5)."""

    api: PrefectApi
    deployments: Deployments
    _: KW_ONLY
    node: str
    clock: Callable[[], datetime]
    run_job: Callable[[dict[str, Any]], None]
    reconcile: Callable[[str], None]
    engine: Callable[[dict[str, Any]], None]
    cancel: Callable[[str, str], bool]
    busy: Callable[[str], bool]
    """Whether the node still has a job (or a record under way) for a flow run."""
    work_pool: str = "sched-agent"
    heartbeat_s: float = 720.0
    vouchers: Vouchers | None = None
    """With ``ad_hoc_runs = "controller"``: the runs and cancels it refuses without a voucher."""
    checks: int = field(default=0, init=False)
    polls: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def heartbeat(self) -> None:
        """Tell the pool this worker is alive (the Workers tab). Raises PrefectUnavailable."""
        self.deployments.get()  # the pool is made with them
        self.api.call(lambda c: c.send_worker_heartbeat(
            self.work_pool, self.node, heartbeat_interval_seconds=self.heartbeat_s),
            f"heartbeat to work pool {self.work_pool}")

    def poll(self) -> int:
        """Poll the node's queue as a worker (its deployments show Ready) and take what is
        due (1); return how many runs were taken. Raises PrefectUnavailable."""
        self.deployments.get()
        with self._lock:
            self.polls += 1
            now = self.clock()
            found = self.api.call(lambda c: c.get_scheduled_flow_runs_for_work_pool(
                self.work_pool, work_queue_names=[self.node],
                scheduled_before=now + DUE_AHEAD), f"poll work queue {self.node}")
            return sum(self._act(item.flow_run.model_dump(mode="json")) for item in found)

    def look(self) -> int:
        """Ask Prefect once for the node's retried and Cancelling runs, and act on each (2, 5);
        return how many. Raises PrefectUnavailable."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterExpectedStartTime,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        with self._lock:
            self.checks += 1
            ids = self.deployments.get()
            now = self.clock()
            runs = self.api.filter_runs(FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(
                    any_=[uuid.UUID(item) for item in ids.values()]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=[StateType.SCHEDULED, StateType.CANCELLING])),
                expected_start_time=FlowRunFilterExpectedStartTime(before_=now + DUE_AHEAD)),
                sort="EXPECTED_START_TIME_ASC", limit=PAGE)
            # A Scheduled run in the node's queue is the poll's; one in another queue is its
            # workers'; a planned run put back by the UI's Retry waits in the paused queue,
            # where only the node takes it.
            return sum(self._act(run) for run in runs
                       if (run.get("state") or {}).get("type") == "CANCELLING"
                       or ((run.get("state") or {}).get("name") == RETRY
                           and run.get("work_queue_name") == PLANNED_QUEUE))

    def check(self) -> int:
        """Poll and look (a wake); return how many runs were acted on."""
        return self.poll() + self.look()

    def _act(self, run: dict[str, Any]) -> int:
        by_id = {value: key for key, value in self.deployments.get().items()}
        flow = by_id.get(str(run.get("deployment_id")))
        state = run.get("state") or {}
        run_id = str(run["id"])
        if flow is None:
            return 0
        if state.get("type") == "CANCELLING":
            # A cancel of a run with no job here stops nothing: it needs no voucher.
            if self.busy(run_id) and self._refused(run, flow):
                return 1
            return self._cancelling(run)
        retried = state.get("name") == RETRY
        if self.busy(run_id) or (self._ours(run) and not retried):
            return 0  # a run the node made (its plan, its records) or whose job it has
        if self._refused(run, flow):
            return 1
        if flow == RECONCILE:
            return self._take(run, lambda item: self.reconcile(str(item["id"])))
        if flow == RUN_JOB:
            return self._take(run, self.run_job)
        if flow == CHAIN:
            return self._take(run, self.engine)
        return 0

    def _refused(self, run: dict[str, Any], flow: str) -> bool:
        """Refuse a run or cancel its controller did not vouch for (sched_node.vouch): the
        run says why (a cancel's run runs on, a Retry's goes back to its end, a run fails)."""
        need = needs(run, flow, self.node) if self.vouchers else None
        if self.vouchers is None or need is None:
            return False
        why = self.vouchers.refusal(need[0], purpose=need[1], subject=need[2])
        if why is None:
            return False
        run_id = str(run["id"])
        kind, name, message = refused_state(run, why, lambda: self.api.call(
            lambda c: [item.model_dump(mode="json")
                       for item in c.read_flow_run_states(uuid.UUID(run_id))],
            f"read the states of flow run {run_id}"))
        self.api.set_state(run_id, new_state(kind, name=name, message=message), force=True)
        log.warning("refused run %s (%s): %s", run.get("name"), run_id, why,
                    extra={"node": self.node, "flow_run_id": run_id})
        return True

    def _ours(self, run: dict[str, Any]) -> bool:
        """Return whether the node made the run (its idempotency key is ``<node>:...``)."""
        return str(run.get("idempotency_key") or "").startswith(f"{self.node}:")

    def _take(self, run: dict[str, Any], act: Callable[[dict[str, Any]], None]) -> int:
        """Claim a Scheduled run for this node (Pending, as a worker does), then act on it."""
        status = self.api.set_state(str(run["id"]), new_state(
            "PENDING", message=f"taken by node {self.node} (a worker of {self.work_pool})"),
            force=False)
        if status != "ACCEPT":
            return 0  # someone else moved it meanwhile (another worker, an operator's cancel)
        log.info("taking run %s (%s) from Prefect", run.get("name"), run.get("id"),
                 extra={"node": self.node, "flow_run_id": str(run.get("id"))})
        act(run)
        return 1

    def _cancelling(self, run: dict[str, Any]) -> int:
        run_id = str(run["id"])
        message = (run.get("state") or {}).get("message") or "cancelled from Prefect"
        if self.cancel(run_id, f"cancelled from Prefect: {message}"):
            return 1
        if self.busy(run_id):
            return 0  # an engine's run: its worker (or the node's engine) ends it
        try:  # no job of this node runs it: end it so it does not stay Cancelling
            self.api.set_state(run_id, new_state(
                "CANCELLED", message=f"node {self.node} has no job running for this run"),
                force=True)
        except PrefectRefused as exc:
            log.warning("could not end cancelling run %s: %s", run_id, exc)
        return 1


class ControllerWait:
    """The long poll on the controller (the module's first way), in a thread.

    ``etag()`` gives the node's cached list's ETag; ``on_schedules()`` and
    ``on_prefect()`` are told what changed. ``supported`` turns False when the
    controller has no ``wait`` (404): the node then uses :class:`PrefectStream`.
    """

    def __init__(self, url: str, *, token: Callable[[], str | None],
                 etag: Callable[[], str | None], heartbeat: timedelta,
                 on_schedules: Callable[[], None], on_prefect: Callable[[], None],
                 on_unsupported: Callable[[], None]) -> None:
        """``on_unsupported()`` is called once when the controller cannot carry Prefect's
        wakes: it has no wait endpoint, or its answers say it follows no Prefect events."""
        self.url = url
        self._token = token
        self._etag = etag
        self.heartbeat = heartbeat
        self._on_schedules = on_schedules
        self._on_prefect = on_prefect
        self._on_unsupported = on_unsupported
        self._worker = Worker("controller-wait", self._main)
        self.supported = True
        self._told = False
        self.relay = False
        """True when the controller said it follows Prefect for the node."""
        self.answers = 0
        self.connected = threading.Event()
        self._start_owed = True

    def start(self) -> ControllerWait:
        """Start the thread (once); return self."""
        self._worker.start()
        return self

    def stop(self) -> None:
        """Stop polling (an open poll ends at its timeout; the thread is a daemon)."""
        self._worker.stop(None)

    def _start_check(self) -> None:
        """Ask for the start's control check once (the module's "At the node's start")."""
        if self._start_owed:
            self._start_owed = False
            self._on_prefect()

    def _main(self) -> None:
        seen = told = ""
        backoff = BACKOFF_MIN_S
        wait_s = min(self.heartbeat.total_seconds(), MAX_WAIT_S)
        with httpx.Client(timeout=wait_s + 15) as client:
            while not self._worker.stopping.is_set():
                token = self._token()
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                # Told of a version its cache has not reached yet (the pull is under way, or
                # failed and is retried at the next answer), the node waits on that version:
                # its old one would be answered "changed" at once, again and again.
                params = {"etag": told or self._etag() or "", "seen": seen,
                          "timeout": f"{wait_s:g}"}
                try:
                    response = client.get(self.url, params=params, headers=headers)
                except httpx.HTTPError as exc:
                    log.debug("controller wait failed: %r", exc)
                    backoff = self._back_off(backoff)
                    continue
                if response.status_code in (404, 405):
                    self._no_wait_endpoint()
                    return
                if response.status_code != 200:
                    log.warning("the controller refused the wait (%d): %s",
                                response.status_code, response.text[:300])
                    backoff = self._back_off(backoff, retry_after_seconds(
                        response.headers.get("retry-after"), most=BACKOFF_MAX_S))
                    continue
                data = _json_object(response)
                if data is None:
                    log.warning("the controller's wait answer is not a JSON object: %r",
                                response.text[:300])
                    backoff = self._back_off(backoff)
                    continue
                backoff = BACKOFF_MIN_S
                told, seen = self._answered(data, told, seen)

    def _back_off(self, backoff: float, asked: float | None = None) -> float:
        """After a failed wait: not connected, the start's check owed, a pause (the longer of
        backoff and what the controller asked, ``Retry-After``); the next pause."""
        self.connected.clear()
        self._start_check()
        self._worker.stopping.wait(max(backoff, asked or 0.0))
        return min(backoff * 2, BACKOFF_MAX_S)

    def _no_wait_endpoint(self) -> None:
        log.info("the controller has no wait endpoint; following Prefect's events instead",
                 extra={"url": self.url})
        self.supported = False
        self._start_check()
        if not self._told:
            self._told = True
            self._on_unsupported()

    def _answered(self, data: dict[str, object], told: str, seen: str) -> tuple[str, str]:
        """Act on a wait's answer; return the version the node was told of, and ``prefect``."""
        self.connected.set()
        self.answers += 1
        self.relay = bool(data.get("relay"))
        if not self.relay and not self._told:
            self._told = True
            log.info("the controller follows no Prefect events; following them from "
                     "the node", extra={"url": self.url})
            self._on_unsupported()
        etag = str(data.get("etag") or "")
        told = etag if etag not in ("", self._etag() or "") else ""
        if told:
            self._on_schedules()
        prefect = str(data.get("prefect") or "")
        if not self.relay or (not seen and poked(prefect)):
            self._start_check()
        self._start_owed = False
        if prefect and newer(prefect, seen):
            if seen:
                self._on_prefect()
            seen = prefect
        return told, seen


def _json_object(response: httpx.Response) -> dict[str, object] | None:
    """Return an answer's JSON object, or None for anything else (a proxy's page, a list)."""
    try:
        data = response.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def poked(token: str) -> bool:
    """Return whether a wait's ``prefect`` counter says the controller was woken for the node
    (not ``0``); an older controller's ``<epoch>:<count>``, whether its count is not 0, and a
    counter of another form, yes (the node looks rather than miss a run)."""
    count = token.rpartition(":")[2]
    return not count.isdigit() or int(count) > 0


def newer(token: str, seen: str) -> bool:
    """Return whether a wait's ``prefect`` counter is newer than ``seen``: the newest event's
    time, so that an instance that missed an event does not take the node back to it; two
    counters of another form (an older controller's) are newer when they differ."""
    if token.isdigit() and seen.isdigit():
        return int(token) > int(seen)
    return token != seen


class PrefectStream(Follower):
    """One websocket on Prefect's event stream, filtered to the node (the module's second way)."""

    def __init__(self, *, node: str, api_url: str, deployment_ids: Callable[[], list[str]],
                 on_schedules: Callable[[], None], on_prefect: Callable[[], None]) -> None:
        self.node = node
        self.api_url = api_url
        self._deployment_ids = deployment_ids
        self._on_schedules = on_schedules
        self._on_prefect = on_prefect
        self._thread = Reconnecting("prefect-stream", self._connect, self._lost)
        self.connected = threading.Event()
        self.events = 0

    def _lost(self, exc: BaseException, wait_s: float) -> None:
        self.connected.clear()
        log.info("no Prefect event stream (%s: %s); trying again in %.0f s",
                 type(exc).__name__, str(exc)[:200], wait_s, extra={"node": self.node})

    async def _connect(self) -> None:
        await self._follow(await asyncio.to_thread(self._deployment_ids))

    async def _follow(self, deployment_ids: list[str]) -> None:
        from prefect.events.clients import PrefectEventSubscriber
        from prefect.events.filters import (
            EventAnyResourceFilter,
            EventFilter,
            EventNameFilter,
        )

        event_filter = EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.Scheduled",
                                        "prefect.flow-run.Cancelling",
                                        "prefect.flow-run.AwaitingRetry",
                                        "sched.schedules.updated"]),
            any_resource=EventAnyResourceFilter(id=[
                f"sched.agent.{self.node}",
                *(f"prefect.deployment.{item}" for item in deployment_ids)]),
        )
        async with PrefectEventSubscriber(api_url=self.api_url, filter=event_filter,
                                          reconnection_attempts=2,
                                          reconnect_on_clean_close=True) as subscriber:
            self.connected.set()
            log.info("following Prefect's events for node %s", self.node,
                     extra={"node": self.node})
            async for event in subscriber:
                self.events += 1
                if event.event == "sched.schedules.updated":
                    self._on_schedules()
                    continue
                if event.event == "prefect.flow-run.AwaitingRetry":
                    state = (event.payload or {}).get("validated_state") or {}
                    if str(state.get("message") or "").startswith(NODE_RETRY):
                        continue  # the node's own retry between two tries
                    self._on_prefect()
                    continue
                tags = [item.id.removeprefix("prefect.tag.") for item in event.related
                        if item.role == "tag"]
                if any(tag.startswith(TRIGGER_TAGS) for tag in tags):
                    continue  # a run the node made itself
                self._on_prefect()
