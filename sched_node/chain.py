"""The chain on the node: prune, then check, after the nightly wave, from the node's own jobs.

The kit's :class:`sched_core.Chain` decides (stages in order, once per chain day,
markers in ``chain.json``); this module gives it what it asks about, from the node's
jobs (:mod:`sched_node.jobs`: what is active) and its history (:mod:`sched_node.history`: what
ended), never from Prefect, so the chain goes on while the server is away.

Rules:

1. A stage is active while a job of its action is active on the node.
2. The wave is complete when no wave job is active and one ended within
   ``wave_lookback``: one that **succeeded**, unless the first stage says
   ``after = "any"``. A wave that drained with only failures fires nothing and marks
   nothing, so a later successful wave job fires the stage the same day; the last
   wave job's log says so (:meth:`NodeChain.note`).
3. Only a job's end feeds the chain (a window that ran nothing does not), and only the
   node's own: no event from outside reaches it. An ad hoc job (trigger ``manual`` or
   ``retry``: a Run or a Retry from Prefect, ``sched run``) neither arms nor uses up the
   day's chain: an ad hoc backup at 00:05 leaves the day's prune and check to the 02:30
   wave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sched_core import Chain, Scheduler, Spec
from sched_core import Stage as ChainStage
from sched_node.adhoc import AD_HOC
from sched_node.history import Ended, History
from sched_node.jobs import Jobs
from sched_node.outbox import KIND_JOB, SKIPPED, JobView, utc_text
from sched_node.settings import AgentSettings

log = logging.getLogger(__name__)



class NodeChain:
    """The kit's chain over the node's jobs and history (the module's rules)."""

    def __init__(self, settings: AgentSettings, scheduler: Scheduler, jobs: Jobs,
                 history: History, clock: Callable[[], datetime]) -> None:
        self.settings = settings
        self.jobs = jobs
        self.history = history
        self._clock = clock
        self.chain = Chain(scheduler, self._spec())
        self.fired: list[str] = []
        """The stages the last job's end fired."""

    def wave_active(self) -> bool:
        """Return whether a wave job (not an ad hoc one) is active on the node."""
        return any(spec.action in self.settings.wave and spec.trigger_key not in AD_HOC
                   for spec, _ in self.jobs.active())

    def _wave_ended(self, now: datetime) -> list[Ended]:
        since = now - self.settings.wave_lookback
        return [item for item in self.history.since(since, actions=self.settings.wave)
                if item.trigger_key not in AD_HOC]

    def wave_succeeded(self, now: datetime) -> bool:
        """Return whether a wave job succeeded within ``wave_lookback`` (rule 3: no ad hoc)."""
        return any(item.succeeded for item in self._wave_ended(now))

    def _spec(self) -> Spec:
        settings = self.settings

        def stage(index: int) -> ChainStage:
            spec = settings.stages[index]

            def active() -> bool:
                return any(job.action == spec.action for job, _ in self.jobs.active())

            return ChainStage(name=spec.name, trigger_key=spec.key(),
                              match=lambda row: row.schedule.on == spec.on
                              and row.action == spec.action, active=active)

        def wave_complete() -> bool:
            if self.wave_active():
                return False
            now = self._clock()
            first = settings.stages[0] if settings.stages else None
            if first is not None and first.after == "success":
                return self.wave_succeeded(now)
            return bool(self._wave_ended(now))

        return Spec(stages=[stage(index) for index in range(len(settings.stages))],
                    is_wave_job=lambda action: action in settings.wave,
                    wave_complete=wave_complete, marker_path=settings.marker_path,
                    timezone=settings.tz)

    def on_end(self, view: JobView, now: datetime) -> str:
        """Feed a job's end to the chain (rule 3); return a line for the job's log, or ""."""
        if view.spec.kind != KIND_JOB or view.end_state == SKIPPED:
            return ""
        if view.spec.trigger_key in AD_HOC:
            return ""  # rule 3: an ad hoc job is not the wave's
        try:
            fired = self.chain.on_job_complete(view.spec.action, now=now)
        except Exception:
            log.exception("the chain failed on the end of %s", view.spec.run_name)
            return ""
        self.fired = fired
        return self.note(view, fired, now)

    def note(self, view: JobView, fired: list[str], now: datetime) -> str:
        """Return what the chain did about a job's end, for its log (rule 2's skip said)."""
        if fired:
            return f"chain: fired stage(s) {', '.join(fired)}"
        if view.spec.action not in self.settings.wave or self.wave_active():
            return ""
        first = self.settings.stages[0] if self.settings.stages else None
        if first is None or first.after != "success" or self.wave_succeeded(now):
            return ""
        return (f"chain: the wave drained with no successful job since "
                f"{utc_text(now - self.settings.wave_lookback)}: stage {first.name} not fired "
                f"(after = \"success\"); a later successful wave job fires it today")
