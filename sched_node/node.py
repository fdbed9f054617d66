"""The node: one long-lived process that fires its windows itself and records them in Prefect.

A thin facade over single-purpose parts (Prefect's runner is the model: each
part is a class of its own, given what it needs):

=====================  ==============================================================
part                   what it does
=====================  ==============================================================
``Scheduler`` (kit)    the cache, pull, chain fires, and the firing loop: it wakes at each
                       window's start, decides through the start guard, starts the job
``Jobs``               slots, order, overlap, attempts in keeper processes, restarts
``Outbox``             every job on disk first, so nothing is lost or doubled
``Recorder``           the outbox into Prefect: runs, states, logs, artifacts, events
``Planner``            the coming windows as Scheduled runs (the Upcoming tab)
``Reconciler``         pull (interval, wake, on demand); plan; record what changed
``Control``            ad hoc runs, on-demand reconciles and cancels from Prefect
``Reporter``           the node's reports to the controller (jobs, heartbeat)
``Chain``              prune, then check, after the wave: from the node's own jobs
``Handoff``            the local door: jobs that flows run by Prefect's engine hand over
=====================  ==============================================================

The constructor assembles them in order (state on disk and the kit's Scheduler, with the
node's job start as its fire callback; the record; jobs and chain; reconcile, control,
report and the local door). :meth:`Node.run` takes up the outbox's
unfinished jobs, starts the threads, and fires windows in its own thread until stopped;
stopping leaves running jobs to their keepers, which the next start follows again.

``python -m sched_node`` (or ``sched agent``) runs it: settings from
``SCHED_CONFIG`` and ``SCHED_*``, Prefect from ``PREFECT_API_URL``.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from sched_core import Config, ConfigError, Fire, LocalSchedule, Scheduler
from sched_core.chain import FOLLOW_WINDOW
from sched_core.firing import NodeView
from sched_core.guard import retry_allowed, stage_retry_allowed
from sched_core.matcher import window_key
from sched_core.plan import TRIGGER_SCHEDULE, WINDOW_TRIGGERS, Missed, NextPlanned
from sched_core.policies import row_zone
from sched_core.render import render_argv
from sched_node.actions import job_environment
from sched_node.adhoc import AdHoc
from sched_node.chain import NodeChain
from sched_node.chain_run import ChainRuns
from sched_node.channel import NodeChannel
from sched_node.control import Control
from sched_node.engine import EngineRuns
from sched_node.handoff import Handoff
from sched_node.history import History
from sched_node.identity import AGENT_TAG, JobRef
from sched_node.jobs import Jobs, longest_run_s
from sched_node.launcher import WarmKeepers
from sched_node.local import DOOR_KEY_ENV, Door, LocalDoor, describe, flow_run_env
from sched_node.node_report import Reporter, build_report
from sched_node.outbox import (
    FAILED,
    KIND_JOB,
    SKIPPED,
    JobFolder,
    JobSpec,
    JobView,
    Outbox,
    job_id_for,
    utc_text,
)
from sched_node.planner import Planner
from sched_node.prefect_api import PrefectApi
from sched_node.reconcile import Reconciler
from sched_node.recorder import Recorder
from sched_node.registration import Deployments
from sched_node.repolock import repo_lock
from sched_node.settings import AgentSettings
from sched_node.vouch import Vouchers, door_key

log = logging.getLogger("sched_node.node")

STOP_GRACE_S = 10.0
"""How long the recorder and the reporter get to send what they hold when the node stops."""


def wall_clock() -> datetime:
    """Return the wall clock in UTC: the one clock read of the node."""
    return datetime.now(UTC)


class Node:
    """One node (the module's parts, assembled in its numbered steps)."""

    def __init__(self, settings: AgentSettings, *, api: PrefectApi,
                 clock: Any = wall_clock) -> None:
        self.settings = settings
        self.node = settings.node_name
        self.api = api
        self._clock = clock
        self._stopping = threading.Event()
        now = clock()
        self._state(now)
        self._record(now)
        self._work()
        self._talk()

    def _state(self, now: datetime) -> None:
        """Step 1: state on disk."""
        settings, state = self.settings, self.settings.state_dir
        self.outbox = Outbox(state / "outbox", max_bytes=settings.outbox_max_bytes,
                             node=self.node)
        self.history = History(state / "history.json", now=now)
        self.scheduler = self._build_scheduler(now)

    def _record(self, now: datetime) -> None:
        """Step 2: Prefect, the record."""
        settings, api, clock = self.settings, self.api, self._clock
        self.deployments = Deployments(api, self.node, tags=[AGENT_TAG],
                                       work_pool=settings.work_pool,
                                       job_env=flow_run_env(settings.state_dir),
                                       cache_path=settings.deployments_path)
        self.recorder = Recorder(api, self.outbox, self.deployments, node=self.node,
                                 clock=clock, done=self._recorded,
                                 planned=lambda key: self.planner.planned_run(key),
                                 parent_task_run=lambda spec: self.chain_runs.parent(spec),
                                 chain_pending=lambda day: self.chain_runs.pending(day),
                                 task_run=settings.record_task_run,
                                 artifact=settings.record_artifact)
        self.planner = Planner(api, self.deployments, settings.plan_path,
                               horizon=settings.plan_horizon, min_windows=settings.plan_min_windows,
                               max_runs=settings.plan_max_runs, now=now,
                               retries_of=self._retries_of)

    def _work(self) -> None:
        """Steps 3 and 4: jobs (warm keepers started ahead take them), the chain."""
        settings, clock = self.settings, self._clock
        self.keepers = WarmKeepers()
        self.jobs = Jobs(self.outbox, slots=settings.job_limit, clock=clock,
                         env_for=self._job_env,
                         on_change=self._changed, on_end=self._ended, may_rerun=self._may_rerun,
                         repo_lock=self._repo_lock, warm=self.keepers, render=self._render)
        self.chain = NodeChain(settings, self.scheduler, self.jobs, self.history, clock)
        self.chain_runs = ChainRuns(self.outbox, node=self.node, clock=clock,
                                    stages={stage.key(): stage.name for stage in settings.stages})

    def _talk(self) -> None:
        """Steps 5 and 6: reconcile, control, report; the local door, where flows that Prefect's
        engine runs here hand over jobs."""
        settings, api, clock = self.settings, self.api, self._clock
        self.vouchers = Vouchers(settings.state_dir / "vouchers.json", node=self.node,
                                 mode=settings.ad_hoc_runs, token=settings.bearer_token,
                                 clock=clock)
        key = door_key(settings.state_dir) if self.vouchers.required else None
        self._next_planned = NextPlanned(node=self.node, tz=settings.tz)
        self.reporter = Reporter(settings, self.outbox, clock=clock, facts=self._report_facts,
                                 done=self._reported,
                                 covered=lambda: self.channel.covered())
        self.adhoc = AdHoc(node=self.node, outbox=self.outbox, clock=clock, row=self._row,
                           known=self._known, spec=self._spec, start=self.start_job,
                           fail=self.jobs.end_without_running,
                           cancel_job=lambda run_id, message: self.jobs.cancel(
                               flow_run_id=run_id, message=message),
                           reconcile=lambda run_id: self.reconciler.poke("on demand",
                                                                         run_id=run_id),
                           engine=EngineRuns(settings.state_dir / "engine", {
                               **flow_run_env(settings.state_dir), "PREFECT_API_URL": api.url,
                               **({DOOR_KEY_ENV: key} if key else {})}))
        self.control = Control(api, self.deployments, node=self.node, clock=clock,
                               run_job=self.adhoc.run_job, reconcile=self.adhoc.reconcile,
                               engine=self.adhoc.chain, cancel=self.adhoc.cancel,
                               busy=self.adhoc.busy, work_pool=settings.work_pool,
                               heartbeat_s=settings.worker_heartbeat.total_seconds(),
                               vouchers=self.vouchers)
        self.channel = NodeChannel(settings, control=self.control, deployments=self.deployments,
                                   api_url=api.url, etag=self.scheduler.etag,
                                   changed=lambda reason: self.reconciler.poke(reason))
        self.reconciler = Reconciler(
            settings, clock=clock, scheduler=self.scheduler, view=self.view,
            planner=self.planner, deployments=self.deployments, control=self.control,
            outbox=self.outbox, reporter=self.reporter, recorded=self.recorder.wake,
            start_checked=self.channel.takes_start_check)
        self.handoff = Handoff(node=self.node, outbox=self.outbox, clock=clock, row=self._row,
                               known=self._known, spec=self._spec, start=self.start_job,
                               wake=self.recorder.wake, door_key=key)
        self.door = LocalDoor(settings.state_dir, Door(
            node=lambda: describe(self.node, self.scheduler.schedules(), settings.stages),
            submit=self.handoff.submit, job=self.handoff.job,
            recorded=self.handoff.recorded, reconcile=self.reconciler.run_now))

    def _build_scheduler(self, now: datetime) -> Scheduler:
        client: httpx.Client | None = None
        settings = self.settings
        if settings.pull_url.startswith(("http://", "https://")):
            token = settings.bearer_token()
            client = httpx.Client(
                headers={"Authorization": f"Bearer {token}"} if token else {},
                timeout=settings.pull_timeout.total_seconds(), follow_redirects=True)
        self._pull_client = client
        return Scheduler(Config(pull_url=settings.pull_url, node_name=self.node,
                                cache_path=settings.cache_path, fire=self._fire,
                                skip=self._skip, missed=self._missed, fail=self._fail,
                                ahead=lambda n: self.keepers.want(min(n, settings.job_limit)),
                                decided_path=settings.state_dir / "decided.json",
                                clock=self._clock, http_client=client, timezone=settings.tz,
                                fire_grace=settings.grace), now=now)

    # -- what the parts read ------------------------------------------------------------

    def view(self, now: datetime) -> NodeView:
        """Return the node's schedules as the firing decisions read them."""
        cache = self.scheduler.snapshot()
        return NodeView(rows=cache.schedules, last_fired=cache.last_fired_at,
                        first_seen=cache.first_seen_at, tz=self.settings.tz, node=self.node,
                        grace=self.settings.grace)

    def _known(self) -> list[str]:
        return [row.id for row in self.scheduler.schedules()]

    def _retries_of(self, action: str) -> tuple[int, float]:
        spec = self.settings.actions.get(action)
        return (spec.retries, spec.retry_delay.total_seconds()) if spec else (0, 0.0)

    def _job_env(self, spec: JobSpec) -> dict[str, str]:
        """A job's environment (:func:`sched_node.actions.job_environment`): never the agent's
        credentials, ``TZ`` the row's zone (UTC unless it has one), the action's ``env``."""
        action = self.settings.actions.get(spec.action) if spec.kind == KIND_JOB else None
        return job_environment(action.env if action else {}, tz=spec.zone)

    def _row(self, schedule_id: str) -> LocalSchedule | None:
        return next((row for row in self.scheduler.schedules() if row.id == schedule_id), None)

    def _spec(self, row: LocalSchedule, *, trigger: str, window: datetime | None, key: str,
              start: datetime | None, reason: str, now: datetime,
              flow_run_id: str | None = None, run_name: str | None = None,
              recorded_by: str = "node") -> JobSpec:
        ref = JobRef(node=self.node, action=row.action, schedule_id=row.id,
                     trigger_key=trigger, window=window, key=key)
        action = self.settings.actions.get(row.action)
        return JobSpec(
            job_id=job_id_for(now, ref.idempotency_key if flow_run_id is None else flow_run_id),
            kind=KIND_JOB, node=self.node, schedule_id=row.id, action=row.action,
            trigger_key=trigger, window=window, key=key,
            run_name=run_name or ref.name(now=now),
            idempotency_key=None if flow_run_id else ref.idempotency_key,
            flow_run_id=flow_run_id, planned_start=start, accepted_at=now, reason=reason,
            cwd=str(action.cwd) if action and action.cwd else None,
            timeout_s=action.timeout.total_seconds() if action else 0.0,
            retries=action.retries if action else 0,
            retry_delay_s=action.retry_delay.total_seconds() if action else 0.0,
            umask=self.settings.job_umask, tags=ref.tags(), parameters=ref.parameters(),
            overlap=(row.overlap.value if row.overlap else "skip"), zone=row.timezone or "",
            repo_lock=row.repo_id if row.repo_lock else None, recorded_by=recorded_by,
        )

    def _window_spec(self, row: LocalSchedule, window: datetime, *, start: datetime | None,
                     reason: str, now: datetime, trigger: str | None = None) -> JobSpec:
        key = window_key(row.id, window, row_zone(row, self.settings.tz))
        return self._spec(row, trigger=trigger or TRIGGER_SCHEDULE, window=window, key=key,
                          start=start, reason=reason, now=now)

    def _render(self, spec: JobSpec) -> list[str]:
        """Return the command the action table renders now for a job a restart took up, from
        its schedule (as cached now), window and trigger; ConfigError when it renders none."""
        row = self._row(spec.schedule_id)
        if row is None:
            raise ConfigError(f"schedule {spec.schedule_id!r} is not in the node's cache")
        if row.action != spec.action:
            raise ConfigError(f"schedule {spec.schedule_id!r} is now a {row.action!r} job, "
                              f"not {spec.action!r}")
        return render_argv(self.settings.action(row.action), row,
                           state_dir=self.settings.state_dir, node=self.node,
                           window=spec.window, trigger_key=spec.trigger_key,
                           now=spec.accepted_at)

    def start_job(self, row: LocalSchedule, spec: JobSpec, lines: list[str]) -> JobFolder:
        """Fill the command from the row and hand the job over; a refused value fails it here."""
        window = spec.window.isoformat() if spec.window else "none"
        lines = [*lines, f"job {row.action} of schedule {row.id} ({row.name}), window {window}, "
                         f"trigger {spec.trigger_key}, key {spec.key}"]
        try:
            action = self.settings.action(row.action)
            argv = render_argv(action, row, state_dir=self.settings.state_dir, node=self.node,
                               window=spec.window, trigger_key=spec.trigger_key,
                               now=spec.accepted_at)
        except ConfigError as exc:
            return self.jobs.end_without_running(spec, FAILED, str(exc), error=str(exc),
                                                 lines=lines)
        spec = JobSpec(**{**spec.__dict__, "argv": argv})
        return self.jobs.accept(spec, lines=[*lines, f"running {argv}"])

    # -- the firing loop's callbacks (the kit's loop calls them, several at once) -------

    def _fire(self, fire: Fire) -> None:
        """A window the start guard runs (or a chain stage) becomes a job now; raise when it
        did not start (the outbox cannot be written): the kit takes the stamp back, and
        tries the window again or ends it with the reason."""
        if fire.window is None:
            self._stage_fire(fire)
            return
        now = self._clock()
        spec = self._window_spec(fire.schedule, fire.window, start=fire.start,
                                 reason=fire.reason, now=now, trigger=fire.trigger_key)
        late = (now - (fire.start or fire.window)).total_seconds()
        self.start_job(fire.schedule, spec, [f"start guard: {fire.reason} (the node decided "
                                             f"{late:.3f} s after the start)"])

    def _skip(self, fire: Fire) -> None:
        assert fire.window is not None
        spec = self._window_spec(fire.schedule, fire.window, start=None, reason=fire.reason,
                                 now=self._clock())
        self.jobs.end_without_running(spec, SKIPPED, fire.reason)

    def _fail(self, fire: Fire) -> None:
        """A window that could not start within its grace: a Failed record with the reason."""
        assert fire.window is not None
        spec = self._window_spec(fire.schedule, fire.window, start=fire.start,
                                 reason=fire.reason, now=self._clock())
        self.jobs.end_without_running(spec, FAILED, fire.reason, error=fire.reason)

    def _missed(self, items: list[Missed], view: NodeView) -> None:
        """Windows the node never decided (it was stopped): skip the planned ones, count all."""
        now = self._clock()
        rows = {row.id: row for row in view.rows}
        for item in items:
            row = rows.get(item.schedule_id)
            shown = ", ".join(utc_text(window) for window in item.windows)
            log.warning("schedule %s missed %d window(s) while the node was not running (%s%s); %s",
                        item.schedule_id, item.count, shown,
                        " ..." if item.count > len(item.windows) else "",
                        "the latest is recovered" if item.recover else
                        "none is recovered (miss policy)",
                        extra={"node": self.node, "schedule_id": item.schedule_id,
                               "missed": item.count})
            self.history.add_missed(item.schedule_id, item.count, now=now)
            if row is None:
                continue
            reason = (f"missed: the node was not running at its start; miss policy "
                      f"{row.miss_policy.value}")
            for window in item.windows:
                spec = self._window_spec(row, window, start=None, reason=reason, now=now)
                recovered = item.recover is not None and window == item.recover.window
                if not recovered and self.planner.planned_run(f"{self.node}:{spec.key}"):
                    self.jobs.end_without_running(spec, SKIPPED, reason)

    # -- jobs' hooks --------------------------------------------------------------------

    def _changed(self, folder: JobFolder) -> None:
        self.recorder.wake(folder)
        self.reporter.poke()

    def _ended(self, view: JobView) -> None:
        now = self._clock()
        self.history.add(view, now=now)
        self.recorder.wake()
        self.reporter.poke()
        self.chain_runs.ended(view)
        self.chain.fired = []
        note = self.chain.on_end(view, now)
        if self.chain.fired:
            self.chain_runs.empty(self.chain.fired)
        if note:
            self.outbox.folder(view.spec.job_id).log(now, note)

    def _may_rerun(self, spec: JobSpec) -> tuple[bool, str]:
        now = self._clock()
        row = self._row(spec.schedule_id)
        if spec.trigger_key in WINDOW_TRIGGERS and spec.window is not None:
            decision = retry_allowed(row, self.view(now), schedule_id=spec.schedule_id,
                                     window=spec.window, now=now)
            return decision.runs, decision.reason
        stage = self.settings.stage(spec.trigger_key)
        if stage is not None:
            decision = stage_retry_allowed(row, schedule_id=spec.schedule_id, stage=stage.name,
                                           action=stage.action, on=stage.on, stopped_at=None,
                                           now=now, follow=FOLLOW_WINDOW, tz=self.settings.tz)
            return decision.runs, decision.reason
        return False, "an ad hoc run is not run again: whoever started it sees how it ended"

    def _repo_lock(self, spec: JobSpec, folder: JobFolder) -> AbstractContextManager[None]:
        if not spec.repo_lock:
            return nullcontext()

        def say(text: str) -> None:
            folder.log(self._clock(), text)
            self.recorder.wake()

        return repo_lock(self.api, spec.repo_lock, wait_s=longest_run_s(spec), info=say,
                         warn=say)

    def _recorded(self, folder: JobFolder) -> None:
        """A folder whose record is complete goes once its end was reported (jobs only)."""
        reported = (folder.read_json("report.json") or {}).get("done")
        if not self.reporter.enabled or reported or folder.spec().kind != KIND_JOB:
            self.outbox.forget(folder)

    def _reported(self, folder: JobFolder) -> None:
        sent = folder.read_json("report.json") or {}
        folder.write_json("report.json", {**sent, "done": True})
        if (folder.read_json("record.json") or {}).get("complete"):
            self.outbox.forget(folder)

    # -- the chain ----------------------------------------------------------------------

    def _stage_fire(self, fire: Fire) -> None:
        """The kit's fire callback: a chain stage's schedule becomes a job now."""
        # The chain day's folder first, so that it is recorded before the job (accept order).
        self.chain_runs.fired(fire.trigger_key, fire.key, fire.schedule.id)
        now = self._clock()
        spec = self._spec(fire.schedule, trigger=fire.trigger_key, window=None, key=fire.key,
                          start=None, reason=f"fired by the chain ({fire.trigger_key})", now=now)
        self.start_job(fire.schedule, spec, [f"chain: {fire.trigger_key} fired {fire.key}"])

    # -- the report ---------------------------------------------------------------------

    def _report_facts(self, now: datetime) -> dict[str, Any]:
        counts = {"skipped": sum(1 for item in self.history.since(now - timedelta(hours=24))
                                 if item.state == SKIPPED),
                  "missed": self.history.missed_since(now - timedelta(hours=24))}
        return build_report(self.settings, self.scheduler.snapshot(), now=now,
                            last_pull=self.reconciler.last_pull,
                            latest=self.history.latest_by_schedule(), counts=counts, jobs=[],
                            next_planned=self._next_planned)

    # -- run ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the node to stop (from a signal handler or another thread)."""
        self._stopping.set()
        self.scheduler.wake()

    def run(self) -> None:
        """Run until :meth:`stop` (step 6)."""
        stop = self._stopping
        resumed = self.jobs.resume()
        for name, what in resumed:
            log.info("outbox job %s: %s", name, what, extra={"node": self.node})
        self.recorder.start()
        self.reporter.start()
        self.reconciler.start()
        self.channel.start()
        self.door.start()
        try:
            self.scheduler.run(stop)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop every part; running jobs go on in their keepers (the next start follows them)."""
        self._stopping.set()
        self.door.stop()
        self.channel.stop()
        self.reconciler.stop()
        self.jobs.stop()
        self.keepers.close()
        deadline = time.monotonic() + STOP_GRACE_S
        self.reporter.send_now()
        self.reporter.stop()
        while time.monotonic() < deadline and self.recorder.reachable:
            try:
                if not self.recorder.drain():
                    break
            except Exception:
                break
        self.recorder.stop()
        self.api.close()
        if self._pull_client is not None:
            self._pull_client.close()
