"""A Prefect API too busy to take the node's records: the node comes back when asked, not at
once, and new jobs do not bring it back sooner (a fleet must not storm a busy center).

The busy server is a real HTTP server on loopback that answers every request 503, as the
scaled layout's balancer does when its queue is full (with ``Retry-After``) or a SQLite
server does when its database is locked (without).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import pytest

from sched_node.outbox import JobFolder, Outbox
from sched_node.prefect_api import BUSY_RETRY_DELAYS, PrefectApi, PrefectUnavailable
from sched_node.recorder import Recorder, backoff_wait
from sched_node.registration import Deployments
from tests.test_recorder import _job

S = TypeVar("S", bound=ThreadingHTTPServer)


class Busy(ThreadingHTTPServer):
    """Answers everything 503 (with ``Retry-After: retry_after`` when set); counts requests."""

    def __init__(self, retry_after: str | None) -> None:
        self.retry_after = retry_after
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _busy(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                server.requests.append(f"{self.command} {self.path}")
                self.send_response(503)
                if server.retry_after is not None:
                    self.send_header("Retry-After", server.retry_after)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", "4")
                self.end_headers()
                self.wfile.write(b"busy")

            do_GET = do_POST = do_PATCH = do_DELETE = _busy

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/api"


def serving(server: S) -> Iterator[S]:
    """Serve a loopback server in a thread for a fixture; shut it down after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def asks_later() -> Iterator[Busy]:
    yield from serving(Busy("5"))


@pytest.fixture
def locked() -> Iterator[Busy]:
    yield from serving(Busy(None))


def _read_flows(server: Busy) -> PrefectUnavailable:
    api = PrefectApi(server.url)
    try:
        with pytest.raises(PrefectUnavailable) as caught:
            api.call(lambda c: c.read_flows(), "read flows")
    finally:
        api.close()
    return caught.value


def test_a_busy_answer_with_retry_after_is_not_asked_again_at_once(asks_later: Busy) -> None:
    failure = _read_flows(asks_later)
    assert failure.retry_after == 5.0
    assert "come back in 5 s" in str(failure)
    assert len(asks_later.requests) == 1  # the first request (Prefect's client's csrf-token)


def test_a_busy_answer_without_retry_after_is_asked_again_a_few_times(locked: Busy) -> None:
    failure = _read_flows(locked)
    assert failure.retry_after is None
    assert len(locked.requests) == len(BUSY_RETRY_DELAYS) + 1


def test_the_wait_after_a_failed_pass_is_the_longer_of_both_jittered() -> None:
    assert backoff_wait(4.0, None, draw=lambda low, high: low) == 4.0
    assert backoff_wait(4.0, 30.0, draw=lambda low, high: low) == 30.0
    assert backoff_wait(4.0, 1.0, draw=lambda low, high: high) == 6.0
    waits = {backoff_wait(2.0, None) for _ in range(50)}
    assert len(waits) > 1 and all(2.0 <= w <= 3.0 for w in waits)


@contextmanager
def refused(server: Busy, tmp_path: Path) -> Iterator[tuple[Outbox, Recorder, JobFolder]]:
    """A recorder with one ended job in its outbox, once it has found the server away (Prefect's
    client itself sleeps the Retry-After once before it gives up, even with its retries off)."""
    outbox = Outbox(tmp_path / "outbox", max_bytes=1 << 30)
    now = datetime.now(UTC)
    folder = _job(outbox, "node-busy", started=now, ended=now, lines=["done"])
    api = PrefectApi(server.url)
    recorder = Recorder(api, outbox, Deployments(api, "node-busy", tags=["sched-agent"]),
                        node="node-busy", clock=lambda: datetime.now(UTC))
    recorder.start()
    try:
        deadline = time.monotonic() + 60
        while recorder.reachable and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not recorder.reachable and server.requests
        yield outbox, recorder, folder
    finally:
        recorder.stop()
        api.close()


def test_new_jobs_do_not_bring_a_refused_recorder_back_sooner(asks_later: Busy,
                                                              tmp_path: Path) -> None:
    with refused(asks_later, tmp_path) as (_, recorder, folder):
        first_pass = len(asks_later.requests)
        for _ in range(20):  # twenty jobs ending within the 5 s the server asked for
            recorder.wake(folder)
            time.sleep(0.1)
        assert len(asks_later.requests) == first_pass


def test_a_job_that_starts_while_the_recorder_waits_out_its_back_off_is_noted_recorded_late(
        asks_later: Busy, tmp_path: Path) -> None:
    with refused(asks_later, tmp_path) as (outbox, recorder, _):
        # A second job starts while the recorder waits the 5 s the server asked for.
        then = datetime.now(UTC) + timedelta(minutes=1)
        later = _job(outbox, "node-busy", started=then, ended=then, lines=["done"])
        assert (later.read_json("record.json") or {}).get("offline") is None
        recorder.wake(later)
        assert (later.read_json("record.json") or {})["offline"] is True
