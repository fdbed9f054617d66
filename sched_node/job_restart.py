"""Rule 5 of :mod:`sched_node.jobs`: what a restart of the node does with the outbox's jobs.

A job whose keeper still runs is followed again; one whose keeper ended has its outcome
read (and ends when its command really ended); one whose keeper is gone without an outcome
was interrupted, and runs once more at once if ``may_rerun`` says so, else ends Crashed
saying why; a job that waited for a slot waits again. What a job taken up again runs is
what the action table renders now (``render``): ``job.json`` is a file like any other. A
folder that is not a job's is put in quarantine (:meth:`sched_node.outbox.Outbox.quarantine`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from sched_core import SchedError
from sched_node import launcher
from sched_node.job_state import LiveJob
from sched_node.outbox import (
    CANCELLED,
    CRASHED,
    FAILED,
    KIND_JOB,
    JobFolder,
    JobSpec,
    JobView,
    Outbox,
    utc_text,
)

log = logging.getLogger("sched_node.jobs")

Outcome = tuple[str, str, str | None]
"""How a job ends: its state, its message, and its error (None when it did not fail)."""


class Restart:
    """The restart half of :class:`sched_node.jobs.Jobs` (rule 5); the rest is its own."""

    if TYPE_CHECKING:
        outbox: Outbox
        _lock: threading.RLock
        _jobs: dict[str, LiveJob]
        _order: list[str]
        _stopping: threading.Event
        _clock: Callable[[], datetime]
        _render: Callable[[JobSpec], list[str]] | None
        _may_rerun: Callable[[JobSpec], tuple[bool, str]]
        _on_change: Callable[[JobFolder], None]
        _on_end: Callable[[JobView], None]

        def _run(self, job: LiveJob) -> None: ...
        def _dispatch(self) -> None: ...
        def _journal(self, folder: JobFolder, event: str, **fields: object) -> None: ...
        def _after_attempt(self, job: LiveJob, number: int) -> Outcome | None: ...


    def resume(self) -> list[tuple[str, str]]:
        """Take up every job of the outbox that has not ended (rule 5); return (run, what) pairs."""
        found: list[tuple[str, str]] = []
        for folder in self.outbox.jobs():
            try:
                view = folder.view()
            except ValueError as exc:  # not a job's files: out of the way (rule 5)
                self.outbox.quarantine(folder.job_id, str(exc))
                continue
            if view.phase == "ended" or view.spec.kind not in (KIND_JOB,):
                continue  # ended, or not a job (a chain day's record)
            spec = self._rendered(folder, view)
            if spec is None:
                found.append((view.spec.run_name, "ended: its command is not the table's"))
                continue
            job = LiveJob(folder=folder, spec=spec, cancel=view.cancel)
            if view.phase == "queued":
                found.append((view.spec.run_name, "waits for a slot again"))
            else:
                job.state, job.resume = "running", view
                found.append((view.spec.run_name, "taken up again"))
            with self._lock:
                self._jobs[view.spec.job_id] = job
                self._order.append(view.spec.job_id)
        with self._lock:
            restarted = [job for job in self._jobs.values() if job.resume is not None]
        for job in restarted:
            job.thread = threading.Thread(target=self._run, args=(job,),
                                          name=f"job-{job.spec.run_name}", daemon=True)
            job.thread.start()
        self._dispatch()
        return found

    def _rendered(self, folder: JobFolder, view: JobView) -> JobSpec | None:
        """Return a resumed job's spec with the command the action table renders now from its
        schedule, window and trigger (``job.json`` is a file like any other: what it says to
        run is not run unless the table says so); None when the table renders none (the
        job is then ended Failed, saying why)."""
        spec = view.spec
        if self._render is None:
            return spec
        try:
            argv = self._render(spec)
        except SchedError as exc:
            message = f"not run again after the node's restart: {exc}"
            folder.log(self._clock(), message)
            folder.append({"e": "end", "at": utc_text(self._clock()), "state": FAILED,
                           "message": message, "error": message})
            self._on_change(folder)
            self._on_end(folder.view())
            return None
        if argv != spec.argv:
            folder.log(self._clock(), f"the action table renders {argv} for this job now "
                                      f"({spec.job_id}/job.json said {spec.argv}): that runs")
            spec = JobSpec(**{**spec.__dict__, "argv": argv})
        return spec

    def _resume_attempts(self, job: LiveJob, view: JobView) -> Outcome | None:
        """Follow or read the attempt a restart found (rule 5); None to run the next one."""
        last = view.attempts[-1] if view.attempts else None
        if last is None:
            return None
        job.attempt = last.number
        if last.exit is None and launcher.alive(last.shim_pid, last.shim_start):
            job.keeper = launcher.Keeper(pid=last.shim_pid or 0, start_ticks=last.shim_start)
            job.folder.log(self._clock(), f"the node restarted; attempt {last.number} is still "
                                          "running: following it")
            if not launcher.wait(job.keeper, self._stopping):
                return FAILED, "the node stopped", None
            job.keeper = None
            return self._after_attempt(job, last.number)
        if last.exit is not None:
            if view.phase == "retrying":
                return self._retry_after_restart(job, view)
            return self._after_attempt(job, last.number)
        message = (f"interrupted: attempt {last.number}'s keeper (pid {last.shim_pid}) is gone "
                   "without an outcome (the node or its machine stopped)")
        self._journal(job.folder, "interrupted", attempt=last.number, message=message)
        job.folder.log(self._clock(), message)
        if job.cancel is not None:
            return CANCELLED, job.cancel, None
        again, why = self._may_rerun(job.spec)
        if not again:
            job.folder.log(self._clock(), f"not run again: {why}")
            return CRASHED, f"{message}; not run again: {why}", message
        job.folder.log(self._clock(), f"running it once more: {why}")
        job.keeper = None
        return None

    def _retry_after_restart(self, job: LiveJob, view: JobView) -> Outcome | None:
        """Wait out the rest of a retry delay the restart interrupted, then go on."""
        if view.retry_at is not None:
            left = (view.retry_at - self._clock()).total_seconds()
            if left > 0 and self._stopping.wait(left):
                return FAILED, "the node stopped", None
        job.keeper = None
        return None
