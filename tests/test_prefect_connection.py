"""The node holds at most one connection to Prefect, whichever of its threads asks.

The first server is a real HTTP/1.1 server on loopback that keeps connections alive, answers
each request after a pause (so requests from several threads overlap) and counts the
connections open at once. The second is a real Prefect server behind a counting TCP proxy:
what the node's client sends to record an artifact, read off the wire.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from sched_node.prefect_api import PrefectApi
from tests.test_busy_prefect import serving

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
    yield from serving(Slow())


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


class Proxy:
    """A TCP proxy in front of a server: the connections open at most, the request lines."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.path = parts.path
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.open = self.most_open = 0
        self.lines: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}{self.path}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self.open += 1
                self.most_open = max(self.most_open, self.open)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False),
                             daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, counting: bool) -> None:
        line = re.compile(rb"(GET|POST|PUT|PATCH|DELETE) (\S+) HTTP/1\.1\r\n")
        try:
            while data := source.recv(65536):
                if counting:
                    with self._lock:
                        self.lines += [f"{m.group(1).decode()} {m.group(2).decode()}"
                                       for m in line.finditer(data)]
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if counting:
                with self._lock:
                    self.open -= 1

    def close(self) -> None:
        self.listener.close()


def test_recording_an_artifact_opens_no_second_connection(prefect_server: str) -> None:
    """Prefect's own ``create_artifact`` also emits an event through its events worker, whose
    websocket (``GET /api/events/in``) then stays open beside the node's one connection."""
    from prefect.client.schemas.actions import ArtifactCreate

    proxy = Proxy(prefect_server)
    api = PrefectApi(proxy.url)
    try:
        made = api.create_artifact(ArtifactCreate(
            key=f"probe-{uuid.uuid4().hex[:8]}", type="markdown", data="# probe"))
        assert uuid.UUID(made)
        time.sleep(3)  # the events worker, had it been started, opens its websocket by then
        assert [line for line in proxy.lines if "/artifacts/" in line] == ["POST /api/artifacts/"]
        assert not [line for line in proxy.lines if "/events" in line], proxy.lines
        assert proxy.most_open == 1
    finally:
        api.close()
        proxy.close()
