"""A node's one connection to the center: its long poll on the controller.

A real controller (over HTTP on loopback) whose relay follows the session's
Prefect server, and a real node pulling from it: a write reaches the node's
wait at once, and so does a run created for the node in Prefect, which the node
then starts without any connection of its own to Prefect between its windows.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.testing import serve_in_thread
from controller.waits import NodeWaits, PrefectRelay
from tests.nodekit import NodeUnderTest, Prefect, final, row
from tests.procs import wait_for

pytestmark = [pytest.mark.prefect]

ADMIN_TOKEN = "admin-secret-token-0123456789"


class Center:
    """The controller (its URL, tokens and waits) and the Prefect it relays from."""

    def __init__(self, base: str, node: str, token: str, waits: NodeWaits) -> None:
        self.base = base
        self.node = node
        self.token = token
        self.waits = waits
        self.admin = httpx.Client(base_url=base, timeout=30,
                                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

    def put(self, data: dict[str, Any]) -> None:
        answer = self.admin.put(f"/api/nodes/{self.node}/schedules/{data['id']}", json=data)
        assert answer.status_code == 200, answer.text

    def node_of(self, folder: Path, prefect_server: str, settings: str = "") -> NodeUnderTest:
        """The center's node (not started), pulling from it with its own token."""
        node = NodeUnderTest(folder, prefect_server, name=self.node, rows=[],
                             settings=f'token = "{self.token}"' + settings)
        node.config.write_text(node.config.read_text().replace(
            'pull_url = "schedules.json"',
            f'pull_url = "{self.base}/api/schedules?node={self.node}"'))
        return node

    def wait(self, **params: Any) -> tuple[dict[str, Any], float]:
        started = time.monotonic()
        answer = httpx.get(f"{self.base}/api/nodes/{self.node}/wait", params=params,
                           headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json(), time.monotonic() - started


@pytest.fixture
def center(tmp_path: Path, prefect_server: str) -> Iterator[Center]:
    url = f"sqlite:///{tmp_path / 'controller.db'}"
    migrate(url)
    engine = make_engine(url)
    node = f"node-{uuid.uuid4().hex[:6]}"
    token = f"{node}-secret-token-0123456789"
    waits = NodeWaits()
    relay = PrefectRelay(waits, prefect_server).start()
    app = create_app(engine, Tokens(admin=[ADMIN_TOKEN], nodes={node: [token]}), waits=waits)
    try:
        with serve_in_thread(app) as base:
            wait_for("the relay following Prefect", lambda: waits.relay, 30)
            center = Center(base, node, token, waits)
            yield center
            center.admin.close()
    finally:
        relay.stop()
        engine.dispose()


def _later(work: Any) -> tuple[threading.Thread, list[Any]]:
    found: list[Any] = []
    thread = threading.Thread(target=lambda: found.append(work()), daemon=True)
    thread.start()
    return thread, found


def test_a_wait_answers_a_write_and_a_prefect_run_at_once_and_else_its_timeout(
    center: Center, prefect_server: str,
) -> None:
    first, _ = center.wait(timeout=1)
    quiet, took = center.wait(etag=first["etag"], seen=first["prefect"], timeout=1)
    assert quiet == first and took >= 0.9, "nothing happened: the timeout's answer"
    thread, found = _later(lambda: center.wait(etag=first["etag"], seen=first["prefect"],
                                               timeout=30))
    time.sleep(0.5)
    center.put(row("s-1"))
    thread.join(30)
    (written, took), = found
    assert written["etag"] != first["etag"] and took < 5
    api = Prefect(prefect_server)
    try:
        api.ensure_deployment("run-job", center.node)
        thread, found = _later(lambda: center.wait(etag=written["etag"],
                                                   seen=written["prefect"], timeout=30))
        time.sleep(0.5)
        api.create_run("run-job", center.node, {"schedule_id": "s-1"})
        thread.join(30)
        (woken, took), = found
        assert woken["prefect"] != written["prefect"] and woken["relay"] is True
        assert took < 10, f"the relay took {took:.1f} s"
        # The node's own runs (its plan: a trigger tag) wake nobody.
        thread, found = _later(lambda: center.wait(etag=woken["etag"], seen=woken["prefect"],
                                                   timeout=3))
        api.create_run("run-job", center.node, {}, tags=["trigger:schedule"])
        thread.join(30)
        (planned, _), = found
        assert planned["prefect"] == woken["prefect"]
    finally:
        api.close()


def test_an_ad_hoc_run_reaches_the_node_through_its_controller(
    tmp_path: Path, center: Center, prefect_server: str,
) -> None:
    center.put(row("q-1", every=None, minute="7", hours=["3"]))
    node = center.node_of(tmp_path / "node", prefect_server)
    prefect = Prefect(prefect_server)
    started = node.start()
    try:
        # Held by the controller: nothing was made for the node (its own records wake nobody).
        wait_for("the node's wait", lambda: center.waits.waiting >= 1, 30)
        wait_for("the node's deployments", lambda: prefect.deployment(
            "run-job", center.node) is not None, 30)
        asked = time.monotonic()
        run = {"id": prefect.create_run("run-job", center.node, {"schedule_id": "q-1"})}
        wait_for("the ad hoc run's end", lambda: final(prefect.api.read_run(str(run["id"]))),
                 30)
        took = time.monotonic() - asked
        assert started.channel.stream is None, "the node holds no Prefect event stream of its own"
        center.put(row("q-2", every=None, minute="9", hours=["3"]))
        wait_for("the new row in the node's cache", lambda: any(
            item.id == "q-2" for item in started.scheduler.schedules()), 10)
        done = prefect.api.read_run(str(run["id"]))
    finally:
        node.stop()
        prefect.close()
    assert took < 15, f"the ad hoc run took {took:.1f} s"
    assert done is not None and done["state"]["type"] == "COMPLETED", done["state"]


def test_a_first_wait_is_answered_at_once_only_when_the_node_was_poked(
    center: Center, prefect_server: str,
) -> None:
    """A node's first wait (no ``seen``: it just started) is held when the controller has
    nothing for it, and answered at once once the controller was poked for it since it
    started (a run made while the node was away)."""
    _, took = center.wait(timeout=1)
    assert took >= 0.9, "a first wait with nothing to say was answered at once"
    api = Prefect(prefect_server)
    try:
        api.ensure_deployment("run-job", center.node)
        api.create_run("run-job", center.node, {"schedule_id": "s-1"})
        wait_for("the relay's poke", lambda: center.waits.poked(center.node), 30)
    finally:
        api.close()
    answer, took = center.wait(timeout=30)
    assert took < 5 and answer["prefect"] != "0", (answer, took)


def test_a_restart_asks_prefect_nothing_and_takes_a_run_made_while_it_was_away(
    tmp_path: Path, center: Center, prefect_server: str,
) -> None:
    center.put(row("q-1", every=None, minute="7", hours=["3"]))
    prefect = Prefect(prefect_server)

    def start() -> tuple[NodeUnderTest, Any, list[str]]:
        node = center.node_of(tmp_path / "node", prefect_server)
        built = node.build()
        sent: list[str] = []
        built.api.watch(lambda request: sent.append(request.url.path))
        node.start()
        wait_for("the start's reconcile", lambda: built.reconciler.finished >= 1, 60)
        return node, built, sent

    try:
        node, _, _ = start()  # the first start registers and plans
        node.stop()
        node, built, sent = start()
        time.sleep(3)  # the node's first wait is held: nothing was made for it
        node.stop()
        assert sent == [] and built.control.checks == 0, sent

        run = {"id": prefect.create_run("run-job", center.node, {"schedule_id": "q-1"})}
        wait_for("the relay's poke", lambda: center.waits.poked(center.node), 30)
        asked = time.monotonic()
        node, built, sent = start()
        try:
            wait_for("the ad hoc run's end", lambda: final(prefect.api.read_run(str(run["id"]))),
                     30)
            took = time.monotonic() - asked
            done = prefect.api.read_run(str(run["id"]))
        finally:
            node.stop()
    finally:
        prefect.close()
    assert took < 15, f"the run made while the node was away took {took:.1f} s"
    assert done is not None and done["state"]["type"] == "COMPLETED", done["state"]
    assert built.control.checks >= 1


def test_a_node_told_of_a_change_waits_again_on_the_new_version_not_its_old_one(
    center: Center,
) -> None:
    """Told of a change, the node's pull is under way; until its cache has the new list
    its next wait carries the version it was told of, so the controller holds it instead of
    answering "changed" at once again and again (a busy loop while the pull runs)."""
    from datetime import timedelta

    from sched_node.control import ControllerWait

    first, _ = center.wait(timeout=1)
    told: list[str] = []
    wait = ControllerWait(
        f"{center.base}/api/nodes/{center.node}/wait", token=lambda: center.token,
        etag=lambda: first["etag"],  # the cache never catches up: a pull that is slow
        heartbeat=timedelta(seconds=10), on_schedules=lambda: told.append("changed"),
        on_prefect=lambda: None, on_unsupported=lambda: None).start()
    try:
        wait_for("the first wait", lambda: wait.connected.is_set(), 30)
        center.put(row("s-1"))
        wait_for("the change told", lambda: bool(told), 30)
        answers = wait.answers
        time.sleep(2)  # a busy loop answers dozens of times here; a held wait none
        assert wait.answers - answers <= 1, f"{wait.answers - answers} answers in 2 s"
        assert told == ["changed"]
    finally:
        wait.stop()


def test_a_node_with_a_heartbeat_over_the_controllers_longest_wait_still_long_polls(
    center: Center,
) -> None:
    """A heartbeat of 10 min asks for waits of 300 s, the controller's bound: asked for 600 s
    the controller refuses (422) and the node never held its long poll."""
    from datetime import timedelta

    from controller.api.wait import MAX_WAIT_S
    from sched_node.control import MAX_WAIT_S as NODE_MAX_WAIT_S
    from sched_node.control import ControllerWait

    assert NODE_MAX_WAIT_S == MAX_WAIT_S
    first, _ = center.wait(timeout=1)
    told: list[str] = []
    wait = ControllerWait(
        f"{center.base}/api/nodes/{center.node}/wait", token=lambda: center.token,
        etag=lambda: first["etag"], heartbeat=timedelta(minutes=10),
        on_schedules=lambda: told.append("changed"), on_prefect=lambda: None,
        on_unsupported=lambda: None).start()
    try:
        center.put(row("s-1"))  # a held wait (or one that comes after) answers it at once
        wait_for("the write's answer", lambda: bool(told), 30)
        assert wait.answers == 1 and wait.connected.is_set()
    finally:
        wait.stop()


def test_a_nodes_reading_of_its_waits_counter() -> None:
    """The node looks when a counter is newer than the one it saw (never when an instance that
    missed an event answers an older one), and at its start when the counter is not 0."""
    from sched_node.control import newer, poked

    assert newer("2000", "1000") and not newer("1000", "2000") and not newer("1000", "1000")
    assert newer("1000", "") and newer("a1:2", "a1:1") and newer("1000", "a1:1")
    assert not poked("0") and poked("1733389200000000")
    assert poked("a1:1") and not poked("a1:0") and poked("odd")


def test_a_wait_answer_that_is_not_a_json_object_is_a_failed_wait_not_the_end_of_the_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A proxy's HTML page or a JSON list answered 200: the node says so, backs off and polls
    again (its thread died on the first of these before)."""
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from sched_node.control import ControllerWait

    bodies = [b"<html>502 Bad Gateway</html>", b"[1, 2]",
              json.dumps({"etag": "e-2", "relay": True, "prefect": "0"}).encode()]
    asked: list[str] = []

    class Hostile(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = bodies[min(len(asked), len(bodies)) - 1]
            if len(asked) > len(bodies):
                time.sleep(0.5)  # a held wait, after the answers under test
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    told: list[str] = []
    wait = ControllerWait(
        f"http://127.0.0.1:{server.server_address[1]}/api/nodes/n/wait", token=lambda: "t",
        etag=lambda: "e-1", heartbeat=timedelta(seconds=10),
        on_schedules=lambda: told.append("changed"), on_prefect=lambda: None,
        on_unsupported=lambda: None)
    try:
        with caplog.at_level("WARNING", logger="sched_node.control"):
            wait.start()
            wait_for("the good answer after two bad ones", lambda: bool(told), 30)
        assert told == ["changed"] and wait.connected.is_set() and wait.answers >= 1
        bad = [r.getMessage() for r in caplog.records if "not a JSON object" in r.getMessage()]
        assert len(bad) == 2 and "502 Bad Gateway" in bad[0] and "[1, 2]" in bad[1], bad
    finally:
        wait.stop()
        server.shutdown()
        server.server_close()
