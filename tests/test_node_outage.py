"""The node as its own process against a Prefect server that goes away, and killed with -9.

A real ``prefect server start`` (SQLite under the test's folder, tests/procs.py)
that the test stops and starts again, and the real node process
(``python -m tests.node_proc``: ``flows.node`` with its clock shifted so that
the windows come seconds after the start). What is checked is what an operator
sees: each window's command ran once, at its instant (its own output says when),
and every run is in Prefect in its final state with its output, once.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flows.identity import job_run_name
from tests.nodekit import NodeUnderTest, Prefect, chain_row, final, offset_to, row, wait_runs
from tests.procs import PrefectServer, stop_group, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PrefectServer]:
    server = PrefectServer(tmp_path / "prefect")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def prefect(server: PrefectServer) -> Iterator[Prefect]:
    reader = Prefect(server.url)
    yield reader
    reader.close()


def _hourly(sid: str, at: datetime, *, sleep: int = 1) -> dict[str, Any]:
    """Return a row that fires once an hour, at at's minute (so once in a test)."""
    return row(sid, every=None, minute=str(at.minute), sleep=sleep)


def _starts(state: Path, sid: str) -> list[float]:
    """Return the real times at which the node's outbox saw sid's command start (any job)."""
    found = []
    for out in state.glob("outbox/*/a*.out"):
        for line in out.read_text().splitlines():
            message = json.loads(line)["m"]
            if message.startswith(f"started {sid} at "):
                found.append(float(message.rsplit(" ", 1)[1]))
    return found


def _started_in_logs(prefect: Prefect, run: dict[str, Any], sid: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in prefect.logs(run["id"])
            if line.startswith(f"started {sid} at ")]


def _planned(prefect: Prefect, node: NodeUnderTest, name: str, log: Path) -> None:
    """Wait until the node's plan (a run called name) is in Prefect."""
    wait_for("the plan in Prefect", lambda: any(
        run["name"] == name for run in prefect.node_runs(node.name)), 40, log=log)


def _recorded(prefect: Prefect, node: NodeUnderTest, names: list[str], log: Path,
              timeout: float = 90) -> dict[str, dict[str, Any]]:
    """Wait until each named run is final and the node's outbox has drained; return the runs."""
    runs = wait_runs(prefect, node.name, names, timeout=timeout)
    wait_for("the outbox drained", lambda: not list(
        (node.state / "outbox").glob("*/job.json")), 60, log=log)
    return runs


def _kill(proc: Any) -> None:
    """kill -9 the node's whole process group, as a crash or an OOM kill would."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _crash_and_restart(node: NodeUnderTest, proc: Any, log: Path) -> Any:
    """kill -9 the node, leave it down 5 s, and start it again; return the new process."""
    _kill(proc)
    time.sleep(5)
    return node.spawn(log)


def _node_before_minute(tmp_path: Path, server: PrefectServer, kind: str,
                        lead: float) -> NodeUnderTest:
    """A node with no rows yet, its clock ``lead`` s before a minute boundary."""
    return NodeUnderTest(tmp_path / "node", server.url, name=f"{kind}-{uuid.uuid4().hex[:6]}",
                         rows=[], offset=offset_to(lead))


def _minute_after(node: NodeUnderTest, seconds: float) -> datetime:
    """Return the node's clock ``seconds`` from now, down to its minute (a window)."""
    return (node.clock() + timedelta(seconds=seconds)).replace(second=0, microsecond=0)


def test_windows_fire_on_time_while_the_server_is_down_and_are_recorded_when_it_is_back(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = _node_before_minute(tmp_path, server, "out", 40)
    first = _minute_after(node, 45)
    second = first + timedelta(minutes=1)
    node.write_rows([_hourly("a", first), _hourly("b", second),
                     chain_row("p", "prune"), chain_row("c", "check")])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        _planned(prefect, node, job_run_name("echo", "a", first), log)
        # The server goes a little before the first window and comes back after the second.
        wait_for("20 s before the first window", lambda: node.clock() >= first - timedelta(
            seconds=20), 60)
        server.stop(kill=True)
        assert not server.healthy()
        wait_for("20 s after the second window", lambda: node.clock() >= second + timedelta(
            seconds=20), 120)
        ran = {sid: _starts(node.state, sid) for sid in ("a", "b")}
        assert "prune p" in _outputs(node.state) and "check c" in _outputs(node.state), \
            "the chain ran while the server was down"
        server.start()
        names = [job_run_name("echo", "a", first), job_run_name("echo", "b", second)]
        runs = _recorded(prefect, node, names, log, timeout=90)
    finally:
        stop_group(proc)
    for sid, window in (("a", first), ("b", second)):
        (start,) = ran[sid]
        late = start - (window - node.offset).timestamp()
        assert 0 <= late < 1.0, f"{sid} started {late:.3f} s after its window, offline"
    for name, sid in zip(names, ("a", "b"), strict=True):
        run = runs[name]
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert "recorded after the Prefect server came back" in run["state"]["message"], [
            (state["type"], state["timestamp"], state["message"])
            for state in prefect.states(run["id"])]
        assert len(_started_in_logs(prefect, run, sid)) == 1, "its output is its log, once"
        kinds = [state["type"] for state in prefect.states(run["id"])]
        assert kinds.count("RUNNING") == 1 and kinds.count("COMPLETED") == 1, kinds
    every = prefect.node_runs(node.name)
    finished = [run for run in every if final(run)]
    assert sorted(run["name"].split("-", 1)[0] for run in finished
                  if "trigger:chain-prune" in run["tags"] or "trigger:chain-check" in run["tags"]
                  ) == ["check", "prune"]
    assert len({run["name"] for run in every}) == len(every), "no run twice"


def _outputs(state: Path) -> str:
    text = []
    for out in state.glob("outbox/*/a*.out"):
        text += [json.loads(line)["m"] for line in out.read_text().splitlines()]
    return "\n".join(text)


def test_a_node_killed_mid_job_follows_its_command_after_the_restart_and_records_it_once(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = _node_before_minute(tmp_path, server, "kill", 15)
    window = _minute_after(node, 20)
    node.write_rows([_hourly("long", window, sleep=12)])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        wait_for("the command running", lambda: bool(_starts(node.state, "long")), 60, log=log)
        killed = time.monotonic()
        proc = _crash_and_restart(node, proc, log)
        name = job_run_name("echo", "long", window)
        runs = _recorded(prefect, node, [name], log, timeout=90)
    finally:
        stop_group(proc)
    run = runs[name]
    assert time.monotonic() - killed > 5
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert len(_started_in_logs(prefect, run, "long")) == 1, "the command ran once"
    assert "done long" in prefect.logs(run["id"]), "its real outcome, after the restart"
    assert "still running: following it" in "\n".join(prefect.logs(run["id"]))
    kinds = [state["type"] for state in prefect.states(run["id"])]
    assert "CRASHED" not in kinds and kinds[-1] == "COMPLETED", kinds


def test_killed_idle_and_at_start_then_back_within_the_grace_each_window_runs_once(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = _node_before_minute(tmp_path, server, "idle", 30)
    window = _minute_after(node, 35)
    node.write_rows([_hourly("w", window)])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        _planned(prefect, node, job_run_name("echo", "w", window), log)
        _kill(proc)  # idle, 10-20 s before the window
        wait_for("20 s past the window", lambda: node.clock() >= window + timedelta(
            seconds=20), 90)
        proc = node.spawn(log)
        time.sleep(0.4)
        proc = _crash_and_restart(node, proc, log)  # during the reconcile at its start
        name = job_run_name("echo", "w", window)
        # A loaded machine (the suite beside a 1,000-node simulation) took over 90 s to start
        # the node and record the run; how late the window ran is asserted below.
        runs = _recorded(prefect, node, [name], log, timeout=180)
    finally:
        stop_group(proc)
    run = runs[name]
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert len(_started_in_logs(prefect, run, "w")) == 1, "the window ran once"
    late = _started_in_logs(prefect, run, "w")[0] - (window - node.offset).timestamp()
    assert 20 <= late < 120, f"it ran {late:.1f} s after its window, within the grace"
    assert any("on time" in line for line in prefect.logs(run["id"]))
    everything = [item for item in prefect.node_runs(node.name) if item["name"] == name]
    assert len(everything) == 1


def test_killed_in_mid_drain_with_the_server_back_in_mid_job_nothing_is_recorded_twice(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = _node_before_minute(tmp_path, server, "drain", 30)
    window = _minute_after(node, 35)
    chatty = {**_hourly("chatty", window), "action": "fail"}  # fails twice: a task's retries
    del chatty["params"]
    node.write_rows([_hourly("quick", window), _hourly("long", window, sleep=25), chatty])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        _planned(prefect, node, job_run_name("echo", "quick", window), log)
        server.stop(kill=True)
        wait_for("the quick job's end, offline", lambda: "done quick" in _outputs(
            node.state), 90, log=log)
        time.sleep(2)  # the failing job's two tries, offline too
        server.start()  # back while the long job still runs
        wait_for("the drain under way", lambda: any(
            (folder / "record.json").exists() for folder in (node.state / "outbox").iterdir()
            if folder.is_dir()), 60, log=log)
        proc = _crash_and_restart(node, proc, log)  # in mid-drain
        names = {sid: job_run_name("fail" if sid == "chatty" else "echo", sid, window)
                 for sid in ("quick", "long", "chatty")}
        runs = _recorded(prefect, node, list(names.values()), log, timeout=120)
    finally:
        stop_group(proc)
    for sid, name in names.items():
        run = runs[name]
        kinds = [state["type"] for state in prefect.states(run["id"])]
        expected = "FAILED" if sid == "chatty" else "COMPLETED"
        assert kinds.count("RUNNING") == 1 and kinds.count(expected) == 1, (sid, kinds)
        logs = prefect.logs(run["id"])
        assert len(logs) == len(set(logs)) or sid == "chatty", (sid, logs)
        artifacts = prefect.api.filter_artifacts({"artifacts": {"flow_run_id": {
            "any_": [run["id"]]}}})
        assert len(artifacts) == 1, sid
    assert prefect.logs(runs[names["chatty"]]["id"]).count("failing chatty") == 2
    assert "done long" in prefect.logs(runs[names["long"]]["id"])
    assert len(prefect.events("sched.job.completed", node.name, at_least=2)) == 2
    assert len(prefect.events("sched.job.failed", node.name)) == 1
