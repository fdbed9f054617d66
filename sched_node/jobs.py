"""The node's jobs: accept, wait for a slot and their turn, run their attempts, end.

Every step is journalled in the job's outbox folder (:mod:`sched_node.outbox`) before
it is taken, so a restart finds each job where it was (:meth:`Jobs.resume`).

Rules:

1. **Slots.** At most ``slots`` jobs hold a slot at once (running, or between
   two attempts); the others wait in the order they were accepted.
2. **In order.** A job never starts while an earlier job of the same schedule
   still waits: one schedule's windows start in order, and a window waiting for
   a slot is never overtaken by a later one.
3. **Overlap** (the row's ``overlap``), checked when a job is accepted and again
   when it could start, against the jobs of its schedule that are running
   (:func:`sched_core.policies.overlap_verdict`): ``skip`` ends it Skipped naming the running one;
   ``allow`` runs it alongside; ``buffer-one`` waits for it (one waiter at
   most, for at most the action's longest run); ``cancel-other`` cancels it,
   then waits as ``buffer-one`` does.
4. **Attempts.** Each attempt runs in its keeper process (:mod:`sched_node.launcher`);
   a failed one is tried again after the action's ``retry_delay`` while tries
   are left; a cancelled one is not.
5. **Restart.** A job whose keeper still runs is followed again; one whose
   keeper ended has its outcome read, and ends when its command really ended
   (the keeper's exit file: its end, its final state's message, its event and
   its last lines carry that time, not the restart's); one whose keeper is gone
   without an outcome was interrupted, and runs once more at once if
   ``may_rerun`` says so, else ends Crashed saying why; a job that waited for a
   slot waits again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime, timedelta

from sched_core import SchedError
from sched_core.policies import Peer, overlap_verdict
from sched_node import launcher
from sched_node.job_restart import Outcome, Restart
from sched_node.job_state import LiveJob, Moves
from sched_node.outbox import (
    CANCELLED,
    COMPLETED,
    FAILED,
    SKIPPED,
    JobFolder,
    JobSpec,
    JobView,
    Outbox,
    utc_text,
)

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


SECRET_NAME = re.compile(r"PASS|SECRET|TOKEN|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
"""The names of a job's environment variables whose values a failure's cause never shows."""


def secrets(env: Mapping[str, str]) -> list[str]:
    """Return the values a failure's cause hides: those of the job's environment variables
    whose names say they are secrets (``RESTIC_PASSWORD``, ``AWS_SECRET_ACCESS_KEY``, ...)."""
    return sorted((value for name, value in env.items()
                   if SECRET_NAME.search(name) and len(value) >= 4), key=len, reverse=True)


def longest_run_s(spec: JobSpec) -> float:
    """Return how long one job can run: every try, and the delays between."""
    return spec.timeout_s * (spec.retries + 1) + spec.retry_delay_s * spec.retries


class Jobs(Restart):
    """The node's jobs (the module's rules), with everything outside injected.

    ``env_for(spec)`` gives a job's environment; ``on_change(folder)`` is told of
    every step (the recorder and the reporter follow); ``on_end(view)`` of every
    end (the chain); ``may_rerun(spec)`` decides an interrupted job's second run
    (``(True, why)`` or ``(False, why)``); ``repo_lock(spec)`` holds a job's
    fleet-wide repository lock around its attempts; ``warm`` keepers started ahead take
    the jobs (without them each try starts its own keeper); ``render(spec)`` gives the
    command the action table renders now for a job a restart takes up (SchedError when
    none): what ``job.json`` says is not run unless the table says so.
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        slots: int,
        clock: Clock,
        env_for: Callable[[JobSpec], Mapping[str, str]],
        on_change: Callable[[JobFolder], None] = lambda folder: None,
        on_end: Callable[[JobView], None] = lambda view: None,
        may_rerun: Callable[[JobSpec], tuple[bool, str]] = lambda spec: (False, "no re-runs"),
        repo_lock: Callable[[JobSpec, JobFolder], AbstractContextManager[None]] | None = None,
        warm: launcher.WarmKeepers | None = None,
        render: Callable[[JobSpec], list[str]] | None = None,
    ) -> None:
        self.outbox = outbox
        self.slots = slots
        self._clock = clock
        self._env_for = env_for
        self._on_change = on_change
        self._on_end = on_end
        self._may_rerun = may_rerun
        self._repo_lock = repo_lock or (lambda spec, folder: nullcontext())
        self._warm = warm
        self._render = render
        self._lock = threading.RLock()
        self._jobs: dict[str, LiveJob] = {}
        self._order: list[str] = []  # accept order of the jobs not ended
        self._stopping = threading.Event()
        self._wakeup = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="jobs-ticker", daemon=True)
        self._ticker.start()

    # -- what there is ------------------------------------------------------------------

    def active(self) -> list[tuple[JobSpec, str]]:
        """Return (spec, "queued" or "running") of every job that has not ended."""
        with self._lock:
            return [(self._jobs[job_id].spec, self._jobs[job_id].state) for job_id in self._order]

    def holding(self) -> int:
        """Return how many jobs hold a slot."""
        with self._lock:
            return sum(1 for job in self._jobs.values() if job.state == "running")

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is active (tests, shutdown); return whether that happened."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._jobs:
                    return True
            time.sleep(0.05)
        return False

    # -- accept, skip, cancel -----------------------------------------------------------

    def _journal(self, folder: JobFolder, event: str, **fields: object) -> None:
        folder.append({"e": event, "at": utc_text(self._clock()), **fields})
        self._on_change(folder)

    def accept(self, spec: JobSpec, *, lines: Sequence[str] = ()) -> JobFolder:
        """Write the job to the outbox, then queue it (rules 1-3); return its folder.

        OSError when the outbox cannot take it (a full or read-only disk): nothing of it is
        left behind, and nothing runs."""
        folder = self.outbox.create(spec)
        try:
            now = self._clock()
            for line in lines:
                folder.log(now, line)
            self._journal(folder, "accepted", reason=spec.reason)
        except OSError:
            self.outbox.forget(folder)
            raise
        with self._lock:
            job = LiveJob(folder=folder, spec=spec)
            verdict, reason = overlap_verdict(spec.overlap, spec.schedule_id, self._peers(job))
            if verdict != "skip":
                self._jobs[spec.job_id] = job
                self._order.append(spec.job_id)
        if verdict == "skip":  # rule 3, at once: a job of its schedule runs (or one waits)
            folder.log(self._clock(), f"skipped: {reason}")
            self._journal(folder, "end", state=SKIPPED, message=reason, error=None)
            self._on_end(folder.view())
            return folder
        self._dispatch()
        return folder

    def end_without_running(self, spec: JobSpec, state: str, message: str, *,
                            error: str | None = None, lines: Sequence[str] = ()) -> JobFolder:
        """Write a job that ends before anything runs (Skipped, or Failed: argv refused)."""
        folder = self.outbox.create(spec)
        now = self._clock()
        for line in lines:
            folder.log(now, line)
        folder.log(now, f"{state.lower()}: {message}")
        self._journal(folder, "end", state=state, message=message, error=error)
        self._on_end(folder.view())
        return folder

    def cancel(self, *, message: str, job_id: str | None = None,
               flow_run_id: str | None = None) -> bool:
        """Cancel a job (by its folder or its run's id); return False when no active job matches."""
        with self._lock:
            job = self._find(job_id=job_id, flow_run_id=flow_run_id)
            if job is None:
                return False
            job.cancel = message
            keeper = job.keeper
            queued = job.state == "queued"
        self._journal(job.folder, "cancel", message=message)
        job.folder.log(self._clock(), f"cancel asked: {message}")
        if queued:
            self._end(job, CANCELLED, message)
        elif keeper is not None:
            launcher.cancel(keeper)
        self._wakeup.set()
        return True

    def _find(self, *, job_id: str | None, flow_run_id: str | None) -> LiveJob | None:
        if job_id is not None:
            return self._jobs.get(job_id)
        for job in self._jobs.values():
            record = job.folder.read_json("record.json") or {}
            if flow_run_id and flow_run_id in (job.spec.flow_run_id, record.get("flow_run_id")):
                return job
        return None

    # -- the queue ----------------------------------------------------------------------

    def _peers(self, job: LiveJob) -> list[Peer]:
        peers = []
        for other_id in self._order:
            other = self._jobs[other_id]
            if other is job or other.spec.schedule_id != job.spec.schedule_id:
                continue
            started = other.folder.view().started_at if other.state == "running" else None
            peers.append(Peer(job_id=other_id, run_name=other.spec.run_name,
                              since=utc_text(started) if started else "waiting",
                              running=other.state == "running", waiting=other.waiting))
        return peers

    def _dispatch(self) -> None:
        """Start every queued job that may start now, in order (rules 1-3)."""
        with self._lock:
            moves = self._pass()
        for job, state, reason in moves.end:
            job.folder.log(self._clock(), f"skipped: {reason}")
            self._end(job, state, reason, dispatch=False)
        for target, message in moves.cancel:
            self.cancel(job_id=target.spec.job_id, message=message)
        for job in moves.start:
            job.thread = threading.Thread(target=self._run, args=(job,),
                                          name=f"job-{job.spec.run_name}", daemon=True)
            job.thread.start()
        if moves.end:
            self._dispatch()

    def _pass(self) -> Moves:
        """Go through the queue in order (the lock held): decide which jobs start, which end
        skipped and which running ones to cancel; the others wait (rules 1-3)."""
        moves = Moves()
        free = self.slots - sum(1 for job in self._jobs.values() if job.state == "running")
        blocked: set[str] = set()
        for job_id in list(self._order):
            job = self._jobs[job_id]
            if job.state != "queued" or job.cancel is not None:
                continue
            schedule = job.spec.schedule_id
            if schedule in blocked:
                continue  # an earlier job of its schedule waits (rule 2)
            verdict, reason = overlap_verdict(job.spec.overlap, schedule, self._peers(job))
            if verdict == "skip":
                moves.end.append((job, SKIPPED, reason))
                self._order.remove(job_id)
                continue
            if verdict in ("wait", "cancel"):
                if self._wait_for_peer(job, verdict, reason, moves):
                    self._order.remove(job_id)
                else:
                    blocked.add(schedule)
                continue
            if free <= 0:
                blocked.add(schedule)
                self._wait_for_slot(job)
                continue
            if job.waiting:
                job.folder.log(self._clock(), "the other job of its schedule ended: running")
            job.waiting = False
            job.state = "running"
            free -= 1
            moves.start.append(job)
        return moves

    def _wait_for_peer(self, job: LiveJob, verdict: str, reason: str, moves: Moves) -> bool:
        """Hold job back behind the running job of its schedule (rule 3): start its wait, or
        end it Skipped once the wait is over (True); for cancel-other, cancel the running one."""
        if not job.waiting:
            job.waiting = True
            job.wait_until = time.monotonic() + longest_run_s(job.spec)
            job.folder.log(self._clock(), reason)
            self._wakeup.set()  # the ticker watches its deadline
        elif job.wait_until is not None and time.monotonic() > job.wait_until:
            waited = longest_run_s(job.spec)
            moves.end.append((job, SKIPPED, f"{reason}; waited {waited:g} s and it did not end"))
            return True
        if verdict == "cancel":
            for peer in self._peers(job):
                if peer.running and peer.job_id not in job.cancelled_peers:
                    job.cancelled_peers.add(peer.job_id)
                    moves.cancel.append((self._jobs[peer.job_id],
                                         f"cancelled by {job.spec.run_name}: overlap "
                                         f"cancel-other of schedule {job.spec.schedule_id}"))
        return False

    def _wait_for_slot(self, job: LiveJob) -> None:
        """Journal, once, that job waits for a free slot (rule 1)."""
        if not job.folder.read_json("queued.json"):
            job.folder.write_json("queued.json", {"at": utc_text(self._clock())})
            job.folder.log(self._clock(), f"waiting for a job slot (all "
                                          f"{self.slots} are taken)")

    def _tick(self) -> None:
        """Look at the queue every second while a job waits for another (its deadline can
        pass with no event); sleep otherwise."""
        waiting = False
        while not self._stopping.is_set():
            self._wakeup.wait(1.0 if waiting else None)
            self._wakeup.clear()
            with self._lock:
                waiting = any(job.waiting for job in self._jobs.values())
            if waiting:
                self._dispatch()

    # -- a job's life -------------------------------------------------------------------

    def _run(self, job: LiveJob) -> None:
        """Run a job's attempts (rule 4) and end it; in the job's own thread."""
        try:
            state, message, error = self._attempts(job)
        except SchedError as exc:  # the job's own failure (a repository lock that stayed taken)
            job.folder.log(self._clock(), str(exc))
            state, message, error = FAILED, str(exc), str(exc)
        except Exception as exc:  # a bug or a broken disk: the job must still end
            log.exception("job %s failed in the node", job.spec.run_name,
                          extra={"job_id": job.spec.job_id})
            state, message, error = FAILED, f"the node failed to run it: {exc!r}", repr(exc)
        if not self._stopping.is_set():
            self._end(job, state, message, error=error, at=self._ended_at(job))

    def _ended_at(self, job: LiveJob) -> datetime | None:
        """Return when the job's last try really ended (its keeper's exit file), when that
        is how it ended: a job whose command ended while the node was down ends then, not
        when the restarted node read it (rule 5)."""
        try:
            view = job.folder.view()
        except ValueError:
            return None
        last = view.attempts[-1] if view.attempts else None
        if last is None or last.exit is None or last.ended_at is None:
            return None
        return min(last.ended_at, self._clock())

    def _attempts(self, job: LiveJob) -> Outcome:
        spec = job.spec
        view = job.resume
        first = 1
        if view is not None:  # the node restarted with this job started (rule 5)
            outcome = self._resume_attempts(job, view)
            if outcome is not None:
                return outcome
            first = job.attempt + 1
        with self._repo_lock(spec, job.folder):
            number = first
            while True:
                if job.cancel is not None:
                    return CANCELLED, job.cancel, None
                if job.keeper is None and not self._launch(job, number):
                    return FAILED, "the job's keeper process could not start", None
                assert job.keeper is not None
                if not launcher.wait(job.keeper, self._stopping):
                    return FAILED, "the node stopped", None  # not journalled: _run checks stop
                outcome = self._after_attempt(job, number)
                if outcome is not None:
                    return outcome
                job.keeper = None
                number += 1

    def _launch(self, job: LiveJob, number: int) -> bool:
        spec = job.spec
        self._journal(job.folder, "launch", attempt=number)
        try:
            offset = (self._clock() - datetime.now(UTC)).total_seconds()

            def spawned(keeper: launcher.Keeper) -> None:
                # Journalled before the keeper has the job (rule 5: a kill in between
                # leaves a keeper that never ran it, or one the restart follows).
                self._journal(job.folder, "spawned", attempt=number, shim_pid=keeper.pid,
                              shim_start=keeper.start_ticks)

            keeper = launcher.launch(job.folder, number, argv=spec.argv, cwd=spec.cwd,
                                     umask=spec.umask, timeout_s=spec.timeout_s,
                                     env=self._env_for(spec), clock_offset_s=offset,
                                     warm=self._warm, before=spawned)
        except OSError as exc:
            job.folder.log(self._clock(), f"could not start the job's keeper: {exc}")
            self._journal(job.folder, "interrupted", attempt=number,
                          message=f"the keeper could not start: {exc}")
            return False
        with self._lock:
            job.keeper, job.attempt = keeper, number
        return True

    def _after_attempt(self, job: LiveJob, number: int) -> Outcome | None:
        """Read attempt number's outcome: the job's end, or None to try again (rule 4)."""
        spec = job.spec
        view = job.folder.view()
        attempt = next((item for item in view.attempts if item.number == number), None)
        if attempt is None or attempt.exit is None:
            message = "the job's keeper ended without an outcome"
            self._journal(job.folder, "interrupted", attempt=number, message=message)
            view = job.folder.view()
            attempt = next(item for item in view.attempts if item.number == number)
        program = spec.argv[0] if spec.argv else spec.action
        # The try's lines carry when it really ended (its keeper's exit file), which is not
        # now when the node was down at that moment.
        ended = min(attempt.ended_at or self._clock(), self._clock())
        if attempt.ok:
            took = ""
            if attempt.started_at and attempt.ended_at:
                took = f" after {(attempt.ended_at - attempt.started_at).total_seconds():.3f} s"
            job.folder.log(ended, f"{program} exited 0{took}")
            return COMPLETED, f"{program} exited 0{took}", None
        failure = attempt.failure(program, spec.timeout_s)
        cause = attempt.cause(secrets(self._env_for(spec)))
        if cause:  # why it failed, in its own words: the report, the alerts, the run say it
            failure = f"{failure}: {cause}"
        job.folder.log(ended, failure)
        cancelled = job.cancel is not None or bool(attempt.exit and attempt.exit.get("cancelled"))
        if cancelled:
            return CANCELLED, job.cancel or failure, None
        if number > spec.retries:
            tries = f" (after {number} tries)" if number > 1 else ""
            return FAILED, f"{failure}{tries}", failure
        until = self._clock() + timedelta(seconds=spec.retry_delay_s)
        job.folder.log(self._clock(), f"try {number} of {spec.retries + 1} failed; trying again "
                                      f"in {spec.retry_delay_s:g} s")
        self._journal(job.folder, "retry", attempt=number, until=utc_text(until))
        if self._stopping.wait(spec.retry_delay_s):
            return FAILED, "the node stopped", None
        return None

    def _end(self, job: LiveJob, state: str, message: str, *, error: str | None = None,
             dispatch: bool = True, at: datetime | None = None) -> None:
        job.folder.append({"e": "end", "at": utc_text(at or self._clock()), "state": state,
                           "message": message, "error": error})
        self._on_change(job.folder)
        with self._lock:
            self._jobs.pop(job.spec.job_id, None)
            if job.spec.job_id in self._order:
                self._order.remove(job.spec.job_id)
        log.info("job %s ended %s: %s", job.spec.run_name, state, message,
                 extra={"job_id": job.spec.job_id, "schedule_id": job.spec.schedule_id,
                        "state": state})
        try:
            self._on_end(job.folder.view())
        except Exception:
            log.exception("the end of job %s could not be handed on", job.spec.run_name)
        if dispatch:
            self._dispatch()

    def stop(self) -> None:
        """Stop following jobs (the node is stopping): keepers and commands go on by themselves."""
        self._stopping.set()
        self._wakeup.set()
