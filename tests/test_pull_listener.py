"""The serve process's warm listener: a controller's change pulled at once (issue 11, point 3).

A real Prefect server (the session's), its event stream over a websocket, the
controller's own event sender (``controller.events.PrefectEvents``), and the
listener's stream cut by a TCP proxy that is stopped and started again, as a
Prefect server that goes away and comes back.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.fixtures_prefect import agent_events

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]


def _row(sid: str, version: int) -> dict[str, Any]:
    return {
        "id": sid, "name": f"backup {sid}", "repo_id": "r-1", "action": "backup",
        "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
        "miss_policy": "skip", "enabled": True, "version": version,
    }


class Proxy:
    """A TCP forwarder on loopback to target that can be stopped (every connection cut)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(16)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        if server is not None:
            try:  # wakes the accept() blocked on it (a close alone does not, on Linux)
                server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            server.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _wait(what: str, done: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)


def _cached_version(state: Path, sid: str) -> int | None:
    try:
        cache = json.loads((state / "cache.json").read_text())
    except (OSError, ValueError):
        return None
    rows = [row for row in cache.get("schedules", []) if row.get("id") == sid]
    return int(rows[0]["version"]) if rows else None


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Path]]:
    from flows.pull_listener import pull_now
    from flows.settings import load_settings

    name = f"n-{uuid.uuid4().hex[:8]}"
    (tmp_path / "schedules.json").write_text(json.dumps({"schedules": [_row("s-1", 1)]}))
    config = tmp_path / "agent.toml"
    config.write_text(f'node_name = "{name}"\npull_url = "schedules.json"\nstate_dir = "state"\n')
    monkeypatch.setenv("SCHED_CONFIG", str(config))
    for var in ("SCHED_NODE_NAME", "SCHED_PULL_URL", "SCHED_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    settings = load_settings()
    assert pull_now(settings).added == ["s-1"]  # the node's first pull, version 1
    yield settings, tmp_path


def test_a_change_is_pulled_as_its_event_arrives_and_after_the_stream_came_back(
    prefect_server: str, node: tuple[Any, Path]
) -> None:
    from controller.events import PrefectEvents
    from flows.pull_listener import PullListener

    settings, home = node
    state = home / "state"
    rows = home / "schedules.json"
    parts = urlsplit(prefect_server)
    proxy = Proxy((parts.hostname or "127.0.0.1", parts.port or 80))
    proxy.start()
    via_proxy = prefect_server.replace(f":{parts.port}", f":{proxy.port}", 1)
    listener = PullListener(settings, api_url=via_proxy).start()
    controller = PrefectEvents(prefect_server)
    try:
        _wait("the listener's stream", listener.connected.is_set)
        # The subscriber replays the minute before it connected: let any first pull settle.
        time.sleep(1)
        before = listener.pulls

        # Another node's change is not this node's: nothing pulled.
        rows.write_text(json.dumps({"schedules": [_row("s-1", 2)]}))
        assert controller.announce(f"other-{uuid.uuid4().hex[:6]}", "s-1", 2, "put").sent
        # This node's change: pulled at once, without any reconcile.
        started = time.monotonic()
        assert controller.announce(settings.node_name, "s-1", 2, "put").sent
        _wait("version 2 in the cache", lambda: _cached_version(state, "s-1") == 2)
        took = time.monotonic() - started
        assert listener.pulls == before + 1, (listener.pulls, before)
        changed = agent_events("sched.schedules.changed", settings.node_name,
                               lambda found: any(e["payload"].get("by") == "listener"
                                                 for e in found))
        [mine] = [e for e in changed if e["payload"].get("by") == "listener"]
        assert mine["payload"]["changed_ids"] == ["s-1"]

        # The Prefect server goes away (every connection cut, none accepted) ...
        proxy.stop()
        _wait("the stream seen lost", lambda: not listener.connected.is_set())
        rows.write_text(json.dumps({"schedules": [_row("s-1", 3)]}))
        assert controller.announce(settings.node_name, "s-1", 3, "put").sent
        time.sleep(2)
        assert _cached_version(state, "s-1") == 2  # nothing reaches the listener
        # ... and comes back: the listener reconnects by itself and pulls the change it
        # missed (the stream replays the minute before a reconnect).
        proxy.start()
        _wait("version 3 in the cache", lambda: _cached_version(state, "s-1") == 3, timeout=60)
        assert listener.connected.is_set()
    finally:
        listener.stop()
        proxy.stop()
    print(f"pulled {took:.2f} s after the controller's answer")


def test_a_failed_pull_keeps_the_cache_and_the_next_event_pulls_again(
    prefect_server: str, node: tuple[Any, Path]
) -> None:
    from controller.events import PrefectEvents
    from flows.pull_listener import PullListener

    settings, home = node
    state = home / "state"
    rows = home / "schedules.json"
    listener = PullListener(settings).start()
    controller = PrefectEvents(prefect_server)
    try:
        _wait("the listener's stream", listener.connected.is_set)
        rows.write_text(json.dumps({"schedules": [_row("s-1", 5)]}))
        assert controller.announce(settings.node_name, "s-1", 5, "put").sent
        _wait("version 5 in the cache", lambda: _cached_version(state, "s-1") == 5)
        pulls = listener.pulls
        rows.write_text("{not json")  # a broken answer: refused whole, the cache stays
        assert controller.announce(settings.node_name, "s-1", 6, "put").sent
        time.sleep(3)
        assert _cached_version(state, "s-1") == 5 and listener.pulls == pulls
        assert listener.connected.is_set()  # a failed pull does not stop listening
        rows.write_text(json.dumps({"schedules": [_row("s-1", 7)]}))
        assert controller.announce(settings.node_name, "s-1", 7, "put").sent
        _wait("version 7 in the cache", lambda: _cached_version(state, "s-1") == 7)
    finally:
        listener.stop()


def test_records_outside_any_run_stay_out_of_the_api_log_and_run_records_go() -> None:
    """Seen in serve's output: Prefect's API log handler (on the ``flows`` and
    ``sched_core`` loggers) warned that the listener's records, and serve's own at start,
    have no flow run. Records logged outside any flow or task run are now marked not to be
    sent (no warning; the console still has them); a flow run's records are untouched."""
    import logging
    import warnings

    from prefect import flow
    from prefect.logging.handlers import APILogHandler

    from flows.runtime import keep_runless_logs_local

    logger = logging.getLogger(f"flows.test-runless-{uuid.uuid4().hex[:6]}")
    handler = APILogHandler()
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger.addHandler(handler)
    logger.addHandler(Keep())
    logger.propagate = False

    @flow(name="runless-probe")
    def probe() -> None:
        logger.warning("inside a flow run")

    try:
        with pytest.warns(UserWarning, match="without a flow run id"):
            logger.warning("before the filter")
        keep_runless_logs_local()
        keep_runless_logs_local()  # once per handler
        assert sum(1 for item in handler.filters
                   if type(item).__name__ == "_RunlessStaysLocal") == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            logger.warning("serve's own line")
            thread = threading.Thread(target=lambda: logger.warning("the listener's line"))
            thread.start()
            thread.join()
        probe()
    finally:
        logger.handlers.clear()
    assert [(r.getMessage(), getattr(r, "send_to_api", True)) for r in seen] == [
        ("before the filter", True), ("serve's own line", False),
        ("the listener's line", False), ("inside a flow run", True)]
