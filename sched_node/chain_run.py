"""The day's chain of the node as one run of ``chain/<node>``: its stages in order, their jobs.

When the node's chain (:mod:`sched_node.chain`) fires a stage, the stage and each of its
jobs are noted in the chain day's folder in the outbox (kind ``chain``, made at the first
stage's first job, before the job: so it is recorded first), and each of those jobs' ends
when it ends. The recorder (:class:`ChainSteps`) writes it into Prefect as a run of the
``chain`` flow, as Prefect's engine would show the flow's own run (``flows/chain.py``):

1. the run, ``chain-<node>-<day>`` (idempotency key ``<node>:chain@<day>``: one run a chain
   day), Running from its first stage's fire;
2. one task run of the flow's ``stage`` task per stage, named after it, Running when it
   fires and Completed (or Failed, when one of its jobs failed) when its jobs have ended;
   each of its jobs' ``run-job`` runs is a child run under it;
3. its final state once the last stage's jobs have ended and their runs are recorded:
   Completed, or Failed naming the jobs that did not complete.

A stage that matched no schedule is noted as fired with no job. The folder goes when the
run's record is complete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sched_node.outbox import (
    COMPLETED,
    FAILED,
    SKIPPED,
    JobFolder,
    JobSpec,
    JobView,
    Outbox,
    job_id_for,
    parse_time,
    utc_text,
)
from sched_node.prefect_api import new_state
from sched_node.registration import CHAIN, PLANNED_QUEUE

if TYPE_CHECKING:
    from sched_node.records import RecordParts

log = logging.getLogger(__name__)

KIND_CHAIN = "chain"
CHAIN_TRIGGER = "chain"
OK_STATES = frozenset({COMPLETED, SKIPPED})


@dataclass
class StageState:
    """One stage of a chain day as its folder's entries tell it."""

    name: str
    fired_at: datetime
    jobs: list[str] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """True once every job it fired has ended (a stage with none at once)."""
        return all(job in self.ended for job in self.jobs)

    @property
    def ok(self) -> bool:
        """True when every job it fired completed (or was skipped)."""
        return all(self.ended.get(job) in OK_STATES for job in self.jobs)


def stages_of(entries: list[dict[str, Any]]) -> list[StageState]:
    """Return the stages of a chain day in the order they fired (pure over its entries)."""
    found: dict[str, StageState] = {}
    for entry in entries:
        name = str(entry.get("stage") or "")
        at = parse_time(entry.get("at"))
        if not name or at is None:
            continue
        if entry.get("e") == "fired":
            stage = found.setdefault(name, StageState(name, at))
            job = str(entry.get("schedule_id") or "")
            if job and job not in stage.jobs:
                stage.jobs.append(job)
        elif entry.get("e") == "job_end" and name in found:
            found[name].ended[str(entry.get("schedule_id"))] = str(entry.get("state"))
    return list(found.values())


def chain_end(stages: list[StageState], last: str) -> tuple[str, str] | None:
    """Return the chain day's (state, message) once its last stage fired and every stage's
    jobs ended; None before."""
    if not stages or not any(stage.name == last for stage in stages):
        return None
    if not all(stage.done for stage in stages):
        return None
    failed = [f"{stage.name}: {job} {state}" for stage in stages
              for job, state in stage.ended.items() if state not in OK_STATES]
    if failed:
        return FAILED, "; ".join(failed)
    return COMPLETED, "; ".join(f"{stage.name}: {len(stage.jobs)} job(s)" for stage in stages)


class ChainRuns:
    """The node's side: note each stage's fire, its jobs and their ends (the module's text)."""

    def __init__(self, outbox: Outbox, *, node: str, clock: Callable[[], datetime],
                 stages: dict[str, str]) -> None:
        """``stages``: each stage's trigger key to its name, in the chain's order."""
        self.outbox = outbox
        self.node = node
        self._clock = clock
        self.stages = stages
        self._lock = threading.Lock()

    def _find(self, day: str) -> JobFolder | None:
        for folder in self.outbox.jobs():
            try:
                spec = folder.spec()
            except ValueError:
                continue
            if spec.kind == KIND_CHAIN and spec.key == f"{CHAIN_TRIGGER}@{day}":
                return folder
        return None

    def _folder(self, day: str, now: datetime) -> JobFolder:
        found = self._find(day)
        if found is not None:
            return found
        key = f"{CHAIN_TRIGGER}@{day}"
        spec = JobSpec(
            job_id=job_id_for(now, f"{self.node}:{key}"), kind=KIND_CHAIN, node=self.node,
            schedule_id="", action=CHAIN_TRIGGER, trigger_key=CHAIN_TRIGGER, window=None,
            key=key, run_name=f"chain-{self.node}-{day}", idempotency_key=f"{self.node}:{key}",
            flow_run_id=None, planned_start=None, accepted_at=now,
            reason=f"the chain of {day} after the wave",
            tags=["sched-agent", f"node:{self.node}", f"trigger:{CHAIN_TRIGGER}"])
        return self.outbox.create(spec)

    def fired(self, trigger_key: str, key: str, schedule_id: str) -> None:
        """Note a stage's job, fired now (before it is accepted); key is its chain key."""
        stage = self.stages.get(trigger_key)
        if stage is None:
            return
        day = key.rsplit("@", 1)[-1]
        now = self._clock()
        with self._lock:
            self._folder(day, now).append({"e": "fired", "stage": stage, "at": utc_text(now),
                                           "schedule_id": schedule_id})

    def empty(self, names: list[str]) -> None:
        """Note stages that fired now matching no schedule (no job to wait for), in the
        latest chain day."""
        now = self._clock()
        with self._lock:
            folders = [folder for folder in self.outbox.jobs() if _is_chain(folder)]
            if not folders:
                return
            folder = folders[-1]
            known = {stage.name for stage in stages_of(folder.entries())}
            for name in names:
                if name not in known:
                    folder.append({"e": "fired", "stage": name, "at": utc_text(now)})
            self._close(folder, now)

    def ended(self, view: JobView) -> None:
        """Note a stage job's end; end the chain day once its last stage's jobs ended."""
        stage = self.stages.get(view.spec.trigger_key)
        if stage is None:
            return
        day = view.spec.key.rsplit("@", 1)[-1]
        now = self._clock()
        with self._lock:
            folder = self._find(day)
            if folder is None:
                return
            folder.append({"e": "job_end", "stage": stage, "schedule_id": view.spec.schedule_id,
                           "state": view.end_state or FAILED,
                           "at": utc_text(view.end_at or now)})
            self._close(folder, now)

    def _close(self, folder: JobFolder, now: datetime) -> None:
        entries = folder.entries()
        if any(entry.get("e") == "end" for entry in entries):
            return
        last = list(self.stages.values())[-1]
        ended = chain_end(stages_of(entries), last)
        if ended is not None:
            state, message = ended
            folder.append({"e": "end", "at": utc_text(now), "state": state, "message": message,
                           "error": message if state == FAILED else None})

    def day_of(self, spec: JobSpec) -> str | None:
        """Return the chain day a stage job belongs to, or None for any other job."""
        if spec.trigger_key not in self.stages:
            return None
        return spec.key.rsplit("@", 1)[-1]

    def pending(self, day: str) -> bool:
        """Return whether a stage job of the chain day has a record still under way (the
        day's run ends, and its folder goes, after its children's records)."""
        for folder in self.outbox.jobs():
            try:
                spec = folder.spec()
            except ValueError:
                continue
            if self.day_of(spec) == day and not (folder.read_json("record.json") or {}).get(
                    "complete"):
                return True
        return False

    def parent(self, spec: JobSpec) -> str | None:
        """Return the task run a stage job's run belongs under (its stage's), once recorded."""
        day = self.day_of(spec)
        folder = self._find(day) if day else None
        if folder is None:
            return None
        progress = folder.read_json("record.json") or {}
        stage = (progress.get("stages") or {}).get(self.stages[spec.trigger_key]) or {}
        found = stage.get("id")
        return str(found) if found else None


def _is_chain(folder: JobFolder) -> bool:
    try:
        return folder.spec().kind == KIND_CHAIN
    except ValueError:
        return False


class ChainSteps:
    """The record of a chain day (the module's steps 1-3), each step once."""

    def __init__(self, recorder: RecordParts, folder: JobFolder, view: JobView,
                 progress: dict[str, Any]) -> None:
        self.r = recorder
        self.api = recorder.api
        self.folder = folder
        self.view = view
        self.p = progress

    def _save(self) -> None:
        self.folder.write_json("record.json", self.p)

    def record(self) -> bool:
        """Write what is new of the chain day; return whether its record is complete."""
        from prefect.client.schemas.actions import DeploymentFlowRunCreate
        from prefect.states import to_state_create

        from flows.chain import stage as stage_task

        spec = self.view.spec
        stages = stages_of(self.folder.entries())
        if not stages:
            return False
        if not self.p.get("flow_run_id"):
            created = self.api.create_run(self.r.deployments.get()[CHAIN],
                                          DeploymentFlowRunCreate(
                name=spec.run_name, parameters={}, tags=spec.tags,
                idempotency_key=spec.idempotency_key, enforce_parameter_schema=False,
                work_queue_name=PLANNED_QUEUE,
                state=to_state_create(new_state("SCHEDULED",
                                                scheduled_time=stages[0].fired_at))))
            self.p["flow_run_id"] = str(created["id"])
            self._save()
        run = str(self.p["flow_run_id"])
        if not self.p.get("running"):
            self.api.set_state(run, new_state("RUNNING", message=(
                f"stage {stages[0].name} fired on {self.r.node} at "
                f"{utc_text(stages[0].fired_at)}")), force=True)
            self.p["running"] = True
            self._save()
        known: dict[str, Any] = self.p.setdefault("stages", {})
        for stage in stages:
            found = known.setdefault(stage.name, {})
            if not found.get("id"):
                found["id"] = self.api.create_task_run(
                    stage_task, flow_run_id=run, dynamic_key=stage.name, name=stage.name,
                    state=new_state("RUNNING", message=f"fired at {utc_text(stage.fired_at)}: "
                                    f"{', '.join(stage.jobs) or 'no schedule of this stage'}"))
                self._save()
            if stage.done and not found.get("ended"):
                summary = ", ".join(f"{job} {state}" for job, state in stage.ended.items())
                self.api.set_task_state(str(found["id"]), new_state(
                    "COMPLETED" if stage.ok else "FAILED",
                    message=summary or "no schedule of this stage"))
                found["ended"] = True
                self._save()
        if self.view.phase != "ended" or self.r.chain_pending(spec.key.rsplit("@", 1)[-1]):
            return False
        if not self.p.get("final"):
            kind = "COMPLETED" if self.view.end_state == COMPLETED else "FAILED"
            self.api.set_state(run, new_state(kind, message=self.view.message), force=True)
            self.p["final"] = True
        self.p["complete"] = True
        self._save()
        return True

