"""The controller stays up for its fleet: what one client may hold, over real HTTP.

Issue 36, points 6 and 8, against a real uvicorn server on loopback
(controller.testing): reports per node are bounded before their body is read, a
refused request frees its connection at once, and slow login forms hold a bounded
number of connections. Each test waits for the server to act (a socket read with a
generous timeout is the event), never for a fixed time.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.testing import serve_in_thread
from tests.fixtures_pg import sqlite_engine
from tests.procs import read_until_closed

ADMIN_TOKEN = "capacity-admin-token-0123456789"
TOKENS = {f"node-{i}": f"node-{i}-capacity-token-0123456789" for i in range(3)}
LIVENESS = 30.0
"""How long a test waits for the server to act before calling it stuck (never reached)."""


def bearer(node: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[node]}"}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tokens = Tokens(admin=[ADMIN_TOKEN], nodes={n: [t] for n, t in TOKENS.items()})
    with sqlite_engine(tmp_path_factory.mktemp("capacity")) as engine, \
            serve_in_thread(create_app(engine, tokens)) as base_url:
        yield base_url


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=LIVENESS)


def report() -> bytes:
    return json.dumps({"agent_version": "0.1.0", "timezone": "UTC", "grace_s": 300,
                       "reported_at": "2026-12-07T07:31:00Z", "schedules": []}).encode()


def test_a_nodes_reports_past_its_rate_are_refused_before_their_body_is_read(
    base: str, tmp_path: Path,
) -> None:
    """Point 8: 2,000 large reports from one node were each read, parsed and stored while
    the other nodes' pulls waited (p50 2.5 s). Now past a burst of 10 a node's report is a
    429 with Retry-After, sent before its body is read, its connection closed."""
    with httpx.Client(base_url=base, timeout=LIVENESS) as http:
        answers = [http.post("/api/nodes/node-0/report", content=report(),
                             headers=bearer("node-0")) for _ in range(12)]
        assert [a.status_code for a in answers][:10] == [204] * 10
        refused = answers[-1]
        assert refused.status_code == 429, refused.text
        assert 1 <= int(refused.headers["retry-after"]) <= 2
        assert refused.headers["connection"] == "close"
        assert "too many reports from node 'node-0'" in refused.json()["detail"]
        # Another node's reports and pulls are not held back.
        assert http.post("/api/nodes/node-1/report", content=report(),
                         headers=bearer("node-1")).status_code == 204
        assert http.get("/api/schedules?node=node-1",
                        headers=bearer("node-1")).status_code == 200
    # The next one of node-0 announces a megabyte and sends none of it: answered anyway.
    with connect(base) as sock:
        sock.sendall(b"POST /api/nodes/node-0/report HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + TOKENS["node-0"].encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n{")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 429 "), answer[:200]


def test_a_refused_request_frees_its_connection_at_once(base: str) -> None:
    """Point 6: a 401 on the report route held its socket (~5 s, or the body's 30 s while a
    body still trickled in). Now every refusal says Connection: close and is closed."""
    with connect(base) as sock:
        sock.sendall(b"POST /api/nodes/node-0/report HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        answer = read_until_closed(sock)  # the server closes it: no body deadline to wait for
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"\r\nconnection: close\r\n" in answer.lower()
    with httpx.Client(base_url=base, timeout=LIVENESS) as http:
        for answer_ in (http.get("/api/nodes"),  # no token
                        http.get("/api/nodes/node-1/wait", headers=bearer("node-0"))):
            assert answer_.status_code in (401, 403)
            assert answer_.headers["connection"] == "close"
        kept = http.get("/healthz")
        assert kept.status_code == 200 and "connection" not in kept.headers  # kept alive


def test_slow_login_forms_from_one_address_hold_two_connections_at_most(base: str) -> None:
    """Point 6: 320 slow /login bodies (no token needed) each held a connection for the 30 s
    body deadline: 18 of 24 probes got 503. Now one address sends 2 forms at once at most
    (the others get 429 at once and are closed), each within 5 s (else 408, closed)."""
    slow = []
    try:
        for _ in range(5):
            sock = connect(base)
            sock.sendall(b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\n\r\ntoken=")
            slow.append(sock)
        answers = [read_until_closed(sock) for sock in slow]
    finally:
        for sock in slow:
            sock.close()
    statuses = sorted(int(a.split(b" ", 2)[1]) for a in answers)
    assert statuses == [408, 408, 429, 429, 429], [a[:60] for a in answers]
    assert all(b"\r\nconnection: close\r\n" in a.lower() for a in answers)
    late = next(a for a in answers if a.startswith(b"HTTP/1.1 408 "))
    assert b"the form did not arrive within 5 s" in late
