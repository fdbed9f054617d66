"""A node's long poll (``GET /api/nodes/<node>/wait``): what it answers, what it records,
and how the waits read their ETags together (:class:`controller.waits.EtagReads`).

Over real HTTP on loopback, on SQLite and on Postgres; the batching itself in one
event loop, with a read function that records what it was asked.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from controller import nodes
from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine, migrate
from controller.fleet import FleetSettings
from controller.testing import serve_in_thread
from controller.waits import REPLACE_BURST, REPLACE_EVERY_S, EtagReads, NodeWaits
from tests.procs import wait_for

ADMIN_TOKEN = "admin-secret-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NODES = [f"node-{i}" for i in range(6)]
T0 = datetime(2026, 12, 3, 7, 0, tzinfo=UTC)


def token(node: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {node}-secret-token-0123456789"}


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Center:
    def __init__(self, client: httpx.Client, clock: Clock, app: Any) -> None:
        self.client = client
        self.clock = clock
        self.app = app

    def put(self, node: str, schedule_id: str) -> dict[str, Any]:
        data = {"id": schedule_id, "name": f"nightly {schedule_id}", "repo_id": "r-9",
                "action": "backup", "storage": "b2",
                "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
                "miss_policy": "run-once-within-24h", "enabled": True, "params": None}
        answer = self.client.put(f"/api/nodes/{node}/schedules/{schedule_id}", json=data,
                                 headers=ADMIN)
        assert answer.status_code == 200, answer.text
        written: dict[str, Any] = answer.json()
        return written

    def etag(self, node: str) -> str:
        answer = self.client.get(f"/api/schedules?node={node}", headers=ADMIN)
        assert answer.status_code == 200, answer.text
        return answer.headers["etag"]

    def wait(self, node: str, headers: dict[str, str] | None = None,
             **params: Any) -> dict[str, Any]:
        answer = self.client.get(f"/api/nodes/{node}/wait", params=params,
                                 headers=token(node) if headers is None else headers)
        assert answer.status_code == 200, answer.text
        assert answer.headers["cache-control"] == "no-store"
        data: dict[str, Any] = answer.json()
        return data

    def row(self, node: str) -> dict[str, Any]:
        found = self.client.get("/api/status", headers=ADMIN).json()["nodes"]
        return next(item for item in found if item["node"] == node)


@pytest.fixture
def center(database_url: str) -> Iterator[Center]:
    migrate(database_url)
    engine = make_engine(database_url)
    clock = Clock(T0)
    tokens = Tokens(admin=[ADMIN_TOKEN],
                    nodes={node: [token(node)["Authorization"].removeprefix("Bearer ")]
                           for node in NODES})
    app = create_app(engine, tokens, clock=clock,
                     fleet_settings=FleetSettings(pull_interval=300))
    try:
        with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            yield Center(client, clock, app)
    finally:
        engine.dispose()


def test_a_stale_wait_answers_at_once_with_its_own_nodes_etag(center: Center) -> None:
    """Many nodes' waits at once, each with an ETag it no longer holds: each is answered
    its own node's ETag (read together, never another node's)."""
    for index, node in enumerate(NODES[:4]):
        for n in range(index + 1):  # each list its own ETag
            center.put(node, f"s-{n}")
    expected = {node: center.etag(node) for node in NODES}
    assert expected[NODES[5]] == '"empty"'
    answers: dict[str, dict[str, Any]] = {}

    def ask(node: str) -> None:
        answers[node] = center.wait(node, etag='"gone-1"', timeout=30)

    threads = [threading.Thread(target=ask, args=(node,)) for node in NODES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {node: answer["etag"] for node, answer in answers.items()} == expected
    reads = center.app.state.etag_reads
    assert reads.nodes_read >= len(NODES) and reads.reads >= 1


def test_a_nodes_own_wait_is_its_heartbeat_and_an_admins_is_nothing(center: Center) -> None:
    node = NODES[0]
    center.put(node, "s-1")
    etag = center.etag(node)
    assert center.row(node)["status"] == "never-seen"
    center.wait(node, headers=ADMIN, etag='"gone-1"', timeout=1)
    center.wait(node, headers=ADMIN, etag=etag, timeout=1)
    assert center.row(node)["last_seen_at"] is None, "an admin's wait is not the node's"
    center.wait(node, etag='"gone-1"', timeout=1)
    assert center.row(node)["last_seen_at"] is None, "a stale wait: the node pulls next"

    answer = center.wait(node, etag=etag, timeout=1)  # nothing changed: answered at 1 s
    assert answer["etag"] == etag and answer["relay"] is False
    got = center.row(node)
    assert got["last_seen_at"] == got["last_pull_at"] == "2026-12-03T07:00:00Z"
    assert got["last_seen_via"] == "pull" and got["last_pull_status"] == "304"
    assert got["list_version_served"] == etag.strip('"') and got["status"] == "ok"

    # Silent after 3 pull intervals (no heartbeat announced), alive again at its next wait.
    center.clock.now = T0 + timedelta(seconds=900)
    assert center.row(node)["status"] == "ok"
    center.clock.now = T0 + timedelta(seconds=901)
    assert center.row(node)["status"] == "silent"
    center.wait(node, etag=etag, seen=answer["prefect"], timeout=1)
    got = center.row(node)
    assert got["status"] == "ok" and got["last_seen_at"] == "2026-12-03T07:15:01Z"


def test_a_write_wakes_the_wait_with_the_new_etag(center: Center) -> None:
    node = NODES[1]
    center.put(node, "s-1")
    etag = center.etag(node)
    found: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: found.append(
        center.wait(node, etag=etag, timeout=60)))
    thread.start()
    waits = center.app.state.waits
    wait_for("the wait registered", lambda: waits.waiting == 1, 30)
    spread = center.put(node, "s-2")["_propagation"]
    thread.join(60)
    assert found and found[0]["etag"] == center.etag(node) != etag
    # The write's answer counts on the wait it answered, with or without a Prefect event.
    assert spread["likely_in_time"] is True, spread
    assert f"node {node}'s long poll on this controller was answered" in spread["reason"]


def test_a_new_wait_of_a_node_replaces_its_held_one(center: Center) -> None:
    """Issue 36, point 6: 320 waits with one node's token were all held (each a connection,
    up to 300 s), filling the connection ceiling. Now one is held per node and token kind:
    a new one answers the older at once (409, its connection closed); the admin's wait on
    the same node is another holder."""
    node = NODES[2]
    center.put(node, "s-1")
    etag = center.etag(node)
    waits = center.app.state.waits
    url = f"/api/nodes/{node}/wait"
    answers: dict[str, httpx.Response] = {}

    def hold(name: str, headers: dict[str, str]) -> threading.Thread:
        def ask() -> None:
            with httpx.Client(base_url=str(center.client.base_url), timeout=400) as client:
                answers[name] = client.get(url, params={"etag": etag, "timeout": 300},
                                           headers=headers)
        thread = threading.Thread(target=ask)
        thread.start()
        return thread

    first = hold("first", token(node))
    wait_for("the first wait held", lambda: waits.waiting == 1, 30)
    admin = hold("admin", ADMIN)
    wait_for("the admin's wait held beside it", lambda: waits.waiting == 2, 30)
    second = hold("second", token(node))
    first.join(30)
    assert not first.is_alive(), "the first wait is still held"
    assert answers["first"].status_code == 409
    assert answers["first"].headers["connection"] == "close"
    assert "replaced by a newer one" in answers["first"].json()["detail"]
    assert waits.waiting == 2 and "admin" not in answers  # the admin's is still held
    center.put(node, "s-2")  # a change answers both held waits
    for thread in (admin, second):
        thread.join(30)
    assert answers["second"].status_code == answers["admin"].status_code == 200
    assert answers["second"].json()["etag"] == center.etag(node) != etag


def test_past_its_budget_a_new_wait_is_refused_and_the_held_one_stays(center: Center) -> None:
    """Issue 36, the long-poll flood: 320 waits with one node's token each replaced the held
    one (an ETag read, a heartbeat record and a 409 each), ~330 a second, and healthy pulls
    waited behind them. Past REPLACE_BURST replacements a new wait is refused at once (429,
    Retry-After) and the held one is neither answered nor replaced."""
    node = NODES[3]
    center.put(node, "s-1")
    etag = center.etag(node)
    waits = center.app.state.waits
    url = f"/api/nodes/{node}/wait"
    base = str(center.client.base_url)
    answers: list[httpx.Response] = []
    threads = []

    def hold() -> None:
        with httpx.Client(base_url=base, timeout=400) as client:
            answers.append(client.get(url, params={"etag": etag, "timeout": 300},
                                      headers=token(node)))

    def held(count: int) -> bool:
        return waits.replaced == count and waits.waiting == 1 and len(answers) == count

    for count in range(REPLACE_BURST + 1):  # the first, then REPLACE_BURST replacements
        threads.append(threading.Thread(target=hold))
        threads[-1].start()
        wait_for("the wait held", functools.partial(held, count), 30)
    with httpx.Client(base_url=base, timeout=30) as client:
        began = time.monotonic()
        refused = client.get(url, params={"etag": etag, "timeout": 300}, headers=token(node))
        took = time.monotonic() - began
    assert refused.status_code == 429, refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= REPLACE_EVERY_S + 1
    assert refused.headers["connection"] == "close"
    assert "replaced its wait too often" in refused.json()["detail"]
    assert took < 10, f"the refusal took {took:.1f} s: it was held"
    assert waits.replaced == REPLACE_BURST and waits.waiting == 1
    assert [answer.status_code for answer in answers] == [409] * REPLACE_BURST
    center.put(node, "s-2")  # the held one is still the node's: a change answers it
    for thread in threads:
        thread.join(30)
    assert answers[-1].status_code == 200
    assert answers[-1].json()["etag"] == center.etag(node) != etag


# -- EtagReads: the batching, in one event loop --------------------------------------------


class Reads:
    def __init__(self, etags: dict[str, str], fail: Exception | None = None) -> None:
        self.etags = etags
        self.fail = fail
        self.asked: list[list[str]] = []

    def __call__(self, wanted: list[str]) -> dict[str, str]:
        self.asked.append(list(wanted))
        if self.fail is not None:
            raise self.fail
        return {node: self.etags.get(node, '"empty"') for node in wanted}


def test_waits_asking_together_are_one_read() -> None:
    reads = Reads({"a": '"e-1"', "b": '"e-2"'})
    etags = EtagReads(reads)

    async def go() -> list[str]:
        return list(await asyncio.gather(*(etags.etag(node) for node in ["a", "b", "a", "c"])))

    assert asyncio.run(go()) == ['"e-1"', '"e-2"', '"e-1"', '"empty"']
    assert reads.asked == [["a", "b", "c"]], "one statement for the batch, each node once"
    assert (etags.reads, etags.nodes_read) == (1, 3)


def test_a_full_batch_is_read_at_once_and_the_rest_after() -> None:
    reads = Reads({})
    etags = EtagReads(reads, window=0.01, max_batch=2)

    async def go() -> None:
        await asyncio.gather(*(etags.etag(node) for node in ["a", "b", "c"]))

    asyncio.run(go())
    assert reads.asked == [["a", "b"], ["c"]]


def test_a_failed_read_fails_every_wait_of_its_batch_and_not_the_next() -> None:
    error = OperationalError("SELECT", {}, Exception("the database is down"))
    reads = Reads({"a": '"e-1"'}, fail=error)
    etags = EtagReads(reads)

    async def go() -> tuple[list[Any], str]:
        failed = await asyncio.gather(etags.etag("a"), etags.etag("b"), return_exceptions=True)
        reads.fail = None
        return list(failed), await etags.etag("a")

    failed, later = asyncio.run(go())
    assert failed == [error, error] and later == '"e-1"'


def test_a_wait_that_went_away_does_not_stop_the_others() -> None:
    reads = Reads({"a": '"e-1"', "b": '"e-2"'})
    etags = EtagReads(reads)

    async def go() -> str:
        gone = asyncio.ensure_future(etags.etag("a"))
        kept = asyncio.ensure_future(etags.etag("b"))
        await asyncio.sleep(0)
        gone.cancel()
        return await kept

    assert asyncio.run(go()) == '"e-2"'


# -- the recorder's batch: two statements, every node's own values -------------------------


def test_a_batch_of_pulls_records_each_node_and_never_moves_back(database_url: str) -> None:
    migrate(database_url)
    engine = make_engine(database_url)
    try:
        with Session(engine) as session:
            nodes.record_pulls(session, [nodes.Pull("n-1", T0, "200", "v-1")])
            nodes.mark_seen(session, "n-3", at=T0, via="report", heartbeat_s=30)
            session.commit()
            later = T0 + timedelta(seconds=60)
            nodes.record_pulls(session, [
                nodes.Pull("n-1", later, "304", "v-1"),
                nodes.Pull("n-2", later + timedelta(seconds=1), "200", "v-2"),
                nodes.Pull("n-3", T0 - timedelta(seconds=5), "304", "v-3"),  # older: kept out
            ])
            pulls = nodes.latest_pulls(session)
            seen = nodes.latest_seen(session)
        assert {n: (p.at, p.status, p.list_version) for n, p in pulls.items()} == {
            "n-1": (later, "304", "v-1"), "n-2": (later + timedelta(seconds=1), "200", "v-2"),
            "n-3": (T0 - timedelta(seconds=5), "304", "v-3")}
        assert {n: (s.at, s.via, s.heartbeat_s, s.first_at) for n, s in seen.items()} == {
            "n-1": (later, "pull", None, T0),
            "n-2": (later + timedelta(seconds=1), "pull", None, later + timedelta(seconds=1)),
            "n-3": (T0, "report", 30, T0)}, "a pull keeps the heartbeat; time never goes back"
    finally:
        engine.dispose()


def test_two_instances_give_a_node_the_same_prefect_counter(center: Center) -> None:
    """Every instance follows the same Prefect events, so a node's counter is the newest
    event's time in each: a node whose wait the balancer sends to the other instance is held
    there (it used to be answered at once, and the node asked Prefect again for nothing)."""
    node = NODES[2]
    etag = center.etag(node)
    here, there = center.app.state.waits, NodeWaits()
    at = T0 + timedelta(seconds=1)
    for waits in (here, there):
        assert waits.token(node) == "0" and not waits.poked(node)
        waits.poke(node, "prefect", at=at)
    seen = there.token(node)
    assert here.token(node) == seen != "0"

    started = time.monotonic()
    answer = center.wait(node, etag=etag, seen=seen, timeout=1)
    assert time.monotonic() - started >= 0.9, "a wait with the other instance's counter"
    assert answer["prefect"] == seen

    here.poke(node, "prefect", at=at - timedelta(seconds=5))  # an older event, late
    assert here.token(node) == seen, "an older event moved the counter back"

    for older in (str(int(seen) - 1), "1f2e3d4c:3"):  # ... or an older controller's counter
        started = time.monotonic()
        answer = center.wait(node, etag=etag, seen=older, timeout=5)
        assert time.monotonic() - started < 2 and answer["prefect"] == seen, older


def test_an_event_dated_in_the_future_never_holds_a_nodes_wake_counter() -> None:
    """Anyone with the Prefect API can post an event dated 2027 about a node's deployment:
    its counter moves to now at most, so the next genuine event still wakes the node."""
    waits = NodeWaits()
    forged = datetime.now(UTC) + timedelta(days=400)
    waits.poke("node-a", "prefect", at=forged)
    after_forged = int(waits.token("node-a"))
    assert after_forged <= int(time.time() * 1_000_000)
    time.sleep(0.01)
    waits.poke("node-a", "prefect", at=datetime.now(UTC))
    assert int(waits.token("node-a")) > after_forged, "a genuine event after it moved it on"
