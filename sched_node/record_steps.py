"""The record steps of one job, each done once (steps 1-4 of :mod:`sched_node.recorder`).

Each step is noted in the job's ``record.json`` when it is done, and as ``inflight``
just before it is sent; a step found in flight after a restart is checked against
the server before it is sent again. The node's lines and every try's output go
together as the run's logs, in requests of at most :data:`LOG_BATCH` lines (each
file read :data:`LOG_BATCH_BYTES` at a time). The command's task run is created in
its first state (Running), one request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
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
    utc_text,
)
from sched_node.prefect_api import PrefectRefused, state_body
from sched_node.records import job_event, job_markdown
from sched_node.registration import RECONCILE, RUN_JOB

if TYPE_CHECKING:
    from sched_node.recorder import Recorder

log = logging.getLogger("sched_node.recorder")

LOG_BATCH = 500
"""Log lines per request (all the job's files together)."""
LOG_BATCH_BYTES = 1 << 20
"""The most of a log file read at once; a request stops taking files past it."""
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})

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


class Steps:
    """The record steps of one job, each done once (the module's steps 1-4)."""

    def __init__(self, recorder: Recorder, folder: JobFolder, view: JobView,
                 progress: dict[str, Any]) -> None:
        self.r = recorder
        self.api = recorder.api
        self.folder = folder
        self.view = view
        self.spec = view.spec
        self.p = progress

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
        flow = RECONCILE if self.spec.kind == KIND_RECONCILE else RUN_JOB
        return self.r.deployments.get()[flow]

    # 1. the run
    def _planned(self) -> bool:
        """Return whether the job's run is most likely one the planner made (a window's)."""
        return bool(self.spec.kind != KIND_RECONCILE and not self.spec.flow_run_id
                    and self.spec.idempotency_key and self.spec.planned_start)

    def _mine(self) -> dict[str, Any]:
        """Return the filter of the job's run by its idempotency key."""
        return {"deployment_id": {"any_": [self._deployment()]},
                "idempotency_key": {"any_": [self.spec.idempotency_key]}}

    def run_id(self) -> None:
        if self.p.get("flow_run_id"):
            return
        if self.spec.flow_run_id:
            self.p["flow_run_id"] = self.spec.flow_run_id
        else:
            scheduled = self.spec.planned_start or self.spec.accepted_at
            body = {
                "name": self.spec.run_name,
                "parameters": self.spec.parameters,
                "tags": self.spec.tags,
                "idempotency_key": self.spec.idempotency_key,
                "state": state_body("SCHEDULED", scheduled_time=scheduled),
                "enforce_parameter_schema": False,
            }
            try:
                created = self.api.create_run(self._deployment(), body)
            except PrefectRefused as exc:
                if exc.status != 404:
                    raise
                self.r.deployments.forget()  # the deployment was deleted: register it again
                created = self.api.create_run(self._deployment(), body)
            self.p["flow_run_id"] = str(created["id"])
        self._save()

    # 2. Running
    def running(self) -> None:
        """Put the run in Running, finding it first if needed, in as few requests as it can.

        A window's run (planned ahead, found by its idempotency key) goes to Running
        in one request; a run with no planned run is created Scheduled at its planned
        start (as the planner would have), then set Running; an ad hoc run is named
        and tagged as a planned one would be, then set Running.
        """
        started = self.view.started_at or self.spec.accepted_at
        offline = bool(self.p.get("offline"))
        for _ in self._step("running"):
            note = " (recorded late: the Prefect server was unreachable)" if offline else ""
            state = state_body("RUNNING", message=f"started on {self.r.node} at "
                                                  f"{utc_text(started)}{note}")
            if not self.p.get("flow_run_id") and self._planned():
                found = self.api.set_state_where(self._mine(), state, force=True)
                if found:
                    self.p["flow_run_id"] = str(found[0]["flow_run_id"])
                    continue  # done: the step is noted with the run's id
            self.run_id()
            if self.spec.flow_run_id and self.spec.kind != KIND_RECONCILE:
                self.api.update_run(self.run, name=self.spec.run_name, tags=self.spec.tags)
            self._set(state)
        self.p.setdefault("offline", False)

    def _set(self, state: dict[str, Any]) -> None:
        try:
            self.api.set_state(self.run, state, force=True)
        except PrefectRefused as exc:
            if exc.status != 404:
                raise
            log.warning("run %s of job %s was deleted on the server; its record is dropped",
                        self.run, self.spec.run_name, extra={"job_id": self.spec.job_id})

    # 3. the task run and its tries
    def task_run(self) -> None:
        """Create the command's task run in its first state (Running), then send the others.

        Created by flow run, task key and dynamic key, so a create sent twice gives the
        same task run.
        """
        wanted = self._task_states()
        if not self.p.get("task_run_id"):
            self.p["task_run_id"] = self.api.create_task_run({
                "name": "run-command", "flow_run_id": self.run, "task_key": "run-command",
                "dynamic_key": "0", "state": wanted[0],
                "empirical_policy": {"retries": self.spec.retries,
                                     "retry_delay": self.spec.retry_delay_s},
            })
            self.p["task_states"] = 1
            self._save()
        sent = int(self.p.get("task_states", 0))
        for state in wanted[sent:]:
            self.api.set_task_state(str(self.p["task_run_id"]), state)
            sent += 1
            self.p["task_states"] = sent
            self._save()

    def _task_states(self) -> list[dict[str, Any]]:
        """Return the task run's states as Prefect shows a task's retries (pure over the view)."""
        states: list[dict[str, Any]] = []
        program = self.spec.argv[0] if self.spec.argv else self.spec.action
        for attempt in self.view.attempts:
            started = attempt.started_at or attempt.launched_at
            name = "Retrying" if attempt.number > 1 else None
            states.append(state_body("RUNNING", name=name,
                                     message=f"try {attempt.number} started at "
                                             f"{utc_text(started)}"))
            if not attempt.ended:
                break
            failure = None if attempt.ok else attempt.failure(program, self.spec.timeout_s)
            ended = utc_text(attempt.ended_at) if attempt.ended_at else "unknown"
            last = attempt is self.view.attempts[-1]
            if not last:
                states.append(state_body("SCHEDULED", name="AwaitingRetry",
                                         message=f"try {attempt.number} ended at {ended}: "
                                                 f"{failure}"))
            elif self.view.phase == "ended":
                states.append(self._final_body())
        return states

    # logs
    def logs(self) -> None:
        """Send the node's lines and each try's output from where the last request stopped.

        One request carries new lines of every file (up to :data:`LOG_BATCH` lines);
        its byte ranges are noted as in flight, so a kill in mid-request is checked.
        """
        sources: list[tuple[str, str, str | None]] = [("log.jsonl", "node", None)]
        task = self.p.get("task_run_id")
        sources += [(f"a{item.number}.out", f"a{item.number}", task or "")
                    for item in self.view.attempts]
        while True:
            batch: list[dict[str, Any]] = []
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

    def _log(self, item: dict[str, Any], task_run: str | None) -> dict[str, Any]:
        """One log record: a try's output (task_run its id, or "" with no task run) or one
        of the node's lines (None)."""
        stamp = item.get("t") or utc_text(self.spec.accepted_at)
        return {"name": "sched.node" if task_run is None else "sched.job", "level": 20,
                "message": str(item.get("m", ""))[:100_000], "timestamp": stamp,
                "flow_run_id": self.run, "task_run_id": task_run or None}

    # 4. artifact, final state, event
    def artifact(self) -> None:
        for _ in self._step("artifact"):
            if self.spec.kind == KIND_RECONCILE:
                markdown = (self.folder.path / "artifact.md").read_text(encoding="utf-8")
                key = f"reconcile-{_slug(self.r.node)}"
            else:
                markdown = job_markdown(self.view, self.r.node)
                key = f"job-{_slug(self.r.node)}-{_slug(self.spec.schedule_id)}"
            self.api.create_artifact({"key": key, "type": "markdown", "data": markdown,
                                      "flow_run_id": self.run,
                                      "description": f"{self.spec.run_name}: "
                                                     f"{self.view.end_state}"})

    def _final_body(self) -> dict[str, Any]:
        state = self.view.end_state or FAILED
        ended = utc_text(self.view.end_at) if self.view.end_at else "unknown"
        started = self.view.started_at
        if self.spec.kind == KIND_RECONCILE:
            when = f"on {self.r.node} at {ended}"
        elif started:
            when = f"ran on {self.r.node} from {utc_text(started)} to {ended}"
        else:
            when = f"decided on {self.r.node} at {ended}"
        message = f"{self.view.message} ({when})" if self.view.message else when
        if self.p.get("offline"):
            message += "; recorded after the Prefect server came back"
        if state == SKIPPED:
            return state_body("COMPLETED", name=SKIPPED, message=message)
        kind = {COMPLETED: "COMPLETED", FAILED: "FAILED", CANCELLED: "CANCELLED",
                CRASHED: "CRASHED"}.get(state, "FAILED")
        return state_body(kind, message=message)

    def final(self) -> None:
        for _ in self._step("final"):
            self._set(self._final_body())

    def event(self) -> None:
        for _ in self._step("event"):
            events = self._job_events()
            if events:
                self.api.emit_events(events)

    def _job_events(self) -> list[dict[str, Any]]:
        state = self.view.end_state
        if state == SKIPPED or self.spec.kind == KIND_RECONCILE:
            extra = self.folder.read_json("events.json") or {}
            return list(extra.get("events", []))
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
        occurred = self.view.end_at or self.r._clock()
        return [job_event(self.r.node, payload, completed=state == COMPLETED,
                          occurred=occurred)]

    # a restart in mid-step
    def check_inflight(self) -> None:
        """Settle a step a kill left in flight: done on the server already, or to send again."""
        step = self.p.get("inflight")
        if step == "running" and not self.p.get("flow_run_id") and self._planned():
            # Its planned run may have gone to Running with the request in flight.
            found = self.api.filter_runs({"flow_runs": self._mine(), "limit": 1})
            if found:
                self.p["flow_run_id"] = str(found[0]["id"])
        if not isinstance(step, str) or not self.p.get("flow_run_id"):
            return
        done = False
        if step.startswith("logs:"):
            done = self._logs_arrived(step)
        elif step == "artifact":
            found = self.api.filter_artifacts({"artifacts": {"flow_run_id": {"any_": [self.run]}},
                                               "limit": 1})
            done = bool(found)
        elif step in ("running", "final"):
            run = self.api.read_run(self.run) or {}
            kind = (run.get("state") or {}).get("type")
            done = kind in (TERMINAL | {"RUNNING", "CANCELLING"} if step == "running"
                            else TERMINAL)
        elif step == "event":
            done = False  # each event's id is derived from the run's: sent twice, kept once
        if done:
            if step.startswith("logs:"):
                for mark, _start, end in _ranges(step):
                    self.p.setdefault("bytes", {})[mark] = end
            else:
                self.p[step] = True
        self.p.pop("inflight", None)
        self._save()

    def _logs_arrived(self, step: str) -> bool:
        """Return whether the request a kill left in flight (its files' byte ranges) reached
        the server.

        One request's lines are stored together or not at all, so its last line is
        looked for among the run's logs from that line's time on.
        """
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
        found = self.api.filter_logs({"logs": {"flow_run_id": {"any_": [self.run]},
                                               "timestamp": {"after_": last.get("t")}},
                                      "limit": 200})
        return any(item.get("message") == last.get("m") for item in found)


def _ranges(step: str) -> list[tuple[str, int, int]]:
    """Return the (file mark, start, end) byte ranges of a ``logs:`` step in flight.

    ``logs:a1:0:120`` (one file, as older nodes wrote it) or ``logs:node:0:80;a1:0:120``.
    """
    ranges = []
    for part in step.removeprefix("logs:").split(";"):
        mark, start, end = part.split(":")
        ranges.append((mark, int(start), int(end)))
    return ranges


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"
