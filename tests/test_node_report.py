"""The node's report to the controller: after a reconcile and after a job, best effort.

A real controller (SQLite, over loopback) and a real Prefect server: the agent
pulls from the controller with its node token, reconciles, runs a planned job,
and the controller's node status shows what it reported. A controller that is
gone, or refuses the report, never fails a reconcile or a job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.testing import serve_in_thread
from flows.node_report import build_report, report_url, send_report
from flows.settings import AgentSettings, load_settings
from sched_core.model import Cache, LocalSchedule
from tests.test_flows import EVERY_HOUR_AT_30, T0, WINDOW, Agent, planned, row, run_planned

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]

ADMIN = {"Authorization": "Bearer admin-token-for-reports-0123"}


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Agent:
    return Agent(tmp_path, monkeypatch)


@pytest.fixture
def controller(agent: Agent, tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=["admin-token-for-reports-0123"],
                    nodes={agent.node: ["node-token-for-reports-456"]})
    app = create_app(engine, tokens)
    try:
        with serve_in_thread(app) as base:
            yield base
    finally:
        app.state.pull_recorder.close()
        engine.dispose()


def status(base: str, node: str) -> dict[str, object]:
    answer = httpx.get(f"{base}/api/nodes/{node}/status", headers=ADMIN, timeout=10)
    assert answer.status_code == 200, answer.text
    data: dict[str, object] = answer.json()
    return data


def test_report_url_is_the_pull_urls_controller(tmp_path: Path) -> None:
    def settings(pull_url: str, **extra: object) -> AgentSettings:
        return AgentSettings(node_name="node a+1", pull_url=pull_url, state_dir=tmp_path,
                             **extra)  # type: ignore[arg-type]

    assert report_url(settings("https://c.example:8443/api/schedules?node=x")) == (
        "https://c.example:8443/api/nodes/node%20a%2B1/report")
    assert report_url(settings("http://c/sched/api/nodes/x/schedules")) == (
        "http://c/sched/api/nodes/node%20a%2B1/report")
    assert report_url(settings("schedules.json")) is None
    assert report_url(settings("http://c/schedules")) is None
    assert report_url(settings("schedules.json", report_url="http://r/x")) == "http://r/x"


def test_reconcile_and_job_report_to_the_controller(agent: Agent, controller: str) -> None:
    from flows.reconcile import reconcile

    agent.write_config(pull_url=f"{controller}/api/schedules?node={agent.node}",
                       extra='token = "node-token-for-reports-456"')
    put = httpx.put(f"{controller}/api/nodes/{agent.node}/schedules/s-1",
                    json=row("s-1", "backup", EVERY_HOUR_AT_30), headers=ADMIN, timeout=10)
    assert put.status_code == 200
    agent.register()
    assert status(controller, agent.node)["status"] == "never-seen"
    reconcile(now=T0)
    got = status(controller, agent.node)
    assert got["timezone"] == "America/New_York" and got["agent_version"]
    assert got["last_pull_status"] == "200" and got["status"] == "ok"
    assert got["list_version_served"] == got["list_version_current"]
    (schedule,) = got["schedules"]  # type: ignore[misc]
    assert schedule["last_outcome"] is None
    run = planned(agent, "s-1", WINDOW)
    state = run_planned(run, WINDOW + timedelta(seconds=2))
    assert state.is_completed()
    got = status(controller, agent.node)
    (schedule,) = got["schedules"]  # type: ignore[misc]
    assert schedule["last_fire"] == "2026-12-02T15:30:00Z"
    outcome = schedule["last_outcome"]
    assert outcome["state"] == "Completed"
    assert outcome["flow_run_id"] == str(state.state_details.flow_run_id)
    assert outcome["flow_run_name"] == "backup-s-1-20261202T1530Z"
    assert outcome["window"] == "2026-12-02T15:30:00Z" and outcome["ended_at"]
    assert got["failing"] is False


def test_a_report_that_cannot_be_sent_fails_nothing(
    agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    from flows.reconcile import reconcile

    agent.write_schedules([row("s-1", "backup", EVERY_HOUR_AT_30)])
    agent.write_config(extra='report_url = "http://127.0.0.1:9/api/nodes/x/report"\n'
                             "report_timeout = 1")
    agent.register()
    with caplog.at_level(logging.WARNING, logger="flows.node_report"):
        counts = reconcile(now=T0)
        state = run_planned(planned(agent, "s-1", WINDOW), WINDOW + timedelta(seconds=2))
    assert counts["schedules"] == 1 and state.is_completed()
    failures = [r for r in caplog.records if "could not send the node report" in r.getMessage()]
    assert len(failures) == 2
    assert all(r.report_url == "http://127.0.0.1:9/api/nodes/x/report"
               for r in failures)
    assert all(r.node == agent.node for r in failures)


def test_a_refused_report_is_logged_with_the_answer(
    agent: Agent, controller: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(agent.config).model_copy(update={
        "pull_url": f"{controller}/api/schedules?node={agent.node}",
        "token": None,
    })
    cache = Cache(schedules=[LocalSchedule.model_validate(row("s-1", "backup",
                                                              EVERY_HOUR_AT_30))])
    now = datetime(2026, 12, 2, 15, 0, tzinfo=UTC)
    report = build_report(settings, cache, now=now, last_pull=None, latest_jobs={},
                          counts={"skipped": 2})
    assert report["schedules"] == [{"id": "s-1", "last_fired": None,
                                    "next_planned": "2026-12-02T15:30:00Z", "latest_job": None}]
    assert report["counts"] == {"skipped": 2, "missed": 0}
    with caplog.at_level(logging.WARNING, logger="flows.node_report"):
        assert send_report(settings, report) is False  # no token: 401
    (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert record.status == 401
    settings = settings.model_copy(update={"token": SecretStr("node-token-for-reports-456")})
    assert send_report(settings, report) is True
    assert status(controller, agent.node)["agent_version"] == report["agent_version"]
