"""Prefect is the record: drain the outbox into flow runs, states, logs, artifacts and events.

A thread of the node (:class:`Recorder`) takes the outbox's jobs in the order they
were accepted and writes each into Prefect, step by step:

1. **The run, Running**, at the job's first start, with the node and the real
   start time in the state's message (Prefect stamps a flow run's states with
   its own clock, so a record written late would otherwise show the wrong
   time). A window's run is the one the planner created ahead: one
   ``bulk_set_state`` request, filtered by the run's idempotency key
   ``<node>:<window key>``, finds it and puts it in Running; a window with no
   planned run gets one created Scheduled at its start, then set Running; an ad
   hoc run is the one its creator made (named and tagged, then set Running).
2. **The command's task run** (``run-command``), created in Running at once
   (one request), its tries as Prefect shows a task's retries (Running,
   AwaitingRetry, Retrying, ...), and **its output** and the node's lines as the
   run's logs, all new lines of the job in one request, each with the time it
   was written. With ``record_task_run`` off there is no task run: the output
   is the flow run's logs (logger ``sched.job``).
3. At the job's end: the task run's final state, **the artifact** (exit code,
   tries, real start and end), **the final state** (Completed, Failed,
   Cancelled, Crashed; Completed named Skipped for a job that ran nothing),
   **one** ``sched.job.completed`` or ``sched.job.failed`` event whose
   ``occurred`` is the real end (its id is derived from the run's, so the
   server keeps one whatever happens), and last the lines not sent yet.

A job recorded live takes 8 requests (3 at its start, 5 at its end), one recorded
after its end 7 (docs/agent.md, "The record"); with ``record_task_run`` and
``record_artifact`` off, 5 and 4.

Each step is noted in the job's ``record.json`` when it is done, and as
``inflight`` just before it is sent; a step found in flight after a restart is
checked against the server before it is sent again, so a kill in mid-drain
creates nothing twice. While the server cannot be reached, the recorder waits
(1 s doubling to :data:`BACKOFF_MAX_S`) and the jobs go on: a slow or absent
server delays the record, never a job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sched_core.worker import Worker
from sched_node.outbox import (
    KIND_RECONCILE,
    JobFolder,
    JobView,
    Outbox,
)
from sched_node.prefect_api import PrefectApi, PrefectRefused, PrefectUnavailable
from sched_node.record_steps import Steps
from sched_node.registration import Deployments

log = logging.getLogger(__name__)


BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
TRIM_EVERY_S = 60.0
IDLE_WAIT_S = 30.0
"""How long the recorder sleeps with nothing to send (a new job wakes it at once)."""

class Recorder:
    """Drain the outbox into Prefect (the module's steps), in a thread, until stopped.

    ``done(folder)`` is called once a job's record is complete (the node then
    deletes the folder when its report is through as well).
    """

    # Alike in shape to ControllerWait's constructor (`self.x = x`, then the worker; a pair
    # `duplicates` lists): each keeps its own collaborators.
    def __init__(self, api: PrefectApi, outbox: Outbox, deployments: Deployments, *,
                 node: str, clock: Callable[[], datetime],
                 done: Callable[[JobFolder], None] = lambda folder: None,
                 task_run: bool = True, artifact: bool = True) -> None:
        self.api = api
        self.task_runs = task_run
        """Whether a job's command is a task run (its tries as the task's states)."""
        self.artifacts = artifact
        """Whether a job's end writes its artifact."""
        self.outbox = outbox
        self.deployments = deployments
        self.node = node
        self._clock = clock
        self._done = done
        self._worker = Worker("recorder", self._main)
        self._draining = threading.Lock()
        """One drain at a time: the node's last drain at stop and the thread's would
        otherwise record one job twice at once (each with its own progress)."""
        self._checked: set[str] = set()  # folders whose in-flight step was checked this process
        self.reachable = True
        """False while the server cannot be reached (for the node's status and its log)."""
        self._trimmed = float("-inf")
        self.recorded = 0

    # -- the thread ---------------------------------------------------------------------

    def start(self) -> Recorder:
        """Start the thread (once); return self."""
        self._worker.start()
        return self

    def wake(self, folder: JobFolder | None = None) -> None:
        """Tell the recorder there is something new to send."""
        self._worker.woken.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (what is not sent stays in the outbox for the next start)."""
        self._worker.stop(timeout)

    def _main(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._worker.stopping.is_set():
            self._worker.woken.clear()
            try:
                pending = self.drain()
            except PrefectUnavailable as exc:
                if self.reachable:
                    log.warning("the Prefect server cannot be reached; jobs go on, their records "
                                "wait in the outbox: %s", exc, extra={"node": self.node})
                self.reachable = False
                self._trim()
                self._worker.woken.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            except Exception:  # a bug must not end the thread: the outbox keeps everything
                log.exception("the recorder failed; trying again", extra={"node": self.node})
                self._worker.woken.wait(BACKOFF_MAX_S)
                continue
            if not self.reachable:
                log.info("the Prefect server answers again; the outbox drains",
                         extra={"node": self.node})
            self.reachable = True
            backoff = BACKOFF_MIN_S
            self._worker.woken.wait(1.0 if pending else IDLE_WAIT_S)

    def _trim(self) -> None:
        """Keep the outbox within its size while the server is away (at most once a minute)."""
        now = time.monotonic()
        if now - self._trimmed < TRIM_EVERY_S:
            return
        self._trimmed = now

        def untouched(folder: JobFolder, attempt: int) -> bool:
            sent = (folder.read_json("record.json") or {}).get("bytes", {})
            return not sent.get(f"a{attempt}")

        try:
            self.outbox.trim(now=self._clock(), untouched=untouched)
        except OSError as exc:
            log.warning("could not trim the outbox: %s", exc, extra={"node": self.node})

    def drain(self) -> bool:
        """Send what can be sent now, oldest job first; return whether any job is still open.

        Raises PrefectUnavailable when the server cannot be reached (the caller waits).
        """
        with self._draining:
            return self._drain()

    def _drain(self) -> bool:
        pending = False
        folders = list(self.outbox.jobs())
        for index, folder in enumerate(folders):
            if self._worker.stopping.is_set():
                return True
            try:
                complete = self.record(folder)
            except PrefectUnavailable:
                for later in folders[index + 1:]:
                    self._mark_offline(later)
                raise
            except PrefectRefused as exc:
                log.error("Prefect refused a record of job %s; it stays in the outbox: %s",
                          folder.job_id, exc, extra={"node": self.node, "job_id": folder.job_id})
                pending = True
                continue
            except ValueError as exc:  # an unreadable job.json: left for a person to look at
                log.error("outbox job %s cannot be read: %s", folder.job_id, exc)
                continue
            if complete:
                self.recorded += 1
                self._done(folder)
            else:
                pending = True
        return pending

    def _mark_offline(self, folder: JobFolder) -> None:
        """Note that a started job's start could not be recorded in time (the server is away)."""
        progress = folder.read_json("record.json") or {}
        if "offline" in progress or progress.get("complete"):
            return
        try:
            started = bool(folder.view().attempts)
        except ValueError:
            return
        if started:
            progress["offline"] = True
            folder.write_json("record.json", progress)

    # -- one job ------------------------------------------------------------------------

    def record(self, folder: JobFolder) -> bool:
        """Write what is new of one job into Prefect; return whether its record is complete."""
        progress = folder.read_json("record.json") or {}
        if progress.get("complete"):
            return True
        view = folder.view()
        steps = Steps(self, folder, view, progress)
        if folder.job_id not in self._checked:
            steps.check_inflight()
            self._checked.add(folder.job_id)
        try:
            complete = self._steps(steps, view, progress, folder)
        except PrefectUnavailable:
            # The request may have reached the server before the answer was lost:
            # check the step in flight again before sending it a second time.
            self._checked.discard(folder.job_id)
            if view.attempts and "offline" not in progress:
                # Its start could not be recorded when the node first tried (at once):
                # the job runs while Prefect cannot be reached from the node.
                progress["offline"] = True
                folder.write_json("record.json", progress)
            raise
        return complete

    def _steps(self, steps: Steps, view: JobView, progress: dict[str, Any],
               folder: JobFolder) -> bool:
        if view.attempts or view.spec.kind == KIND_RECONCILE:
            steps.running()  # finds or creates the run as it goes Running
        elif view.phase != "ended":
            # Accepted, not started yet (a slot, a lock, its keeper): nothing to record. Its
            # planned run shows it Scheduled; finding the run now would cost a create (the
            # key's run answered) and turn its Running into a request of its own: 9 requests
            # a job instead of 7 when the recorder woke between the accept and the start.
            return False
        else:
            steps.run_id()  # a job that ran nothing: its run, for its final state
        if view.attempts and (self.task_runs or progress.get("task_run_id")):
            steps.task_run()  # one begun before record_task_run was turned off is ended
        if view.phase != "ended":
            steps.logs()
            return False
        if self.artifacts or view.spec.kind == KIND_RECONCILE:
            steps.artifact()
        steps.final()
        steps.event()
        steps.logs()  # every line not sent yet, the ones written at the end too
        progress["complete"] = True
        folder.write_json("record.json", progress)
        return True
