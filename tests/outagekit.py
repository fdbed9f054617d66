"""What the tests of a node against a Prefect server that goes away, or killed with -9, share.

tests/test_node_outage.py and tests/test_node_kill.py (two files, so two of the suite's
workers take them apart): a Prefect server of the test's own that it may stop (``server``)
and its reader (``prefect``), rows that fire once in a test, and what the node's outbox and
Prefect say about its commands.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.nodekit import NodeUnderTest, Prefect, offset_to, row, wait_runs
from tests.procs import PrefectServer, wait_for


@pytest.fixture(name="server")
def own_server(tmp_path: Path) -> Iterator[PrefectServer]:
    """A Prefect server of the test's own, which the test may stop and start."""
    server = PrefectServer(tmp_path / "prefect")
    server.start()
    yield server
    server.stop()


@pytest.fixture(name="prefect")
def own_prefect(server: PrefectServer) -> Iterator[Prefect]:
    """A reader of that server."""
    reader = Prefect(server.url)
    yield reader
    reader.close()


def hourly(sid: str, at: datetime, *, sleep: int = 1) -> dict[str, Any]:
    """Return a row that fires once an hour, at at's minute (so once in a test)."""
    return row(sid, every=None, minute=str(at.minute), sleep=sleep)


def _messages(state: Path) -> Iterator[str]:
    """Yield every line the node's commands wrote to its outbox (any job, any try)."""
    for out in state.glob("outbox/*/a*.out"):
        for line in out.read_text().splitlines():
            yield json.loads(line)["m"]


def _start_times(lines: Iterable[str], sid: str) -> list[float]:
    """Return the real times in the lines ``started <sid> at <time>`` that sid's command wrote."""
    prefix = f"started {sid} at "
    return [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)]


def starts(state: Path, sid: str) -> list[float]:
    """Return the real times at which the node's outbox saw sid's command start (any job)."""
    return _start_times(_messages(state), sid)


def started_in_logs(prefect: Prefect, run: dict[str, Any], sid: str) -> list[float]:
    """Return the same times, as the run's logs in Prefect have them."""
    return _start_times(prefect.logs(run["id"]), sid)


def planned(prefect: Prefect, node: NodeUnderTest, name: str, log: Path) -> None:
    """Wait until the node's plan (a run called name) is in Prefect."""
    wait_for("the plan in Prefect", lambda: any(
        run["name"] == name for run in prefect.node_runs(node.name)), 40, log=log)


def recorded(prefect: Prefect, node: NodeUnderTest, names: list[str], log: Path,
              timeout: float = 90) -> dict[str, dict[str, Any]]:
    """Wait until each named run is final and the node's outbox has drained; return the runs."""
    runs = wait_runs(prefect, node.name, names, timeout=timeout)
    wait_for("the outbox drained", lambda: not list(
        (node.state / "outbox").glob("*/job.json")), 60, log=log)
    return runs


def kill(proc: Any) -> None:
    """kill -9 the node's whole process group, as a crash or an OOM kill would."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def crash_and_restart(node: NodeUnderTest, proc: Any, log: Path) -> Any:
    """kill -9 the node, leave it down 5 s, and start it again; return the new process."""
    kill(proc)
    time.sleep(5)
    return node.spawn(log)


def node_before_minute(tmp_path: Path, server: PrefectServer, kind: str,
                        lead: float) -> NodeUnderTest:
    """A node with no rows yet, its clock ``lead`` s before a minute boundary."""
    return NodeUnderTest(tmp_path / "node", server.url, name=f"{kind}-{uuid.uuid4().hex[:6]}",
                         rows=[], offset=offset_to(lead))


def minute_after(node: NodeUnderTest, seconds: float) -> datetime:
    """Return the node's clock ``seconds`` from now, down to its minute (a window)."""
    return (node.clock() + timedelta(seconds=seconds)).replace(second=0, microsecond=0)


def outputs(state: Path) -> str:
    """Return every line the node's commands wrote, one text."""
    return "\n".join(_messages(state))
