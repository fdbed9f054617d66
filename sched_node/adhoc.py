"""What the node does with the runs Prefect asks of it (:mod:`sched_node.control` takes them).

1. A ``run-job`` run (a Run, ``run_deployment``, ``sched run``): the cached row its
   parameter ``schedule_id`` names becomes a job now (trigger ``manual``), recorded into that
   run. Its parameters name a row and nothing else: never a window, a trigger or a clock
   (anyone with the Prefect API sets them); a row the node does not have fails the run,
   naming the rows it has.
2. A run the UI's Retry put back (AwaitingRetry): the same, into the same run, which keeps
   its name and tags (trigger ``retry``); Prefect counts the try (its run count).
3. A ``reconcile`` run: a reconcile now, recorded into it.
4. A ``chain`` run: to Prefect's engine on this host (:mod:`sched_node.engine`).
5. A cancel: the job of the run is stopped, or its engine process.

An ad hoc or retried job neither arms nor uses up the day's chain (:mod:`sched_node.chain`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sched_core.model import LocalSchedule
from sched_node.engine import EngineRuns
from sched_node.outbox import FAILED, JobFolder, JobSpec, Outbox

log = logging.getLogger(__name__)

MANUAL = "manual"
RETRY = "retry"
AD_HOC = frozenset({MANUAL, RETRY})
"""The triggers of jobs Prefect asked for (never the wave's, never the chain's)."""


class AdHoc:
    """The node's hands for Prefect's runs (the module's rules)."""

    def __init__(self, *, node: str, outbox: Outbox, clock: Callable[[], datetime],
                 row: Callable[[str], LocalSchedule | None], known: Callable[[], list[str]],
                 spec: Callable[..., JobSpec],
                 start: Callable[[LocalSchedule, JobSpec, list[str]], JobFolder],
                 fail: Callable[..., JobFolder], cancel_job: Callable[[str, str], bool],
                 reconcile: Callable[[str], None], engine: EngineRuns) -> None:
        self.node = node
        self.outbox = outbox
        self._clock = clock
        self._row = row
        self._known = known
        self._spec = spec
        self._start = start
        self._fail = fail
        self._cancel_job = cancel_job
        self._reconcile = reconcile
        self.engine = engine

    def run_job(self, run: dict[str, Any]) -> None:
        """Rules 1 and 2: the cached row the run names, now, into the run."""
        now = self._clock()
        run_id = str(run["id"])
        retried = (run.get("state") or {}).get("name") == "AwaitingRetry"
        trigger = RETRY if retried else MANUAL
        schedule_id = (run.get("parameters") or {}).get("schedule_id")
        row = self._row(schedule_id) if isinstance(schedule_id, str) else None
        name = str(run.get("name") or run_id)
        keep = {"run_name": name} if retried else {}
        if row is None:
            known = ", ".join(sorted(self._known())) or "none"
            message = (f"no schedule {schedule_id!r} in this node's cache (known: {known})"
                       if schedule_id else "run-job needs a schedule_id (the cached schedule "
                                           "to run)")
            placeholder = LocalSchedule.model_validate({
                "id": "unknown", "name": "unknown", "repo_id": "", "action": "job",
                "schedule": {"days": ["*"], "hours": ["*"], "minute": "0"},
                "miss_policy": "skip", "enabled": True, "version": 0})
            spec = self._spec(placeholder, trigger=trigger, window=None,
                              key=f"unknown@{trigger}@{run_id}", start=None, reason=message,
                              now=now, flow_run_id=run_id, run_name=name)
            self._fail(spec, FAILED, message, error=message)
            return
        # A retry's key (and so its job's folder) differs from the run's earlier job's.
        key = f"{row.id}@{trigger}@{run_id}" + (f"@{now:%Y%m%dT%H%M%S}" if retried else "")
        spec = self._spec(row, trigger=trigger, window=None, key=key, start=None,
                          reason=(f"the UI's Retry of {name}" if retried
                                  else f"ad hoc run {name} from Prefect"),
                          now=now, flow_run_id=run_id, **keep)
        if retried:
            spec = JobSpec(**{**spec.__dict__, "tags": [str(tag) for tag in run.get("tags")
                                                        or spec.tags]})
        self._start(row, spec, [f"{'retry' if retried else 'ad hoc run'} {name} ({run_id}) "
                                "taken by the node"])

    def reconcile(self, run_id: str) -> None:
        """Rule 3."""
        self._reconcile(run_id)

    def chain(self, run: dict[str, Any]) -> None:
        """Rule 4."""
        self.engine.start(str(run["id"]), str(run.get("name") or run["id"]))

    def cancel(self, run_id: str, message: str) -> bool:
        """Rule 5: stop the run's job or engine process; False when the node has neither."""
        return self._cancel_job(run_id, message) or self.engine.cancel(run_id)

    def busy(self, run_id: str) -> bool:
        """Return whether the node has a job of run_id whose record is not complete, or
        runs it through its engine."""
        if self.engine.running(run_id):
            return True
        for folder in self.outbox.jobs():
            record = folder.read_json("record.json") or {}
            try:
                mine = folder.spec().flow_run_id == run_id
            except ValueError:
                continue
            if (mine or record.get("flow_run_id") == run_id) and not record.get("complete"):
                return True
        return False
