"""The agent's flows against a real Prefect server (the session's test harness).

Time is passed in as a parameter (freezegun breaks flow runs). Each test uses
its own node name, so the job registry (run-job runs tagged ``node:<name>``)
of one test never sees another's runs.

Pinned instants: 2026-12-02 is a Wednesday; New York is on EST (UTC-5), so
15:30Z is 10:30 local.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_prefect import agent_events

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]

T0 = datetime(2026, 12, 2, 15, 29, 5, tzinfo=UTC)  # 10:29:05 EST
WINDOW = datetime(2026, 12, 2, 15, 30, tzinfo=UTC)  # 10:30 EST

EVERY_HOUR_AT_30 = {"days": ["*"], "hours": ["*"], "minute": "30"}


def row(sid: str, action: str, shape: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {
        "id": sid, "name": f"{action} {sid}", "repo_id": "r-1", "action": action,
        "schedule": shape, "miss_policy": "run-once-within-24h", "enabled": True,
        "params": params or None, "version": 1,
    }


class Agent:
    """One test node: a config file, a schedule file, a state folder, registered deployments."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.node = f"n-{uuid.uuid4().hex[:8]}"
        self.tmp = tmp
        self.schedules = tmp / "schedules.json"
        self.config = tmp / "agent.toml"
        self.monkeypatch = monkeypatch
        self.write_config()
        monkeypatch.setenv("SCHED_CONFIG", str(self.config))
        for name in ("SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
            monkeypatch.delenv(name, raising=False)

    def write_config(self, pull_url: str = "schedules.json", extra: str = "") -> None:
        py = json.dumps(sys.executable)
        self.config.write_text(f"""
node_name = "{self.node}"
pull_url = "{pull_url}"
state_dir = "state"
pull_retries = 3
pull_retry_delay = 0.05
{extra}
[actions.backup]
argv = [{py}, "-c", "print('backing up', '{{repo_id}}')"]
[actions.copy]
argv = [{py}, "-c", "print('copying')"]
[actions.prune]
argv = [{py}, "-c", "print('pruning')"]
[actions.check]
argv = [{py}, "-c", "print('checking')"]
[actions.fail]
argv = [{py}, "-c", "import sys; print('about to fail'); sys.exit(3)"]
retries = 2
retry_delay = 0
[actions.needs]
argv = ["echo", "{{param:missing}}"]
""")

    def write_schedules(self, rows: list[dict[str, Any]]) -> None:
        self.schedules.write_text(json.dumps({"schedules": rows}))

    def register(self) -> None:
        from flows.job import run_job

        run_job.to_deployment(name=self.node).apply()

    def cache(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.tmp / "state" / "cache.json").read_text())
        return data

    def runs(self, action: str | None = None) -> list[Any]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        tags = [f"node:{self.node}"] + ([f"action:{action}"] if action else [])
        with get_client(sync_client=True) as client:
            return list(client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags))
            ))


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Agent:
    return Agent(tmp_path, monkeypatch)


def set_state(run_id: Any, state: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Failed, Running

    new = {"completed": Completed(), "failed": Failed(), "running": Running()}[state]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, new, force=True)


# -- fire-tick ------------------------------------------------------------------------


def test_due_schedule_gives_one_run_even_when_ticked_twice_or_retried(agent: Agent) -> None:
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    agent.write_schedules([row("s-1", "backup", EVERY_HOUR_AT_30)])
    agent.register()
    assert reconcile(now=T0)["added"] == 1
    assert fire_tick(now=WINDOW + timedelta(seconds=2)) == 1
    # The same minute again (a second tick, a worker starting the run early/late).
    assert fire_tick(now=WINDOW + timedelta(seconds=40)) == 0
    # A retried or restarted tick that crashed after the fire but before the stamp:
    # the cache says unfired, the scheduler fires again, the idempotency key dedupes.
    cache = agent.cache()
    cache["last_fired_at"] = {}
    (agent.tmp / "state" / "cache.json").write_text(json.dumps(cache))
    assert fire_tick(now=WINDOW + timedelta(seconds=50)) == 1
    runs = agent.runs("backup")
    assert len(runs) == 1
    run = runs[0]
    assert run.name == "backup-s-1-20261202T1530Z"
    assert {f"node:{agent.node}", "action:backup", "schedule:s-1", "trigger:schedule"} <= set(
        run.tags
    )
    assert run.parameters["window"] == WINDOW.isoformat()
    assert run.state.is_scheduled()


def test_many_due_windows_are_created_in_bulk_once(agent: Agent) -> None:
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    agent.write_schedules([row(f"s-{i:02d}", "backup", EVERY_HOUR_AT_30) for i in range(25)])
    agent.register()
    reconcile(now=T0)
    assert fire_tick(now=WINDOW + timedelta(seconds=2)) == 25
    cache = agent.cache()
    cache["last_fired_at"] = {}
    (agent.tmp / "state" / "cache.json").write_text(json.dumps(cache))
    assert fire_tick(now=WINDOW + timedelta(seconds=30)) == 25  # bulk again, same keys
    runs = agent.runs("backup")
    assert len(runs) == 25
    assert sorted(run.name for run in runs)[0] == "backup-s-00-20261202T1530Z"
    assert all(run.idempotency_key.startswith(f"{agent.node}:s-") for run in runs)


def test_bulk_entries_reported_failed_are_retried_in_bulk_without_duplicates(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bulk request that lost SQLite's write race is retried in bulk, not run by run.

    The first bulk answer is doctored: every other entry reads FAILED although
    the server did create it, the worst case for a retry. The retry must send
    only those entries, get the same runs back by their idempotency keys, and
    never fall back to run_deployment.
    """
    import httpx
    from prefect.client.orchestration import SyncPrefectClient

    import flows.agent
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    real_request = SyncPrefectClient.request
    sent: list[list[str]] = []

    def first_answer_half_failed(
        self: SyncPrefectClient, method: str, path: str, *args: Any, **kwargs: Any
    ) -> httpx.Response:
        response: httpx.Response = real_request(self, method, path, *args, **kwargs)  # type: ignore[arg-type]
        if not path.endswith("/create_flow_run/bulk"):
            return response
        sent.append([entry["idempotency_key"] for entry in kwargs["json"]])
        if len(sent) > 1:
            return response
        results = response.json()["results"]
        for result in results[::2]:
            result.update(status="FAILED", flow_run_id=None, error="database is locked")
        return httpx.Response(200, json={"results": results})

    def slow_path(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("run_deployment called: a fire left the bulk path")

    monkeypatch.setattr(SyncPrefectClient, "request", first_answer_half_failed)
    monkeypatch.setattr(flows.agent, "run_deployment", slow_path)
    monkeypatch.setattr(flows.agent, "BULK_RETRY_DELAYS", (0.0, 0.0, 0.0))
    agent.write_schedules([row(f"s-{i:02d}", "backup", EVERY_HOUR_AT_30) for i in range(25)])
    agent.register()
    reconcile(now=T0)
    assert fire_tick(now=WINDOW + timedelta(seconds=2)) == 25
    assert len(sent[0]) == 25
    assert sent[1] == sent[0][::2]
    # The server itself may lose the race again (seen here): more retries, fewer entries.
    assert all(set(later) <= set(sent[1]) for later in sent[2:])
    runs = agent.runs("backup")
    assert len(runs) == 25
    assert len({run.idempotency_key for run in runs}) == 25


def test_tick_artifact_shows_fired_late_and_missed(agent: Agent) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    late = {"days": ["*"], "hours": ["*"], "minute": "28"}
    agent.write_schedules([
        row("on-time", "backup", EVERY_HOUR_AT_30),
        row("late", "copy", late),
        row("missed", "copy", {"days": ["*"], "hours": ["*"], "minute": "24"}),
        row("long-missed", "copy", {"days": ["*"], "hours": ["*"], "minute": "10"}),
    ])
    agent.register()
    reconcile(now=T0 - timedelta(hours=1))
    # The missed-run check at T0 - 1 h recovered 14:24 and 14:10; nothing since.
    # At 15:30:03 the 15:24 window has just left the 5-minute grace (reported
    # once); 15:10 left it long ago (reported by an earlier tick, not again).
    assert fire_tick(now=WINDOW + timedelta(seconds=3)) == 2
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"fire-tick-{agent.node}"]))
        )
    table = artifacts[-1].data
    rows = json.loads(table) if isinstance(table, str) else table
    outcomes = {item["schedule"]: item["outcome"] for item in rows}
    assert outcomes["on-time"] == "fired"
    assert outcomes["late"] == "fired late"
    assert outcomes["missed"] == "missed: run-once-within-24h"
    assert "long-missed" not in outcomes


# -- reconcile ------------------------------------------------------------------------


class FlakyController:
    """A real HTTP server that answers the first `fail` pulls with 503, then `body`."""

    def __init__(self) -> None:
        self.fail = 0
        self.body = b""
        self.hits = 0
        self.auth: list[str | None] = []
        self.hold: threading.Event | None = None  # when set, each answer waits for it
        self.answered = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                outer.auth.append(self.headers.get("Authorization"))
                if outer.hold is not None:
                    outer.hold.wait(timeout=60)
                outer.answered += 1
                if outer.fail > 0:
                    outer.fail -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/schedules?node=x"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def controller() -> Iterator[FlakyController]:
    server = FlakyController()
    yield server
    server.close()


def test_pull_that_fails_503_twice_then_succeeds_updates_the_cache(
    agent: Agent, controller: FlakyController, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.reconcile import reconcile

    monkeypatch.setenv("SCHED_TOKEN", "t0ken")
    agent.write_config(pull_url=controller.url)
    agent.register()
    controller.fail = 2
    controller.body = json.dumps([row("s-1", "backup", EVERY_HOUR_AT_30)]).encode()
    counts = reconcile(now=T0)
    assert controller.hits == 3
    assert controller.auth == ["Bearer t0ken"] * 3
    assert counts["added"] == 1 and counts["schedules"] == 1
    assert [item["id"] for item in agent.cache()["schedules"]] == ["s-1"]


def test_garbage_pull_keeps_the_cache_and_the_schedules_firing(
    agent: Agent, controller: FlakyController
) -> None:
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    agent.write_config(pull_url=controller.url)
    agent.register()
    controller.body = json.dumps({"schedules": [row("s-1", "backup", EVERY_HOUR_AT_30)]}).encode()
    reconcile(now=T0)
    before = agent.cache()["schedules"]
    controller.body = b"<html>502 Bad Gateway</html>"
    state = reconcile(now=T0 + timedelta(seconds=20), return_state=True)
    assert state.is_failed()
    assert "not valid JSON" in str(state.message) or "not valid JSON" in repr(
        state.result(raise_on_failure=False)
    )
    assert controller.hits == 1 + 4  # the first pull, then 1 + 3 retries of the garbage
    assert agent.cache()["schedules"] == before
    assert fire_tick(now=WINDOW + timedelta(seconds=1)) == 1
    assert len(agent.runs("backup")) == 1


def test_a_slow_pull_never_holds_up_the_tick(
    agent: Agent, controller: FlakyController
) -> None:
    """The tick fires while a reconcile waits on an unresponsive controller."""
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    agent.write_config(pull_url=controller.url, extra="pull_timeout = 120")
    agent.register()
    controller.body = json.dumps({"schedules": [row("s-1", "backup", EVERY_HOUR_AT_30)]}).encode()
    reconcile(now=T0)
    controller.hold = threading.Event()
    pulling = threading.Thread(target=reconcile, kwargs={"now": T0 + timedelta(seconds=20)})
    pulling.start()
    try:
        deadline = time.monotonic() + 30
        while controller.hits < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert controller.hits == 2 and controller.answered == 1  # the pull is waiting
        ticked: list[int] = []
        tick = threading.Thread(
            target=lambda: ticked.append(fire_tick(now=WINDOW + timedelta(seconds=1)))
        )
        tick.start()
        tick.join(timeout=45)
        assert ticked == [1], "the tick waited for the reconcile's pull"
        assert controller.answered == 1  # still no answer: the tick did not wait for one
    finally:
        controller.hold.set()
        pulling.join(timeout=60)
    assert not pulling.is_alive()
    assert len(agent.runs("backup")) == 1


def test_token_from_a_prefect_secret_block(
    agent: Agent, controller: FlakyController
) -> None:
    from prefect.blocks.system import Secret

    from flows.reconcile import reconcile

    block = f"token-{agent.node}"
    Secret(value="from-the-block").save(block, overwrite=True)
    agent.write_config(pull_url=controller.url, extra=f'token_secret_block = "{block}"')
    controller.body = b"[]"
    assert reconcile(now=T0)["schedules"] == 0
    assert controller.auth == ["Bearer from-the-block"]


def _events(name: str, node: str, count: int) -> list[dict[str, Any]]:
    """Return the events called name about node once there are count of them (or 15 s)."""
    return agent_events(name, node, lambda events: len(events) >= count)


def test_reconcile_emits_schedules_changed(agent: Agent) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("s-1", "backup", EVERY_HOUR_AT_30)])
    reconcile(now=T0)
    reconcile(now=T0 + timedelta(minutes=5))  # nothing changed: no event
    agent.write_schedules([
        row("s-3", "backup", EVERY_HOUR_AT_30),
        row("s-2", "backup", {"days": ["Mon"], "hours": ["1"], "minute": "0"}),
    ])
    reconcile(now=T0 + timedelta(minutes=10))
    events = _events("sched.schedules.changed", agent.node, 2)
    payloads = sorted((e["payload"] for e in events), key=lambda p: p["removed"])
    assert len(payloads) == 2
    assert payloads[0]["added_ids"] == ["s-1"]
    assert payloads[1]["removed_ids"] == ["s-1"]
    assert payloads[1]["added_ids"] == ["s-3"]
    assert payloads[1]["rejected"][0]["id"] == "s-2"
    assert "Mon" in payloads[1]["rejected"][0]["reason"]


# -- run-job --------------------------------------------------------------------------


def _logs(run_id: Any, expect: str) -> list[str]:
    """Return the run's log lines once one contains expect (logs are shipped in batches)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 15
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
            )
            lines = [log.message for log in logs]
            if any(expect in line for line in lines) or time.monotonic() > deadline:
                return lines
            time.sleep(0.2)


def test_job_runs_its_command_and_logs_the_output(agent: Agent) -> None:
    from flows.job import run_job

    agent.write_schedules([])
    schedule = row("s-1", "backup", EVERY_HOUR_AT_30)
    state = run_job(schedule=schedule, trigger_key="schedule", window=WINDOW,
                    key="s-1@x", return_state=True)
    assert state.is_completed()
    summary = state.result()
    assert summary["exit_code"] == 0 and summary["attempts"] == 1
    assert "backing up r-1" in _logs(state.state_details.flow_run_id, "backing up r-1")
    done, = _events("sched.job.completed", agent.node, 1)
    assert done["payload"]["schedule_id"] == "s-1" and done["payload"]["action"] == "backup"


def test_failing_job_is_retried_as_configured_and_shows_failed(agent: Agent) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.job import run_job

    state = run_job(schedule=row("s-f", "fail", EVERY_HOUR_AT_30), return_state=True)
    assert state.is_failed()
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    assert run.state is not None and run.state.is_failed()
    failed, = _events("sched.job.failed", agent.node, 1)
    assert failed["payload"]["action"] == "fail"
    assert failed["payload"]["flow_run_id"] == str(run_id)
    assert run.name == "fail-s-f-" + run.name.rsplit("-", 1)[1]
    assert [task.run_count for task in tasks] == [3]  # 1 try + 2 retries
    assert _logs(run_id, "Finished").count("about to fail") == 3
    assert f"node:{agent.node}" in run.tags  # tags added to an ad hoc run


def test_missing_template_parameter_fails_before_anything_runs(agent: Agent) -> None:
    from flows.job import run_job

    state = run_job(schedule=row("s-n", "needs", EVERY_HOUR_AT_30), return_state=True)
    assert state.is_failed()
    assert "no parameter 'missing'" in str(state.message)


def test_window_without_an_offset_fails_before_anything_runs(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A naive window (``--param window=2026-03-08T02:30:00``) is an error, not local time."""
    from flows.actions import window_stamp
    from flows.job import run_job
    from sched_core import ConfigError

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        naive = datetime(2026, 3, 8, 2, 30)
        with pytest.raises(ConfigError, match="no UTC offset"):
            window_stamp(naive)
        state = run_job(schedule=row("s-naive", "backup", EVERY_HOUR_AT_30), window=naive,
                        return_state=True)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert state.is_failed()
    assert "2026-03-08T02:30:00 has no UTC offset" in str(state.message)
    run_id = state.state_details.flow_run_id
    assert not any("backing up" in line for line in _logs(run_id, "no UTC offset"))
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).name == "backup-s-naive-bad-window"
    assert window_stamp(datetime(2026, 3, 8, 2, 30, tzinfo=UTC)) == "20260308T0230Z"


def test_cancelled_job_emits_failed_and_counts_as_finished_for_the_wave(agent: Agent) -> None:
    """A cancelled backup (an operator's, or serve stopping) still ends the wave for the chain."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Running

    from flows.agent import ACTIVE_STATES, FINISHED_STATES, count_jobs, job_tags
    from flows.job import _emit_terminal, run_job

    assert _emit_terminal in run_job.on_cancellation_hooks
    before = datetime.now(UTC) - timedelta(seconds=5)
    schedule = row("s-c", "backup", EVERY_HOUR_AT_30)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(
            run_job, parameters={"schedule": schedule, "trigger_key": "schedule"},
            tags=job_tags(agent.node, "backup", "s-c", "schedule"), state=Running(),
        )
        assert count_jobs(agent.node, ["backup"], ACTIVE_STATES) == 1
        client.set_flow_run_state(run.id, Cancelled(), force=True)
        run = client.read_flow_run(run.id)
    assert run.state is not None and run.state.is_cancelled()
    assert count_jobs(agent.node, ["backup"], ACTIVE_STATES) == 0
    assert count_jobs(agent.node, ["backup"], FINISHED_STATES, ended_after=before) == 1

    _emit_terminal(run_job, run, run.state)
    failed, = _events("sched.job.failed", agent.node, 1)
    assert failed["payload"]["state"] == "Cancelled"
    assert failed["payload"]["action"] == "backup"
    assert failed["payload"]["flow_run_id"] == str(run.id)


# -- advance-chain --------------------------------------------------------------------


def test_wave_runs_prune_then_check_once_a_day_never_before_it_drains(agent: Agent) -> None:
    from flows.chain import advance_chain
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    agent.write_schedules([
        row("b-1", "backup", EVERY_HOUR_AT_30),
        row("c-1", "copy", EVERY_HOUR_AT_30),
        row("p-1", "prune", {"on": "after_wave"}),
        row("k-1", "check", {"on": "after_wave"}),
        row("k-2", "check", {"on": "something_else"}),
    ])
    agent.register()
    now = datetime.now(UTC).replace(second=5, microsecond=0)
    reconcile(now=now - timedelta(minutes=1))
    minute = now.replace(second=0)
    agent.write_schedules([
        row("b-1", "backup", {"days": ["*"], "hours": ["*"], "minute": str(minute.minute)}),
        row("c-1", "copy", {"days": ["*"], "hours": ["*"], "minute": str(minute.minute)}),
        row("p-1", "prune", {"on": "after_wave"}),
        row("k-1", "check", {"on": "after_wave"}),
        row("k-2", "check", {"on": "something_else"}),
    ])
    reconcile(now=now - timedelta(seconds=30))
    assert fire_tick(now=now) == 2
    backup, = agent.runs("backup")
    copy, = agent.runs("copy")

    # The backup finishes, the copy is still scheduled: the wave has not drained.
    set_state(backup.id, "completed")
    assert advance_chain(action="backup", node=agent.node, completed_run=str(backup.id)) == []
    assert agent.runs("prune") == []
    # A completion on another node is not ours.
    assert advance_chain(action="copy", node="elsewhere") == []

    set_state(copy.id, "running")
    assert advance_chain(action="backup") == []
    set_state(copy.id, "failed")  # a failed wave job still ends the wave
    assert advance_chain(action="copy", completed_run=str(copy.id)) == ["prune"]
    prune, = agent.runs("prune")
    assert prune.name.startswith("prune-p-1-")
    assert "trigger:chain-prune" in prune.tags

    # Check waits for the prune to drain.
    assert advance_chain(action="copy") == []
    assert agent.runs("check") == []
    set_state(prune.id, "completed")
    assert advance_chain(action="prune", completed_run=str(prune.id)) == ["check"]
    check, = agent.runs("check")
    assert "k-1" in check.name

    # Once per day: more completions fire nothing again.
    set_state(check.id, "completed")
    assert advance_chain(action="backup") == []
    assert advance_chain(action="check") == []
    assert len(agent.runs("prune")) == 1 and len(agent.runs("check")) == 1
    marks = json.loads((agent.tmp / "state" / "chain.json").read_text())["stages"]
    assert set(marks) == {"prune", "check"}


def test_stage_that_could_not_fire_fails_the_run_and_is_retried_on_the_next_completion(
    agent: Agent,
) -> None:
    """No run-job deployment yet: the prune cannot fire, the run says so, a later job retries."""
    from prefect.client.orchestration import get_client
    from prefect.states import Completed

    from flows.chain import advance_chain
    from flows.job import run_job
    from flows.reconcile import reconcile

    agent.write_schedules([
        row("b-1", "backup", EVERY_HOUR_AT_30),
        row("p-1", "prune", {"on": "after_wave"}),
        row("k-1", "check", {"on": "after_wave"}),
    ])
    now = datetime.now(UTC)
    reconcile(now=now - timedelta(minutes=1))
    with get_client(sync_client=True) as client:
        backup = client.create_flow_run(
            run_job, parameters={"schedule_id": "b-1"},
            tags=[f"node:{agent.node}", "action:backup"], state=Completed(),
        )
    state = advance_chain.with_options(retries=0)(
        action="backup", node=agent.node, completed_run=str(backup.id), return_state=True,
    )
    assert state.is_failed()
    assert "chain stage(s) prune (" in str(state.message)
    assert "could not fire every schedule" in str(state.message)
    assert agent.runs("prune") == []

    # The deployment is back; the wave's last job has long finished, but any
    # completion (here an ad hoc check) fires the day's prune, once.
    agent.register()
    assert advance_chain(action="check", node=agent.node) == ["prune"]
    prune, = agent.runs("prune")
    assert "trigger:chain-prune" in prune.tags
    assert advance_chain(action="check", node=agent.node) == []
    assert len(agent.runs("prune")) == 1
