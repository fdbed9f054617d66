"""The record steps of one job, each done once (the steps of :mod:`sched_node.recorder`).

A job's record has the shape of a run of its flow (``flows/run_job.py``) as Prefect's engine
would leave it, written through Prefect's client and schemas:

- the flow run's states: Running at the first try's start; for each try that failed and is
  tried again, AwaitingRetry (scheduled at the retry) then Running named Retrying, so the
  run's ``run_count`` is its number of tries; at the end its final state;
- one ``run-command`` task run per try (the flow's own task), Running at the try's start,
  Completed or Failed at its end;
- the node's lines and every try's output as the run's logs, each with the time it was
  written, in requests of at most :data:`LOG_BATCH` lines;
- the artifact, and one ``sched.job.*`` event whose ``occurred`` is the real end.

Each step is noted in the job's ``record.json`` when it is done, and as ``inflight`` just
before it is sent; a step found in flight after a restart is checked against the server
before it is sent again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sched_node.outbox import (
    CANCELLED,
    COMPLETED,
    CRASHED,
    FAILED,
    KIND_RECONCILE,
    SKIPPED,
    JobFolder,
    JobView,
    parse_time,
    utc_text,
)
from sched_node.prefect_api import TERMINAL, PrefectRefused, new_state
from sched_node.records import job_event, job_markdown
from sched_node.registration import PLANNED_QUEUE

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from sched_node.records import RecordParts

log = logging.getLogger("sched_node.recorder")

LOG_BATCH = 500
"""Log lines per request (all the job's files together)."""
LOG_BATCH_BYTES = 1 << 20
"""The most of a log file read at once; a request stops taking files past it."""


def read_lines(folder: JobFolder, name: str, start: int,
               limit: int = LOG_BATCH) -> tuple[list[dict[str, Any]], int]:
    """Return up to limit JSON lines of a log file from byte start, and the byte after them.

    Only whole lines are read: the part after the last newline may still be written.
    """
    try:
        with open(folder.path / name, "rb") as handle:
            handle.seek(start)
            data = handle.read(LOG_BATCH_BYTES)
    except FileNotFoundError:
        return [], start
    found: list[dict[str, Any]] = []
    end = start
    for raw in data.split(b"\n")[:-1][:limit]:
        end += len(raw) + 1
        try:
            value = json.loads(raw)
        except ValueError:
            value = {"t": None, "m": raw.decode("utf-8", "replace")}
        found.append(value if isinstance(value, dict) else {"t": None, "m": str(value)})
    if not found and len(data) == LOG_BATCH_BYTES:  # one line longer than a batch: skip it
        cut = data.find(b"\n")
        return [{"t": None, "m": "[an output line longer than 1 MiB was left out]"}], (
            start + cut + 1 if cut >= 0 else start + len(data))
    return found, end


def sent_states(found: list[dict[str, Any]], wanted: list[State[Any]]) -> int:
    """Return how many of the wanted states (in order) the run's states read back end with:
    the most m such that the last m states on the server are the first m wanted (type and
    name). A kill in mid-request leaves m at the count sent before, or one more."""
    server = [(item.get("type"), item.get("name")) for item in found]
    ours = [(state.type.value, state.name) for state in wanted]
    for m in range(min(len(server), len(ours)), 0, -1):
        if server[-m:] == ours[:m]:
            return m
    return 0


class Steps:
    """The record steps of one job (the module's shape), each done once."""

    def __init__(self, recorder: RecordParts, folder: JobFolder, view: JobView,
                 progress: dict[str, Any]) -> None:
        self.r = recorder
        self.api = recorder.api
        self.folder = folder
        self.view = view
        self.spec = view.spec
        self.p = progress
        self._upgrade()

    def _upgrade(self) -> None:
        """Read the progress an older node noted (``running``, ``final``, one ``task_run_id``
        for every try) as this one notes it, so a job it began is finished, nothing twice."""
        if "flow_states" in self.p or not ({"running", "final", "task_run_id"} & set(self.p)):
            return
        if self.p.get("running"):
            self.p["flow_states"] = 1
        if self.p.get("task_run_id") and "task_runs" not in self.p:
            self.p["task_runs"] = {"1": {"id": self.p["task_run_id"]}}
        if self.p.get("final"):
            self.p["flow_states"] = len(self._flow_states())
        if self.p.get("inflight") in ("running", "final"):
            self.p["inflight"] = f"flow_state:{self.p.get('flow_states', 0)}"
        self.p.setdefault("flow_states", 0)
        self._save()

    def _save(self) -> None:
        self.folder.write_json("record.json", self.p)

    def _step(self, name: str) -> Iterator[None]:
        """Run a step once: mark it in flight, do it, mark it done (use with ``for _ in``)."""
        if self.p.get(name):
            return
        self.p["inflight"] = name
        self._save()
        yield
        self.p[name] = True
        self.p.pop("inflight", None)
        self._save()

    @property
    def run(self) -> str:
        run_id = self.p.get("flow_run_id")
        assert isinstance(run_id, str)
        return run_id

    def _deployment(self) -> str:
        return self.r.deployments.get()[self.r.flow_of(self.spec)]

    # 1. the run
    def run_id(self) -> None:
        """Find the job's run: the one its creator made (ad hoc), the planner's (by its key),
        or one created now, Scheduled at its start, by its idempotency key (so the plan's run
        and this one are one run whoever creates it first)."""
        if self.p.get("flow_run_id"):
            return
        if self.spec.flow_run_id:
            self.p["flow_run_id"] = self.spec.flow_run_id
            self.p["adhoc"] = True
        else:
            planned = (self.r.planned(self.spec.idempotency_key)
                       if self.spec.idempotency_key else None)
            self.p["flow_run_id"] = planned or self._create()
        self._save()

    def _create(self) -> str:
        from prefect.client.schemas.actions import DeploymentFlowRunCreate
        from prefect.states import to_state_create

        scheduled = self.spec.planned_start or self.spec.accepted_at
        parent = self.r.parent_task_run(self.spec)
        body = DeploymentFlowRunCreate(
            name=self.spec.run_name, parameters=self.r.parameters_of(self.spec),
            tags=self.spec.tags, idempotency_key=self.spec.idempotency_key,
            state=to_state_create(new_state("SCHEDULED", scheduled_time=scheduled)),
            enforce_parameter_schema=False, work_queue_name=PLANNED_QUEUE,
            **({"parent_task_run_id": parent} if parent else {}))
        try:
            created = self.api.create_run(self._deployment(), body)
        except PrefectRefused as exc:
            if exc.status != 404:
                raise
            self.r.deployments.forget()  # the deployment was deleted: register it again
            created = self.api.create_run(self._deployment(), body)
        return str(created["id"])

    # 2. the flow run's states
    def flow_states(self, *, final: bool) -> None:
        """Send the flow run's states not sent yet (the module's shape); the final one only
        when final is true."""
        wanted = self._flow_states()
        if not final and self.view.phase == "ended" and wanted:
            wanted = wanted[:-1]
        sent = int(self.p.get("flow_states", 0))
        if sent == 0 and wanted and self.p.get("adhoc") and self.spec.kind != KIND_RECONCILE:
            self.api.update_run(self.run, name=self.spec.run_name, tags=self.spec.tags)
        for state in wanted[sent:]:
            self.p["inflight"] = f"flow_state:{sent}"
            self._save()
            self._set(state)
            sent += 1
            self.p["flow_states"] = sent
            self.p.pop("inflight", None)
            self._save()

    def _flow_states(self) -> list[State[Any]]:
        """Return every flow-run state of the job so far, in order (pure over the view)."""
        view = self.view
        offline = " (recorded late: the Prefect server was unreachable)" \
            if self.p.get("offline") else ""
        states: list[State[Any]] = []
        if not view.attempts:  # a reconcile, or a job that ran nothing (its final state only)
            if self.spec.kind == KIND_RECONCILE:
                states.append(new_state("RUNNING", message=f"started on {self.r.node} at "
                                        f"{utc_text(self.spec.accepted_at)}"))
            if view.phase == "ended":
                states.append(self._final_state())
            return states
        program = self.spec.argv[0] if self.spec.argv else self.spec.action
        for attempt in view.attempts:
            started = attempt.started_at or attempt.launched_at
            if attempt.number == 1:
                states.append(new_state("RUNNING", message=f"started on {self.r.node} at "
                                                           f"{utc_text(started)}{offline}"))
            else:
                states.append(new_state("RUNNING", name="Retrying",
                                        message=f"try {attempt.number} started at "
                                                f"{utc_text(started)}"))
            if not attempt.ended or attempt is view.attempts[-1]:
                continue
            failure = attempt.failure(program, self.spec.timeout_s)
            ended = utc_text(attempt.ended_at) if attempt.ended_at else "unknown"
            retry_at = self._retry_at(attempt.number) or attempt.ended_at
            states.append(new_state("SCHEDULED", name="AwaitingRetry", scheduled_time=retry_at,
                                    message=f"try {attempt.number} ended at {ended}: "
                                            f"{failure}"))
        if view.phase == "retrying":
            last = view.attempts[-1]
            failure = last.failure(program, self.spec.timeout_s)
            ended = utc_text(last.ended_at) if last.ended_at else "unknown"
            states.append(new_state("SCHEDULED", name="AwaitingRetry",
                                    scheduled_time=view.retry_at or last.ended_at,
                                    message=f"try {last.number} ended at {ended}: {failure}"))
        if view.phase == "ended":
            states.append(self._final_state())
        return states

    def _retry_at(self, number: int) -> datetime | None:
        """Return when the retry after try number was due (its journal's ``until``)."""
        for entry in self.folder.entries():
            if entry.get("e") == "retry" and str(entry.get("attempt")) == str(number):
                return parse_time(entry.get("until"))
        return None

    def _set(self, state: State[Any]) -> None:
        try:
            self.api.set_state(self.run, state, force=True)
        except PrefectRefused as exc:
            if exc.status != 404:
                raise
            log.warning("run %s of job %s was deleted on the server; its record is dropped",
                        self.run, self.spec.run_name, extra={"job_id": self.spec.job_id})

    # 3. a task run per try
    def task_runs(self) -> None:
        """Create each try's ``run-command`` task run in Running, and end it when the try
        ends (created by flow run, task key and try: sent twice, one task run)."""
        program = self.spec.argv[0] if self.spec.argv else self.spec.action
        runs: dict[str, Any] = self.p.setdefault("task_runs", {})
        for attempt in self.view.attempts:
            mark = str(attempt.number)
            found = runs.get(mark) or {}
            if not found.get("id"):
                started = attempt.started_at or attempt.launched_at
                found["id"] = self.api.create_task_run(
                    self.r.command_task, flow_run_id=self.run, dynamic_key=mark,
                    name=f"run-command-{mark}",
                    state=new_state("RUNNING", message=f"try {mark} started at "
                                                       f"{utc_text(started)}"))
                runs[mark] = found
                self._save()
            if attempt.ended and not found.get("ended"):
                ended = utc_text(attempt.ended_at) if attempt.ended_at else "unknown"
                if attempt.ok:
                    state = new_state("COMPLETED", message=f"{program} exited 0 at {ended}")
                else:
                    failure = attempt.failure(program, self.spec.timeout_s)
                    state = new_state("FAILED", message=f"{failure} (at {ended})")
                self.api.set_task_state(str(found["id"]), state)
                found["ended"] = True
                self._save()

    # logs
    def logs(self) -> None:
        """Send the node's lines and each try's output from where the last request stopped.

        One request carries new lines of every file (up to :data:`LOG_BATCH` lines);
        its byte ranges are noted as in flight, so a kill in mid-request is checked.
        """
        runs = self.p.get("task_runs") or {}
        sources: list[tuple[str, str, str | None]] = [("log.jsonl", "node", None)]
        sources += [(f"a{item.number}.out", f"a{item.number}",
                     str((runs.get(str(item.number)) or {}).get("id") or ""))
                    for item in self.view.attempts]
        while True:
            batch: list[Any] = []
            ranges: list[tuple[str, int, int]] = []
            size = 0
            for name, mark, task_run in sources:
                if len(batch) >= LOG_BATCH or size >= LOG_BATCH_BYTES:
                    break
                start = int(self.p.get("bytes", {}).get(mark, 0))
                lines, end = read_lines(self.folder, name, start, LOG_BATCH - len(batch))
                if end == start:
                    continue
                batch += [self._log(item, task_run) for item in lines]
                ranges.append((mark, start, end))
                size += end - start
            if not ranges:
                return
            self.p["inflight"] = "logs:" + ";".join(f"{m}:{a}:{b}" for m, a, b in ranges)
            self._save()
            self.api.send_logs(batch)
            for mark, _start, end in ranges:
                self.p.setdefault("bytes", {})[mark] = end
            self.p.pop("inflight", None)
            self._save()

    def _log(self, item: dict[str, Any], task_run: str | None) -> Any:
        """One log record: a try's output (task_run its task run's id, "" with none) or one of
        the node's lines (None)."""
        import uuid

        from prefect.client.schemas.actions import LogCreate

        stamp = parse_time(item.get("t")) or self.spec.accepted_at
        return LogCreate(name="sched.node" if task_run is None else "sched.job", level=20,
                         message=str(item.get("m", ""))[:100_000], timestamp=stamp,
                         flow_run_id=uuid.UUID(self.run),
                         task_run_id=uuid.UUID(task_run) if task_run else None)

    # 4. artifact, final state, event
    def artifact(self) -> None:
        from prefect.client.schemas.actions import ArtifactCreate

        for _ in self._step("artifact"):
            if self.spec.kind == KIND_RECONCILE:
                markdown = (self.folder.path / "artifact.md").read_text(encoding="utf-8")
                key = f"reconcile-{_slug(self.r.node)}"
            else:
                markdown = job_markdown(self.view, self.r.node)
                key = f"job-{_slug(self.r.node)}-{_slug(self.spec.schedule_id)}"
            self.api.create_artifact(ArtifactCreate(
                key=key, type="markdown", data=markdown, flow_run_id=self.run,
                description=f"{self.spec.run_name}: {self.view.end_state}"))

    def _final_state(self) -> State[Any]:
        view = self.view
        state = view.end_state or FAILED
        ended = utc_text(view.end_at) if view.end_at else "unknown"
        started = view.started_at
        if self.spec.kind == KIND_RECONCILE:
            when = f"on {self.r.node} at {ended}"
        elif started:
            when = f"ran on {self.r.node} from {utc_text(started)} to {ended}"
        else:
            when = f"decided on {self.r.node} at {ended}"
        message = f"{view.message} ({when})" if view.message else when
        if self.p.get("offline"):
            message += "; recorded after the Prefect server came back"
        if self.p.get("engine_gone"):
            message += ("; recorded by the node: the flow run that handed it the job went "
                        "away before its end")
        if state == SKIPPED:
            return new_state("COMPLETED", name=SKIPPED, message=message)
        kind = {COMPLETED: "COMPLETED", FAILED: "FAILED", CANCELLED: "CANCELLED",
                CRASHED: "CRASHED"}.get(state, "FAILED")
        return new_state(kind, message=message)

    def final(self) -> None:
        """Send the final state alone (a job an engine handed over, whose engine went away)."""
        for _ in self._step("final"):
            self._set(self._final_state())

    def event(self) -> None:
        for _ in self._step("event"):
            events = self._job_events()
            if events:
                self.api.emit_events(events)

    def _job_events(self) -> list[Any]:
        from prefect.events import Event

        state = self.view.end_state
        if state == SKIPPED or self.spec.kind == KIND_RECONCILE:
            extra = self.folder.read_json("events.json") or {}
            return [Event.model_validate(item) for item in extra.get("events", [])]
        started = self.view.started_at
        payload = {
            "node": self.r.node, "action": self.spec.action,
            "schedule_id": self.spec.schedule_id, "trigger_key": self.spec.trigger_key,
            "window": self.spec.window.isoformat() if self.spec.window else "",
            "key": self.spec.key, "flow_run_id": self.run,
            "flow_run_name": self.spec.run_name, "state": state or "",
            "started_at": utc_text(started) if started else None,
            "ended_at": utc_text(self.view.end_at) if self.view.end_at else None,
            "error": self.view.error, "offline": bool(self.p.get("offline")),
        }
        occurred = self.view.end_at or self.r.clock()
        return [Event.model_validate(job_event(self.r.node, payload,
                                               completed=state == COMPLETED,
                                               occurred=occurred))]

    # a restart in mid-step
    def check_inflight(self) -> None:
        """Settle a step a kill left in flight: done on the server already, or to send again."""
        step = self.p.get("inflight")
        if not isinstance(step, str) or not self.p.get("flow_run_id"):
            self.p.pop("inflight", None)
            return
        done = False
        if step.startswith("logs:"):
            done = self._logs_arrived(step)
        elif step == "artifact":
            done = bool(self.api.run_artifacts(self.run))
        elif step.startswith("flow_state:"):
            self.p["flow_states"] = sent_states(self.api.run_states(self.run),
                                                self._flow_states())
        elif step == "final":
            run = self.api.read_run(self.run) or {}
            done = ((run.get("state") or {}).get("type")) in TERMINAL
        if done:
            if step.startswith("logs:"):
                for mark, _start, end in _ranges(step):
                    self.p.setdefault("bytes", {})[mark] = end
            elif step in ("artifact", "final"):
                self.p[step] = True
        self.p.pop("inflight", None)
        self._save()

    def _logs_arrived(self, step: str) -> bool:
        """Return whether the request a kill left in flight (its files' byte ranges) reached
        the server.

        One request's lines are stored together or not at all, so its last line is
        looked for among the run's logs from that line's time on.
        """
        import uuid

        from prefect.client.schemas.filters import (
            LogFilter,
            LogFilterFlowRunId,
            LogFilterTimestamp,
        )

        mark, start, end = _ranges(step)[-1]
        name = "log.jsonl" if mark == "node" else f"{mark}.out"
        try:
            with open(self.folder.path / name, "rb") as handle:
                handle.seek(int(start))
                data = handle.read(int(end) - int(start))
        except FileNotFoundError:
            return True
        lines = [line for line in data.split(b"\n") if line]
        if not lines:
            return True
        try:
            last = json.loads(lines[-1])
        except ValueError:
            return False
        after = parse_time(last.get("t"))
        found = self.api.filter_logs(LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(self.run)]),
            timestamp=LogFilterTimestamp(after_=after) if after else None))
        return any(item.get("message") == last.get("m") for item in found)


def _ranges(step: str) -> list[tuple[str, int, int]]:
    """Return the (file mark, start, end) byte ranges of a ``logs:`` step in flight
    (``logs:node:0:80;a1:0:120``)."""
    ranges = []
    for part in step.removeprefix("logs:").split(";"):
        mark, start, end = part.split(":")
        ranges.append((mark, int(start), int(end)))
    return ranges


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"
