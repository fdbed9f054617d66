"""``sched report``, ``sched explain`` and the ``LAST`` column against a real controller.

The controller is the real app on SQLite served over loopback, its clock at the
morning of tests/test_morning_api.py (Friday 2026-12-04 12:00Z); the nodes post
their job records with their own tokens. The commands run through typer's
runner, as the installed ``sched`` does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session
from typer.testing import CliRunner

from controller import db
from controller.models import FleetAlert
from sched_cli import app as sched
from sched_ops.cli import silent_warning
from tests.factories import Clock
from tests.test_morning_api import (
    BK_KEY,
    MORNING,
    WRITTEN,
    controller,
    morning_fleet,
)

ADMIN_TOKEN = "morning-admin-token"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("morning-cli")
    clock = Clock(MORNING)
    with controller(f"sqlite:///{folder / 'c.db'}", clock) as client:
        clock.now = WRITTEN
        morning_fleet(client, clock)
        yield str(client.base_url)


def run(base: str, *args: str, token: str = ADMIN_TOKEN) -> Any:
    env = {"SCHED_TOKEN": token, "SCHED_CONTROLLER_URL": base, "PREFECT_API_URL": ""}
    return CliRunner().invoke(sched, list(args), env=env)


def test_report_answers_the_morning_question_and_exits_6_for_a_missed_window(base: str) -> None:
    result = run(base, "report")
    assert result.exit_code == 6, result.output
    lines = result.output.rstrip().splitlines()
    assert lines[-1] == ("1 of 3 nodes backed up (each schedule's latest window "
                         "completed); 1 failing: node-b "
                         "bk failed 1 window since 2026-12-04 02:30 EST, last: tar exited with "
                         "code 2; 0 missed; 1 silent: node-c (bk missed 1)")
    text = result.output
    # Worst first: the node that never showed up, then the failed one, then the good one.
    assert text.index("node-c  (since") < text.index("node-b  (since") < text.index(
        "node-a  (since")
    assert "node-c  (since Thu 2026-12-03 18:00 EST)  SILENT: node node-c has never made" in text
    missed = next(x for x in lines if x.strip().startswith("bk") and "MISSED" in x)
    assert "2026-12-04 02:30 EST" in missed and "MISSED: no report from the node" in missed
    failed = next(x for x in lines if "FAILED" in x)
    assert "FAILED: tar exited with code 2" in failed and "4 min 20 s" in failed
    assert "0b7c2b0f-1a11-4a3b-8f53-9b2f64c60d4e" in failed  # no Prefect UI here: the run id
    offline = next(x for x in lines if "2026-12-03 18:00 EST" in x and x.strip().startswith("cp"))
    assert "Completed (ran offline, recorded later)" in offline
    assert any("manual 2026-12-04 04:00 EST" in x and "Completed" in x for x in lines)
    running = next(x for x in lines if "2026-12-04 06:00 EST" in x)
    assert "Running since 2026-12-04T11:00:00Z" in running and "Running: Running" not in running
    assert any("Skipped: window 2026-12-04 00:00 EST missed: 14 min late" in x for x in lines)


def test_report_json_one_node_and_the_exit_codes(base: str) -> None:
    result = run(base, "report", "--json")
    assert result.exit_code == 6
    found = json.loads(result.output)
    assert [n["node"] for n in found["nodes"]] == ["node-c", "node-b", "node-a"]
    assert [(item["node"], item["schedule_id"], item["windows"], item["key"], item["window"])
            for item in found["summary"]["missed"]] == [
        ("node-c", "bk", 1, BK_KEY, "2026-12-04T07:30:00Z")]
    failed = run(base, "report", "--node", "node-b")
    assert failed.exit_code == 5, failed.output
    assert failed.output.rstrip().splitlines()[-1] == (
        "0 of 1 nodes backed up (each schedule's latest window completed); 1 failing: "
        "node-b bk failed 1 window since 2026-12-04 02:30 EST, last: tar exited with code "
        "2; 0 missed")
    fine = run(base, "report", "--node", "node-a")
    assert fine.exit_code == 0, fine.output
    assert fine.output.rstrip().splitlines()[-1] == (
        "1 of 1 nodes backed up (each schedule's latest window completed); 0 failing; "
        "0 missed")
    # A narrower range: only Thursday evening, where node-a's 18:00 copy ran.
    evening = run(base, "report", "--node", "node-a", "--since", "2026-12-03T22:00:00Z",
                  "--until", "2026-12-04T00:00:00Z", "--json")
    assert [w["key"] for w in json.loads(evening.output)["nodes"][0]["windows"]] == [
        "cp@2026-12-03T18:00-05:00"]
    assert run(base, "report", "--since", "yesterday").exit_code == 2
    refused = run(base, "report", "--node", "node-a", token="node-b-token-0123")
    assert refused.exit_code == 1 and "403" in refused.output


def test_explain_says_why_each_window_ran_or_not(base: str) -> None:
    failed = run(base, "explain", "node-b", "bk", "2026-12-04T02:30")
    assert failed.exit_code == 0, failed.output
    lines = failed.output.splitlines()
    assert lines[0] == "FAILED: tar exited with code 2"
    assert any(x.startswith("- row: version 1 (written 2026-12-03T12:00:00Z, in force now): "
                            "daily at 02:30 in America/New_York") for x in lines)
    assert any("error: tar exited with code 2" in x and "Prefect run 0b7c2b0f" in x
               for x in lines)

    missed = run(base, "explain", "node-c", "bk", BK_KEY, "--json")
    found = json.loads(missed.output)
    assert (found["verdict"], found["key"], found["window"]) == ("MISSED", BK_KEY,
                                                                 "2026-12-04T07:30:00Z")
    assert found["summary"] == ("no report from the node (node node-c has never made a request "
                                "to this controller with its own token)")
    topics = {f["topic"]: f["text"] for f in found["facts"]}
    assert topics["start"].startswith("its run starts 2026-12-04 02:30 EST; the node's grace "
                                      "is 5 min")

    skipped = run(base, "explain", "node-a", "cp", "2026-12-04T05:00:00Z")
    assert skipped.output.splitlines()[0].startswith("SKIPPED: window 2026-12-04 00:00 EST "
                                                     "missed")
    not_one = run(base, "explain", "node-a", "cp", "2026-12-04T03:00")
    assert not_one.output.splitlines()[0] == (
        "NOT A WINDOW: 2026-12-04 03:00 EST is not a window of cp (every 6 h): the window "
        "before is 2026-12-04 00:00 EST; the one after is 2026-12-04 06:00 EST")
    before = run(base, "explain", "node-c", "bk", "2026-12-03T02:30")
    assert before.output.splitlines()[0] == ("NOT A WINDOW: the row bk did not exist on the "
                                             "controller yet: it was written at "
                                             "2026-12-03T12:00:00Z")
    # 2027-03-14 02:30 does not exist in New York: the kit runs it at 03:00 EDT.
    gap = json.loads(run(base, "explain", "node-c", "bk", "2027-03-14T02:30", "--json").output)
    assert (gap["verdict"], gap["key"]) == ("NOT YET", "bk@2027-03-14T03:00-04:00")
    assert gap["facts"][1] == {"topic": "DST", "text": (
        "02:30 does not exist on 2027-03-14 (DST: clocks jump from 02:00 to 03:00): runs at "
        "03:00 EDT")}
    assert run(base, "explain", "node-c", "nope", "2026-12-04T02:30").exit_code == 1
    bad = run(base, "explain", "node-c", "bk", "someday")
    assert bad.exit_code == 1 and "422" in bad.output and "window" in bad.output


def test_ls_last_shows_one_runs_window_and_outcome_together(base: str) -> None:
    listed = run(base, "schedules", "ls", "--node", "node-b")
    assert listed.exit_code == 0, listed.output
    line = next(x for x in listed.output.splitlines() if x.startswith("bk"))
    assert "Fri 2026-12-04 02:30 EST Failed: tar exited with code 2" in line
    # node-a's bk: its last run is the manual one at 04:00 EST, shown with its own outcome.
    listed = run(base, "schedules", "ls", "--node", "node-a")
    line = next(x for x in listed.output.splitlines() if x.startswith("bk"))
    assert "manual Fri 2026-12-04 04:00 EST Completed" in line
    nodes = run(base, "nodes")
    assert nodes.exit_code == 0
    row = next(x for x in nodes.output.splitlines() if x.startswith("node-a"))
    assert "(heartbeat 60 s)" in row and " ok " in f" {row} "  # AGO is the real clock's


def test_silent_warning_words() -> None:
    from datetime import UTC, datetime

    now = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    assert silent_warning({"node": "n", "status": "ok"}, now) is None
    assert silent_warning({"node": "n", "status": "silent", "heartbeat_s": 60,
                           "last_seen_at": "2026-12-04T11:48:00Z"}, now) == (
        "node n is silent: no request of its own for 12 min (it promised one every 60 s); "
        "the run waits in Prefect until its agent is back")


def test_explain_names_the_alerts_the_watch_raised_about_the_window_and_the_node(
    tmp_path: Path,
) -> None:
    """The fleet watch's alerts (as it stores them) are facts of the window they are about."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    clock = Clock(MORNING)
    with controller(url, clock) as client:
        clock.now = WRITTEN
        morning_fleet(client, clock)
        at = datetime(2026, 12, 4, 7, 50, tzinfo=UTC)
        engine = db.make_engine(url)
        with Session(engine) as session:
            session.add(FleetAlert(node="node-c", kind="window-missed", subject=BK_KEY,
                                   schedule_id="bk", reason="missed", payload={},
                                   detected_at=at, sent_at=at + timedelta(seconds=2)))
            session.add(FleetAlert(node="node-c", kind="node-silent",
                                   subject="silent@2026-12-03T18:00:00Z", reason="silent",
                                   payload={}, detected_at=at - timedelta(hours=1)))
            session.add(FleetAlert(node="node-c", kind="window-failed", subject="bk@other",
                                   reason="another window", payload={}, detected_at=at))
            session.commit()
        engine.dispose()
        found = json.loads(run(str(client.base_url), "explain", "node-c", "bk", BK_KEY,
                               "--json").output)
    texts = [fact["text"] for fact in found["facts"]]
    assert "window-missed raised 2026-12-04T07:50:00Z, sent 2026-12-04T07:50:02Z" in texts
    assert ("node node-c went silent (last request 2026-12-03T18:00:00Z; alert raised "
            "2026-12-04T06:50:00Z), not back since") in texts
    assert not any("window-failed" in text for text in texts), texts
