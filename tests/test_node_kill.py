"""The node as its own process, killed with -9 in mid-job, idle and at its start.

As tests/test_node_outage.py (whose kit, tests/outagekit.py, this shares): a real ``prefect
server start`` of the test's own and the real node process; what is checked is what an
operator sees: each window's command ran once, and its run is in Prefect once, final.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from sched_node.identity import job_run_name
from tests import outagekit as kit
from tests.nodekit import Prefect
from tests.procs import PrefectServer, stop_group, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

# The fixtures `server` (a Prefect server of the test's own) and `prefect` (its reader).
own_server, own_prefect = kit.own_server, kit.own_prefect


def test_a_node_killed_mid_job_follows_its_command_after_the_restart_and_records_it_once(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = kit.node_before_minute(tmp_path, server, "kill", 15)
    window = kit.minute_after(node, 20)
    node.write_rows([kit.hourly("long", window, sleep=12)])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        wait_for("the command running", lambda: bool(kit.starts(node.state, "long")), 60, log=log)
        killed = time.monotonic()
        proc = kit.crash_and_restart(node, proc, log)
        name = job_run_name("echo", "long", window)
        runs = kit.recorded(prefect, node, [name], log, timeout=90)
    finally:
        stop_group(proc)
    run = runs[name]
    assert time.monotonic() - killed > 5
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert len(kit.started_in_logs(prefect, run, "long")) == 1, "the command ran once"
    assert "done long" in prefect.logs(run["id"]), "its real outcome, after the restart"
    assert "still running: following it" in "\n".join(prefect.logs(run["id"]))
    kinds = [state["type"] for state in prefect.states(run["id"])]
    assert "CRASHED" not in kinds and kinds[-1] == "COMPLETED", kinds


def test_killed_idle_and_at_start_then_back_within_the_grace_each_window_runs_once(
    tmp_path: Path, server: PrefectServer, prefect: Prefect,
) -> None:
    node = kit.node_before_minute(tmp_path, server, "idle", 30)
    window = kit.minute_after(node, 35)
    node.write_rows([kit.hourly("w", window)])
    log = tmp_path / "node.log"
    proc = node.spawn(log)
    try:
        kit.planned(prefect, node, job_run_name("echo", "w", window), log)
        kit.kill(proc)  # idle, 10-20 s before the window
        wait_for("20 s past the window", lambda: node.clock() >= window + timedelta(
            seconds=20), 90)
        proc = node.spawn(log)
        time.sleep(0.4)
        proc = kit.crash_and_restart(node, proc, log)  # during the reconcile at its start
        name = job_run_name("echo", "w", window)
        # A loaded machine (the suite beside a 1,000-node simulation) took over 90 s to start
        # the node and record the run; how late the window ran is asserted below.
        runs = kit.recorded(prefect, node, [name], log, timeout=180)
    finally:
        stop_group(proc)
    run = runs[name]
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert len(kit.started_in_logs(prefect, run, "w")) == 1, "the window ran once"
    late = kit.started_in_logs(prefect, run, "w")[0] - (window - node.offset).timestamp()
    assert 20 <= late < 120, f"it ran {late:.1f} s after its window, within the grace"
    assert any("on time" in line for line in prefect.logs(run["id"]))
    everything = [item for item in prefect.node_runs(node.name) if item["name"] == name]
    assert len(everything) == 1
