"""The node holds at most one connection to Prefect, whichever of its threads asks.

The server is a real HTTP/1.1 server on loopback that keeps connections alive, answers
each request after a pause (so requests from several threads overlap) and counts the
connections open at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sched_node.prefect_api import PrefectApi

PAUSE_S = 0.2


class Slow(ThreadingHTTPServer):
    """Answers ``GET`` with ``{}`` after PAUSE_S, keeping the connection open."""

    daemon_threads = True

    def __init__(self) -> None:
        self.open = 0
        self.most_open = 0
        self.opened = 0
        self.answered = 0
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with lock:
                    server.open += 1
                    server.opened += 1
                    server.most_open = max(server.most_open, server.open)

            def finish(self) -> None:
                with lock:
                    server.open -= 1
                super().finish()

            def do_GET(self) -> None:
                time.sleep(PAUSE_S)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                with lock:
                    server.answered += 1

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/api"


@pytest.fixture
def slow() -> Iterator[Slow]:
    server = Slow()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_threads_asking_at_once_share_the_nodes_one_connection(slow: Slow) -> None:
    api = PrefectApi(slow.url)
    answers: list[int] = []
    failures: list[BaseException] = []

    def ask() -> None:
        try:
            answer = api.call(lambda c: c._client.get("/health"), "read health")
            answers.append(answer.status_code)
        except BaseException as exc:  # reported below
            failures.append(exc)

    try:
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not failures and answers == [200] * 4
        # Four requests of 0.2 s each went one after the other on one connection.
        assert slow.answered == 4 and slow.most_open == 1 and slow.opened == 1
        assert api.requests == 4
    finally:
        api.close()
