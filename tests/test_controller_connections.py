"""Slow and odd clients against a real controller over loopback (controller.connections).

uvicorn alone kept a connection that never finished its headers, or never
sent anything, forever, never answered a PUT whose body never finished, and
had no ceiling on open connections. Each test here waits for the server to act
(a socket read with a generous timeout is the event), never for a fixed time.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.connections import ConnectionLimits, Notices, QuietRepeats
from controller.testing import serve_in_thread
from tests.fixtures_pg import sqlite_engine
from tests.procs import read_until_closed, wait_for

ADMIN_TOKEN = "conn-admin-token-2718"
LIVENESS = 30.0
"""How long a test waits for the server to act before calling it stuck (never reached)."""

LIMITS = ConnectionLimits(max_connections=40, header_timeout=1.0, body_timeout=1.5,
                          write_timeout=2.0, notice_interval=3600)


@contextmanager
def serving(folder: Path, limits: ConnectionLimits) -> Iterator[str]:
    """Serve a controller on a migrated SQLite file in folder, with limits; yield its URL."""
    with serving_app(folder, limits) as (base_url, _app):
        yield base_url


@contextmanager
def serving_app(folder: Path, limits: ConnectionLimits) -> Iterator[tuple[str, Any]]:
    """Serve a controller as :func:`serving` does; yield its URL and its app."""
    with sqlite_engine(folder) as engine:
        app = create_app(engine, Tokens(admin=[ADMIN_TOKEN]))
        with serve_in_thread(app, limits=limits) as base_url:
            yield base_url, app


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(tmp_path_factory.mktemp("conn"), LIMITS) as base_url:
        yield base_url


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=LIVENESS)
    return sock


def read_response(sock: socket.socket, timeout: float = LIVENESS) -> bytes:
    """Return one whole response (headers and a Content-Length body), however it is split."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_an_idle_connection_is_answered_408_and_closed(base: str) -> None:
    with connect(base) as sock:
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"request headers not received within 1 s" in answer


def test_headers_trickling_in_are_cut_off_at_the_deadline_however_they_trickle(
    base: str,
) -> None:
    """Each byte arrives well within the deadline; the whole header never does: 408, closed."""
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        answer = b""
        while time.monotonic() - started < LIVENESS:
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready:
                answer = read_until_closed(sock)
                break
            try:
                sock.sendall(b"X-Slow: a\r\n")  # a new header line every 0.2 s
            except OSError:
                answer = read_until_closed(sock)
                break
    assert answer.startswith(b"HTTP/1.1 408 "), answer


def test_a_put_whose_body_never_finishes_is_answered_408_and_nothing_is_stored(
    base: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with connect(base) as sock:
        sock.sendall(
            b"PUT /api/nodes/node-a/schedules/slow-1 HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"name\": "
        )
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"request body not received within 1.5 s" in answer
    got = httpx.get(f"{base}/api/nodes/node-a/schedules/slow-1",
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=LIVENESS)
    assert got.status_code == 404
    # The handler saw a disconnect, not an error: no traceback, no ERROR line.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert ADMIN_TOKEN not in caplog.text


def test_a_body_still_trickling_after_an_early_answer_is_cut_off(base: str) -> None:
    """A PUT without a token gets its 401 before its body; the body may not hold the line."""
    with connect(base) as sock:
        sock.sendall(b"PUT /api/tasks/t HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 401 ") and first.endswith(b"}"), first
        started = time.monotonic()
        closed = False
        while not closed and time.monotonic() - started < LIVENESS:
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready:
                closed = read_until_closed(sock) == b""
                break
            try:
                sock.sendall(b" ")  # still "sending its body", a byte every 0.2 s
            except OSError:
                closed = True
    assert closed


def test_a_keep_alive_connection_gets_a_header_deadline_for_its_next_request(base: str) -> None:
    with connect(base) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer


@pytest.fixture()
def small_app(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A server of its own with a ceiling of 30 (no other test's connections in its count)."""
    limits = ConnectionLimits(max_connections=30, header_timeout=6.0, body_timeout=6.0,
                              write_timeout=6.0, notice_interval=3600)
    with serving_app(tmp_path, limits) as served:
        yield served


@pytest.fixture()
def small(small_app: tuple[str, Any]) -> str:
    return small_app[0]


def test_past_the_ceiling_the_oldest_slow_connections_make_room_logged_once(
    small: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Slow clients over the ceiling cannot lock a normal client out: the oldest make room."""
    caplog.set_level(logging.INFO)
    ceiling, over = 30, 20
    held: list[socket.socket] = []
    try:
        for _ in range(ceiling + over):
            sock = connect(small)
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # half a request, never finished
            held.append(sock)
        # The ceiling is full of slow connections: a normal client still gets its answer
        # (each of its connections takes the place of the oldest slow one).
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for _ in range(5):
            assert httpx.get(f"{small}/api/nodes", headers=admin,
                             timeout=LIVENESS).status_code == 200
        answers = [read_until_closed(sock) for sock in held]
    finally:
        for sock in held:
            sock.close()
    made_room = [i for i, a in enumerate(answers) if a.startswith(b"HTTP/1.1 503 ")]
    timed_out = [i for i, a in enumerate(answers) if a.startswith(b"HTTP/1.1 408 ")]
    # The oldest ones, in the order they came: 20 for the slow newcomers, 1 for the client
    # (its connection closes after its answer, so its later ones find a free slot).
    assert made_room == list(range(over + 1)), made_room
    assert timed_out == list(range(over + 1, ceiling + over))
    assert answers[0].endswith(
        b"too many open connections: this one had not sent its request headers")
    lines = [r for r in caplog.records if r.name == "controller.connections"]
    # One line per kind for 50 closed connections (the interval is an hour here).
    assert sorted(r.__dict__["kind"] for r in lines) == ["evicted", "header_timeout"]
    assert [r.__dict__["count"] for r in lines] == [1, 1]


def test_at_the_ceiling_with_no_slow_connection_a_new_one_is_refused(
    small_app: tuple[str, Any],
) -> None:
    """Every slot holds a request being read or answered: nothing to give up, 503 at once."""
    small, app = small_app
    ceiling = 30
    held: list[socket.socket] = []
    try:
        for index in range(ceiling - 1):
            sock = connect(small)
            # Whole headers, a body still to come: the handler waits for it.
            sock.sendall(
                f"PUT /api/nodes/node-a/schedules/s-{index} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {ADMIN_TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{".encode())
            held.append(sock)
        # One more request, answered: the server has had the held ones' headers by then
        # (they were in its socket buffers before this request was sent). Then a long poll
        # on the same connection, held: every slot is busy (an idle one could make room).
        kept = connect(small)
        held.append(kept)
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(kept).startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /api/nodes/node-a/wait?timeout=300 HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n\r\n")
        wait_for("the long poll held", lambda: app.state.waits.waiting == 1, LIVENESS)
        with connect(small) as extra:
            answer = read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
        assert answer.endswith(b"too many open connections; try again later")
        # The requests being read were not disturbed: each gets its body deadline's 408.
        answers = [read_until_closed(sock) for sock in held[:-1]]
    finally:
        for sock in held:
            sock.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[:3]
    assert all(b"request body not received" in a for a in answers)


def test_notices_write_one_line_per_interval_with_the_count() -> None:
    """Pure: a flood of events writes the first line at once, then one summary per interval."""
    now = [0.0]
    notices = Notices(60, clock=lambda: now[0])
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("controller.connections")
    handler = Keep()
    logger.addHandler(handler)
    try:
        for step in range(1000):  # 1,000 refused connections over 100 s
            now[0] = step * 0.1
            notices.note("refused", LIMITS)
    finally:
        logger.removeHandler(handler)
    assert [r.__dict__["count"] for r in records] == [1, 600]
    assert notices.totals["refused"] == 1000


def test_quiet_repeats_passes_one_line_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    quiet = QuietRepeats(("Invalid HTTP request received.",), 60, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, (), None)

    passed = []
    for step in range(500):
        now[0] = step * 0.25
        line = record("Invalid HTTP request received.")
        if quiet.filter(line):
            passed.append(line.getMessage())
    assert passed == ["Invalid HTTP request received.",
                      "Invalid HTTP request received. (239 more such lines suppressed)",
                      "Invalid HTTP request received. (239 more such lines suppressed)"]
    assert quiet.filter(record("Exception in ASGI application\n"))  # never held back


def test_a_client_that_stops_reading_its_answer_is_cut_off(tmp_path: Path) -> None:
    """A big pull answer to a client that never reads: the write deadline frees the connection."""
    from sqlmodel import Session

    from controller import schedules
    from sched_core.model import LocalSchedule

    ROWS, PAD = 16, 1 << 20  # a 16 MiB answer: more than every socket buffer holds
    with sqlite_engine(tmp_path) as engine:
        with Session(engine) as session:
            for index in range(ROWS):
                schedules.put_schedule(session, "big", LocalSchedule.model_validate({
                    "id": f"s-{index}", "name": "n", "action": "backup",
                    "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
                    "miss_policy": "skip", "enabled": True, "params": {"pad": "x" * PAD},
                }))
            session.commit()
        with serve_in_thread(create_app(engine, Tokens(admin=[ADMIN_TOKEN])),
                             limits=LIMITS) as base_url:
            sock = connect(base_url)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"GET /api/schedules?node=big HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n\r\n")
            # Never read until the server gives up; then the socket shows a reset or an end.
            ready, _, _ = select.select([sock], [], [], LIVENESS)
            assert ready
            received = 0
            try:
                sock.settimeout(LIVENESS)
                while chunk := sock.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            sock.close()
            assert received < ROWS * PAD  # cut off before the whole answer
            assert httpx.get(f"{base_url}/healthz", timeout=LIVENESS).status_code == 200


def test_slowloris_the_controller_answers_a_normal_client_while_many_slow_ones_hang(
    tmp_path: Path,
) -> None:
    """200 connections trickle their headers a byte at a time; a normal client is still served.

    Every slow connection is still open (it has had no answer) when the normal
    client's requests are answered, and each is then closed with a 408 at its
    header deadline, without one log line per connection.
    """
    SLOW = 200
    # A header deadline long enough for the normal client's rounds on a loaded machine.
    limits = ConnectionLimits(max_connections=SLOW + 50, header_timeout=8.0,
                              body_timeout=8.0, write_timeout=8.0, notice_interval=3600)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    logging.getLogger().addHandler(keep)
    slow: list[socket.socket] = []
    try:
        with serving(tmp_path, limits) as base_url:
            for index in range(SLOW):
                sock = connect(base_url)
                sock.sendall(b"GET /api/nodes HTTP/1.1\r\nHost: x\r\nX-Slow-" +
                             str(index).encode())
                slow.append(sock)
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            with httpx.Client(base_url=base_url, headers=admin, timeout=LIVENESS) as client:
                for round_ in range(3):
                    for sock in slow:  # one more byte from each: they are "alive"
                        sock.sendall(b"x")
                    assert client.get("/healthz").status_code == 200
                    put = client.put(f"/api/nodes/node-a/schedules/s-{round_}", json={
                        "name": "n", "action": "backup",
                        "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
                        "miss_policy": "skip", "enabled": True,
                    })
                    assert put.status_code == 200, put.text
                    # With one fresh connection per request too (not only a kept-alive one).
                    assert httpx.get(f"{base_url}/api/nodes", headers=admin,
                                     timeout=LIVENESS).json() == {"nodes": ["node-a"]}
                    # ... while every slow connection still hangs, unanswered and open.
                    assert select.select(slow, [], [], 0)[0] == []
            answers = [read_until_closed(sock) for sock in slow]
            assert all(a.startswith(b"HTTP/1.1 408 Request Timeout\r\n") for a in answers)
    finally:
        for sock in slow:
            sock.close()
        logging.getLogger().removeHandler(keep)
    ours = [r for r in records if r.name == "controller.connections"]
    assert len(ours) <= 2 and sum(r.__dict__["count"] for r in ours) <= SLOW
    assert [r.__dict__["kind"] for r in ours][:1] == ["header_timeout"]
    assert not [r for r in records if r.name.startswith("uvicorn") and r.levelno >= logging.WARNING]


def test_the_ceiling_fits_the_open_file_limit_and_bad_limits_are_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="controller.connections")
    limits = ConnectionLimits(max_connections=1000)
    assert limits.within_file_limit(soft_limit=5000) is limits
    lowered = limits.within_file_limit(soft_limit=1024)
    assert lowered.max_connections == 1024 - 128
    assert (lowered.header_timeout, lowered.body_timeout) == (
        limits.header_timeout, limits.body_timeout)
    assert "max_connections lowered to fit the open-file limit" in caplog.text
    tiny = ConnectionLimits(max_connections=10).within_file_limit(soft_limit=64)
    assert tiny.max_connections == 1
    with pytest.raises(ValueError, match="max_connections must be at least 1, got 0"):
        ConnectionLimits(max_connections=0)
    with pytest.raises(ValueError, match="header_timeout must be a positive number"):
        ConnectionLimits(header_timeout=0)
    with pytest.raises(ValueError, match="body_timeout must be a positive number"):
        ConnectionLimits(body_timeout=float("nan"))


def test_the_soft_open_file_limit_is_raised_for_the_ceiling_and_its_accept_bursts() -> None:
    """A service's soft limit (often 1,024) is raised towards the hard one, not past it."""
    import subprocess
    import sys

    script = (
        "import resource, sys\n"
        "from controller.connections import ConnectionLimits\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "limits = ConnectionLimits(max_connections=1000).within_file_limit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], limits.max_connections, hard)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    soft, ceiling, hard = (int(x) for x in done.stdout.split())
    wanted = 1000 + 128 + 2048
    if hard == -1 or hard >= wanted:  # RLIM_INFINITY is -1
        assert (soft, ceiling) == (wanted, 1000)
    else:  # a hard limit below what is wanted: up to it, and the ceiling fits under it
        assert (soft, ceiling) == (hard, min(1000, hard - 128))
