"""Prefect is the record: drain the outbox into flow runs, states, logs, artifacts and events.

A thread of the node (:class:`Recorder`) takes the outbox's jobs in the order they
were accepted and writes each into Prefect through Prefect's client, as a run of its flow
(:mod:`sched_node.record_steps` has the shape):

1. **The run, Running**, at the job's first start, with the node and the real start time
   in the state's message (Prefect stamps a flow run's states with its own clock, so a
   record written late would otherwise show the wrong time). A window's run is the one the
   planner created ahead (its id from the plan's record, one request); a window with no
   planned run gets one created Scheduled at its start (by its idempotency key
   ``<node>:<window key>``), then set Running; an ad hoc run is the one its creator made
   (named and tagged, then set Running).
2. **Each try** as Prefect shows a flow's retries: a try that failed and is tried again
   puts the run in AwaitingRetry, the next one in Running named Retrying; each try is a
   ``run-command`` task run, and **its output** and the node's lines are the run's logs,
   all new lines of the job in one request, each with the time it was written. With
   ``record_task_run`` off there are no task runs: the output is the flow run's logs
   (logger ``sched.job``).
3. At the job's end: **the artifact** (exit code, tries, real start and end), **the final
   state** (Completed, Failed, Cancelled, Crashed; Completed named Skipped for a job that
   ran nothing), **one** ``sched.job.completed`` or ``sched.job.failed`` event whose
   ``occurred`` is the real end (its id is derived from the run's, so the server keeps one
   whatever happens), and last the lines not sent yet.

A job of one try recorded live takes 8 requests (3 at its start, 5 at its end), one
recorded after its end 7 (docs/agent.md, "The record"); with ``record_task_run`` and
``record_artifact`` off, 5 and 4. A job that Prefect's engine handed over
(:mod:`sched_node.handoff`) is the engine's to record.

Each step is noted in the job's ``record.json`` when it is done, and as
``inflight`` just before it is sent; a step found in flight after a restart is
checked against the server before it is sent again, so a kill in mid-drain
creates nothing twice. While the server cannot be reached or is too busy, the recorder
waits (1 s doubling to :data:`BACKOFF_MAX_S`, or the server's ``Retry-After`` when longer,
jittered; new jobs do not cut it short) and the jobs go on: a slow or absent server delays
the record, never a job, and a fleet refused together does not come back together.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sched_core.worker import Worker
from sched_node.chain_run import KIND_CHAIN, ChainSteps
from sched_node.handoff import RECORDED_BY_ENGINE, engine_overdue
from sched_node.outbox import (
    KIND_EVENT,
    KIND_RECONCILE,
    JobFolder,
    JobSpec,
    JobView,
    Outbox,
)
from sched_node.prefect_api import TERMINAL, PrefectApi, PrefectRefused, PrefectUnavailable
from sched_node.record_steps import Steps
from sched_node.registration import RECONCILE, RUN_JOB, Deployments

log = logging.getLogger(__name__)


BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
TRIM_EVERY_S = 60.0
IDLE_WAIT_S = 30.0
"""How long the recorder sleeps with nothing to send (a new job wakes it at once)."""

def backoff_wait(backoff: float, retry_after: float | None,
                 draw: Callable[[float, float], float] = random.uniform) -> float:
    """Return how long the recorder waits after a failed pass: its back-off, or the server's
    ``Retry-After`` when longer, times a random 1 to 1.5."""
    return max(backoff, retry_after or 0.0) * draw(1.0, 1.5)


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
                 planned: Callable[[str], str | None] = lambda key: None,
                 parent_task_run: Callable[[JobSpec], str | None] = lambda spec: None,
                 chain_pending: Callable[[str], bool] = lambda day: False,
                 task_run: bool = True, artifact: bool = True) -> None:
        self.api = api
        self.planned = planned
        """The planned run of a window's idempotency key (the planner's record), or None."""
        self.parent_task_run = parent_task_run
        """The task run a job's run belongs under (a chain stage's), or None."""
        self.chain_pending = chain_pending
        """Whether a chain day's stage jobs still have records under way."""
        self._command_task: Any = None
        self.task_runs = task_run
        """Whether a job's command is a task run (its tries as the task's states)."""
        self.artifacts = artifact
        """Whether a job's end writes its artifact."""
        self.outbox = outbox
        self.deployments = deployments
        self.node = node
        self.clock = clock
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

    @property
    def command_task(self) -> Any:
        """The flow's ``run-command`` task: each try's task run is one of it (imported with
        Prefect, by the recorder's thread, not at the node's start)."""
        if self._command_task is None:
            from flows.run_job import run_command

            self._command_task = run_command
        return self._command_task

    @staticmethod
    def flow_of(spec: JobSpec) -> str:
        """Return the flow whose run records the job (``run-job`` or ``reconcile``)."""
        return RECONCILE if spec.kind == KIND_RECONCILE else RUN_JOB

    @staticmethod
    def parameters_of(spec: JobSpec) -> dict[str, Any]:
        """Return a run's parameters as its flow takes them: the schedule, never a time."""
        return {} if spec.kind == KIND_RECONCILE else {"schedule_id": spec.schedule_id}

    # -- the thread ---------------------------------------------------------------------

    def start(self) -> Recorder:
        """Start the thread (once); return self."""
        self._worker.start()
        return self

    def wake(self, folder: JobFolder | None = None) -> None:
        """Tell the recorder there is something new to send (of folder's job, when given).

        A job that starts while the server is away, the recorder waiting out its back-off,
        is noted as recorded after the server came back, as one whose first record failed."""
        if folder is not None and not self.reachable and self._draining.acquire(blocking=False):
            try:
                self._mark_offline(folder)
            except OSError as exc:  # the record says less; the job and its outbox go on
                log.warning("could not note job %s as recorded late: %s", folder.job_id, exc,
                            extra={"node": self.node, "job_id": folder.job_id})
            finally:
                self._draining.release()
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
                # New jobs do not cut the wait short (a fleet must not storm a busy server);
                # jittered so that nodes refused together do not come back together.
                self._worker.stopping.wait(backoff_wait(backoff, exc.retry_after))
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
            self.outbox.trim(now=self.clock(), untouched=untouched)
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
            except ValueError as exc:  # not a job's files: out of the way, the rest goes on
                self.outbox.quarantine(folder.job_id, str(exc))
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
        if view.spec.kind == KIND_EVENT:  # events only (a folder put in quarantine, ...)
            self.api.emit_events(list((folder.read_json("events.json") or {}).get("events")
                                      or []))
            progress["complete"] = True
            folder.write_json("record.json", progress)
            return True
        if view.spec.kind == KIND_CHAIN:
            return ChainSteps(self, folder, view, progress).record()
        if view.spec.recorded_by == RECORDED_BY_ENGINE:
            return self._engine_job(folder, view, progress)
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

    def _engine_job(self, folder: JobFolder, view: JobView, progress: dict[str, Any]) -> bool:
        """A job Prefect's engine handed over and records (:mod:`sched_node.handoff`): done
        when the engine says so; ended and unacknowledged past the grace (its flow's process
        died), its run's final state and event are the node's to send, unless the run ended."""
        if not progress.get("engine_recorded"):
            if view.phase != "ended" or not engine_overdue(view, self.clock()):
                return False
            run_id = view.spec.flow_run_id or ""
            progress["flow_run_id"] = run_id
            run = self.api.read_run(run_id) if run_id else None
            kind = ((run or {}).get("state") or {}).get("type")
            if run is not None and kind not in TERMINAL:
                log.warning("the flow run %s that followed job %s went away before recording "
                            "its end: the node records it", run_id, view.spec.run_name,
                            extra={"node": self.node, "job_id": folder.job_id})
                progress["engine_gone"] = True
                steps = Steps(self, folder, view, progress)
                steps.final()
                steps.event()
        progress["complete"] = True
        folder.write_json("record.json", progress)
        return True

    def _steps(self, steps: Steps, view: JobView, progress: dict[str, Any],
               folder: JobFolder) -> bool:
        if view.attempts or view.spec.kind == KIND_RECONCILE:
            steps.run_id()  # the planned run (by its key), the ad hoc one, or one made now
            steps.flow_states(final=False)  # Running, and each retry's two states
            progress.setdefault("offline", False)
        elif view.phase != "ended":
            # Accepted, not started yet (a slot, a lock, its keeper): nothing to record. Its
            # planned run shows it Scheduled; finding the run now would cost a create (the
            # key's run answered) and turn its Running into a request of its own: 9 requests
            # a job instead of 7 when the recorder woke between the accept and the start.
            return False
        else:
            steps.run_id()  # a job that ran nothing: its run, for its final state
        if view.attempts and (self.task_runs or progress.get("task_runs")):
            steps.task_runs()  # one begun before record_task_run was turned off is ended
        if view.phase != "ended":
            steps.logs()
            return False
        if self.artifacts or view.spec.kind == KIND_RECONCILE:
            steps.artifact()
        steps.flow_states(final=True)
        steps.event()
        steps.logs()  # every line not sent yet, the ones written at the end too
        progress["complete"] = True
        folder.write_json("record.json", progress)
        return True
