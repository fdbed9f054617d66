"""When the node's Reporter sends a heartbeat report: over real HTTP on loopback, to a
server that counts the reports and accepts each (204).

The heartbeat is a second or two here and ``COVERED_EVERY`` a few seconds, so the rules
show in seconds; every check is on the order of the reports or a lower bound of a time,
never an upper bound that a loaded machine could miss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sched_node import node_report
from sched_node.node_report import Reporter
from sched_node.outbox import Outbox
from sched_node.settings import load_settings
from tests.procs import wait_for

HEARTBEAT = timedelta(seconds=0.4)


class Reports:
    """A loopback server that accepts every report and keeps when each arrived."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.then: Callable[[], None] = lambda: None
        """Called (in a thread of its own) when a report arrived."""
        reports = self

        class Accept(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                reports.at.append(time.monotonic())
                threading.Thread(target=reports.then, daemon=True).start()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Accept)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/nodes/n-1/report"

    def count(self) -> int:
        return len(self.at)


@pytest.fixture
def reports() -> Iterator[Reports]:
    found = Reports()
    yield found
    found.server.shutdown()
    found.server.server_close()


def _reporter(tmp_path: Path, url: str, covered: threading.Event,
              heartbeat: timedelta = HEARTBEAT) -> Reporter:
    config = tmp_path / "agent.toml"
    config.write_text(f'node_name = "n-1"\npull_url = "schedules.json"\nstate_dir = "state"\n'
                      f'report_url = "{url}"\n')
    # A heartbeat under the setting's 10 s floor, for the rules to show in seconds.
    settings = load_settings(config).model_copy(update={"heartbeat": heartbeat})
    return Reporter(settings, Outbox(tmp_path / "outbox", max_bytes=1 << 30),
                    clock=lambda: datetime.now(UTC), facts=lambda now: {"node": "n-1"},
                    covered=covered.is_set)


@contextmanager
def _reported_once(tmp_path: Path, reports: Reports, *,
                   covered_every: timedelta) -> Iterator[tuple[Reporter, threading.Event]]:
    """A started reporter whose long poll is open, after its first report; stopped after."""
    poll = threading.Event()
    poll.set()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(node_report, "COVERED_EVERY", covered_every)
        reporter = _reporter(tmp_path, reports.url, poll).start()
        try:
            reporter.poke()
            wait_for("the first report", lambda: reports.count() == 1, 30)
            yield reporter, poll
        finally:
            reporter.stop()


def test_the_long_poll_answered_after_the_starts_report_stands_for_the_next_heartbeats(
    tmp_path: Path, reports: Reports, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At a start the report goes before the long poll's first answer: nothing covers the
    # node yet. The poll answers half a second later; the heartbeat after that report must
    # then see the poll and send nothing (it sent a second report, one per start of every
    # node). The heartbeat is 2 s: the poll's answer lands well inside it, however loaded.
    monkeypatch.setattr(node_report, "COVERED_EVERY", timedelta(seconds=6))
    poll = threading.Event()

    def answer_the_poll() -> None:
        time.sleep(0.5)
        poll.set()

    reports.then = answer_the_poll
    reporter = _reporter(tmp_path, reports.url, poll, heartbeat=timedelta(seconds=2)).start()
    try:
        reporter.poke()  # the start's reconcile is done
        wait_for("the start's report", lambda: reports.count() == 1, 30)
        first = reports.at[0]
        time.sleep(5)  # two heartbeats and a half
        if reports.count() > 1:
            gap = reports.at[1] - first
            raise AssertionError(f"a second report {gap:.2f} s after the start's, the poll open")
        # Covered, a report still goes every COVERED_EVERY.
        wait_for("the covered heartbeat report", lambda: reports.count() == 2, 30)
        assert reports.at[1] - first >= 6
    finally:
        reporter.stop()


def test_a_lost_long_poll_brings_the_heartbeat_reports_back_within_a_heartbeat(
    tmp_path: Path, reports: Reports,
) -> None:
    # The poll covered the node when its last report went, so the next is 10 minutes away;
    # the poll is lost: the reporter looks at it each heartbeat and reports at the next (it
    # slept the whole COVERED_EVERY before, the node silent to the controller meanwhile).
    with _reported_once(tmp_path, reports, covered_every=timedelta(minutes=10)) as (_, poll):
        time.sleep(5 * HEARTBEAT.total_seconds())
        assert reports.count() == 1, "a heartbeat report while the poll covers the node"
        poll.clear()
        lost = time.monotonic()
        wait_for("a heartbeat report after the poll was lost", lambda: reports.count() >= 3, 60)
        assert reports.at[1] >= lost
        # Uncovered, one report per heartbeat again (not one at each look).
        assert reports.at[2] - reports.at[1] >= HEARTBEAT.total_seconds() * 0.9


def test_a_covered_heartbeat_due_while_a_reconcile_runs_is_the_reconciles_report(
    tmp_path: Path, reports: Reports,
) -> None:
    # The covered heartbeat report and the reconcile's are both due every 15 minutes: a
    # reconcile that took longer than the report's debounce sent two reports a second apart,
    # every 15 minutes, from every node. While a reconcile runs the heartbeat waits for it.
    with _reported_once(tmp_path, reports, covered_every=timedelta(seconds=2)) as (reporter, _):
        reporter.expect()  # a reconcile begins, and runs past COVERED_EVERY
        time.sleep(4)
        assert reports.count() == 1, "a heartbeat report while the reconcile ran"
        ended = time.monotonic()
        reporter.poke()  # the reconcile ended
        wait_for("the reconcile's report", lambda: reports.count() == 2, 30)
        assert reports.at[1] >= ended
        # After it, COVERED_EVERY counts from that report, and a heartbeat report goes with
        # no reconcile under way.
        wait_for("the next covered heartbeat report", lambda: reports.count() == 3, 30)
        assert reports.at[2] - reports.at[1] >= 2


def test_a_busy_controllers_retry_after_sets_when_the_report_goes_again(tmp_path: Path) -> None:
    """Issue 36, point 8: a report refused 429 (over the node's report rate) or 503 is sent
    again after the answer's Retry-After (at least RETRY_S, at most MAX_RETRY_AFTER_S), not
    after RETRY_S whatever it said; any other failure after RETRY_S."""
    answers: list[tuple[int, dict[str, str]]] = [
        (429, {"Retry-After": "120"}), (503, {"Retry-After": "99999"}),
        (429, {"Retry-After": "2"}), (429, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}),
        (500, {"Retry-After": "120"}), (204, {})]

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, headers = answers.pop(0)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api/nodes/n-1/report"
        reporter = _reporter(tmp_path, url, threading.Event())
        waits = []
        for _ in range(6):
            ok = reporter.send_now()
            waits.append(None if ok else reporter.retry_s)
    finally:
        server.shutdown()
        server.server_close()
    retry, most = node_report.RETRY_S, node_report.MAX_RETRY_AFTER_S
    assert waits == [120.0, most, retry, retry, retry, None]
