"""The scaled layout (scripts/scaled.py) under a client: an API process killed, Redis restarted.

One throwaway layout from Debian's PostgreSQL, Redis and HAProxy (free ports, a temporary
folder): two Prefect API processes behind HAProxy, the services process, two controller
instances. A client records through the balancer as a node does, over Prefect's REST API: a
deployment, then run after run (created with an idempotency key; Pending, Running, Completed,
each with its own transition id; one event per run), every call retried until it answers, with
the same key, transition id or event id, as a node's outbox would.

0. Each part asks for the layout's secret (issue 36): Prefect's API answers 401 without the
   auth string, at the balancer and at each process (``/api/health``, what HAProxy checks,
   stays open); Redis refuses a client without its password; HAProxy's stats page asks for
   its own; a controller's event reaches Prefect (it has the auth string). No file or folder
   of the layout is readable by others, and ``up`` makes private again what was not.
1. One API process is SIGKILLed mid-run; the client goes on through the other. Three events a
   client had streamed over a websocket straight to that process, and seen confirmed, are
   stored all the same (Prefect's default publisher batch of 5 events or 10 s would have held
   them in the dead process: measured, lost; the layout sets a batch of 1).
2. Redis is stopped until a call of the client's has failed (the API answers 500 once its
   Redis client gives up, ~12 s), then ``up`` is run again (it starts Redis and the killed API
   process, and only them): the client's retries go through; a concurrency slot taken before
   the restart is released after it (its lease is kept in Redis's append-only file).
3. Nothing lost, nothing twice: every run once, each with exactly Scheduled, Pending, Running,
   Completed; every event once; one state-change event of Prefect's per transition (see the
   comment there for the one case that could make two).
4. ``down`` leaves no process and no port behind.

Skipped, naming the package, only where a Debian package is missing and cannot be installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from scripts.scaled_parts.balancer import haproxy_stats
from scripts.scaled_parts.procs import alive, port_free, start_time
from tests import scaledkit as kit
from tests.scaledkit import DEADLINE_S, Layout, readable_by_others
from tests.scaledkit import wait as _wait

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.prefect]

STATES = ["PENDING", "RUNNING", "COMPLETED"]
scaled_layout = kit.scaled_layout  # the fixture `layout`


class Node(threading.Thread):
    """Records run after run through the balancer, retrying each call as a node's outbox does."""

    def __init__(self, api: str, auth: httpx.Auth, deployment_id: str, tag: str) -> None:
        super().__init__(daemon=True)
        self.api, self.auth, self.deployment_id, self.tag = api, auth, deployment_id, tag
        self.finished = 0
        self.keys: list[str] = []
        self.event_ids: dict[str, str] = {}  # run key -> its event's id
        self.run_ids: dict[str, str] = {}
        self.shaky: set[tuple[str, str]] = set()  # (run id, state) with a failed attempt
        self.failed_attempts: list[str] = []
        self.problems: list[str] = []
        self.halt = threading.Event()

    def call(self, client: httpx.Client, method: str, path: str, body: Any,
             what: str) -> httpx.Response:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                response = client.request(method, path, json=body)
                if response.status_code < 500:
                    response.raise_for_status()  # a 4xx is the test's bug: stop
                    return response
                error = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:
                error = type(exc).__name__
            self.failed_attempts.append(f"{what}: {error}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no answer within {DEADLINE_S:.0f} s ({error})")
            time.sleep(0.25)

    def record_one(self, client: httpx.Client, key: str) -> None:
        run = self.call(client, "POST", f"/deployments/{self.deployment_id}/create_flow_run",
                        {"idempotency_key": key, "tags": [self.tag]}, f"create {key}").json()
        self.run_ids[key] = run["id"]
        for state in STATES:
            transition = str(uuid.uuid4())
            failed_before = len(self.failed_attempts)
            answer = self.call(
                client, "POST", f"/flow_runs/{run['id']}/set_state",
                {"state": {"type": state, "state_details": {"transition_id": transition}}},
                f"{state} {key}").json()
            if len(self.failed_attempts) > failed_before:
                self.shaky.add((run["id"], state))
            now = answer.get("state") or {}
            ours = (now.get("type") == state
                    and (now.get("state_details") or {}).get("transition_id") == transition)
            # REJECT with our own transition id: an earlier attempt of this call was committed.
            if not (answer["status"] == "ACCEPT" or (answer["status"] == "REJECT" and ours)):
                self.problems.append(f"{key} {state}: {answer['status']} {answer.get('details')}")
        event_id = str(uuid.uuid4())
        self.call(client, "POST", "/events", [{
            "id": event_id, "occurred": datetime.now(UTC).isoformat(), "event": "sched.scaled.job",
            "resource": {"prefect.resource.id": f"sched.scaled.{key}"},
        }], f"event {key}")
        self.event_ids[key] = event_id

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.api, timeout=30, auth=self.auth) as client:
                i = 0
                while not self.halt.is_set():
                    key = f"{self.tag}-{i:04d}"
                    self.keys.append(key)
                    self.record_one(client, key)
                    self.finished += 1
                    i += 1
                    time.sleep(0.1)
        except BaseException as exc:  # the test reads it: a thread cannot fail the test itself
            self.problems.append(f"node stopped: {type(exc).__name__}: {exc}")

    def wait_for(self, more: int, what: str) -> None:
        target = self.finished + more
        _wait(f"{more} more runs recorded {what} (problems: {self.problems})",
              lambda: self.finished >= target or not self.is_alive())
        assert self.is_alive(), self.problems


def _websocket_events(names: list[str]) -> list[Any]:
    from prefect.events import Event

    return [Event(event="sched.scaled.ws", resource={"prefect.resource.id": f"sched.scaled.ws.{n}"})
            for n in names]


def _emit_and_kill(api: str, names: list[str], before_kill: Callable[[set[str]], None],
                   pid: int) -> None:
    """Stream events to api over a websocket until the client counts them delivered (it
    checkpoints after each one), call before_kill(their ids), then SIGKILL pid (the process
    behind api) while the socket is still open, as a long-lived client's is."""
    from prefect.events.clients import PrefectEventsClient

    events = _websocket_events(names)

    async def scenario() -> None:
        client = PrefectEventsClient(api_url=api, checkpoint_every=1)
        await client.__aenter__()
        try:
            for event in events:
                await client.emit(event)
            assert not client._unconfirmed_events  # every one confirmed by the server
            await asyncio.to_thread(before_kill, {str(e.id) for e in events})
            os.kill(pid, signal.SIGKILL)
        finally:
            with contextlib.suppress(Exception):  # its server is gone
                await client.__aexit__(None, None, None)

    asyncio.run(scenario())


def _emit(api: str, names: list[str]) -> None:
    from prefect.events.clients import PrefectEventsClient

    async def emit() -> None:
        async with PrefectEventsClient(api_url=api, checkpoint_every=1) as client:
            for event in _websocket_events(names):
                await client.emit(event)

    asyncio.run(emit())


def _events(layout: Layout, event_filter: dict[str, Any]) -> list[dict[str, Any]]:
    """Every stored event matching event_filter (all pages)."""
    with layout.prefect() as client:
        page = client.post("/events/filter", json={"filter": event_filter, "limit": 50})
        page.raise_for_status()
        body = page.json()
        events: list[dict[str, Any]] = body["events"]
        while body.get("next_page"):
            page = client.get(body["next_page"])
            page.raise_for_status()
            body = page.json()
            events += body["events"]
        return events


def _stream_ids(client: Any) -> set[str]:
    """The event ids in Redis's `events` stream (what an API process publishes to)."""
    return {json.loads(fields["attributes"]).get("id") for _, fields in client.xrange("events")}


def _in_redis_stream(layout: Layout, event_ids: set[str]) -> bool:
    """True once every id is in Redis's `events` stream."""
    with layout.redis() as client:
        return event_ids <= _stream_ids(client)


def _missing_events(event_filter: dict[str, Any], node: Node, layout: Layout) -> str:
    """Which of the node's events are not stored, and where each got to: the failed attempts of
    its POST, whether it is in Redis's stream, whether its deduplication key is set; then what
    the Prefect processes logged as warnings and errors (a failure's evidence: the layout's
    folder is deleted after the test). Never raises: it only explains a failure."""
    import redis
    from prefect_redis.messaging import _deduplication_key

    stored = {e["id"] for e in _events(layout, event_filter)}
    missing = {key: event_id for key, event_id in node.event_ids.items() if event_id not in stored}
    lines = [f"{key} ({event_id}): failed attempts "
             f"{[a for a in node.failed_attempts if a.startswith(f'event {key}:')]}"
             for key, event_id in missing.items()]
    try:
        with layout.redis() as client:
            in_stream = _stream_ids(client)
            lines += [f"{event_id}: in the stream {event_id in in_stream}, deduplication key "
                      f"{bool(client.exists(_deduplication_key('messaging-cache', event_id)))}"
                      for event_id in missing.values()]
            groups = [(g["name"], g["last-delivered-id"], g["pending"])
                      for g in client.xinfo_groups("events")]
            lines.append(f"the stream's groups (name, last delivered, pending): {groups}")
    except redis.RedisError as exc:
        lines.append(f"Redis not read: {exc}")
    logged = [f"{name}: {line[:300]}" for name in ["prefect-services", *layout.state.api_names()]
              for line in layout.state.log(name).read_text(errors="replace").splitlines()
              if "WARNING" in line or "ERROR" in line]
    return (f"({len(missing)} of {len(node.event_ids)} missing: {'; '.join(lines)}; the Prefect "
            "processes' warnings and errors:\n" + "\n".join(logged[-80:]) + ")")


def _each_part_asks_for_its_secret(layout: Layout) -> None:
    """Prefect's API, Redis and HAProxy's stats page refuse a client without the layout's
    secret, and take one with it; the controllers send Prefect the auth string."""
    import redis

    state = layout.state
    apis = [f"http://127.0.0.1:{port}/api" for port in state.ports["api"]]
    for api in [state.prefect_url, *apis]:
        with httpx.Client(base_url=api, timeout=30) as anyone:
            assert anyone.get("/health").status_code == 200  # what HAProxy's checks call
            refused = anyone.post("/flows/filter", json={})
            assert refused.status_code == 401, (api, refused.status_code, refused.text)
        with layout.prefect(api) as client:
            assert client.post("/flows/filter", json={}).status_code == 200
    with redis.Redis(host="127.0.0.1", port=state.redis_port) as anyone:
        with pytest.raises(redis.AuthenticationError):
            anyone.ping()
    with layout.redis() as client:
        assert client.ping()
    stats = f"http://127.0.0.1:{state.ports['lb_stats']}/"
    assert httpx.get(stats, timeout=30).status_code == 401
    assert httpx.get(stats, timeout=30, auth=("admin", state.secret("lb_stats"))).status_code == 200
    # A schedule write's event goes to Prefect through a controller: accepted, so the
    # controller has the auth string (without it: 401, and `event_sent` false).
    with httpx.Client(base_url=state.controller_url, timeout=30,
                      headers={"Authorization": f"Bearer {state.secret('admin_token')}"}) as ctl:
        row = {"name": "auth check", "repo_id": "r-1", "action": "backup", "storage": "s",
               "schedule": {"days": ["mon"], "hours": ["2"], "minute": "30"},
               "miss_policy": "run-once-within-24h", "enabled": True}
        written = ctl.put("/api/nodes/auth-check/schedules/s-1", json=row)
        assert written.status_code == 200, written.text
        assert written.json()["_propagation"]["event_sent"] is True, written.json()
    env = (layout.folder / "client.env").read_text()
    assert f"PREFECT_API_AUTH_STRING={state.secret('prefect_auth')}\n" in env


@pytest.mark.timeout(900)  # ~50 s here; the deadlines inside are generous for a loaded machine
def test_the_scaled_layout_loses_nothing_when_an_api_process_dies_and_redis_restarts(
        layout: Layout) -> None:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    state = layout.state
    api = state.prefect_url
    apis = {name: f"http://127.0.0.1:{port}/api"
            for name, port in zip(state.api_names(), state.ports["api"], strict=True)}
    victim = state.api_names()[0]
    assert {layout.servers()[f"prefect_api/{n}"]["status"] for n in apis} == {"UP"}
    # The balancer is two processes on the same ports: the kernel spreads new connections.
    assert state.lb_names() == ["haproxy", "haproxy-2"]
    for _ in range(20):
        with httpx.Client(base_url=api, timeout=30) as fresh:
            assert fresh.get("/health").status_code == 200
    served = {lb: sum(int(row["stot"]) for name, row in haproxy_stats(state, lb).items()
                      if name.startswith("prefect_api/")) for lb in state.lb_names()}
    assert all(served.values()), f"a balancer process served none of 20 connections: {served}"

    _each_part_asks_for_its_secret(layout)
    assert readable_by_others(layout.folder) == []

    # The controller's two instances answer behind the balancer too.
    token = state.secret("admin_token")
    with httpx.Client(base_url=state.controller_url, timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as controller:
        assert controller.get("/healthz").status_code == 200
        assert controller.get("/api/tasks").json() == {"tasks": []}

    tag = f"scaled-{uuid.uuid4().hex[:8]}"
    with layout.prefect() as client:
        flow = client.post("/flows/", json={"name": "scaled-layout-test"}).json()
        deployment = client.post("/deployments/", json={"name": tag, "flow_id": flow["id"]})
        deployment.raise_for_status()
    node = Node(api, layout.auth, deployment.json()["id"], tag)
    node.start()
    ws_names = [f"{tag}-{i}" for i in range(6)]
    try:
        with temporary_settings({PREFECT_API_URL: api,
                                 PREFECT_API_AUTH_STRING: state.secret("prefect_auth")}):
            # 1. An API process killed mid-run.
            node.wait_for(8, "before the kill")
            _wait(f"{victim} served part of the runs",
                  lambda: int(layout.servers()[f"prefect_api/{victim}"]["stot"]) > 0)

            def handed_to_redis(ids: set[str]) -> None:
                # Time for the process to hand them to Redis, but less than the 10 s Prefect's
                # default publisher holds them: with that default they die with the process.
                deadline = time.monotonic() + 8
                while time.monotonic() < deadline and not _in_redis_stream(layout, ids):
                    time.sleep(0.1)

            _emit_and_kill(apis[victim], ws_names[:3], handed_to_redis, layout.pid(victim))
            node.wait_for(8, f"after {victim} was killed")
            _emit(api, ws_names[3:])  # through the balancer: lands on the survivor
            assert not alive(state.proc(victim))

            # 2. Redis restarted (SIGTERM: it writes its append-only file and exits), then `up`.
            limit = f"{tag}-slot"
            with layout.prefect() as client:
                client.post("/v2/concurrency_limits/",
                            json={"name": limit, "limit": 1}).raise_for_status()
                taken = client.post("/v2/concurrency_limits/increment-with-lease", json={
                    "names": [limit], "slots": 1, "mode": "concurrency", "lease_duration": 600})
                taken.raise_for_status()
                lease = taken.json()
                assert client.get(f"/v2/concurrency_limits/{limit}").json()["active_slots"] == 1
            failed = len(node.failed_attempts)
            os.kill(layout.pid("redis"), signal.SIGTERM)
            _wait("Redis exited", lambda: not alive(layout.state.proc("redis")))
            # Down long enough for a call to fail (a state change or an event: HTTP 500 once
            # the server's Redis client has given up retrying), which the node then retries.
            _wait("a call failed while Redis was down", lambda: len(node.failed_attempts) > failed)
            # Files a layout made before had readable by all: `up` makes them private again.
            for made_before in ["logs/prefect-services.log", "client.env", "haproxy/haproxy.cfg",
                                "redis/redis.conf", "logs", "prefect"]:
                (layout.folder / made_before).chmod(0o755)
            again = layout.script("up")
            assert again.returncode == 0, f"up failed:\n{again.stdout}\n{again.stderr}"
            assert readable_by_others(layout.folder) == []
            assert f"started: redis, {victim}\n" in again.stdout, again.stdout
            node.wait_for(8, "after Redis came back")
            with layout.prefect() as client:
                released = client.post("/v2/concurrency_limits/decrement-with-lease",
                                       json={"lease_id": lease["lease_id"]})
                assert released.status_code == 204
                slots = client.get(f"/v2/concurrency_limits/{limit}").json()["active_slots"]
                assert slots == 0, "the lease taken before Redis restarted was lost"

            # 3. One of the balancer's processes killed: the other holds the ports.
            os.kill(layout.pid("haproxy-2"), signal.SIGKILL)
            node.wait_for(8, "after haproxy-2 was killed")
    finally:
        node.halt.set()
        node.join(timeout=DEADLINE_S)
    assert not node.problems, node.problems
    assert not node.is_alive()
    statuses = layout.servers()
    assert {statuses[f"prefect_api/{n}"]["status"] for n in apis} == {"UP"}, statuses

    # 4. Nothing lost, nothing twice.
    with layout.prefect() as client:
        runs: list[dict[str, Any]] = []
        while True:
            page = client.post("/flow_runs/filter", json={
                "flow_runs": {"tags": {"all_": [tag]}}, "limit": 200, "offset": len(runs),
                "sort": "EXPECTED_START_TIME_ASC"}).json()
            runs += page
            if len(page) < 200:
                break
        recorded = node.run_ids
        assert sorted(r["idempotency_key"] for r in runs) == sorted(node.run_ids), \
            "a run was lost or made twice"
        for run in runs:
            states = client.get("/flow_run_states/", params={"flow_run_id": run["id"]}).json()
            history = [s["type"] for s in sorted(states, key=lambda s: s["timestamp"])]
            assert history == ["SCHEDULED", *STATES], (run["idempotency_key"], history)
    expected = set(node.event_ids.values())
    job_events = {"event": {"name": ["sched.scaled.job"]},
                  "resource": {"id_prefix": [f"sched.scaled.{tag}"]}}
    _wait("every run's event stored once",
          lambda: expected <= {e["id"] for e in _events(layout, job_events)},
          explain=lambda: _missing_events(job_events, node, layout))
    stored = _events(layout, job_events)
    assert sorted(e["id"] for e in stored) == sorted(node.event_ids.values())
    _wait("the six websocket events stored", lambda: len(_events(layout, {
        "event": {"name": ["sched.scaled.ws"]},
        "resource": {"id_prefix": [f"sched.scaled.ws.{tag}"]}})) == 6)
    ws = _events(layout, {"event": {"name": ["sched.scaled.ws"]},
                       "resource": {"id_prefix": [f"sched.scaled.ws.{tag}"]}})
    assert sorted(e["resource"]["prefect.resource.id"] for e in ws) == sorted(
        f"sched.scaled.ws.{n}" for n in ws_names)
    # Prefect's own state events: one per transition. (The server publishes a state's event
    # inside the transaction that records the state, so a state change that fails with Redis
    # down leaves neither; only a process killed between the publish and the commit could
    # leave an event for a state its retry then records again: a second one, never none.)
    # (Filtered here, not by the runs' ids in the query: a next page carries its filter in
    # its URL, and hundreds of ids outgrow what HAProxy takes in a request line.)
    ids = {f"prefect.flow-run.{run_id}" for run_id in recorded.values()}
    want = {(run_id, s) for run_id in recorded.values() for s in STATES}

    def state_events() -> list[tuple[str, str]]:
        return [(e["resource"]["prefect.resource.id"].rsplit(".", 1)[1],
                 e["resource"]["prefect.state-type"])
                for e in _events(layout, {"event": {"prefix": ["prefect.flow-run."]}})
                if e["resource"]["prefect.resource.id"] in ids
                and e["resource"]["prefect.state-type"] in STATES]

    _wait("a state event for every transition", lambda: want <= set(state_events()))
    counts = Counter(state_events())
    twice = {t for t, n in counts.items() if n > 1}
    assert twice <= node.shaky and max(counts.values()) <= 2, counts
    print(f"{len(recorded)} runs; {len(node.failed_attempts)} failed attempts retried "
          f"({Counter(a.split(': ', 1)[1] for a in node.failed_attempts)}); "
          f"{len(twice)} state events twice")

    # 4. down leaves nothing running.
    records = dict(layout.state.state["processes"])
    pg_pid = int((layout.folder / "pg" / "data" / "postmaster.pid").read_text().split()[0])
    stopped = layout.script("down")
    assert stopped.returncode == 0, stopped.stderr
    assert not any(alive(r) for r in records.values()), records
    assert start_time(pg_pid) is None, "postgres still runs"
    assert all(port_free(int(p)) for p in layout.env.values() if p.isdigit())
