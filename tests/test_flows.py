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
from zoneinfo import ZoneInfo

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


def cache_rows(agent: Agent, rows: list[dict[str, Any]] | None, now: datetime = T0) -> None:
    """Put rows (or the schedule file as it is) into the node's cache: a pull, no planning."""
    from flows.dispatch import build_scheduler
    from flows.settings import load_settings

    if rows is not None:
        agent.write_schedules(rows)
    build_scheduler(load_settings(agent.config), now=now).pull(now)


def set_state(run_id: Any, state: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Failed, Running

    new = {"completed": Completed(), "failed": Failed(), "running": Running()}[state]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, new, force=True)


# -- the planner (reconcile) -----------------------------------------------------------

NIGHTLY_0230 = {"days": ["*"], "hours": ["2"], "minute": "30"}


def scheduled(agent: Agent) -> list[Any]:
    """Return the node's Scheduled runs, by start time."""
    runs = [run for run in agent.runs() if run.state.type.value == "SCHEDULED"]
    return sorted(runs, key=lambda run: (run.expected_start_time, run.name))


def starts(runs: list[Any]) -> list[tuple[str, datetime]]:
    return [(run.parameters["schedule_id"], run.expected_start_time.astimezone(UTC))
            for run in runs]


def test_reconcile_plans_each_window_as_a_named_scheduled_run_at_its_exact_instant(
    agent: Agent,
) -> None:
    """New York's spring-forward day: 02:30 does not exist, so the nightly runs at 03:00 EDT."""
    from flows.reconcile import reconcile
    from sched_core.matcher import fire_times
    from sched_core.model import Schedule

    every_20 = {"days": None, "hours": None, "minute": "", "interval_minutes": 20}
    agent.write_schedules([row("n", "backup", NIGHTLY_0230), row("i", "copy", every_20)])
    agent.register()
    now = datetime(2026, 3, 8, 6, 10, tzinfo=UTC)  # 01:10 EST
    counts = reconcile(now=now)
    assert counts["created"] == counts["planned"] == 3 + 3  # nightly: 3 days; i: 01:20..03:00 EDT
    runs = scheduled(agent)
    tz = ZoneInfo("America/New_York")
    nightly_times = fire_times(Schedule.model_validate(NIGHTLY_0230), now,
                               now + timedelta(days=3), tz)
    interval_times = fire_times(Schedule.model_validate(every_20), now - timedelta(minutes=5),
                                now + timedelta(hours=1), tz)
    expected = sorted([("n", w) for w in nightly_times] + [("i", w) for w in interval_times],
                      key=lambda item: (item[1], item[0]))
    assert sorted(starts(runs), key=lambda item: (item[1], item[0])) == expected
    assert ("n", datetime(2026, 3, 8, 7, 0, tzinfo=UTC)) in expected  # 03:00 EDT
    nightly = next(run for run in runs if run.parameters["schedule_id"] == "n")
    assert nightly.name == "backup-n-20260308T0700Z"
    assert {f"node:{agent.node}", "action:backup", "schedule:n", "trigger:schedule"} <= set(
        nightly.tags)
    assert nightly.parameters == {"schedule_id": "n", "trigger_key": "schedule",
                                  "window": "2026-03-08T07:00:00+00:00",
                                  "key": "n@2026-03-08T03:00-04:00"}
    assert nightly.idempotency_key == f"{agent.node}:n@2026-03-08T03:00-04:00"


def test_planning_again_makes_no_second_run_and_a_changed_row_replaces_only_its_own(
    agent: Agent,
) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("a", "backup", EVERY_HOUR_AT_30),
                           row("b", "copy", NIGHTLY_0230)])
    agent.register()
    first = reconcile(now=T0)
    before = {run.id: run.parameters["schedule_id"] for run in scheduled(agent)}
    assert first["created"] == len(before) == 3 + 3  # at least 3 windows each
    again = reconcile(now=T0 + timedelta(seconds=30))
    assert again["created"] == 0 and again["deleted"] == 0
    assert {run.id for run in scheduled(agent)} == set(before)

    # b moves to 03:30: only b's runs are touched; a params-only change keeps a's.
    agent.write_schedules([
        {**row("a", "backup", EVERY_HOUR_AT_30), "params": {"x": 1}, "version": 2},
        row("b", "copy", {"days": ["*"], "hours": ["3"], "minute": "30"}),
    ])
    changed = reconcile(now=T0 + timedelta(minutes=1))
    assert changed["changed"] == 2 and changed["deleted"] == 3 and changed["created"] == 3
    after = scheduled(agent)
    kept = [run.id for run in after if run.parameters["schedule_id"] == "a"]
    assert kept == [rid for rid, sid in before.items() if sid == "a"]
    assert {run.expected_start_time.astimezone(UTC).hour for run in after
            if run.parameters["schedule_id"] == "b"} == {8}  # 03:30 EST

    # Removed and disabled rows lose their planned runs.
    agent.write_schedules([{**row("b", "copy", NIGHTLY_0230), "enabled": False}])
    reconcile(now=T0 + timedelta(minutes=2))
    assert scheduled(agent) == []


def test_the_cap_plans_the_nearest_windows_and_the_rest_later(agent: Agent) -> None:
    from flows.reconcile import reconcile

    agent.write_config(extra="plan_max_runs = 10")
    agent.write_schedules([row("m", "copy", {"days": None, "hours": None, "minute": "",
                                             "interval_minutes": 1})])
    agent.register()
    counts = reconcile(now=T0)
    runs = scheduled(agent)
    assert counts["created"] == 10 and len(runs) == 10
    # From the minute it was first seen (15:29) on, nearest first; 51 held back.
    assert [run.expected_start_time.astimezone(UTC).minute for run in runs] == list(range(29, 39))
    # 15:41:05: the ten nearest are now 15:37..15:46, of which 15:37 and 15:38 exist.
    assert reconcile(now=T0 + timedelta(minutes=12))["created"] == 8


def test_windows_that_never_had_a_run_are_recovered_once_and_reported(agent: Agent) -> None:
    """The node was down 3 hours, longer than the horizon: one recovery, every window named."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.reconcile import reconcile

    agent.write_schedules([row("h", "backup", EVERY_HOUR_AT_30),
                           {**row("s", "copy", EVERY_HOUR_AT_30), "miss_policy": "skip"}])
    agent.register()
    reconcile(now=T0)  # plans 15:30, 16:30 and 17:30 (at least 3 windows each)
    later = T0 + timedelta(hours=4, minutes=40)  # 20:09:05: 18:30 and 19:30 never had a run
    counts = reconcile(now=later)
    assert counts["missed"] == 4 and counts["recovered"] == 1
    recovery = [run for run in agent.runs() if "trigger:schedule-recovery" in run.tags]
    assert [run.name for run in recovery] == ["backup-h-20261202T1930Z"]
    events = _events("sched.window.missed", agent.node, 2)
    by_id = {e["payload"]["schedule_id"]: e["payload"] for e in events}
    assert by_id["h"]["count"] == 2 and by_id["h"]["recovered"] == "2026-12-02T19:30:00+00:00"
    assert by_id["s"]["count"] == 2 and by_id["s"]["recovered"] is None
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"reconcile-{agent.node}"])))
    text = str(max(artifacts, key=lambda artifact: artifact.created).data)
    assert "`h`: 2 missed" in text and "recovered Wed 2026-12-02 14:30 EST" in text
    assert "`s`: 2 missed" in text and "not recovered (miss policy)" in text
    # Reported once: the next reconcile finds nothing new to recover or report.
    assert reconcile(now=later + timedelta(minutes=1))["missed"] == 0


# -- the start guard (run-job) ----------------------------------------------------------


def planned(agent: Agent, sid: str, window: datetime) -> Any:
    run, = [r for r in agent.runs() if r.parameters.get("schedule_id") == sid
            and r.parameters.get("window") == window.isoformat()]
    return run


def run_planned(run: Any, now: datetime) -> Any:
    """Run a planned run's parameters in this process at logical time now."""
    from flows.job import run_job

    return run_job(**run.parameters, now=now, return_state=True)


def test_a_planned_window_runs_once_and_a_second_run_of_it_is_skipped(agent: Agent) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("s-1", "backup", EVERY_HOUR_AT_30)])
    agent.register()
    reconcile(now=T0)
    run = planned(agent, "s-1", WINDOW)
    state = run_planned(run, WINDOW + timedelta(seconds=2))
    assert state.is_completed() and state.name == "Completed"
    assert agent.cache()["last_fired_at"]["s-1"] == "2026-12-02T15:30:00Z"
    second = run_planned(run, WINDOW + timedelta(seconds=40))
    assert second.is_completed() and second.name == "Skipped"
    assert second.message == "window 2026-12-02 10:30 EST already ran"
    events = _events("sched.job.completed", agent.node, 2)
    assert len(events) == 1  # the skipped run emitted nothing


def test_late_runs_follow_the_miss_policy_and_say_why(agent: Agent) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("once", "backup", EVERY_HOUR_AT_30),
                           {**row("never", "copy", EVERY_HOUR_AT_30), "miss_policy": "skip"}])
    agent.register()
    reconcile(now=T0)
    back = WINDOW + timedelta(hours=1, minutes=15)  # 16:45: both 15:30 and 16:30 are late
    s = run_planned(planned(agent, "never", WINDOW), back)
    assert s.name == "Skipped"
    assert "missed: 1 h 15 min late (grace 5 min); miss policy skip" in s.message
    old = run_planned(planned(agent, "once", WINDOW), back)
    assert old.name == "Skipped" and old.message.endswith(
        "coalesced into 2026-12-02 11:30 EST (the latest missed window)")
    latest = run_planned(planned(agent, "once", WINDOW + timedelta(hours=1)), back)
    assert latest.name == "Completed"
    assert agent.cache()["last_fired_at"] == {"once": "2026-12-02T16:30:00Z"}


def test_a_reconcile_after_downtime_ends_the_late_runs_the_guard_would_skip(agent: Agent) -> None:
    """No process per late run: the reconcile ends them Skipped with the guard's reason."""
    from flows.reconcile import reconcile

    agent.write_schedules([row("once", "backup", EVERY_HOUR_AT_30),
                           {**row("never", "copy", EVERY_HOUR_AT_30), "miss_policy": "skip"}])
    agent.register()
    reconcile(now=T0)
    back = WINDOW + timedelta(hours=1, minutes=15)  # 16:45: 15:30 and 16:30 are late
    reconcile(now=back)
    ended = {(run.parameters["schedule_id"], run.parameters["window"]): run.state
             for run in agent.runs() if run.state.name == "Skipped"}
    w1, w2 = WINDOW.isoformat(), (WINDOW + timedelta(hours=1)).isoformat()
    assert set(ended) == {("once", w1), ("never", w1), ("never", w2)}
    assert ended[("once", w1)].message.endswith(
        "coalesced into 2026-12-02 11:30 EST (the latest missed window)")
    assert ended[("never", w2)].message.endswith("15 min late (grace 5 min); miss policy skip")
    assert all(state.is_completed() for state in ended.values())
    # The latest missed window of run-once is left to its run, which runs it.
    latest = planned(agent, "once", WINDOW + timedelta(hours=1))
    assert latest.state.name == "Scheduled"
    assert run_planned(latest, back + timedelta(seconds=5)).name == "Completed"
    # A run the reconcile ended never started: no job event, nothing fired.
    assert agent.cache()["last_fired_at"] == {"once": "2026-12-02T16:30:00Z"}
    events = _events("sched.job.completed", agent.node, 2)
    assert [(e["payload"]["schedule_id"], e["payload"]["window"]) for e in events] == [
        ("once", latest.parameters["window"])]


def test_a_row_removed_or_changed_after_planning_runs_in_its_new_version_or_not_at_all(
    agent: Agent,
) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("s-1", "backup", EVERY_HOUR_AT_30),
                           row("s-2", "copy", EVERY_HOUR_AT_30)])
    agent.register()
    reconcile(now=T0)
    run1, run2 = planned(agent, "s-1", WINDOW), planned(agent, "s-2", WINDOW)
    agent.write_schedules([{**row("s-1", "backup", EVERY_HOUR_AT_30), "repo_id": "r-new"}])
    from flows.dispatch import build_scheduler

    build_scheduler(agent_settings_for(agent), now=T0).pull(T0 + timedelta(seconds=1))
    gone = run_planned(run2, WINDOW)
    assert gone.name == "Skipped"
    assert gone.message == "schedule s-2 was removed from this node's list"
    state = run_planned(run1, WINDOW)
    assert state.name == "Completed"
    assert "backing up r-new" in _logs(state.state_details.flow_run_id, "backing up r-new")


def agent_settings_for(agent: Agent) -> Any:
    from flows.settings import load_settings

    return load_settings(agent.config)


def test_a_whole_row_as_a_parameter_is_refused_unless_the_node_allows_it(agent: Agent) -> None:
    from flows.job import run_job

    state = run_job(schedule=row("s-1", "backup", EVERY_HOUR_AT_30), return_state=True)
    assert state.is_failed() and "takes a schedule_id, not a whole schedule row" in state.message
    agent.write_config(extra="allow_row_parameter = true")
    state = run_job(schedule=row("s-1", "backup", EVERY_HOUR_AT_30), return_state=True)
    assert state.is_completed()


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


def test_garbage_pull_keeps_the_cache_and_the_planned_runs(
    agent: Agent, controller: FlakyController
) -> None:
    from flows.reconcile import reconcile

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
    # The plan is made from the cache all the same, and the window still runs.
    assert len(scheduled(agent)) == 3
    assert run_planned(planned(agent, "s-1", WINDOW), WINDOW + timedelta(seconds=1)).name == (
        "Completed")


def test_a_slow_pull_never_holds_up_a_job_start(
    agent: Agent, controller: FlakyController
) -> None:
    """A planned job starts while a reconcile waits on an unresponsive controller."""
    from flows.reconcile import reconcile

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
        started: list[str] = []
        job = threading.Thread(target=lambda: started.append(
            run_planned(planned(agent, "s-1", WINDOW), WINDOW + timedelta(seconds=1)).name))
        job.start()
        job.join(timeout=45)
        assert started == ["Completed"], "the job waited for the reconcile's pull"
        assert controller.answered == 1  # still no answer: the job did not wait for one
    finally:
        controller.hold.set()
        pulling.join(timeout=60)
    assert not pulling.is_alive()


def test_token_from_a_prefect_secret_block(
    agent: Agent, controller: FlakyController
) -> None:
    from prefect.blocks.system import Secret

    from flows.reconcile import reconcile

    block = f"token-{agent.node}"
    Secret(value="from-the-block").save(block, overwrite=True)
    agent.write_config(pull_url=controller.url, extra=f'token_secret_block = "{block}"')
    controller.body = b"[]"
    state = reconcile(now=T0, return_state=True)  # no run-job deployment: planning fails
    assert state.is_failed() and f"no deployment run-job/{agent.node}" in str(state.message)
    agent.register()
    assert reconcile(now=T0)["schedules"] == 0
    assert controller.auth == ["Bearer from-the-block"] * 2


def _events(name: str, node: str, count: int) -> list[dict[str, Any]]:
    """Return the events called name about node once there are count of them (or 15 s)."""
    return agent_events(name, node, lambda events: len(events) >= count)


def test_reconcile_emits_schedules_changed(agent: Agent) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("s-1", "backup", EVERY_HOUR_AT_30)])
    agent.register()
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

    cache_rows(agent, [row("s-1", "backup", EVERY_HOUR_AT_30)])
    state = run_job(schedule_id="s-1", trigger_key="schedule", window=WINDOW,
                    key="s-1@x", now=WINDOW, return_state=True)
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

    cache_rows(agent, [row("s-f", "fail", EVERY_HOUR_AT_30)])
    state = run_job(schedule_id="s-f", return_state=True)
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

    cache_rows(agent, [row("s-n", "needs", EVERY_HOUR_AT_30)])
    state = run_job(schedule_id="s-n", return_state=True)
    assert state.is_failed()
    assert "no parameter 'missing'" in str(state.message)


def test_window_without_an_offset_fails_before_anything_runs(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A naive window (``--param window=2026-03-08T02:30:00``) is an error, not local time."""
    from flows.actions import window_stamp
    from flows.job import run_job
    from sched_core import ConfigError

    cache_rows(agent, [row("s-naive", "backup", EVERY_HOUR_AT_30)])
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        naive = datetime(2026, 3, 8, 2, 30)
        with pytest.raises(ConfigError, match="no UTC offset"):
            window_stamp(naive)
        state = run_job(schedule_id="s-naive", window=naive, return_state=True)
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

    from flows.dispatch import job_tags
    from flows.job import _emit_terminal, run_job
    from flows.registry import ACTIVE_STATES, FINISHED_STATES, count_jobs

    assert _emit_terminal in run_job.on_cancellation_hooks
    before = datetime.now(UTC) - timedelta(seconds=5)
    now = datetime.now(UTC)
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(
            run_job, parameters={"schedule_id": "s-c", "trigger_key": "schedule"},
            tags=job_tags(agent.node, "backup", "s-c", "schedule"), state=Running(),
        )
        assert count_jobs(agent.node, ["backup"], ACTIVE_STATES, now=now) == 1
        client.set_flow_run_state(run.id, Cancelled(), force=True)
        run = client.read_flow_run(run.id)
    assert run.state is not None and run.state.is_cancelled()
    assert count_jobs(agent.node, ["backup"], ACTIVE_STATES, now=now) == 0
    assert count_jobs(agent.node, ["backup"], FINISHED_STATES, now=now, ended_after=before) == 1

    _emit_terminal(run_job, run, run.state)
    failed, = _events("sched.job.failed", agent.node, 1)
    assert failed["payload"]["state"] == "Cancelled"
    assert failed["payload"]["action"] == "backup"
    assert failed["payload"]["flow_run_id"] == str(run.id)


# -- advance-chain --------------------------------------------------------------------


def test_wave_runs_prune_then_check_once_a_day_never_before_it_drains(agent: Agent) -> None:
    from flows.chain import advance_chain
    from flows.reconcile import reconcile

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
    reconcile(now=now - timedelta(seconds=30))  # plans this minute's backup and copy
    backup = planned(agent, "b-1", minute)
    copy = planned(agent, "c-1", minute)

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

    agent.write_schedules([
        row("b-1", "backup", EVERY_HOUR_AT_30),
        row("p-1", "prune", {"on": "after_wave"}),
        row("k-1", "check", {"on": "after_wave"}),
    ])
    now = datetime.now(UTC)
    cache_rows(agent, None, now=now - timedelta(minutes=1))  # no run-job deployment yet
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


def test_a_run_job_process_hung_after_its_final_state_prints_its_stacks_and_exits() -> None:
    """Seen in CI: a run-job process whose run was already Completed hung in its last
    hook and never exited. The watchdog the last hook starts in the run's own process
    prints every thread's stack (each line naming the run) and ends the process with the
    run's outcome."""
    import subprocess

    script = (
        "import threading, flows.job as job\n"
        "job.EXIT_GRACE_S = 0.5\n"
        "threading.Thread(target=job._exit_watchdog, args=('backup-s-1-x', False),"
        " daemon=True).start()\n"
        "def stuck_in_prefect_teardown():\n"
        "    threading.Event().wait()\n"
        "stuck_in_prefect_teardown()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parent.parent)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == ("run-job backup-s-1-x: the process is still alive 0.5 s after the "
                        "run's final state; its threads:"), done.stderr
    assert "run-job backup-s-1-x: thread MainThread:" in lines
    assert any("in stuck_in_prefect_teardown" in line for line in lines), done.stderr
    assert all(line.startswith("run-job backup-s-1-x:") for line in lines), done.stderr
