"""A corrupt or hostile outbox never stops the node, and runs nothing the action table would
not (the hardening issue's point 5).

1. A journal line whose ``attempt`` is not an integer used to kill the node at every start
   (``Jobs.resume`` caught only ValueError): the folder is put in quarantine with one log
   line and a ``sched.outbox.quarantined`` event, and the other jobs resume.
2. A ``job.json`` planted in the outbox used to run its stored ``argv`` at the next start,
   past the action table's checks: a restart runs what the table renders now for the job's
   schedule, window and trigger, or nothing (the job ends Failed, saying why).
3. A symlink where a job's folder should be used to be followed (the node wrote its journal
   outside its state folder): it is put in quarantine, never followed.

A real node (tests/nodekit.py) with real keepers; its Prefect server is an address nobody
answers (the node fires and runs jobs whether Prefect answers or not).
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path

from sched_node.outbox import EVENT_QUARANTINED, KIND_EVENT, JobSpec, job_id_for, utc_text
from tests.nodekit import NodeUnderTest, row
from tests.procs import free_port, wait_for


def _node(tmp_path: Path) -> NodeUnderTest:
    return NodeUnderTest(tmp_path, f"http://127.0.0.1:{free_port()}/api",
                         name=f"obx-{uuid.uuid4().hex[:6]}",
                         rows=[row("s-1", every=None, minute="7", hours=["3"])])


def _plant(node: NodeUnderTest, name: str, argv: list[str], **fields: object) -> Path:
    """Write a queued job's folder into the node's outbox, as an attacker (or a torn disk)."""
    now = datetime.now(UTC)
    spec = JobSpec(job_id=job_id_for(now, name), kind="job", node=node.name, schedule_id="s-1",
                   action="echo", trigger_key="manual", window=None, key=f"s-1@manual@{name}",
                   run_name=name, idempotency_key=None, flow_run_id=None, planned_start=None,
                   accepted_at=now, reason="planted", argv=argv, timeout_s=30)
    folder = node.state / "outbox" / spec.job_id
    folder.mkdir(parents=True, mode=0o700)
    (folder / "job.json").write_text(json.dumps({**spec.to_json(), **fields}))
    with (folder / "journal.jsonl").open("w") as journal:
        journal.write(json.dumps({"e": "accepted", "at": utc_text(now)}) + "\n")
    return folder


def _events(node: NodeUnderTest) -> list[dict[str, object]]:
    found = []
    for folder in (node.state / "outbox").iterdir():
        spec = json.loads((folder / "job.json").read_text())
        if spec["kind"] == KIND_EVENT:
            found += json.loads((folder / "events.json").read_text())["events"]
    return found


def test_a_bad_journal_line_is_put_in_quarantine_and_the_other_jobs_resume(
    tmp_path: Path,
) -> None:
    node = _node(tmp_path)
    node.build()
    bad = _plant(node, "bad", ["echo", "x"])
    with (bad / "journal.jsonl").open("a") as journal:
        journal.write(json.dumps({"e": "launch", "at": utc_text(datetime.now(UTC)),
                                  "attempt": "one"}) + "\n")
    _plant(node, "good", ["echo", "x"])
    started = node.start()
    try:
        wait_for("the good job's end", lambda: any(
            item.run_name == "good" for item in started.history.items()), 30)
    finally:
        node.stop()
    assert not bad.exists(), "the bad folder is out of the outbox"
    (moved,) = (node.state / "quarantine").iterdir()
    assert moved.name.startswith(bad.name) and (moved / "journal.jsonl").exists()
    (event,) = [item for item in _events(node) if item["event"] == EVENT_QUARANTINED]
    assert event["payload"]["folder"] == bad.name  # type: ignore[index]
    assert "attempt is not an integer" in str(event["payload"]["reason"])  # type: ignore[index]


def test_a_planted_job_runs_what_the_action_table_renders_not_what_it_says(
    tmp_path: Path,
) -> None:
    node = _node(tmp_path)
    first = node.start()  # a node that ran before: its cache holds s-1
    wait_for("the node's first pull", lambda: bool(first.scheduler.schedules()), 30)
    node.stop()
    node = NodeUnderTest(tmp_path, node.api_url, name=node.name, rows=[row(
        "s-1", every=None, minute="7", hours=["3"])])
    node.build()
    target = tmp_path / "pwned"
    planted = _plant(node, "planted", ["touch", str(target)])
    unknown = _plant(node, "unknown", ["touch", str(target)], schedule_id="nope")
    started = node.start()
    try:
        wait_for("both jobs' ends", lambda: {"planted", "unknown"} <= {
            item.run_name for item in started.history.items()}, 30)
    finally:
        node.stop()
    assert not target.exists(), "the planted argv ran"
    ended = {item.run_name: item for item in started.history.items()}
    assert ended["planted"].state == "Completed", ended["planted"]
    spec = json.loads((planted / "a1.spec.json").read_text())
    assert spec["argv"][:2] == ["sh", "-c"] and spec["argv"][-2:] == ["s-1", "0"], spec["argv"]
    assert ended["unknown"].state == "Failed"
    assert "schedule 'nope' is not in the node's cache" in ended["unknown"].message
    assert not (unknown / "a1.spec.json").exists(), "nothing was launched for it"


def test_a_symlinked_job_folder_is_put_in_quarantine_and_never_followed(
    tmp_path: Path,
) -> None:
    node = _node(tmp_path)
    node.build()
    elsewhere = tmp_path / "elsewhere"
    real = _plant(node, "linked", ["echo", "x"])
    os.rename(real, elsewhere)
    os.symlink(elsewhere, real)
    before = sorted(path.name for path in elsewhere.iterdir())
    journal = (elsewhere / "journal.jsonl").read_text()
    node.start()
    try:
        wait_for("the link in quarantine", lambda: (node.state / "quarantine").exists(), 30)
    finally:
        node.stop()
    assert sorted(path.name for path in elsewhere.iterdir()) == before
    assert (elsewhere / "journal.jsonl").read_text() == journal, "written through the link"
    (moved,) = (node.state / "quarantine").iterdir()
    assert moved.is_symlink() and moved.name.startswith(real.name)
    assert any(item["event"] == EVENT_QUARANTINED for item in _events(node))
