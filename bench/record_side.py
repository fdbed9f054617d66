"""One path of bench/bench_record.py: a node's recorder in a process of its own, driven over
stdin and stdout, with every request it sends counted by endpoint.

Runs with the code of one tree: the working tree's node (``sched_node``, its recorder through
Prefect's client) or an older commit's (``flows``, its hand-written REST client), from a git
worktree of that commit (``PYTHONPATH`` and the working folder set to it by the caller). It
imports nothing of the benchmarks but itself, and only the node's own modules of that tree.

    python bench/record_side.py --package sched_node|flows --url URL --work DIR
        [--lean] [--label NAME]

Commands, one JSON object a line on stdin; each answer is one line on stdout that begins
with ``@@ `` (anything else there is the code's own output and is not read):

- ``{"op": "plan", "jobs": N}``: a new node, its deployments, and N planned windows' runs
  made ahead as its planner makes them (not counted); answers ``{"planned": N}``;
- ``{"op": "record"}``: each job written into the outbox as the node writes it live (its
  start, then its end) and recorded after each part; answers the requests sent meanwhile
  (``calls``, by endpoint), the busy answers among them and the seconds it took;
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

LINES = 20
"""Command output lines per job (half at the start's record, half at the end's)."""


def id_template(path: str) -> str:
    """Return an API path with each id in it written ``{id}`` (tests/test_record_calls.py's too)."""
    return "/".join("{id}" if _is_uuid(part) else part for part in path.split("/"))


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


class Side:
    """The recorder of one tree's node, its requests counted."""

    def __init__(self, package: str, url: str, work: Path, *, lean: bool) -> None:
        self.package = package
        self.old = package != "sched_node"
        self.mod = {name: importlib.import_module(f"{package}.{name}")
                    for name in ("identity", "outbox", "prefect_api", "recorder", "registration")}
        self.url = url
        self.work = work
        self.lean = lean
        self.calls: Counter[str] = Counter()
        self.busy = 0
        base = httpx.URL(url).path.rstrip("/")

        def note(response: httpx.Response) -> None:
            request = response.request
            self.calls[f"{request.method} {id_template(request.url.path.removeprefix(base))}"] += 1
            if response.status_code in (429, 503):
                self.busy += 1

        self._count_emitted_events()
        api_module = self.mod["prefect_api"]
        if self.old:  # the hand-written REST client: an httpx client of the caller's
            self.client: httpx.Client | None = httpx.Client(
                base_url=url, event_hooks={"response": [note]}, timeout=30)
            self.api = api_module.PrefectApi(api_module.ApiSettings(url=url), client=self.client)
        else:  # Prefect's own client (one per process, as the node holds one)
            self.client = None
            self.api = api_module.PrefectApi(url, httpx_settings={
                "event_hooks": {"response": [note]}})
        self.jobs: list[tuple[Any, Any]] = []
        self.recorder: Any = None
        self.outbox: Any = None

    def _count_emitted_events(self) -> None:
        """Count the events Prefect's client emits by itself (``emit_event``: its create_artifact
        sends ``prefect.artifact.created`` over the websocket ``/events/in`` that its events
        worker opens and keeps): messages to the server that are no HTTP request."""
        try:
            import prefect.events.utilities as utilities
        except ImportError:  # pragma: no cover (Prefect is installed with the project)
            return
        original = utilities.emit_event

        def counted(*args: Any, **kwargs: Any) -> Any:
            event = original(*args, **kwargs)
            if event is not None:
                name = kwargs.get("event", args[0] if args else "?")
                self.calls[f"WS /events/in ({name})"] += 1
            return event

        utilities.emit_event = counted  # type: ignore[assignment]

    def files(self) -> dict[str, str]:
        """Where each module of the node was loaded from (the caller checks the tree)."""
        return {name: str(module.__file__) for name, module in self.mod.items()}

    def plan(self, jobs: int) -> int:
        """A new node with jobs planned windows an hour ago, their runs made ahead."""
        identity, outbox_mod = self.mod["identity"], self.mod["outbox"]
        registration = self.mod["registration"]
        node = f"bench-{uuid.uuid4().hex[:6]}"
        self.outbox = outbox_mod.Outbox(self.work / node, max_bytes=1 << 30)
        deployments = registration.Deployments(self.api, node, tags=["sched-agent"])
        planned: dict[str, str] = {}
        options: dict[str, Any] = {"task_run": False, "artifact": False} if self.lean else {}
        if not self.old:
            options["planned"] = planned.get  # the plan's record (plan.json in the node)
        self.recorder = self.mod["recorder"].Recorder(
            self.api, self.outbox, deployments, node=node, clock=lambda: datetime.now(UTC),
            done=lambda folder: shutil.rmtree(folder.path), **options)
        base = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
        self.jobs = []
        for n in range(jobs):
            window = base + timedelta(minutes=n)
            ref = identity.JobRef(node=node, action="backup", schedule_id="nightly",
                                  trigger_key="schedule", window=window,
                                  key=f"nightly@{window.isoformat()}")
            spec = outbox_mod.JobSpec(
                job_id=outbox_mod.job_id_for(window, ref.idempotency_key), kind="job", node=node,
                schedule_id="nightly", action="backup", trigger_key="schedule", window=window,
                key=ref.key, run_name=ref.name(), idempotency_key=ref.idempotency_key,
                flow_run_id=None, planned_start=window, accepted_at=window,
                reason="window on time", argv=["restic", "backup"], timeout_s=3600,
                tags=ref.tags(), parameters=ref.parameters())
            self.jobs.append((ref, spec))
        deployment = deployments.get()[registration.RUN_JOB]
        if self.old:
            api_module = self.mod["prefect_api"]
            self.api.create_runs(deployment, [{
                "name": ref.name(), "parameters": ref.parameters(), "tags": ref.tags(),
                "idempotency_key": ref.idempotency_key,
                "state": api_module.state_body("SCHEDULED", scheduled_time=spec.planned_start),
                "enforce_parameter_schema": False} for ref, spec in self.jobs])
            return len(self.jobs)
        from prefect.client.schemas.actions import DeploymentFlowRunCreate
        from prefect.states import to_state_create

        new_state = self.mod["prefect_api"].new_state
        pending = list(self.jobs)
        for _ in range(10):  # as the planner: an entry SQLite failed as locked is sent again
            body = [DeploymentFlowRunCreate(
                name=ref.name(), parameters=ref.parameters(), tags=ref.tags(),
                idempotency_key=ref.idempotency_key,
                state=to_state_create(new_state("SCHEDULED", scheduled_time=spec.planned_start)),
                enforce_parameter_schema=False, work_queue_name=registration.PLANNED_QUEUE)
                for ref, spec in pending]
            results = self.api.create_runs(deployment, body)
            failed = []
            for (ref, spec), result in zip(pending, results, strict=True):
                if result.get("status") == "CREATED" and result.get("flow_run_id"):
                    planned[ref.idempotency_key] = str(result["flow_run_id"])
                else:
                    failed.append((ref, spec))
            pending = failed
            if not pending:
                return len(planned)
            time.sleep(0.5)
        raise SystemExit(f"{len(pending)} planned runs could not be made")

    def record(self) -> dict[str, Any]:
        """Record every planned job live (its start, then its end); return the requests."""
        self.calls.clear()
        self.busy = 0
        t0 = time.monotonic()
        for _ref, spec in self.jobs:
            started = spec.window + timedelta(seconds=0.05)
            folder = self.outbox.create(spec)
            self._write_start(folder, started)
            if not self.recorder.drain():
                raise SystemExit(f"{self.package}: the job's start left nothing open")
            self._write_end(folder, started, started + timedelta(seconds=LINES + 5))
            if self.recorder.drain():
                raise SystemExit(f"{self.package}: a job's record is not complete")
        return {"jobs": len(self.jobs), "calls": dict(self.calls), "busy": self.busy,
                "busy_s": time.monotonic() - t0}

    def _write_start(self, folder: Any, at: datetime) -> None:
        utc_text = self.mod["outbox"].utc_text
        folder.append({"e": "accepted", "at": utc_text(at)})
        folder.log(at, "start guard: window on time")
        folder.log(at, "job backup of schedule nightly")
        folder.append({"e": "launch", "at": utc_text(at), "attempt": 1})
        folder.append({"e": "spawned", "at": utc_text(at), "attempt": 1, "shim_pid": 4242})
        folder.attempt_path(1, "started").write_text(json.dumps({"pid": 4243,
                                                                 "at": utc_text(at)}))
        self._output(folder, at, range(LINES // 2))

    def _output(self, folder: Any, at: datetime, numbers: range) -> None:
        utc_text = self.mod["outbox"].utc_text
        with folder.attempt_path(1, "out").open("a") as handle:
            for n in numbers:
                stamp = utc_text(at + timedelta(seconds=n))
                handle.write(json.dumps({"t": stamp, "m": f"processed file {n}"}) + "\n")

    def _write_end(self, folder: Any, at: datetime, ended: datetime) -> None:
        utc_text = self.mod["outbox"].utc_text
        self._output(folder, at, range(LINES // 2, LINES))
        folder.attempt_path(1, "exit").write_text(json.dumps({
            "exit_code": 0, "timed_out": False, "cancelled": False, "at": utc_text(ended),
            "lines": LINES}))
        folder.append({"e": "end", "at": utc_text(ended), "state": self.mod["outbox"].COMPLETED,
                       "message": "restic exited 0"})
        folder.log(ended, "restic exited 0")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        else:
            self.api.close()


def _answer(data: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(data) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", required=True, choices=("sched_node", "flows"))
    parser.add_argument("--url", required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--lean", action="store_true",
                        help="record_task_run and record_artifact off (the working tree's)")
    args = parser.parse_args()
    side = Side(args.package, args.url, args.work, lean=args.lean)
    _answer({"files": side.files()})
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "plan":
                _answer({"planned": side.plan(int(command["jobs"]))})
            elif command["op"] == "record":
                _answer(side.record())
            else:
                break
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
