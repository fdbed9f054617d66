"""The node as its own process against a Prefect server that goes away (tests/test_node_kill.py
kills it with -9; a kill in mid-drain is here).

A real ``prefect server start`` (SQLite under the test's folder, tests/procs.py)
that the test stops and starts again, and the real node process
(``python -m tests.node_proc``: ``sched_node.node`` with its clock shifted so that
the windows come seconds after the start). What is checked is what an operator
sees: each window's command ran once, at its instant (its own output says when),
and every run is in Prefect in its final state with its output, once.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from sched_node.identity import job_run_name
from tests import outagekit
from tests.nodekit import Prefect, chain_row, final
from tests.outagekit import (
    crash_and_restart,
    hourly,
    minute_after,
    node_before_minute,
    outputs,
    planned,
    recorded,
    started_in_logs,
    starts,
)
from tests.procs import PrefectServer, stop_group, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

# The fixtures `server` (a Prefect server of the test's own) and `prefect` (its reader).
own_server, own_prefect = outagekit.own_server, outagekit.own_prefect


def test_windows_fire_on_time_while_the_server_is_down_and_are_recorded_when_it_is_back(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = node_before_minute(tmp_path, server, "out", 40)
    first = minute_after(node, 45)
    second = first + timedelta(minutes=1)
    node.write_rows([hourly("a", first), hourly("b", second),
                     chain_row("p", "prune"), chain_row("c", "check")])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        planned(prefect, node, job_run_name("echo", "a", first), log)
        # The server goes a little before the first window and comes back after the second.
        wait_for("20 s before the first window", lambda: node.clock() >= first - timedelta(
            seconds=20), 60)
        server.stop(kill=True)
        assert not server.healthy()
        wait_for("20 s after the second window", lambda: node.clock() >= second + timedelta(
            seconds=20), 120)
        ran = {sid: starts(node.state, sid) for sid in ("a", "b")}
        assert "prune p" in outputs(node.state) and "check c" in outputs(node.state), \
            "the chain ran while the server was down"
        server.start()
        names = [job_run_name("echo", "a", first), job_run_name("echo", "b", second)]
        runs = recorded(prefect, node, names, log, timeout=90)
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
        assert len(started_in_logs(prefect, run, sid)) == 1, "its output is its log, once"
        kinds = [state["type"] for state in prefect.states(run["id"])]
        assert kinds.count("RUNNING") == 1 and kinds.count("COMPLETED") == 1, kinds
    every = prefect.node_runs(node.name)
    finished = [run for run in every if final(run)]
    assert sorted(run["name"].split("-", 1)[0] for run in finished
                  if "trigger:chain-prune" in run["tags"] or "trigger:chain-check" in run["tags"]
                  ) == ["check", "prune"]
    assert len({run["name"] for run in every}) == len(every), "no run twice"

def test_killed_in_mid_drain_with_the_server_back_in_mid_job_nothing_is_recorded_twice(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = node_before_minute(tmp_path, server, "drain", 30)
    window = minute_after(node, 35)
    chatty = {**hourly("chatty", window), "action": "fail"}  # fails twice: a task's retries
    del chatty["params"]
    node.write_rows([hourly("quick", window), hourly("long", window, sleep=25), chatty])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        planned(prefect, node, job_run_name("echo", "quick", window), log)
        server.stop(kill=True)
        wait_for("the quick job's end, offline", lambda: "done quick" in outputs(
            node.state), 90, log=log)
        time.sleep(2)  # the failing job's two tries, offline too
        server.start()  # back while the long job still runs
        wait_for("the drain under way", lambda: any(
            (folder / "record.json").exists() for folder in (node.state / "outbox").iterdir()
            if folder.is_dir()), 60, log=log)
        proc = crash_and_restart(node, proc, log)  # in mid-drain
        names = {sid: job_run_name("fail" if sid == "chatty" else "echo", sid, window)
                 for sid in ("quick", "long", "chatty")}
        runs = recorded(prefect, node, list(names.values()), log, timeout=120)
    finally:
        stop_group(proc)
    for sid, name in names.items():
        run = runs[name]
        kinds = [state["type"] for state in prefect.states(run["id"])]
        expected = "FAILED" if sid == "chatty" else "COMPLETED"
        tries = 2 if sid == "chatty" else 1  # chatty fails and is tried again: Retrying
        assert kinds.count("RUNNING") == tries and kinds.count(expected) == 1, (sid, kinds)
        logs = prefect.logs(run["id"])
        assert len(logs) == len(set(logs)) or sid == "chatty", (sid, logs)
        assert len(prefect.artifacts(run["id"])) == 1, sid
    assert prefect.logs(runs[names["chatty"]]["id"]).count("failing chatty") == 2
    assert "done long" in prefect.logs(runs[names["long"]]["id"])
    assert len(prefect.events("sched.job.completed", node.name, at_least=2)) == 2
    assert len(prefect.events("sched.job.failed", node.name)) == 1
