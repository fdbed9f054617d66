"""How many requests a job's record takes, and that the record reads as its flow's run.

Against a real Prefect server: a job of a planned window is written into an outbox
by hand, in two parts as the node writes it (its start, then its end), and
recorded after each part, with every request the recorder sends (through Prefect's
client) counted. What the operator sees is then read back through the API: the planned
run (its name, tags and parameters), its state history and times (a failed try as
Prefect's retry: AwaitingRetry, Retrying), each try's ``run-command`` task run and its
states, the logs, the artifact and the event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.client.schemas.actions import DeploymentFlowRunCreate
from prefect.client.schemas.filters import LogFilter
from prefect.states import to_state_create

from sched_node.identity import JobRef
from sched_node.outbox import COMPLETED, FAILED, JobFolder, JobSpec, Outbox, job_id_for, utc_text
from sched_node.prefect_api import BUSY, PrefectApi, new_state
from sched_node.recorder import Recorder
from sched_node.registration import PLANNED_QUEUE, RUN_JOB, Deployments
from tests.nodekit import Prefect

pytestmark = [pytest.mark.prefect]

START_CALLS = [("POST", "/flow_runs/{id}/set_state"), ("POST", "/task_runs/"),
               ("POST", "/logs/")]
"""A window's job at its start: Running (its planned run's id from the plan's record), the
try's task run, the lines so far."""
END_CALLS = [("POST", "/task_runs/{id}/set_state"), ("POST", "/artifacts/"),
             ("POST", "/flow_runs/{id}/set_state"), ("POST", "/events"), ("POST", "/logs/")]
"""At its end: the task run's end, the artifact, the final state, the job's event, the lines
since."""


class Counted:
    """A PrefectApi whose requests are noted as (method, path with ids as ``{id}``).

    A request the server turned away as busy (429, 503: the session's SQLite server says
    "database is locked" so when the suite loads it) did nothing, and the client asks again
    at once (``sched_node.prefect_api.BUSY``): only the request that was taken is noted. The
    CSRF token's look Prefect's client makes once a process is not the job's.
    """

    def __init__(self, url: str) -> None:
        self.calls: list[tuple[str, str]] = []
        base = httpx.URL(url).path.rstrip("/")

        def note(response: httpx.Response) -> None:
            request = response.request
            if response.status_code in BUSY or request.url.path.endswith("/csrf-token"):
                return
            self.calls.append((request.method, id_template(request.url.path.removeprefix(base))))

        self.api = PrefectApi(url, httpx_settings={"event_hooks": {"response": [note]}})

    def take(self) -> list[tuple[str, str]]:
        """Return the requests noted since the last take."""
        calls, self.calls = self.calls, []
        return calls




@pytest.fixture
def counted(prefect_server: str) -> Iterator[Counted]:
    found = Counted(prefect_server)
    yield found
    found.api.close()


class Job:
    """A job of one window, written into an outbox part by part as the node writes it."""

    def __init__(self, outbox: Outbox, node: str, window: datetime, *, retries: int = 0) -> None:
        self.ref = JobRef(node=node, action="backup", schedule_id="s-1", trigger_key="schedule",
                          window=window, key=f"s-1@{window.isoformat()}")
        self.window = window
        spec = JobSpec(job_id=job_id_for(window, self.ref.idempotency_key), kind="job",
                       node=node, schedule_id="s-1", action="backup", trigger_key="schedule",
                       window=window, key=self.ref.key, run_name=self.ref.name(),
                       idempotency_key=self.ref.idempotency_key, flow_run_id=None,
                       planned_start=window, accepted_at=window,
                       reason="window on time", argv=["tar", "-c"], timeout_s=60,
                       retries=retries, retry_delay_s=2.0, tags=self.ref.tags(),
                       parameters=self.ref.parameters())
        self.folder: JobFolder = outbox.create(spec)
        self.folder.append({"e": "accepted", "at": utc_text(window)})
        self.folder.log(window, f"job backup of schedule s-1, window {window.isoformat()}")

    def start(self, attempt: int, at: datetime, lines: list[str]) -> None:
        """Launch try attempt at at; its command writes lines, one a second."""
        self.folder.append({"e": "launch", "at": utc_text(at), "attempt": attempt})
        self.folder.append({"e": "spawned", "at": utc_text(at), "attempt": attempt,
                            "shim_pid": 4242})
        self.folder.attempt_path(attempt, "started").write_text(
            json.dumps({"pid": 4243, "at": utc_text(at)}))
        self.folder.attempt_path(attempt, "out").write_text("".join(
            json.dumps({"t": utc_text(at + timedelta(seconds=n)), "m": line}) + "\n"
            for n, line in enumerate(lines)))

    def exit(self, attempt: int, at: datetime, code: int) -> None:
        """Write try attempt's outcome."""
        self.folder.attempt_path(attempt, "exit").write_text(json.dumps({
            "exit_code": code, "timed_out": False, "cancelled": False, "at": utc_text(at),
            "lines": 2}))

    def end(self, at: datetime, state: str, message: str) -> None:
        """Journal the job's end."""
        self.folder.append({"e": "end", "at": utc_text(at), "state": state, "message": message})

    def complete(self, at: datetime) -> None:
        """Its one try exits 0 at at, and the job ends Completed then."""
        self.exit(1, at, 0)
        self.end(at, COMPLETED, "tar exited 0")

    def plan(self, api: PrefectApi, deployment: str, planned: dict[str, str]) -> str:
        """Create the window's planned run as the planner does, noted in planned (the plan's
        record); return its id."""
        body = DeploymentFlowRunCreate(
            name=self.ref.name(), parameters=self.ref.parameters(), tags=self.ref.tags(),
            idempotency_key=self.ref.idempotency_key,
            state=to_state_create(new_state("SCHEDULED", scheduled_time=self.window)),
            enforce_parameter_schema=False, work_queue_name=PLANNED_QUEUE)
        for _ in range(10):  # a loaded SQLite server fails a bulk entry as locked: again
            (result,) = api.create_runs(deployment, [body])
            if result.get("status") == "CREATED" and result.get("flow_run_id"):
                break
            time.sleep(0.5)
        assert result.get("status") == "CREATED", result
        planned[self.ref.idempotency_key] = str(result["flow_run_id"])
        return str(result["flow_run_id"])

    def progress(self) -> dict[str, Any]:
        """Return the job's record.json."""
        return self.folder.read_json("record.json") or {}


def _now() -> datetime:
    """A window a minute ago, whole seconds (the events filter looks a day around now)."""
    return datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)


def _task_runs(prefect: Prefect, run_id: str, count: int, done: int) -> list[dict[str, Any]]:
    """Return a flow run's task runs (count of them; the last with done states), each with
    its states (oldest first)."""
    deadline = time.monotonic() + 5
    while True:
        runs = prefect.task_runs(run_id)
        if (len(runs) == count and len(runs[-1]["states"]) >= done
                and runs[-1]["state_type"] == runs[-1]["states"][-1]["type"]) \
                or time.monotonic() > deadline:
            assert len(runs) == count, runs
            return runs
        time.sleep(0.3)


def _recorded_completed(prefect: Prefect, run_id: str) -> None:
    """Assert the run went Scheduled, Running, Completed, and its task run Running, Completed."""
    assert [s["type"] for s in prefect.states(run_id)] == ["SCHEDULED", "RUNNING", "COMPLETED"]
    (task,) = _task_runs(prefect, run_id, 1, 2)
    assert [s["type"] for s in task["states"]] == ["RUNNING", "COMPLETED"]


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def id_template(path: str) -> str:
    """Return an API path with each id in it written ``{id}``."""
    def is_id(part: str) -> bool:
        try:
            uuid.UUID(part)
        except ValueError:
            return False
        return True

    return "/".join("{id}" if is_id(part) else part for part in path.split("/"))


PLANNED: dict[str, str] = {}
"""The plan's record of every test's planned runs (idempotency key to run id)."""


def _recorder(api: PrefectApi, outbox: Outbox, node: str, *, task_run: bool = True,
              artifact: bool = True) -> Recorder:
    """The node's recorder (task_run and artifact: its record_task_run and record_artifact),
    the plan's record read from PLANNED."""
    return Recorder(api, outbox, Deployments(api, node, tags=["sched-agent"]), node=node,
                    clock=lambda: datetime.now(UTC), planned=PLANNED.get, task_run=task_run,
                    artifact=artifact)


# The tests below open alike (`duplicates` pairs them by shape): a node, its outbox, a
# recorder and one job from this helper, each test with its own prefix and story.
def _recorder_and_job(tmp_path: Path, counted: Counted, prefix: str, retries: int = 0, *,
                      task_run: bool = True,
                      artifact: bool = True) -> tuple[str, Outbox, Recorder, Job]:
    """A new node named after prefix: its name, outbox, recorder, and a job at a window now."""
    node = f"{prefix}-{uuid.uuid4().hex[:6]}"
    outbox = Outbox(tmp_path / "outbox", max_bytes=1 << 30)
    return (node, outbox,
            _recorder(counted.api, outbox, node, task_run=task_run, artifact=artifact),
            Job(outbox, node, _now(), retries=retries))


def test_a_planned_window_is_recorded_live_in_eight_requests_and_reads_as_its_flows_run(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "calls")
    window = job.window
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    started = window + timedelta(seconds=0.25)
    ended = started + timedelta(seconds=42.5)
    job.start(1, started, ["one", "two"])
    counted.take()

    assert recorder.drain() is True, "the job is still running"
    assert counted.take() == START_CALLS
    assert job.progress()["flow_run_id"] == planned, "recorded into the planned run"
    run = counted.api.read_run(planned)
    assert run is not None and run["state"]["type"] == "RUNNING"
    assert run["state"]["message"] == f"started on {node} at {utc_text(started)}"
    (task,) = _task_runs(prefect, planned, 1, 1)
    assert [(s["type"], s["name"]) for s in task["states"]] == [("RUNNING", "Running")]
    assert task["start_time"] is not None and task["run_count"] == 1

    job.complete(ended)
    job.folder.log(ended, "exit line written at the end")
    counted.take()
    assert recorder.drain() is False
    assert counted.take() == END_CALLS
    assert recorder.drain() is False and counted.take() == [], "nothing is sent twice"

    # What the operator sees: the planned run, as the planner made it, ...
    run = counted.api.read_run(planned)
    assert run is not None
    assert (run["name"], sorted(run["tags"]), run["parameters"]) == (
        job.ref.name(), sorted(job.ref.tags()), job.ref.parameters())
    assert run["deployment_id"] == recorder.deployments.get()[RUN_JOB]
    assert run["parameters"] == {"schedule_id": "s-1"} and run["work_queue_name"] == "planned"
    # ... its states: Scheduled at its window, Running, Completed with the real times ...
    history = prefect.states(planned)
    assert [s["type"] for s in history] == ["SCHEDULED", "RUNNING", "COMPLETED"]
    assert _at(history[0]["state_details"]["scheduled_time"]) == window
    assert history[2]["message"] == (f"tar exited 0 (ran on {node} from {utc_text(started)} "
                                     f"to {utc_text(ended)})")
    assert _at(run["start_time"]) == _at(history[1]["timestamp"])
    assert _at(run["end_time"]) == _at(history[2]["timestamp"])
    assert run["total_run_time"] == pytest.approx(
        (_at(run["end_time"]) - _at(run["start_time"])).total_seconds(), abs=1e-6)
    assert run["run_count"] == 1
    # ... the try's task run (the flow's run-command task): Running, then Completed ...
    (task,) = _task_runs(prefect, planned, 1, 2)
    states = task["states"]
    assert task["name"] == "run-command-1"
    assert task["id"] == job.progress()["task_runs"]["1"]["id"]
    assert task["task_key"] == recorder.command_task.task_key
    assert [(s["type"], s["name"]) for s in states] == [
        ("RUNNING", "Running"), ("COMPLETED", "Completed")]
    assert states[0]["message"] == f"try 1 started at {utc_text(started)}"
    assert states[1]["message"] == f"tar exited 0 at {utc_text(ended)}"
    assert _at(task["start_time"]) == _at(states[0]["timestamp"])
    assert _at(task["end_time"]) == _at(states[1]["timestamp"])
    assert task["run_count"] == 1
    # ... the logs: the node's lines and the command's, in the task run, with their times ...
    logs = counted.api.filter_logs(LogFilter.model_validate(
        {"flow_run_id": {"any_": [planned]}}))
    command = [(item["message"], _at(item["timestamp"])) for item in logs
               if item["task_run_id"] == task["id"]]
    assert command == [("one", started), ("two", started + timedelta(seconds=1))]
    node_lines = [item["message"] for item in logs if item["task_run_id"] is None]
    assert node_lines == [f"job backup of schedule s-1, window {window.isoformat()}",
                          "exit line written at the end"]
    # ... one artifact and one event.
    (artifact,) = counted.api.run_artifacts(planned)
    assert artifact["key"] == f"job-{node}-s-1"
    assert artifact["description"] == f"{job.ref.name()}: {COMPLETED}"
    assert f"| 1 | {utc_text(started)} | {utc_text(ended)} | 0 |" in artifact["data"]
    (event,) = prefect.events("sched.job.completed", node)
    assert _at(event["occurred"]) == ended
    assert event["payload"]["flow_run_id"] == planned


def test_tries_show_as_prefects_retries_of_the_flow_run(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "tries", retries=1)
    window = job.window
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    first, second = window + timedelta(seconds=1), window + timedelta(seconds=10)
    job.start(1, first, ["try one"])
    assert recorder.drain() is True
    job.exit(1, first + timedelta(seconds=3), 2)
    job.folder.append({"e": "retry", "at": utc_text(first + timedelta(seconds=3)),
                       "attempt": 1, "until": utc_text(second)})
    job.start(2, second, ["try two"])
    assert recorder.drain() is True
    job.exit(2, second + timedelta(seconds=5), 2)
    job.end(second + timedelta(seconds=5), FAILED, "tar exited with code 2")
    counted.take()
    assert recorder.drain() is False
    assert counted.take() == END_CALLS[:4], "no line since the last record: no logs request"

    states = prefect.states(planned)
    assert [(s["type"], s["name"]) for s in states] == [
        ("SCHEDULED", "Scheduled"), ("RUNNING", "Running"), ("SCHEDULED", "AwaitingRetry"),
        ("RUNNING", "Retrying"), ("FAILED", "Failed")]
    assert states[2]["message"] == (f"try 1 ended at {utc_text(first + timedelta(seconds=3))}: "
                                    "tar exited with code 2")
    assert _at(states[2]["state_details"]["scheduled_time"]) == second, "the retry's time"
    assert states[3]["message"] == f"try 2 started at {utc_text(second)}"
    run = counted.api.read_run(planned)
    assert run is not None and run["run_count"] == 2 and run["state_type"] == "FAILED"
    tasks = _task_runs(prefect, planned, 2, 2)
    assert [task["name"] for task in tasks] == ["run-command-1", "run-command-2"]
    assert [[s["type"] for s in task["states"]] for task in tasks] == [
        ["RUNNING", "FAILED"], ["RUNNING", "FAILED"]]
    logs = counted.api.filter_logs(LogFilter.model_validate(
        {"flow_run_id": {"any_": [planned]}}))
    assert [(item["message"], item["task_run_id"]) for item in logs
            if item["name"] == "sched.job"] == [("try one", tasks[0]["id"]),
                                               ("try two", tasks[1]["id"])]
    (event,) = prefect.events("sched.job.failed", node)
    assert event["payload"]["state"] == FAILED


def test_a_window_with_no_planned_run_gets_one_scheduled_at_its_window(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    # The plan never reached Prefect.
    _node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "unpl")
    window = job.window
    recorder.deployments.get()
    started, ended = window + timedelta(seconds=1), window + timedelta(seconds=4)
    job.start(1, started, ["x"])
    job.complete(ended)
    counted.take()
    assert recorder.drain() is False
    calls = counted.take()
    assert calls == [("POST", "/deployments/{id}/create_flow_run"),
                     ("POST", "/flow_runs/{id}/set_state"), ("POST", "/task_runs/"), *END_CALLS]
    run_id = job.progress()["flow_run_id"]
    run = counted.api.read_run(run_id)
    assert run is not None and run["idempotency_key"] == job.ref.idempotency_key
    assert run["work_queue_name"] == "planned", "in the paused queue, as a planned run"
    _recorded_completed(prefect, run_id)
    assert _at(prefect.states(run_id)[0]["state_details"]["scheduled_time"]) == window


def test_a_kill_with_the_running_request_in_flight_finds_the_run_and_sends_nothing_twice(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    # The request that puts the planned run in Running reached the server, and the node
    # was killed before it noted the answer (the run's id with it).
    node, outbox, recorder, job = _recorder_and_job(tmp_path, counted, "kill")
    window = job.window
    deployment = recorder.deployments.get()[RUN_JOB]
    planned = job.plan(counted.api, deployment, PLANNED)
    job.start(1, window + timedelta(seconds=1), ["a"])
    job.folder.write_json("record.json", {"flow_run_id": planned, "inflight": "flow_state:0"})
    counted.api.set_state(planned, new_state("RUNNING", message="started"), force=True)
    job.complete(window + timedelta(seconds=2))
    again = _recorder(counted.api, outbox, node)  # a new process checks what was in flight
    assert again.drain() is False
    assert job.progress()["flow_run_id"] == planned
    _recorded_completed(prefect, planned)
    command = [item["message"] for item in counted.api.filter_logs(LogFilter.model_validate(
        {"flow_run_id": {"any_": [planned]}})) if item["task_run_id"] is not None]
    assert command == ["a"]


def test_a_job_an_older_node_began_recording_is_finished_on_the_same_task_run(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    # An older node created the job's one task run (Pending, then Running, noted as one
    # state sent), put the run in Running, and was upgraded before the job ended.
    _node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "old")
    window = job.window
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    started = window + timedelta(seconds=1)
    job.start(1, started, ["a"])
    counted.api.set_state(planned, new_state("RUNNING", message="old"), force=True)
    task_id = counted.api.create_task_run(recorder.command_task, flow_run_id=planned,
                                          dynamic_key="0", name="run-command",
                                          state=new_state("PENDING"))
    counted.api.set_task_state(task_id, new_state("RUNNING", message="try 1 (old node)"))
    job.folder.write_json("record.json", {"flow_run_id": planned, "running": True,
                                          "offline": False, "task_run_id": task_id,
                                          "task_states": 1})
    ended = datetime.now(UTC) + timedelta(seconds=1)  # after the old node's server-stamped states
    job.complete(ended)
    assert recorder.drain() is False
    (task,) = _task_runs(prefect, planned, 1, 3)
    assert task["id"] == task_id
    assert [s["type"] for s in task["states"]] == ["PENDING", "RUNNING", "COMPLETED"]
    assert [s["type"] for s in prefect.states(planned)] == ["SCHEDULED", "RUNNING", "COMPLETED"]


def test_a_job_that_ended_before_its_first_record_takes_seven_requests(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    # A job that ended before its first record (the server was away) is recorded at once.
    _node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "once")
    window = job.window
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    started, ended = window + timedelta(seconds=2), window + timedelta(seconds=30)
    job.start(1, started, ["a", "b"])
    job.complete(ended)
    counted.take()
    assert recorder.drain() is False
    assert counted.take() == [*START_CALLS[:2], *END_CALLS]
    _recorded_completed(prefect, planned)


@pytest.mark.parametrize(("task_run", "artifact"), [(False, True), (True, False), (False, False)])
def test_a_leaner_record_leaves_out_the_task_run_or_the_artifact_and_nothing_else(
    tmp_path: Path, counted: Counted, prefect: Prefect, task_run: bool, artifact: bool,
) -> None:
    # record_task_run / record_artifact off (a large fleet): those requests go, the run, its
    # states, every line and the event stay.
    node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "lean",
                                                     task_run=task_run, artifact=artifact)
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    started = job.window + timedelta(seconds=1)
    ended = started + timedelta(seconds=20)
    job.start(1, started, ["one", "two"])
    counted.take()
    assert recorder.drain() is True
    left_out = set()
    if not task_run:
        left_out |= {("POST", "/task_runs/"), ("POST", "/task_runs/{id}/set_state")}
    if not artifact:
        left_out.add(("POST", "/artifacts/"))
    assert counted.take() == [call for call in START_CALLS if call not in left_out]
    job.complete(ended)
    job.folder.log(ended, "exit line written at the end")
    assert recorder.drain() is False
    assert counted.take() == [call for call in END_CALLS if call not in left_out]
    assert recorder.drain() is False and counted.take() == []

    assert [s["type"] for s in prefect.states(planned)] == ["SCHEDULED", "RUNNING", "COMPLETED"]
    tasks = prefect.task_runs(planned)
    assert len(tasks) == (1 if task_run else 0)
    logs = counted.api.filter_logs(LogFilter.model_validate(
        {"flow_run_id": {"any_": [planned]}}))
    output = [(item["name"], item["message"], item["task_run_id"]) for item in logs
              if item["name"] == "sched.job"]
    task_id = tasks[0]["id"] if task_run else None
    assert output == [("sched.job", "one", task_id), ("sched.job", "two", task_id)]
    assert [item["message"] for item in logs if item["name"] == "sched.node"] == [
        f"job backup of schedule s-1, window {job.window.isoformat()}",
        "exit line written at the end"]
    assert len(counted.api.run_artifacts(planned)) == (1 if artifact else 0)
    (event,) = prefect.events("sched.job.completed", node)
    assert event["payload"]["flow_run_id"] == planned


def test_a_job_not_started_yet_sends_nothing_and_its_start_takes_the_planned_path(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    # The recorder is woken at a job's accept, before its first try starts (a slot, a lock,
    # the keeper's spawn). It used to find the run then (a create answered with the key's
    # run), and the start went Running by id: 9 requests a job instead of 7.
    _node, _outbox, recorder, job = _recorder_and_job(tmp_path, counted, "queued")
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    counted.take()
    assert recorder.drain() is True, "the job is still open"
    assert counted.take() == [], "nothing is sent for a job that has not started"
    assert job.progress().get("flow_run_id") is None
    started = job.window + timedelta(seconds=3)
    job.start(1, started, ["one"])
    assert recorder.drain() is True
    assert counted.take() == START_CALLS
    assert job.progress()["flow_run_id"] == planned
    job.complete(started + timedelta(seconds=5))
    assert recorder.drain() is False
    _recorded_completed(prefect, planned)


def test_a_task_run_begun_before_the_setting_was_turned_off_is_still_ended(
    tmp_path: Path, counted: Counted, prefect: Prefect,
) -> None:
    # The node restarted with record_task_run off while a job ran: its task run, created at
    # the start, still gets its final state (it would stay Running for good).
    node, outbox, recorder, job = _recorder_and_job(tmp_path, counted, "turned")
    planned = job.plan(counted.api, recorder.deployments.get()[RUN_JOB], PLANNED)
    started = job.window + timedelta(seconds=1)
    job.start(1, started, ["one"])
    assert recorder.drain() is True
    lean = _recorder(counted.api, outbox, node, task_run=False, artifact=False)
    job.complete(started + timedelta(seconds=4))
    assert lean.drain() is False
    _recorded_completed(prefect, planned)
