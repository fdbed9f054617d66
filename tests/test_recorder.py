"""The recorder against a real Prefect server: each outbox job becomes its run, once.

Jobs are written into an outbox by hand, as the node writes them (a journal, a
keeper's started and exit files, output lines with their times), so each case is
exact: a job recorded late, a kill in the middle of a step, a deleted deployment.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from prefect.client.schemas.filters import LogFilter

from sched_node.identity import JobRef
from sched_node.outbox import COMPLETED, JobFolder, JobSpec, Outbox, job_id_for, utc_text
from sched_node.prefect_api import PrefectApi, PrefectUnavailable
from sched_node.recorder import Recorder
from sched_node.registration import Deployments
from tests.factories import Clock
from tests.nodekit import Prefect
from tests.procs import free_port

pytestmark = [pytest.mark.prefect]

WINDOW = (datetime.now(UTC) - timedelta(hours=1)).replace(minute=30, second=0, microsecond=0)
"""A recent window: Prefect keeps events 7 days, and the tests read them a day either side of
now (a fixed date here made them fail the next day)."""
NEW_YORK = ZoneInfo("America/New_York")


@pytest.fixture
def api(prefect_server: str) -> Iterator[PrefectApi]:
    client = PrefectApi(prefect_server)
    yield client
    client.close()


@pytest.fixture
def outbox(tmp_path: Path) -> Outbox:
    """The node's outbox under tmp_path, too large to refuse a job."""
    return Outbox(tmp_path / "outbox", max_bytes=1 << 30)


def _job(outbox: Outbox, node: str, *, started: datetime, ended: datetime,
         lines: list[str]) -> JobFolder:
    """Write a completed job of window WINDOW into the outbox, as the node would have."""
    ref = JobRef(node=node, action="backup", schedule_id="s-1", trigger_key="schedule",
                 window=WINDOW,
                 key=f"s-1@{WINDOW.astimezone(NEW_YORK).isoformat(timespec='minutes')}")
    spec = JobSpec(job_id=job_id_for(started, ref.idempotency_key), kind="job", node=node,
                   schedule_id="s-1", action="backup", trigger_key="schedule", window=WINDOW,
                   key=ref.key, run_name=ref.name(), idempotency_key=ref.idempotency_key,
                   flow_run_id=None, planned_start=WINDOW, accepted_at=started,
                   reason=f"window {WINDOW.astimezone(NEW_YORK):%Y-%m-%d %H:%M %Z}: on time",
                   argv=["tar", "-c"],
                   timeout_s=60, tags=ref.tags(), parameters=ref.parameters())
    folder = outbox.create(spec)
    folder.append({"e": "accepted", "at": utc_text(started)})
    folder.append({"e": "launch", "at": utc_text(started), "attempt": 1})
    folder.append({"e": "spawned", "at": utc_text(started), "attempt": 1, "shim_pid": 4242})
    folder.attempt_path(1, "started").write_text(json.dumps({"pid": 4243,
                                                             "at": utc_text(started)}))
    folder.attempt_path(1, "out").write_text("".join(
        json.dumps({"t": utc_text(started + timedelta(seconds=n)), "m": line}) + "\n"
        for n, line in enumerate(lines)))
    folder.attempt_path(1, "exit").write_text(json.dumps({
        "exit_code": 0, "timed_out": False, "cancelled": False, "at": utc_text(ended),
        "lines": len(lines)}))
    folder.append({"e": "end", "at": utc_text(ended), "state": COMPLETED,
                   "message": "tar exited 0"})
    return folder


def _recorder(api: PrefectApi, outbox: Outbox, node: str, clock: Clock) -> Recorder:
    return Recorder(api, outbox, Deployments(api, node, tags=["sched-agent"]), node=node,
                    clock=clock)


def test_a_job_recorded_late_keeps_its_real_times_and_says_it_ran_offline(
    api: PrefectApi, prefect: Prefect, outbox: Outbox,
) -> None:
    node = f"rec-{uuid.uuid4().hex[:6]}"
    started = WINDOW + timedelta(seconds=0.01)
    ended = started + timedelta(seconds=3)
    clock = Clock(ended + timedelta(minutes=40))  # the server came back 40 minutes later
    folder = _job(outbox, node, started=started, ended=ended, lines=["one", "two", "three"])
    away = PrefectApi(f"http://127.0.0.1:{free_port()}/api")
    with pytest.raises(PrefectUnavailable):  # the node's first try: nobody answers
        _recorder(away, outbox, node, clock).drain()
    away.close()
    recorder = _recorder(api, outbox, node, clock)
    assert recorder.drain() is False, "nothing left open"
    run_id = (folder.read_json("record.json") or {})["flow_run_id"]
    run = api.read_run(run_id)
    assert run is not None and run["state"]["type"] == "COMPLETED"
    message = run["state"]["message"]
    assert f"from {utc_text(started)} to {utc_text(ended)}" in message
    assert message.endswith("recorded after the Prefect server came back")
    running = [state for state in prefect.states(run_id) if state["type"] == "RUNNING"]
    assert len(running) == 1 and "recorded late" in running[0]["message"]
    logs = api.filter_logs(LogFilter.model_validate({"flow_run_id": {"any_": [run_id]}}))
    command = [(item["message"], item["timestamp"]) for item in logs
               if item["task_run_id"] is not None]
    assert [text for text, _ in command] == ["one", "two", "three"]
    assert command[0][1].startswith(utc_text(started)[:19]), "each line keeps its own time"
    (event,) = prefect.events("sched.job.completed", node)
    assert event["occurred"].startswith(utc_text(ended)[:19]), "the event's time is the end"
    assert event["payload"]["offline"] is True


@pytest.mark.parametrize("step", ["flow_state:0", "logs", "artifact", "flow_state:1", "event"])
def test_a_record_cut_off_after_a_step_reached_the_server_is_not_sent_twice(
    api: PrefectApi, prefect: Prefect, outbox: Outbox, step: str,
) -> None:
    node = f"cut-{uuid.uuid4().hex[:6]}"
    started = WINDOW
    ended = started + timedelta(seconds=2)
    clock = Clock(ended + timedelta(seconds=1))
    folder = _job(outbox, node, started=started, ended=ended, lines=["a", "b"])
    recorder = _recorder(api, outbox, node, clock)
    assert recorder.drain() is False
    progress = folder.read_json("record.json") or {}
    # A kill right after the step's request reached the server, before it was noted:
    # the step is in flight again and not done in record.json.
    if step == "logs":
        size = folder.attempt_path(1, "out").stat().st_size
        progress["inflight"] = f"logs:a1:0:{size}"
        progress["bytes"]["a1"] = 0
    elif step.startswith("flow_state:"):  # Running (0) or the final state (1)
        progress["inflight"] = step
        progress["flow_states"] = int(step.split(":")[1])
    else:
        progress["inflight"] = step
        progress.pop(step, None)
    progress.pop("complete", None)
    folder.write_json("record.json", progress)
    again = _recorder(api, outbox, node, clock)  # a new process: it checks what is in flight
    assert again.drain() is False
    run_id = progress["flow_run_id"]
    kinds = [state["type"] for state in prefect.states(run_id)]
    assert kinds.count("RUNNING") == 1 and kinds.count("COMPLETED") == 1, kinds
    command = [item["message"] for item in api.filter_logs(LogFilter.model_validate(
        {"flow_run_id": {"any_": [run_id]}})) if item["task_run_id"] is not None]
    assert sorted(command) == ["a", "b"]
    assert len(api.run_artifacts(run_id)) == 1
    assert len(prefect.events("sched.job.completed", node)) == 1


def test_a_deleted_deployment_is_registered_again_and_the_job_recorded(
    tmp_path: Path, api: PrefectApi, prefect: Prefect,
) -> None:
    node = f"del-{uuid.uuid4().hex[:6]}"
    outbox = Outbox(tmp_path / "outbox", max_bytes=1 << 30)
    recorder = _recorder(api, outbox, node, Clock(WINDOW + timedelta(seconds=5)))
    ids = recorder.deployments.get()
    prefect.request("DELETE", f"/deployments/{ids['run-job']}")
    folder = _job(outbox, node, started=WINDOW, ended=WINDOW + timedelta(seconds=1),
                  lines=["x"])
    assert recorder.drain() is False
    run = api.read_run((folder.read_json("record.json") or {})["flow_run_id"])
    assert run is not None and run["state"]["type"] == "COMPLETED"
    assert run["deployment_id"] != ids["run-job"]


def test_two_drains_at_once_record_a_job_once(
    api: PrefectApi, prefect: Prefect, outbox: Outbox,
) -> None:
    # The node's last drain at stop runs beside the recorder thread's: one at a time, or
    # both record the job with their own progress (two RUNNING states, two events) and
    # one writes into the folder the other has just forgotten.
    import threading

    node = f"two-{uuid.uuid4().hex[:6]}"
    ended = WINDOW + timedelta(seconds=2)
    folder = _job(outbox, node, started=WINDOW, ended=ended, lines=["a", "b", "c"])
    recorder = _recorder(api, outbox, node, Clock(ended + timedelta(seconds=1)))
    together = threading.Barrier(2)
    errors: list[BaseException] = []

    def drain() -> None:
        together.wait()
        try:
            recorder.drain()
        except Exception as exc:  # the test reports whatever a drain raised
            errors.append(exc)

    threads = [threading.Thread(target=drain) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    run_id = (folder.read_json("record.json") or {})["flow_run_id"]
    kinds = [state["type"] for state in prefect.states(run_id)]
    assert kinds.count("RUNNING") == 1 and kinds.count("COMPLETED") == 1, kinds
    assert len(prefect.events("sched.job.completed", node)) == 1
