"""The node's reconcile: pull the schedule list, plan, and record what changed (a thread).

Every ``reconcile_interval``, when woken (the controller's long poll, the pull file, a
Prefect event: the first at once, a burst after it folded, at most one reconcile a
:data:`ANNOUNCED_GAP_S`) and on demand (a Run of ``reconcile/<node>``): pull with retries and
exponential backoff (a pull that still fails changes nothing: the last good list keeps
firing); wake the firing loop; plan (:mod:`sched_node.planner`) and look for ad hoc runs
(:mod:`sched_node.control`); record a ``reconcile/<node>`` run when the list changed (rows
added, removed, changed or rejected), when the plan deleted or moved runs, when the pull
failed, or into the run that asked for it. A reconcile that changed nothing records
nothing (an idle node's only cost), the one at the node's start included: a restart with
its list as cached and its plan as recorded sends no reconcile run. A first start records one
when its pull adds rows. Nothing reads these runs but people (the operator's page
and CLI read the controller's node reports); a restart shows in the node's log. A plan the
Prefect server could not take is made again every :data:`PLAN_RETRY_S`.

**A restart asks Prefect nothing** when its list, plan and deployments are as it left them (a
fleet-wide restart is every node at once): the deployments' kept ids are used unread
(:mod:`sched_node.registration`) and read back at the first periodic reconcile; the start's
control check is the controller's to ask for when its long poll carries Prefect's wakes
(:class:`sched_node.control.ControllerWait`), else the node's, at the start. The first periodic
reconcile comes at a random point of the interval's second half (:data:`FIRST_SPREAD`), so
nodes started together do not reconcile together.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sched_core import PullError
from sched_core.pull import NOT_MODIFIED
from sched_core.worker import Worker
from sched_node.identity import AGENT_TAG
from sched_node.node_report import pull_outcome
from sched_node.outbox import COMPLETED, FAILED, KIND_RECONCILE, JobSpec, job_id_for, utc_text
from sched_node.planner import PlanReport
from sched_node.prefect_api import PrefectUnavailable
from sched_node.reports import plan_lines, pull_lines

if TYPE_CHECKING:
    from sched_core import Scheduler
    from sched_core.firing import NodeView
    from sched_node.control import Control
    from sched_node.node_report import Reporter
    from sched_node.outbox import Outbox
    from sched_node.planner import Planner
    from sched_node.registration import Deployments
    from sched_node.settings import AgentSettings

log = logging.getLogger("sched_node.node")

FIRST_SPREAD = 0.5
"""The first periodic reconcile comes between (1 - this) and 1 interval after the start."""
PLAN_RETRY_S = 30.0
"""How soon a plan the Prefect server could not take is tried again."""
ENGINE_WAIT_S = 120.0
"""The longest a flow run's ask to reconcile waits for the reconcile to end."""
ANNOUNCED_GAP_S = 1.0
"""Reconciles that change announcements start (an event, the long poll, the pull file) begin
at least this far apart: the first at once, what a burst announces after it in one more."""


class Reconciler:
    """Pull and plan: every ``reconcile_interval``, when woken, on demand (a thread)."""

    def __init__(self, settings: AgentSettings, *, clock: Callable[[], datetime],
                 scheduler: Scheduler, view: Callable[[datetime], NodeView], planner: Planner,
                 deployments: Deployments, control: Control, outbox: Outbox,
                 reporter: Reporter, recorded: Callable[[], None],
                 start_checked: Callable[[], bool]) -> None:
        """``view``: the node's schedules at a time; ``recorded``: wakes the recorder after a
        reconcile run is journaled; ``start_checked``: whether the channel makes the start's
        control check (then the start's reconcile does not)."""
        self.settings, self.node, self._clock = settings, settings.node_name, clock
        self.scheduler, self.view, self.planner = scheduler, view, planner
        self.deployments, self.control, self.outbox = deployments, control, outbox
        self.reporter, self._recorded, self._start_checked = reporter, recorded, start_checked
        self.last_pull: dict[str, Any] | None = None
        """The last pull's outcome, as the node's report shows it."""
        self._worker = Worker("reconcile", self._main)
        self._reasons: list[tuple[str, str | None]] = [("start", None)]
        self._lock = threading.Lock()
        self.runs = 0
        """Reconciles begun."""
        self.finished = 0
        """Reconciles ended (recorded or not, failed or not)."""
        self.recorded = 0
        self.plan_pending = False
        """True while the last plan could not reach Prefect (planned again every PLAN_RETRY_S)."""
        self._waiters: list[tuple[threading.Event, dict[str, Any]]] = []

    def start(self) -> Reconciler:
        """Start the thread (once), and reconcile at once."""
        self._worker.start()
        self._worker.wake()
        return self

    def poke(self, reason: str, run_id: str | None = None) -> None:
        """Reconcile now (a change announced, an operator's Run)."""
        with self._lock:
            self._reasons.append((reason, run_id))
        self._worker.wake()

    def run_now(self, run_id: str | None, timeout: float = ENGINE_WAIT_S) -> dict[str, Any]:
        """Reconcile now for a flow run Prefect's engine runs (it records the run); return
        what the reconcile found once it ended (its summary and artifact)."""
        done: threading.Event = threading.Event()
        found: dict[str, Any] = {}
        with self._lock:
            self._waiters.append((done, found))
            self._reasons.append((f"asked by flow run {run_id or 'of a flow'}", None))
        self._worker.wake()
        if not done.wait(timeout):
            return {"ok": False, "node": self.node,
                    "summary": f"the reconcile did not end within {timeout:g} s"}
        return found

    def stop(self) -> None:
        """Stop the thread after the reconcile in progress."""
        self._worker.stop(None)

    def _main(self) -> None:
        interval = self.settings.reconcile_interval.total_seconds()
        # The first periodic reconcile comes at a random point of the interval's second half,
        # so a fleet started together (a fleet-wide restart) does not reconcile together
        # every interval after.
        first = interval * (1 - FIRST_SPREAD * random.random())
        began = float("-inf")
        while not self._worker.stopping.is_set():
            woken = self._worker.woken.wait(PLAN_RETRY_S if self.plan_pending
                                            else first if self.runs == 1 else interval)
            if self._worker.stopping.is_set():
                return
            with self._lock:
                announced = _announced(self._reasons)
            if announced and not self._gap_after(began):
                return
            # Cleared before the reasons are taken: what comes after is the next reconcile's;
            # what came during the gap joins this one.
            self._worker.woken.clear()
            with self._lock:
                reasons, self._reasons = self._reasons, []
            began = time.monotonic()
            try:
                if not woken and self.plan_pending:
                    self.replan()
                else:
                    self.reconcile(reasons or [("interval", None)])
            except Exception:
                log.exception("the reconcile failed; the next one tries again")

    def _gap_after(self, began: float) -> bool:
        """Wait until ANNOUNCED_GAP_S after the last reconcile began; False when stopping."""
        left = began + ANNOUNCED_GAP_S - time.monotonic()
        return left <= 0 or not self._worker.stopping.wait(left)

    def replan(self) -> None:
        """Plan again after a plan the Prefect server could not take (no pull)."""
        now = self._clock()
        try:
            report = self.planner.plan(self.view(now), now=now)
            self.control.look()
        except PrefectUnavailable:
            return
        self.plan_pending = bool(report.failed)
        if self.plan_pending:
            return
        log.info("the plan reached Prefect", extra={"node": self.node})

    def reconcile(self, reasons: list[tuple[str, str | None]]) -> None:
        """Pull, plan and record what changed (the module's Reconciler); then the node reports
        (the reporter told at the start, so a heartbeat report due meanwhile waits for it)."""
        self.reporter.expect()
        with self._lock:
            waiters, self._waiters = self._waiters, []
        found: dict[str, Any] = {"ok": False, "node": self.node,
                                 "summary": "the reconcile failed (the node's log says why)"}
        try:
            found = self._reconcile(reasons, asked=bool(waiters))
        finally:
            self.finished += 1
            self.reporter.poke()
            for done, answer in waiters:
                answer.update(found)
                done.set()

    def _reconcile(self, reasons: list[tuple[str, str | None]], *, asked: bool = False
                   ) -> dict[str, Any]:
        self.runs += 1
        now = self._clock()
        result, error = self._pull(now)
        self.last_pull = pull_outcome(now, ok=error is None, error=error,
                                    status=None if result is None
                                    else "304" if result is NOT_MODIFIED else "200")
        self.scheduler.wake()
        view = self.view(now)
        report: PlanReport | None = None
        plan_error: str | None = None
        start = any(reason == "start" for reason, _ in reasons)
        try:
            if not start and self.deployments.verify():
                self.planner.rebase()
            report = self.planner.plan(view, now=now)
            if not (start and self._start_checked()):
                self.control.look()
            self.plan_pending = bool(report.failed)
        except PrefectUnavailable as exc:
            plan_error = str(exc)
            self.plan_pending = True
        if report is not None:
            log.info("planned %d windows: %d runs created, %d deleted, %d moved, %d failed%s",
                     report.planned, len(report.created), len(report.deleted), len(report.moved),
                     len(report.failed),
                     f" (first: {report.failed[0][0]}: {report.failed[0][1]})"
                     if report.failed else "", extra={"node": self.node})
        changed = result is not None and (result.changed_anything or bool(result.rejected))
        on_demand = [run_id for _, run_id in reasons if run_id]
        recording = bool(changed or on_demand or error or (report and (report.deleted
                                                                        or report.moved)))
        # The artifact's text reads every row: made only for a record or a flow run that asked.
        summary, markdown = self._summary(now, result, error, report, plan_error, reasons,
                                          markdown=recording or asked)
        if recording:
            self._record(now, result, error, summary, markdown, on_demand, reasons)
        elif start:
            # A restart that changed nothing records nothing (module text): 6 requests and 3
            # state changes per node, 10,000 of them in a fleet-wide restart, for a run that
            # said "nothing changed". The restart shows in the node's log (this line).
            log.info("the start's reconcile changed nothing (list as cached, plan as "
                     "recorded): no reconcile run recorded", extra={"node": self.node})
        return {"ok": error is None, "node": self.node, "summary": summary, "markdown": markdown}

    def _pull(self, now: datetime) -> tuple[Any, str | None]:
        settings = self.settings
        delay = settings.pull_retry_delay.total_seconds()
        error: str | None = None
        for attempt in range(settings.pull_retries + 1):
            if attempt:
                if self._worker.stopping.wait(delay * 2 ** (attempt - 1)):
                    break
            try:
                return self.scheduler.pull(self._clock()), None
            except PullError as exc:
                error = str(exc)
        return None, error

    def _summary(self, now: datetime, result: Any, error: str | None,
                 report: PlanReport | None, plan_error: str | None,
                 reasons: list[tuple[str, str | None]], *, markdown: bool = True
                 ) -> tuple[str, str]:
        """Return a reconcile's one-line summary and its artifact's markdown ("" unless
        markdown)."""
        summary = (f"pull: {'failed: ' + error if error else 'ok'}; plan: "
                   + (f"{report.planned} windows, {len(report.created)} created, "
                      f"{len(report.deleted)} deleted" if report else f"not updated "
                                                                       f"({plan_error})"))
        if not markdown:
            return summary, ""
        cache, node = self.scheduler.snapshot(), self.node
        names = {row.id: row.name for row in cache.schedules}
        return summary, "\n".join([
            f"### Reconcile on {node} at {utc_text(now)}", "",
            f"why: {', '.join(reason for reason, _ in reasons)}", "",
            *pull_lines(result, error, names),
            *plan_lines(report, cache.schedules, now=now, tz=self.settings.tz, node=node,
                        last_fired=cache.last_fired_at, plan_error=plan_error),
        ])

    def _record(self, now: datetime, result: Any, error: str | None, summary: str,
                markdown: str, on_demand: list[str],
                reasons: list[tuple[str, str | None]]) -> None:
        node = self.node
        runs: list[str | None] = [*on_demand] or [None]
        for run_id in runs:
            stamp = now.strftime("%Y%m%dT%H%M%S%fZ")
            key = f"reconcile@{stamp}"
            spec = JobSpec(
                job_id=job_id_for(now, f"{node}:{key}:{run_id}"), kind=KIND_RECONCILE,
                node=node, schedule_id="", action="reconcile", trigger_key="reconcile",
                window=None, key=key, run_name=f"reconcile-{now.strftime('%Y%m%dT%H%MZ')}",
                idempotency_key=None if run_id else f"{node}:{key}", flow_run_id=run_id,
                planned_start=None, accepted_at=now, reason=", ".join(r for r, _ in reasons),
                tags=[AGENT_TAG, f"node:{node}", "trigger:reconcile"])
            folder = self.outbox.create(spec)
            (folder.path / "artifact.md").write_text(markdown, encoding="utf-8")
            events = []
            if result is not None and (result.changed_anything or result.rejected):
                events.append(_changed_event(node, result, now))
            folder.write_json("events.json", {"events": events})
            folder.log(now, summary)
            folder.append({"e": "end", "at": utc_text(now),
                           "state": FAILED if error else COMPLETED, "message": summary,
                           "error": error})
            self.recorded += 1
        self._recorded()


def _changed_event(node: str, result: Any, now: datetime) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid4()), "occurred": utc_text(now), "event": "sched.schedules.changed",
        "resource": {"prefect.resource.id": f"sched.agent.{node}",
                     "prefect.resource.name": node},
        "payload": {"node": node, "added": len(result.added), "removed": len(result.removed),
                    "changed": len(result.changed), "rejected": len(result.rejected),
                    "added_ids": result.added, "removed_ids": result.removed,
                    "changed_ids": result.changed,
                    "rejected_ids": [{"id": rid, "reason": reason}
                                     for rid, reason in result.rejected]},
    }


def _announced(reasons: list[tuple[str, str | None]]) -> bool:
    """Whether every reason is a change announced (no operator's Run, not the start)."""
    return bool(reasons) and all(run_id is None and reason != "start"
                                 for reason, run_id in reasons)
