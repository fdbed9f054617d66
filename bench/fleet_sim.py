"""A fleet simulator: N simulated nodes in one process, making the calls a real node makes.

1. **Record.** One real node (``python -m sched_node``) runs against a throwaway Prefect
   server and controller, each behind a logging proxy (method, path, query, the request's
   JSON and replayed headers, the status, the answer's JSON and ETag, the client's
   connection): start-up, idle reconciles, a restart, a schedule change, jobs.
2. **Templates.** The log is cut by phase into what the node does per trigger: its first
   start, a restart, one periodic reconcile, one job's record, the plan's bulk entry, the
   long poll (its query fields taken from the previous answer), the worker's look at its
   queue and its heartbeat to the pool (at the node's ``worker_poll`` and
   ``worker_heartbeat``). Answers from 500 up and busy
   answers are the server's trouble, not the pattern: a simulated node asks again itself.
3. **Replay.** N :class:`SimNode` objects (asyncio, one process, a lean HTTP/1.1 client)
   replay the templates with their own name and token, the ids of their own answers in
   place of the recorded ones (mapped field by field), times shifted to their windows, and
   their schedule ids; one new connection per burst, as the node's client opens one; one
   held connection each for the long poll. The templates are read from the recording, so
   the simulator follows the node as it changes.
4. **Check.** The simulated idle calls per endpoint per node-hour are compared with the
   real node's (each recorded reconcile's calls at the node's reconcile interval, the long
   poll at its heartbeat); the result is in the table's notes.
5. **Measure**, per size: the fleet's start, idle minutes, a slice of the nightly wave at its
   peak rate, optionally a fleet-wide restart: the center's CPU by part (``/proc``),
   requests and connections per node-hour, latency, 5xx, record lag, windows recorded.

    .venv/bin/python bench/fleet_sim.py --layout scaled --nodes 100,1000 --restart
    .venv/bin/python bench/fleet_sim.py --layout sqlite --nodes 100,1000
    .venv/bin/python bench/fleet_sim.py --layout postgres --nodes 100,1000
    .venv/bin/python bench/fleet_sim.py --record-only rec.json   # the recording alone

``--layout scaled`` starts the worktree's scaled layout (``scripts/scaled.py up``; left
running), writes the simulated nodes' tokens into its tokens file and their rows into its
controller database. ``--layout sqlite`` starts ``prefect server start`` on SQLite (as
``make run``) and one controller. ``--layout postgres`` starts a throwaway PostgreSQL cluster
(scripts/scaled.py's) and ``prefect server start`` on it with Prefect's default pool, and one
controller as the sqlite layout; both are stopped at the end. A size whose start does not
finish within ``--start-timeout-s`` ends there and is recorded so (where the layout ends),
with the answers and the servers' log errors seen. Raw figures go to
``bench/fleet_sim.json`` (one entry per layout; a run replaces the sizes it measured and
keeps the others), the docs section (the method and the tables) to docs/benchmarks.md
between ``fleet:begin`` and ``fleet:end``; each size's details are printed. What the runs
found, written by hand, is in ``bench/fleet_sim_findings.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import prefect_bench as pb
from bench.bench_node import Controller, _config, _spawn_node
from ops.run_local import wait_healthy

ROOT = Path(__file__).resolve().parent.parent

NY = "America/New_York"
REPLAYED_HEADERS = frozenset({"if-none-match", "content-type", "accept"})
"""Request headers the log keeps and the simulated nodes send (never Authorization)."""


# -- the logging proxy --------------------------------------------------------------------


@dataclass
class Call:
    """One request a node sent, as the logging proxy saw it."""

    t: float
    side: str
    method: str
    path: str
    query: str
    request: Any
    status: int
    response: Any
    conn: str
    seconds: float
    headers: dict[str, str] = field(default_factory=dict)
    etag: str = ""


class LoggingProxy:
    """An HTTP proxy (ASGI, in a thread) that forwards to target and logs every call."""

    def __init__(self, side: str, target: str) -> None:
        import httpx
        import uvicorn

        self.side = side
        self.target = target.rstrip("/")
        self.calls: list[Call] = []
        self.port = pb.free_port()
        self._client: httpx.AsyncClient | None = None
        config = uvicorn.Config(self._app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_keep_alive=75, interface="asgi3")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        import httpx

        if scope["type"] != "http":
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]
                   if k.lower() not in (b"host", b"content-length", b"connection")]
        query = scope.get("query_string", b"").decode()
        url = f"{self.target}{scope['path']}" + (f"?{query}" if query else "")
        t0 = time.time()
        answer = await self._client.request(scope["method"], url, content=body, headers=headers)
        seconds = time.time() - t0
        self.calls.append(Call(
            t=t0, side=self.side, method=scope["method"], path=scope["path"], query=query,
            request=_json(body), status=answer.status_code, response=_json(answer.content),
            conn="{}:{}".format(*tuple(scope.get("client") or ("?", 0))), seconds=seconds,
            headers={k: v for k, v in headers if k.lower() in REPLAYED_HEADERS},
            etag=answer.headers.get("etag", "")))
        out = [(k.encode(), v.encode()) for k, v in answer.headers.items()
               if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                    "content-encoding")]
        out.append((b"content-length", str(len(answer.content)).encode()))
        await send({"type": "http.response.start", "status": answer.status_code,
                    "headers": out})
        await send({"type": "http.response.body", "body": answer.content})

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _json(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"__text__": raw.decode("utf-8", "replace")[:2000]}


# -- recording a real node ----------------------------------------------------------------


def fleet_rows(now: datetime) -> list[dict[str, Any]]:
    """The fleet's ten schedules per node (node's zone): seven nightly backups in a 4-hour wave,
    an hourly copy, and the chain's prune and check (fired by the node after the wave)."""
    rows: list[dict[str, Any]] = []
    for n in range(7):
        rows.append({"id": f"backup-{n}", "name": f"nightly backup {n}", "repo_id": f"repo-{n}",
                     "action": "stamp", "schedule": {"days": ["*"], "hours": [str(1 + n % 4)],
                                                     "minute": str((n * 17) % 60)},
                     "jitter": 3600, "miss_policy": "skip", "enabled": True, "version": 1})
    # The copy at the minute half an hour away: nothing fires while the node is recorded
    # but the job phase's own row.
    rows.append({"id": "copy", "name": "hourly copy", "repo_id": "repo-copy", "action": "stamp",
                 "schedule": {"days": ["*"], "hours": ["*"], "minute": str((now.minute + 30) % 60)},
                 "miss_policy": "skip", "enabled": True, "version": 1})
    for n, name in enumerate(("prune", "check")):
        rows.append({"id": name, "name": name, "repo_id": "repo-0", "action": "stamp",
                     "schedule": {"days": ["*"], "hours": ["5"], "minute": str(30 + 10 * n)},
                     "miss_policy": "skip", "enabled": True, "version": 1})
    return rows


RECORD_RECONCILE_S = 90
"""The recorded node's reconcile interval: its first periodic reconcile comes in the second
half of it (sched_node.reconcile), after the start's 40 s, and one or two fall in the idle phase."""


def record(work: Path, *, idle_s: float = 130, jobs: int = 2,
           node_config: str = "") -> dict[str, Any]:
    """Run one real node through start-up, idle reconciles, a restart, a schedule change and
    jobs, with Prefect and the controller behind logging proxies; return the log and phases.

    node_config: TOML lines added to the node's configuration (``--node-config``)."""
    proc, url = pb.start_server(work / "rec-prefect")
    name = f"rec{uuid.uuid4().hex[:8]}"
    controller = Controller(work / "rec-ctl", url, [name])
    pp = LoggingProxy("prefect", url.removesuffix("/api"))
    cp = LoggingProxy("controller", controller.base)
    phases: dict[str, tuple[float, float]] = {}
    node = None
    try:
        for row in fleet_rows(datetime.now(UTC)):
            controller.put(name, row)
        pull = f"{cp.base}/api/schedules?node={name}"
        extra = f'token = "{controller.tokens[name]}"\n' + node_config
        config = _config(work / "rec-node", name, pull,
                         extra=extra + f"reconcile_interval = {RECORD_RECONCILE_S}\n")
        t = time.time()
        node = _spawn_node(config, f"{pp.base}/api", work / "rec-node.log")
        time.sleep(40)
        phases["start"] = (t, time.time())
        t = time.time()
        time.sleep(idle_s)
        phases["idle"] = (t, time.time())
        pb.stop_group(node)
        config = _config(work / "rec-node", name, pull, extra=extra)
        t = time.time()
        node = _spawn_node(config, f"{pp.base}/api", work / "rec-node.log")
        time.sleep(30)
        phases["restart"] = (t, time.time())
        # A schedule change: one every-minute row (its jobs are the job phase's).
        now = datetime.now(UTC)
        if now.second > 30:  # keep the change clear of the next minute's job
            time.sleep(62 - now.second)
        t = time.time()
        controller.put(name, {"id": "minutely", "name": "minutely", "repo_id": "repo-m",
                              "action": "stamp", "schedule": {"days": ["*"], "hours": ["*"],
                                                              "minute": "0",
                                                              "interval_minutes": 1},
                              "miss_policy": "skip", "enabled": True, "version": 1})
        time.sleep(max(5.0, 57 - datetime.now(UTC).second))
        phases["change"] = (t, time.time())
        t = time.time()
        time.sleep(60 * jobs)
        phases["jobs"] = (t, time.time())
    finally:
        pb.stop_group(node)
        pp.close()
        cp.close()
        controller.stop()
        pb.stop_group(proc)
    calls = sorted(pp.calls + cp.calls, key=lambda c: c.t)
    return {"node": name, "phases": phases, "calls": [asdict(c) for c in calls],
            "heartbeat_s": 60, "reconcile_s": RECORD_RECONCILE_S, "node_config": node_config}


# -- templates: the recorded calls, with what varies marked -----------------------------

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PLANNED_SET_STATE = re.compile(r"/api/flow_runs/" + UUID_RE.pattern + "/set_state")
ISO_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2})(?::(\d{2})(\.\d+)?)?"
                    r"(Z|[+-]\d{2}:\d{2})?")
COMPACT_RE = re.compile(r"(\d{8})T(\d{4})((?:\d{2}\d*)?)Z")
BUSY_OR_ERROR = 500
"""Recorded answers from 500 up (and 429) are the server's trouble, not the node's pattern:
the simulated node asks again as the node's client does."""


@dataclass
class TCall:
    """One call of a template: the recorded request and answer."""

    side: str
    method: str
    path: str
    query: str
    headers: dict[str, str]
    request: Any
    response: Any
    etag: str
    status: int


@dataclass
class Templates:
    """The call pattern of a real node, by what triggers it."""

    node: str
    start: list[TCall]
    restart: list[TCall]
    reconcile: list[TCall]
    job: list[TCall]
    job_window: datetime
    job_schedule: str
    job_run: str
    """The recorded job's planned run (its id in the job's calls), or "" when the job's
    record found or made its run itself."""
    worker_poll: TCall | None
    """The start's look at the node's queue (``get_scheduled_flow_runs``), as a worker polls."""
    worker_heartbeat: TCall | None
    """The start's heartbeat to the node's work pool."""
    plan_entry: dict[str, Any]
    plan_window: datetime
    plan_schedule: str
    wait_query: dict[str, str]
    wait_fields: dict[str, str]
    heartbeat_s: float
    reconcile_s: float
    start_at: datetime
    recorded_rates: dict[str, float] = field(default_factory=dict)

    def counts(self, which: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for call in getattr(self, which):
            key = endpoint_class(call.side, call.method, call.path, self.node)
            found[key] = found.get(key, 0) + 1
        return found


def endpoint_class(side: str, method: str, path: str, node: str) -> str:
    """Return ``side METHOD /path`` with ids and the node's name replaced by placeholders."""
    path = UUID_RE.sub("{id}", path.split("?")[0]).replace(node, "{node}")
    return f"{side} {method} {path}"


def _tcall(raw: dict[str, Any]) -> TCall:
    return TCall(side=raw["side"], method=raw["method"], path=raw["path"], query=raw["query"],
                 headers=dict(raw.get("headers") or {}), request=raw["request"],
                 response=raw["response"], etag=raw.get("etag", ""), status=raw["status"])


def _kept(raw: dict[str, Any]) -> bool:
    return raw["status"] < BUSY_OR_ERROR and raw["status"] != 429 and "/wait" not in raw["path"]


def build_templates(found: dict[str, Any]) -> Templates:
    """Cut the recording into the templates a simulated node replays."""
    node = found["node"]
    calls = found["calls"]

    def phase(name: str) -> list[dict[str, Any]]:
        a, b = found["phases"][name]
        return [c for c in calls if a <= c["t"] < b]

    start = [_tcall(c) for c in phase("start") if _kept(c)]
    restart = [_tcall(c) for c in phase("restart") if _kept(c)]
    idle = [c for c in phase("idle") if _kept(c)]
    pulls = [i for i, c in enumerate(idle) if c["path"] == "/api/schedules"]
    if not pulls:
        raise SystemExit("the recorded node made no periodic reconcile")
    # One reconcile: its pull, what follows up to its report to the controller, and any call
    # of the 3 s before the pull (a timer of the node's that runs beside it) but a report:
    # the reconcile's own ends the template; one before the pull is a heartbeat's, which a
    # node with its long poll open does not send between reconciles 15 minutes apart.
    pull = pulls[0]
    first = pull
    while first > 0 and idle[pull]["t"] - idle[first - 1]["t"] < 3:
        first -= 1
    end = next(i for i in range(pull, len(idle)) if idle[i]["path"].endswith("/report"))
    reconcile = [_tcall(c) for c in idle[first:pull] if not c["path"].endswith("/report")]
    reconcile += [_tcall(c) for c in idle[pull:end + 1]]
    jobs = [c for c in phase("jobs") if _kept(c)]
    # A job's record begins by putting its planned run in Running (found by its idempotency
    # key, ``<node>:<schedule>@<window>``), or, for a window with none, by creating its run.
    # The simulated windows are all planned ahead: the first planned job's record is theirs
    # (the first job after the schedule change may find no plan yet and create its run).
    # A node that knows its planned run's id (its plan kept it) puts that run in Running.
    begins = [i for i, c in enumerate(jobs)
              if c["path"].endswith(("/create_flow_run", "/flow_runs/bulk_set_state"))
              or _runs_planned(c)]
    if not begins:
        raise SystemExit("the recorded node's jobs phase holds no job's record")
    begin = next((i for i in begins if _runs_planned(jobs[i])),
                 next((i for i in begins if jobs[i]["path"].endswith("/bulk_set_state")),
                      begins[0]))
    stop = next(i for i, c in enumerate(jobs) if i > begin and c["path"].endswith("/report"))
    job = [_tcall(c) for c in jobs[begin:stop + 1]]
    job_run = ""
    if _runs_planned(jobs[begin]):
        job_run = jobs[begin]["path"].split("/")[3]
        schedule, window = _key_window(_planned_entry(calls, job_run)["idempotency_key"])
        params = {"schedule_id": schedule, "window": window}
    elif "parameters" in job[0].request:
        params = job[0].request["parameters"]
    else:
        schedule, window = _key_window(job[0].request["flow_runs"]["idempotency_key"]["any_"][0])
        params = {"schedule_id": schedule, "window": window}
    bulk = next(c for c in start if c.path.endswith("/create_flow_run/bulk"))
    entry = bulk.request[0]
    plan_schedule, plan_window = _key_window(entry["idempotency_key"])
    waits = [c for c in calls if c["path"].endswith("/wait") and c["status"] == 200]
    second = next(c for c in waits if c["query"] and "seen=&" not in c["query"])
    before = waits[waits.index(second) - 1]["response"]
    query = dict(urllib.parse.parse_qsl(second["query"], keep_blank_values=True))
    fields = {key: next((f for f, v in before.items() if v == value), "")
              for key, value in query.items()}
    hours = (found["phases"]["idle"][1] - found["phases"]["idle"][0]) / 3600
    idle_counts: dict[str, float] = {}
    for c in idle:
        key = endpoint_class(c["side"], c["method"], c["path"], node)
        idle_counts[key] = idle_counts.get(key, 0) + 1 / hours
    return Templates(
        node=node, start=start, restart=restart, reconcile=reconcile, job=job,
        job_window=datetime.fromisoformat(params["window"]), job_schedule=params["schedule_id"],
        job_run=job_run,
        worker_poll=next((c for c in start if c.path.endswith("/get_scheduled_flow_runs")), None),
        worker_heartbeat=next((c for c in start if c.path.endswith("/workers/heartbeat")), None),
        plan_entry=entry, plan_window=datetime.fromisoformat(plan_window),
        plan_schedule=plan_schedule, wait_query=query, wait_fields=fields,
        heartbeat_s=float(found["heartbeat_s"]), reconcile_s=float(found["reconcile_s"]),
        start_at=datetime.fromtimestamp(found["phases"]["start"][0], UTC),
        recorded_rates=idle_counts)


def _runs_planned(raw: dict[str, Any]) -> bool:
    """Whether a recorded call puts a flow run it knows by id in Running (a planned one)."""
    request = raw.get("request")
    return (raw["method"] == "POST" and bool(PLANNED_SET_STATE.fullmatch(raw["path"]))
            and isinstance(request, dict)
            and request.get("state", {}).get("type") == "RUNNING")


def _planned_entry(calls: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    """The recorded plan's bulk entry that created the run run_id."""
    for c in calls:
        results = c["response"].get("results") if isinstance(c["response"], dict) else None
        if c["path"].endswith("/create_flow_run/bulk") and isinstance(results, list):
            for i, result in enumerate(results):
                if isinstance(result, dict) and result.get("flow_run_id") == run_id:
                    return dict(c["request"][i])
    raise SystemExit(f"the recorded job's run {run_id} was not made by the recorded plan")


def _key_window(key: str) -> tuple[str, str]:
    """A planned run's schedule and window from its idempotency key, ``node:schedule@window``."""
    schedule, window = key.split(":", 1)[1].rsplit("@", 1)
    return schedule, window


def _shift_iso(match: re.Match[str], delta: timedelta) -> str:
    text = match.group(0)
    y, mo, d, h, mi, sec, frac, tz = match.groups()
    moment = datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec or 0)) + delta
    out = moment.strftime("%Y-%m-%dT%H:%M")
    if sec is not None:
        out += moment.strftime(":%S") + (frac or "")
    return out + (tz or "") if text else text


def _shift_compact(match: re.Match[str], delta: timedelta) -> str:
    day, hm, rest = match.groups()
    moment = datetime.strptime(day + hm, "%Y%m%d%H%M") + delta
    return moment.strftime("%Y%m%dT%H%M") + rest + "Z"


class Subst:
    """What a simulated node puts in place of the recorded node's values."""

    def __init__(self, rec_node: str, node: str, ids: dict[str, str]) -> None:
        self.rec_node = rec_node
        self.node = node
        self.ids = ids
        self.delta = timedelta(0)
        self.schedule: tuple[str, str] | None = None

    def text(self, value: str) -> str:
        value = value.replace(self.rec_node, self.node)
        if self.schedule is not None and self.schedule[0] in value:
            value = value.replace(self.schedule[0], self.schedule[1])
        value = UUID_RE.sub(self._id, value)
        if self.delta:
            value = ISO_RE.sub(lambda m: _shift_iso(m, self.delta), value)
            value = COMPACT_RE.sub(lambda m: _shift_compact(m, self.delta), value)
        return value

    def _id(self, match: re.Match[str]) -> str:
        found = self.ids.get(match.group(0))
        if found is None:  # made by the node itself (an event's id): a new one
            found = self.ids[match.group(0)] = str(uuid.uuid4())
        return found

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, dict):
            return {self.text(k): self.value(v) for k, v in value.items()}
        return value


def learn_ids(recorded: Any, got: Any, ids: dict[str, str]) -> None:
    """Map each id (UUID) of a recorded answer to the one at the same place in the node's."""
    if isinstance(recorded, str) and isinstance(got, str):
        if UUID_RE.fullmatch(recorded) and UUID_RE.fullmatch(got):
            ids[recorded] = got
    elif isinstance(recorded, dict) and isinstance(got, dict):
        for key, value in recorded.items():
            if key in got:
                learn_ids(value, got[key], ids)
    elif isinstance(recorded, list) and isinstance(got, list):
        for a, b in zip(recorded, got, strict=False):
            learn_ids(a, b, ids)


# -- a lean HTTP/1.1 client (thousands of nodes in one process) --------------------------


class Stats:
    """What the simulated nodes sent and how it was answered."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.latency: dict[str, list[float]] = {}
        self.status: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.opened: dict[str, int] = {"prefect": 0, "controller": 0}
        self.busy = 0

    def add(self, key: str, status: int, seconds: float) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self.latency.setdefault(key, []).append(seconds)
        self.status[status] = self.status.get(status, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"count": dict(self.count), "status": dict(self.status),
                "errors": dict(self.errors), "opened": dict(self.opened), "busy": self.busy,
                "n_latency": {k: len(v) for k, v in self.latency.items()}}


class Conn:
    """One keep-alive connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.closed = False
        """The server said ``Connection: close`` (a busy SQLite server's 503 does)."""

    async def exchange(self, head: bytes, body: bytes, timeout: float
                       ) -> tuple[int, dict[str, str], bytes]:
        self.writer.write(head + body)
        await self.writer.drain()
        raw = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        data = b""
        if "content-length" in headers:
            data = await asyncio.wait_for(
                self.reader.readexactly(int(headers["content-length"])), timeout)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                data += chunk[:-2]
        self.closed = headers.get("connection", "").lower() == "close"
        return status, headers, data

    def close(self) -> None:
        self.closed = True
        self.writer.close()


class Side:
    """One server (Prefect or the controller) behind a pool of keep-alive connections."""

    def __init__(self, name: str, base: str, stats: Stats, limit: int,
                 always: dict[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(base)
        self.name = name
        self.always = always or {}  # headers of every request (the scaled layout's auth)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.stats = stats
        self.idle: list[Conn] = []
        self.slots = asyncio.Semaphore(limit)

    async def connect(self) -> Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=2 ** 22)
        self.stats.opened[self.name] += 1
        return Conn(reader, writer)

    def head(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "User-Agent: sched-fleet-sim", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in {**self.always, **headers}.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def call(self, key: str, method: str, path: str, *, headers: dict[str, str],
                   body: Any = None, timeout: float = 30.0, conn: Conn | None = None
                   ) -> tuple[int, dict[str, str], Any]:
        """Send one request (asked again on a busy answer, as the node's client does)."""
        raw = b"" if body is None else json.dumps(body).encode()
        if body is not None:
            headers = {**headers, "Content-Type": "application/json"}
        head = self.head(method, self.prefix + path, headers, raw)
        extra: Conn | None = None
        for delay in (0.1, 0.3, 1.0, None):
            t0 = time.perf_counter()
            if conn is not None and conn.closed:  # asked again on a new connection
                conn = extra = await self.connect()
            status, answer_headers, data = await self._send(head, raw, timeout, conn)
            self.stats.add(key, status, time.perf_counter() - t0)
            if status not in (429, 503) or delay is None:
                break
            self.stats.busy += 1
            if conn is not None:  # a busy server may close the connection after its answer
                conn.close()
            await asyncio.sleep(delay)
        if extra is not None:
            extra.close()
        try:
            parsed = json.loads(data) if data else None
        except ValueError:
            parsed = None
        return status, answer_headers, parsed

    async def _send(self, head: bytes, raw: bytes, timeout: float, own: Conn | None
                    ) -> tuple[int, dict[str, str], bytes]:
        if own is not None:
            return await own.exchange(head, raw, timeout)
        async with self.slots:
            for attempt in range(2):
                conn = self.idle.pop() if self.idle else await self.connect()
                try:
                    status, headers, data = await conn.exchange(head, raw, timeout)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    conn.close()
                    if attempt == 0:  # a kept connection the server had closed: once more
                        continue
                    self.stats.errors[type(exc).__name__] = (
                        self.stats.errors.get(type(exc).__name__, 0) + 1)
                    return 599, {}, b""
                except (TimeoutError, OSError) as exc:
                    conn.close()
                    self.stats.errors[type(exc).__name__] = (
                        self.stats.errors.get(type(exc).__name__, 0) + 1)
                    return 599, {}, b""
                if headers.get("connection", "").lower() == "close":
                    conn.close()
                else:
                    self.idle.append(conn)
                return status, headers, data
        return 599, {}, b""


# -- the simulated node -------------------------------------------------------------------


@dataclass
class Job:
    """One window a simulated node fires, and when its record reached its final state."""

    node: str
    schedule: str
    window: datetime
    recorded_at: float | None = None
    status: int = 0
    ended: float = 0.0


class Burst:
    """One replay of a template by one node: its own connections, as the node's client opens
    one per burst of calls (it keeps none between them)."""

    KEEP_S = 4.0
    """A connection unused this long is not reused (the servers close idle ones after 5 s)."""

    def __init__(self, sim: Fleet) -> None:
        self.sim = sim
        self.conns: dict[str, Conn] = {}
        self.used: dict[str, float] = {}

    async def conn(self, side: str) -> Conn:
        now = time.monotonic()
        if side in self.conns and (now - self.used.get(side, now) > self.KEEP_S
                                   or self.conns[side].closed):
            self.conns.pop(side).close()
        if side not in self.conns:
            self.conns[side] = await self.sim.sides[side].connect()
        self.used[side] = now
        return self.conns[side]

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


class SimNode:
    """A simulated node: the real node's templates, replayed with its own name and ids."""

    def __init__(self, sim: Fleet, name: str, token: str) -> None:
        self.sim = sim
        self.name = name
        self.token = token
        self.ids: dict[str, str] = {}
        self.planned_runs: dict[tuple[str, datetime], str] = {}
        """Each planned window's run id, from the answers to its plan."""
        self.etags: dict[str, str] = {}
        self.wait_answer: dict[str, Any] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.up = False
        self.registered = False

    def headers(self, call: TCall) -> dict[str, str]:
        out = {k: self.etags.get(v, v) for k, v in call.headers.items()
               if k.lower() != "content-type"}
        if call.side == "controller":
            out["Authorization"] = f"Bearer {self.token}"
        return out

    async def replay(self, calls: list[TCall], subst: Subst, *, job: Job | None = None,
                     answers: list[Any] | None = None) -> None:
        t = self.sim.templates
        burst = Burst(self.sim)
        try:
            for call in calls:
                path = subst.text(call.path)
                if call.query:
                    pairs = urllib.parse.parse_qsl(call.query, keep_blank_values=True)
                    path += "?" + urllib.parse.urlencode([(k, subst.text(v)) for k, v in pairs])
                key = endpoint_class(call.side, call.method, call.path, t.node)
                body = subst.value(call.request) if call.request is not None else None
                for attempt in range(30):
                    try:
                        conn = await burst.conn(call.side)
                        status, headers, answer = await self.sim.sides[call.side].call(
                            key, call.method, path, headers=self.headers(call), body=body,
                            conn=conn)
                    except (ConnectionError, OSError, asyncio.IncompleteReadError,
                            TimeoutError) as exc:
                        self.sim.stats.errors[type(exc).__name__] = (
                            self.sim.stats.errors.get(type(exc).__name__, 0) + 1)
                        burst.conns.pop(call.side, None)
                        status, headers, answer = 599, {}, None
                    if status < 500 and status != 429:
                        break
                    await asyncio.sleep(min(2 ** attempt, 30))  # as the recorder: wait, again
                if call.etag and headers.get("etag"):
                    self.etags[call.etag] = headers["etag"]
                if answer is not None and call.response is not None:
                    learn_ids(call.response, answer, subst.ids)
                if answers is not None:
                    answers.append(answer)
                if (job is not None and call.method == "POST" and path.endswith("/set_state")
                        and isinstance(call.request, dict)
                        and call.request.get("state", {}).get("type") in FINAL
                        and "/flow_runs/" in path):
                    job.recorded_at = time.time()
                    job.status = status
        finally:
            burst.close()

    def subst(self, ids: dict[str, str] | None = None) -> Subst:
        return Subst(self.sim.templates.node, self.name, self.ids if ids is None else ids)

    async def start(self, *, again: bool) -> None:
        t = self.sim.templates
        subst = self.subst()
        subst.delta = datetime.now(UTC) - t.start_at if not again else timedelta(0)
        self.up = True
        self.tasks = [asyncio.create_task(self._wait_loop())]
        if again and not self.registered:
            # A restart reads the deployments it registered before (their ids kept in its
            # state folder): this run's fleet did not exist before it, so a node whose first
            # start here is a restart's registers first, as its first start once did.
            await self.replay([c for c in t.start if c.method == "POST" and c.path in (
                "/api/flows/", "/api/deployments/")], subst)
        self.registered = True
        await self.replay(t.restart if again else t.start, subst)
        self.tasks.append(asyncio.create_task(self._reconcile_loop()))
        self.tasks.append(asyncio.create_task(self._worker_loop()))

    async def stop(self) -> None:
        self.up = False
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self.tasks = []

    async def _wait_loop(self) -> None:
        t = self.sim.templates
        side = self.sim.sides["controller"]
        path = f"/api/nodes/{self.name}/wait"
        key = endpoint_class("controller", "GET", f"/api/nodes/{t.node}/wait", t.node)
        conn: Conn | None = None
        while self.up:
            query = {k: str(self.wait_answer.get(f, "")) if f else v
                     for (k, v), f in zip(t.wait_query.items(), t.wait_fields.values(),
                                          strict=True)}
            try:
                if conn is None:
                    conn = await side.connect()
                status, _, answer = await side.call(
                    key, "GET", f"{path}?{urllib.parse.urlencode(query)}",
                    headers={"Authorization": f"Bearer {self.token}"},
                    timeout=t.heartbeat_s + 15, conn=conn)
            except asyncio.CancelledError:
                if conn is not None:
                    conn.close()
                raise
            except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                self.sim.stats.errors[type(exc).__name__] = (
                    self.sim.stats.errors.get(type(exc).__name__, 0) + 1)
                if conn is not None:
                    conn.close()
                conn, status, answer = None, 599, None
            if status == 200 and isinstance(answer, dict):
                self.wait_answer = answer
            elif status >= 400:
                await asyncio.sleep(random.uniform(1, 5))

    async def _reconcile_loop(self) -> None:
        t = self.sim.templates
        await asyncio.sleep(random.uniform(0, self.sim.reconcile_s))
        while self.up:
            subst = self.subst(dict(self.ids))
            await self.replay(t.reconcile, subst)
            self.sim.reconciles += 1
            windows = self.sim.plan_due(self)
            if windows:
                await self.plan(windows)
            await asyncio.sleep(self.sim.reconcile_s)

    async def _worker_loop(self) -> None:
        """The node as its pool's worker: a look at its queue every ``worker_poll_s``, a
        heartbeat every ``worker_heartbeat_s``, each at a random phase (the recorded start's
        calls, their times shifted to now)."""
        t, sim = self.sim.templates, self.sim
        if t.worker_poll is None or t.worker_heartbeat is None:
            return  # a recording of a node that was no worker of its pool
        clock = time.monotonic
        due = {"poll": clock() + random.uniform(0, sim.worker_poll_s),
               "beat": clock() + random.uniform(0, sim.worker_heartbeat_s)}
        while self.up:
            await asyncio.sleep(max(0.0, min(due.values()) - clock()))
            for what, call, every_s in (("poll", t.worker_poll, sim.worker_poll_s),
                                        ("beat", t.worker_heartbeat, sim.worker_heartbeat_s)):
                if self.up and clock() >= due[what]:
                    subst = self.subst(dict(self.ids))
                    subst.delta = datetime.now(UTC) - t.start_at
                    await self.replay([call], subst)
                    due[what] += every_s

    async def plan(self, windows: list[tuple[str, datetime]]) -> None:
        """Create the planned runs of windows (the recorded bulk entry, once per window); the
        entries the server did not create (a locked SQLite database answers them FAILED in
        its 200) are sent again, as the node's plan does at its next reconcile."""
        t = self.sim.templates
        bulk = next(c for c in t.start if c.path.endswith("/create_flow_run/bulk"))
        for attempt in range(6):
            entries = []
            for schedule, window in windows:
                subst = self.subst(dict(self.ids))
                subst.schedule = (t.plan_schedule, schedule)
                subst.delta = window - t.plan_window
                entries.append(subst.value(t.plan_entry))
            call = TCall(side=bulk.side, method=bulk.method, path=bulk.path, query=bulk.query,
                         headers=bulk.headers, request=entries, response=None, etag="",
                         status=bulk.status)
            answers: list[Any] = []
            await self.replay([call], self.subst(dict(self.ids)), answers=answers)
            found = answers[0] if answers and isinstance(answers[0], dict) else {}
            results = found.get("results") or []
            left = []
            for index, planned in enumerate(windows):
                result = results[index] if index < len(results) else None
                if isinstance(result, dict) and result.get("flow_run_id"):
                    self.planned_runs[planned] = str(result["flow_run_id"])
                else:
                    left.append(planned)
                    why = str(result.get("error") if isinstance(result, dict) else found)[:120]
                    self.sim.plan_errors[why] = self.sim.plan_errors.get(why, 0) + 1
            self.sim.planned += len(windows) - len(left)
            windows = left
            if not windows:
                return
            await asyncio.sleep(min(2 ** attempt, 15))
        self.sim.plan_failed += len(windows)

    async def run_job(self, job: Job) -> None:
        t = self.sim.templates
        delay = (job.window - datetime.now(UTC)).total_seconds()
        if delay > 0:
            await asyncio.sleep(delay)
        while not self.up:  # a node that is down fires when it is back (its catch-up)
            await asyncio.sleep(1)
        subst = self.subst(dict(self.ids))
        subst.schedule = (t.job_schedule, job.schedule)
        subst.delta = job.window - t.job_window
        if t.job_run:  # its planned run, as the node's plan holds it (a new id: never found)
            subst.ids[t.job_run] = self.planned_runs.get((job.schedule, job.window),
                                                         str(uuid.uuid4()))
        job.ended = time.time()
        await self.replay(t.job, subst, job=job)


FINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})


# -- the fleet ----------------------------------------------------------------------------

SCHEDULE_IDS = [f"backup-{n}" for n in range(7)] + ["copy", "prune", "check"]
WAVE_JOBS_PER_NODE_HOUR = 7 / 4 + 1 + 2 / 4
"""The nightly wave's rate per node: seven backups over its four hours, the hourly copy, and
the chain's prune and check (counted inside the wave)."""


class Fleet:
    """N simulated nodes against one layout."""

    def __init__(self, templates: Templates, prefect_root: str, controller_root: str,
                 tokens: dict[str, str], *, reconcile_s: float, plan_ahead_s: float,
                 limit: int = 400, prefect_headers: dict[str, str] | None = None) -> None:
        self.templates = templates
        self.stats = Stats()
        self.sides = {"prefect": Side("prefect", prefect_root, self.stats, limit,
                                      prefect_headers),
                      "controller": Side("controller", controller_root, self.stats, limit)}
        self.nodes = [SimNode(self, name, token) for name, token in tokens.items()]
        self.reconcile_s = reconcile_s
        self.plan_ahead_s = plan_ahead_s
        self.worker_poll_s = 240.0
        self.worker_heartbeat_s = 720.0
        """The node's ``worker_poll`` and ``worker_heartbeat`` (main sets its defaults)."""
        self.rate = 0.0
        self.wave_rate = WAVE_JOBS_PER_NODE_HOUR
        self.reconciles = 0
        self.planned = 0
        self.plan_failed = 0
        """Windows whose planned run was never created (each such job's record fails)."""
        self.plan_errors: dict[str, int] = {}
        """Why the server did not create a planned run, and how often (each try)."""
        self.started = 0
        self.jobs: list[Job] = []
        self.probe: Probe | None = None
        """A person asking the center while the fleet runs (its answers in each measure)."""

    def plan_due(self, node: SimNode) -> list[tuple[str, datetime]]:
        """The windows entering the plan's reach at this reconcile (the fleet's job rate)."""
        expected = self.rate * self.reconcile_s / 3600
        count = int(expected) + (1 if random.random() < expected - int(expected) else 0)
        base = datetime.now(UTC) + timedelta(seconds=self.plan_ahead_s)
        return [(random.choice(SCHEDULE_IDS),
                 (base + timedelta(seconds=random.uniform(0, self.reconcile_s))).replace(
                     second=0, microsecond=0) + timedelta(days=1)) for _ in range(count)]

    async def start_all(self, *, again: bool, spread_s: float, concurrency: int,
                        full: int = 10 ** 9) -> float:
        """Start every node (the first ``full`` with the first start's calls, the others with a
        restart's after the first start's registration: their plan made), at most concurrency
        at once."""
        gate = asyncio.Semaphore(concurrency)
        t0 = time.monotonic()

        async def one(node: SimNode, at: float, warm: bool) -> None:
            await asyncio.sleep(at)
            async with gate:
                await node.start(again=warm)
            self.started += 1

        await asyncio.gather(*(one(node, random.uniform(0, spread_s), again or i >= full)
                               for i, node in enumerate(self.nodes)))
        return time.monotonic() - t0

    async def stop_all(self) -> None:
        await asyncio.gather(*(node.stop() for node in self.nodes))

    async def preplan(self, jobs: list[Job], concurrency: int) -> None:
        """Plan the jobs' windows ahead, as each node's plan holds them (at most concurrency
        nodes' bulk creates at once)."""
        by_node: dict[str, list[Job]] = {}
        for job in jobs:
            by_node.setdefault(job.node, []).append(job)
        gate = asyncio.Semaphore(concurrency)

        async def one(node: SimNode) -> None:
            async with gate:
                await node.plan([(j.schedule, j.window) for j in by_node[node.name]])

        await asyncio.gather(*(one(node) for node in self.nodes if node.name in by_node))

    def wave_jobs(self, begin: datetime, minutes: float, rate: float | None = None
                  ) -> list[Job]:
        """Each node's windows in [begin, begin + minutes) at rate jobs per node-hour (the
        wave's by default; one schedule fires once a minute at most)."""
        jobs = []
        per_node = (self.wave_rate if rate is None else rate) * minutes / 60
        for node in self.nodes:
            count = int(per_node) + (1 if random.random() < per_node - int(per_node) else 0)
            used: set[tuple[str, int]] = set()
            for _ in range(count):
                minute = random.randrange(int(minutes))
                schedule = random.choice(SCHEDULE_IDS)
                if (schedule, minute) in used:
                    continue
                used.add((schedule, minute))
                window = begin + timedelta(minutes=minute, seconds=random.uniform(0, 59))
                jobs.append(Job(node.name, schedule, window.replace(microsecond=0)))
        return jobs


def _cpu(parts: dict[str, int]) -> dict[str, float]:
    return {name: pb.tree_cpu(pid) for name, pid in parts.items()}


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b}


def _group(cpu: dict[str, float]) -> dict[str, float]:
    groups: dict[str, float] = {}
    for name, value in cpu.items():
        group = ("prefect-api" if name.startswith("prefect-api") else
                 "controller" if name.startswith("controller") else name)
        groups[group] = groups.get(group, 0.0) + value
    return groups


RUNS_LIST = {"sort": "START_TIME_DESC", "limit": 50, "offset": 0}
"""The probing user's runs list (the UI's Runs page: the newest 50)."""


class Probe:
    """A person at the center while the fleet runs: every ``every_s``, through the balancers,
    Prefect's health, the flow runs list (the UI's Runs page: the newest 50) and the
    controller's health, one after the other on one kept connection each, in a thread of its
    own (not the simulator's event loop, whose lag would count as the center's)."""

    def __init__(self, layout: Layout, every_s: float = 3.0) -> None:
        self.layout = layout
        self.every_s = every_s
        self.samples: list[tuple[float, str, float, int]] = []
        """(monotonic time asked, what, seconds to the answer, status; 599 no answer)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        import httpx

        prefect = httpx.Client(base_url=self.layout.prefect_root + "/api", timeout=120,
                               headers=self.layout.prefect_headers)
        controller = httpx.Client(base_url=self.layout.controller_root, timeout=120)
        asks: list[tuple[str, httpx.Client, str, str, Any]] = [
            ("health", prefect, "GET", "/health", None),
            ("runs list", prefect, "POST", "/flow_runs/filter", RUNS_LIST),
            ("controller health", controller, "GET", "/healthz", None)]
        with prefect, controller:
            while not self._stop.wait(self.every_s):
                for what, client, method, path, body in asks:
                    begun = time.monotonic()
                    try:
                        status = client.request(method, path, json=body).status_code
                    except httpx.HTTPError:
                        status = 599
                    self.samples.append((begun, what, time.monotonic() - begun, status))

    def summary(self, begin: float, end: float) -> dict[str, dict[str, float]]:
        """Per ask, the answers asked between begin and end (monotonic): their count, p50,
        p99 and max in ms, and how many were not 2xx (599: no answer)."""
        found: dict[str, dict[str, float]] = {}
        for what in ("health", "runs list", "controller health"):
            got = [(s, st) for t, w, s, st in list(self.samples) if w == what and begin <= t < end]
            took = [s for s, _ in got]
            found[what] = {"n": len(got), "p50_ms": pb.percentile(took, 0.5) * 1000,
                           "p99_ms": pb.percentile(took, 0.99) * 1000,
                           "max_ms": max(took) * 1000 if took else float("nan"),
                           "not_2xx": sum(1 for _, st in got if not 200 <= st < 300),
                           "http_5xx": sum(1 for _, st in got if st >= 500)}
        return found


async def measure(sim: Fleet, parts: dict[str, int], seconds: float, label: str
                  ) -> dict[str, Any]:
    """The center's CPU (per part), the requests, their latency and status, for seconds."""
    stats = sim.stats
    before = stats.snapshot()
    lat0 = {k: len(v) for k, v in stats.latency.items()}
    cpu0, self0, t0 = _cpu(parts), _self_cpu(), time.monotonic()
    load0 = os.getloadavg()
    await asyncio.sleep(seconds)
    cpu1, self1, elapsed = _cpu(parts), _self_cpu(), time.monotonic() - t0
    after = stats.snapshot()
    hours = elapsed / 3600
    n = len(sim.nodes)
    cpu = _group(_diff(cpu0, cpu1))
    counts = {k: after["count"][k] - before["count"].get(k, 0) for k in after["count"]}
    statuses = {k: after["status"][k] - before["status"].get(k, 0) for k in after["status"]}
    latency: dict[str, dict[str, float]] = {}
    for side in ("prefect", "controller"):
        values = [x for k, v in stats.latency.items() if k.startswith(side)
                  and "/wait" not in k for x in v[lat0.get(k, 0):]]
        latency[side] = {"p50_ms": pb.percentile(values, 0.5) * 1000,
                         "p99_ms": pb.percentile(values, 0.99) * 1000, "n": len(values)}
    opened = {k: (after["opened"][k] - before["opened"][k]) / hours / n for k in after["opened"]}
    return {
        "label": label, "seconds": elapsed, "nodes": n,
        "load_before": load0, "load_after": os.getloadavg(),
        "center_cores": sum(cpu.values()) / elapsed,
        "parts_cores": {k: v / elapsed for k, v in cpu.items()},
        "sim_cores": (self1 - self0) / elapsed,
        "requests_per_node_hour": {
            side: sum(v for k, v in counts.items() if k.startswith(side)) / hours / n
            for side in ("prefect", "controller")},
        "per_endpoint_per_node_hour": {k: v / hours / n for k, v in counts.items() if v},
        "connections_opened_per_node_hour": opened,
        "latency": latency,
        "status": statuses,
        "http_5xx": sum(v for k, v in statuses.items() if 500 <= k < 599),
        "failed_connections": sum(v for k, v in statuses.items() if k == 599),
        **({"probe": sim.probe.summary(t0, t0 + elapsed)} if sim.probe is not None else {}),
    }


def check_pattern(t: Templates, idle: dict[str, Any], reconcile_s: float, heartbeat_s: float,
                  worker_s: tuple[float, float] = (240.0, 720.0)) -> dict[str, Any]:
    """The simulated nodes' idle calls per endpoint per node-hour against the real node's.

    The real node was recorded with reconcile every ``t.reconcile_s``; its idle calls per
    reconcile, scaled to the simulated interval, its long poll at its heartbeat and its
    worker's poll and heartbeat at ``worker_s``, are what each simulated node must make.
    Tolerance: 25 % per endpoint (the simulated window is a few minutes of reconciles spread
    at random, or three standard deviations of their count)."""
    expected: dict[str, float] = {}
    for key, count in t.counts("reconcile").items():
        expected[key] = count * 3600 / reconcile_s
    for call, every_s in ((t.worker_poll, worker_s[0]), (t.worker_heartbeat, worker_s[1])):
        if call is not None:
            key = endpoint_class(call.side, call.method, call.path, t.node)
            expected[key] = expected.get(key, 0.0) + 3600 / every_s
    got = idle["per_endpoint_per_node_hour"]
    scale = idle["seconds"] / 3600 * idle["nodes"]  # node-hours measured
    rows = {}
    ok = True
    for key, want in expected.items():
        have = got.get(key, 0.0)
        # 25 %, or three standard deviations of a count of random reconciles, if more
        room = max(0.25 * want * scale, 3 * (want * scale) ** 0.5) / scale
        good = abs(have - want) <= room
        ok = ok and good
        rows[key] = {"real": want, "sim": have, "ok": good}
    for key, have in got.items():
        if key not in expected and "/wait" not in key and "create_flow_run/bulk" not in key:
            rows[key] = {"real": 0.0, "sim": have, "ok": False}
            ok = False
    wait = next((k for k in got if k.endswith("/wait")), None)
    if wait:
        want = 3600 / heartbeat_s
        good = abs(got[wait] - want) <= 0.25 * want
        rows[wait] = {"real": want, "sim": got[wait], "ok": good}
        ok = ok and good
    real = {k: v for k, v in t.recorded_rates.items()}
    return {"ok": ok, "rows": rows, "recorded_real_node_per_hour_at_its_interval": real}


# -- the layouts --------------------------------------------------------------------------


@dataclass
class Layout:
    """Where a fleet runs: Prefect's and the controller's addresses, the center's processes."""

    name: str
    prefect_root: str
    controller_root: str
    parts: dict[str, int]
    tokens: dict[str, str]
    stop: Any = None
    logs: dict[str, Path] = field(default_factory=dict)
    """The servers' logs, whose errors each size counts (``server_errors``)."""
    prefect_headers: dict[str, str] = field(default_factory=dict)
    """Headers of every request to Prefect: the scaled layout's auth string, as a node's
    ``PREFECT_API_AUTH_STRING`` sends it."""


def _rows() -> list[Any]:
    from sched_core.model import LocalSchedule

    return [LocalSchedule.model_validate(row) for row in fleet_rows(datetime.now(UTC))]


def seed_rows(db_url: str, names: list[str], threads: int = 4) -> float:
    """Give each node the fleet's ten rows, straight into the controller's database (the
    controller's own code; a setup step, not measured). Nodes that have rows are skipped.
    On PostgreSQL, the seeding connections do not wait for the WAL flush at each commit
    (``synchronous_commit off``: 10,000 nodes' rows took 18 min with it), in a few threads."""
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import event
    from sqlmodel import Session

    from controller.db import make_engine
    from controller.schedules import list_nodes, put_schedule

    t0 = time.monotonic()
    engine = make_engine(db_url)
    if engine.dialect.name == "postgresql":
        def no_flush_wait(connection: Any, _record: Any) -> None:
            with connection.cursor() as cursor:
                cursor.execute("SET synchronous_commit TO off")

        event.listen(engine, "connect", no_flush_wait)
    else:
        threads = 1  # SQLite: one writer at a time anyway
    rows = _rows()

    def seed(part: list[str]) -> None:
        with Session(engine) as session:
            for name in part:
                for row in rows:
                    put_schedule(session, name, row)

    try:
        with Session(engine) as session:
            have = set(list_nodes(session))
        todo = [name for name in names if name not in have]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(seed, [todo[i::threads] for i in range(threads)]))
    finally:
        engine.dispose()
    return time.monotonic() - t0


def node_tokens(names: list[str]) -> dict[str, str]:
    return {name: f"{name}-sim-token-0123456789abcdef" for name in names}


def scaled_layout(names: list[str]) -> Layout:
    """The scaled layout of this worktree (scripts/scaled.py up), its tokens and rows."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "scaled.py"), "up"], env=env,
                   check=True, cwd=ROOT)
    state = json.loads((ROOT / ".scaled" / "layout.json").read_text())
    ports, secrets = state["config"]["ports"], state["secrets"]
    tokens = node_tokens(names)
    path = ROOT / ".scaled" / "controller" / "tokens.toml"
    lines = [f'admin = ["{secrets["admin_token"]}"]', "[nodes]"]
    lines += [f'"{name}" = "{token}"' for name, token in tokens.items()]
    tmp = path.with_suffix(".sim")
    tmp.touch(mode=0o600)
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    seeded = seed_rows(f"postgresql://sched:{secrets['pg_sched']}@127.0.0.1:"
                       f"{ports['postgres']}/sched", names)
    print(f"rows seeded in {seeded:.0f} s", flush=True)
    time.sleep(8)  # the controllers reload the tokens file within a few seconds
    parts = {name: rec["pid"] for name, rec in state["processes"].items() if rec}
    pidfile = ROOT / ".scaled" / "pg" / "data" / "postmaster.pid"
    parts["postgres"] = int(pidfile.read_text().split()[0])  # with its backends (children)
    auth = base64.b64encode(secrets["prefect_auth"].encode()).decode()
    return Layout("scaled", f"http://127.0.0.1:{ports['prefect_lb']}",
                  f"http://127.0.0.1:{ports['controller_lb']}", parts, tokens,
                  prefect_headers={"Authorization": f"Basic {auth}"})


def _controller(folder: Path, prefect_url: str, names: list[str]
                ) -> tuple[subprocess.Popen[bytes], int, dict[str, str]]:
    """One controller on SQLite (``sched controller serve --api-only``) with the nodes' tokens
    and rows, as ``make run`` gives one; return it, its port and the tokens."""

    tokens = node_tokens(names)
    folder.mkdir(parents=True, exist_ok=True)
    tokens_file = folder / "tokens.json"
    tokens_file.write_text(json.dumps({"admin": [Controller.ADMIN], "nodes": {
        name: [token] for name, token in tokens.items()}}))
    tokens_file.chmod(0o600)
    db = f"sqlite:///{folder / 'controller.db'}"
    env = {**os.environ, "PREFECT_API_URL": prefect_url, "SCHED_TOKENS_FILE": str(tokens_file)}
    sched = str(Path(sys.executable).parent / "sched")
    subprocess.run([sched, "controller", "migrate", "--database-url", db], env=env, check=True,
                   capture_output=True)
    seed_rows(db, names)
    port = pb.free_port()
    with (folder / "controller.log").open("ab") as out:
        ctl = subprocess.Popen([sched, "controller", "serve", "--database-url", db, "--port",
                                str(port), "--api-only", "--max-connections",
                                str(len(names) + 1000)], env=env, stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    pb.wait_until(lambda: pb.answers(f"http://127.0.0.1:{port}/healthz"), 60)
    return ctl, port, tokens


def sqlite_layout(work: Path, names: list[str]) -> Layout:
    """One ``prefect server start`` on SQLite (as ``make run``) and one controller (SQLite)."""
    proc, url = pb.start_server(work / "sqlite-prefect")
    ctl, port, tokens = _controller(work / "sqlite-controller", url, names)

    def stop() -> None:
        pb.stop_group(ctl)
        pb.stop_group(proc)

    return Layout("sqlite", url.removesuffix("/api"), f"http://127.0.0.1:{port}",
                  {"prefect-server": proc.pid, "controller": ctl.pid}, tokens, stop,
                  logs={"prefect-server": work / "sqlite-prefect" / "server.log"})


def postgres_layout(work: Path, names: list[str]) -> Layout:
    """One ``prefect server start`` (one API process, its services in it) on a throwaway
    PostgreSQL cluster (scripts/scaled.py's, under work), Prefect's default pool (5 + 10
    overflow), and one controller as in the sqlite layout (SQLite)."""
    from scripts.scaled_parts import config as scaled
    from scripts.scaled_parts import postgres

    work.chmod(0o711)  # the postgres user reaches its cluster under work
    folder = work / "postgres"
    layout = scaled.Layout(folder)
    # Only the cluster's part of the layout's settings is used: its port, max_connections
    # (100, PostgreSQL's default, for one Prefect process of 5 + 10), the databases' secrets.
    layout.create(scaled.config_from_env({
        "SCALED_PG_PORT": str(pb.free_port()), "SCALED_API_COUNT": "1",
        "SCALED_CONTROLLER_COUNT": "0", "SCALED_DB_POOL_SIZE": "5",
        "SCALED_DB_MAX_OVERFLOW": "10", "SCALED_PORT_BASE": str(pb.free_port())}))
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    pg = postgres.Postgres(layout, scaled.Tools.find())
    pg.init()
    pg.start()
    pg.ensure_databases()
    home = work / "postgres-prefect"
    home.mkdir(parents=True, exist_ok=True)
    port = pb.free_port()
    env = pb.server_env(home, port)
    env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = layout.pg_url("prefect", "postgresql+asyncpg")
    with (home / "server.log").open("ab") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
             "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
    url = env["PREFECT_API_URL"]
    if not wait_healthy(url, proc, timeout_s=240):
        pb.stop_group(proc, grace_s=0)
        pg.stop()
        raise SystemExit(f"the Prefect server did not start; see {home / 'server.log'}")
    ctl, ctl_port, tokens = _controller(work / "postgres-controller", url, names)
    pid = pg.pid()
    assert pid is not None

    def stop() -> None:
        pb.stop_group(ctl)
        pb.stop_group(proc)
        pg.stop()

    return Layout("postgres", url.removesuffix("/api"), f"http://127.0.0.1:{ctl_port}",
                  {"prefect-server": proc.pid, "controller": ctl.pid, "postgres": pid}, tokens,
                  stop, logs={"prefect-server": home / "server.log",
                              "postgres": layout.log("postgres")})


# -- one size -----------------------------------------------------------------------------


async def count_completed(sim: Fleet, begin: datetime, end: datetime,
                          state: str = "COMPLETED") -> int:
    """The planned runs of windows in [begin, end) whose state is of type state, in Prefect."""
    body = {"flow_runs": {"tags": {"all_": ["trigger:schedule"]},
                          "state": {"type": {"any_": [state]}},
                          "expected_start_time": {"after_": begin.isoformat(),
                                                  "before_": end.isoformat()}}}
    status, _, answer = await sim.sides["prefect"].call("check", "POST", "/api/flow_runs/count",
                                                        headers={}, body=body, timeout=120)
    return int(answer) if status == 200 and answer is not None else -1


STATE_TYPES = ("SCHEDULED", "PENDING", "RUNNING", "COMPLETED", "FAILED", "CRASHED",
               "CANCELLED", "CANCELLING", "PAUSED")


async def accounted(sim: Fleet, jobs: list[Job], begin: datetime, end: datetime
                    ) -> dict[str, Any]:
    """Where each of jobs' windows ended: the simulated nodes' own count (a final state
    recorded, by HTTP status) and Prefect's (its runs of [begin, end) by state type)."""
    statuses: dict[str, int] = {}
    for job in jobs:
        key = "not recorded" if job.recorded_at is None else str(job.status)
        statuses[key] = statuses.get(key, 0) + 1
    counts = await asyncio.gather(*(count_completed(sim, begin, end, state)
                                    for state in STATE_TYPES))
    in_prefect = dict(zip(STATE_TYPES, counts, strict=True))
    return {"jobs_recorded_by_sim": sum(1 for j in jobs if j.recorded_at is not None),
            "record_status_by_sim": statuses,
            "prefect_runs_by_state": {k: v for k, v in in_prefect.items() if v}}


async def run_size(templates: Templates, layout: Layout, count: int, args: argparse.Namespace,
                   result: dict[str, Any]) -> dict[str, Any]:
    """Measure count nodes on layout into result (filled as each phase ends, so a run stopped
    on the way keeps what it measured)."""
    names = list(layout.tokens)[:count]
    sim = Fleet(templates, layout.prefect_root, layout.controller_root,
                {n: layout.tokens[n] for n in names}, reconcile_s=args.reconcile_s,
                plan_ahead_s=args.plan_ahead_s, prefect_headers=layout.prefect_headers)
    sim.wave_rate = args.jobs_per_node_hour
    sim.worker_poll_s, sim.worker_heartbeat_s = args.worker_poll_s, args.worker_heartbeat_s
    result.update({"nodes": count, "layout": layout.name})
    marks = log_marks(layout)
    sim.probe = Probe(layout)
    sim.probe.start()
    try:
        return await _run_size(sim, templates, layout, count, args, result, marks)
    finally:
        sim.probe.stop()


async def _run_size(sim: Fleet, templates: Templates, layout: Layout, count: int,
                    args: argparse.Namespace, result: dict[str, Any], marks: dict[str, int]
                    ) -> dict[str, Any]:
    assert sim.probe is not None
    cpu0, t0 = _cpu(layout.parts), time.monotonic()
    try:
        start_s = await asyncio.wait_for(
            sim.start_all(again=False, spread_s=min(60.0, count / 20),
                          concurrency=args.start_concurrency, full=args.full_start),
            args.start_timeout_s)
    except TimeoutError:
        start_s = float("nan")
    cpu1 = _cpu(layout.parts)
    result["start"] = {"seconds": start_s, "full_starts": min(count, args.full_start),
                       "center_cpu_s": sum(_diff(cpu0, cpu1).values()),
                       "center_cores": sum(_diff(cpu0, cpu1).values()) / (time.monotonic() - t0),
                       "nodes_started": sim.started,
                       "requests": sum(sim.stats.count.values()),
                       "http_5xx": sum(v for k, v in sim.stats.status.items() if 500 <= k < 599),
                       "status": dict(sim.stats.status), "errors": dict(sim.stats.errors),
                       "probe": sim.probe.summary(t0, time.monotonic())}
    if start_s != start_s:  # NaN: the start did not finish
        return await _ended(sim, layout, result, marks,
                            f"the start did not finish in {args.start_timeout_s:.0f} s: "
                            f"{sim.started:,} of {count:,} nodes started")
    print(f"[{layout.name} {count}] started in {start_s:.0f} s", flush=True)
    # The wave's windows, planned ahead (as the node's plan holds them), then idle minutes.
    wave_begin = (datetime.now(UTC) + timedelta(minutes=args.idle_minutes + 1.5)).replace(
        second=0, microsecond=0)
    jobs = sim.wave_jobs(wave_begin, args.wave_minutes)
    try:
        await asyncio.wait_for(sim.preplan(jobs, args.start_concurrency), args.start_timeout_s)
    except TimeoutError:
        return await _ended(sim, layout, result, marks,
                            f"the wave's plan did not finish in {args.start_timeout_s:.0f} s")
    await asyncio.sleep(20)
    result["idle"] = await measure(sim, layout.parts, args.idle_minutes * 60, "idle")
    print(f"[{layout.name} {count}] idle: {result['idle']['center_cores']:.3f} cores "
          f"{json.dumps(result['idle']['parts_cores'])}, simulator "
          f"{result['idle']['sim_cores']:.2f}", flush=True)
    nodes = {node.name: node for node in sim.nodes}
    tasks = [asyncio.create_task(nodes[job.node].run_job(job)) for job in jobs]
    sim.rate = sim.wave_rate
    await asyncio.sleep(max(0.0, (wave_begin - datetime.now(UTC)).total_seconds()))
    result["wave"] = await measure(sim, layout.parts, args.wave_minutes * 60, "wave")
    after = time.monotonic()
    deadline = after + 180
    while time.monotonic() < deadline and not all(t.done() for t in tasks):
        await asyncio.sleep(1)
    await asyncio.sleep(max(0.0, after + 60 - time.monotonic()))
    sim.rate = 0.0
    result["after_wave_probe"] = sim.probe.summary(after, time.monotonic())
    lags = [j.recorded_at - j.ended for j in jobs if j.recorded_at is not None]
    recorded = await count_completed(sim, wave_begin,
                                     wave_begin + timedelta(minutes=args.wave_minutes))
    if recorded != len(jobs):
        result["wave"]["accounted"] = await accounted(
            sim, jobs, wave_begin, wave_begin + timedelta(minutes=args.wave_minutes))
    result["wave"].update({
        "jobs": len(jobs), "jobs_recorded_by_sim": len(lags), "completed_in_prefect": recorded,
        "planned": sim.planned, "plan_failed": sim.plan_failed, "plan_errors": sim.plan_errors,
        "lag_p50_s": pb.percentile(lags, 0.5), "lag_p99_s": pb.percentile(lags, 0.99),
        "lag_max_s": max(lags) if lags else float("nan"),
        "jobs_per_node_hour": sim.wave_rate})
    print(f"[{layout.name} {count}] wave: {result['wave']['center_cores']:.2f} cores "
          f"{json.dumps(result['wave']['parts_cores'])}, simulator "
          f"{result['wave']['sim_cores']:.2f}; {recorded}/{len(jobs)} recorded, lag p99 "
          f"{result['wave']['lag_p99_s']:.1f} s, 5xx {result['wave']['http_5xx']}", flush=True)
    result["check"] = check_pattern(templates, result["idle"], sim.reconcile_s,
                                    templates.heartbeat_s,
                                    (sim.worker_poll_s, sim.worker_heartbeat_s))
    if args.restart and count == max(args.sizes):
        try:
            result["restart"] = await restart(sim, layout, result["idle"]["center_cores"], args)
        except Exception as exc:  # keep the size's other figures
            result["restart"] = {"error": repr(exc)}
    result["stats_total"] = sim.stats.snapshot()
    result["server_log"] = server_errors(layout, marks)
    for task in tasks:
        task.cancel()
    await sim.stop_all()
    return result


async def _ended(sim: Fleet, layout: Layout, result: dict[str, Any], marks: dict[str, int],
                 why: str) -> dict[str, Any]:
    """A size the layout did not carry: what was measured until then, and why it ended."""
    print(f"[{layout.name} {result['nodes']}] ended: {why}", flush=True)
    result["ended"] = why
    result["stats_total"] = sim.stats.snapshot()
    result["server_log"] = server_errors(layout, marks)
    await sim.stop_all()
    return result


SERVER_ERRORS = {
    "QueuePool limit": "QueuePool limit of size",
    "database is locked": "database is locked",
    "TimeoutError": "TimeoutError",
    "too many clients": "too many clients",
}
"""What a server's log says when it cannot keep up (the key counts lines holding the text)."""


def log_marks(layout: Layout) -> dict[str, int]:
    return {name: path.stat().st_size if path.exists() else 0
            for name, path in layout.logs.items()}


def server_errors(layout: Layout, marks: dict[str, int]) -> dict[str, dict[str, int]]:
    """The lines of each server's log since marks that say it could not keep up."""
    found: dict[str, dict[str, int]] = {}
    for name, path in layout.logs.items():
        if not path.exists():
            continue
        with path.open("rb") as log:
            log.seek(marks.get(name, 0))
            text = log.read().decode("utf-8", "replace")
        counts = {key: sum(1 for line in text.splitlines() if needle in line)
                  for key, needle in SERVER_ERRORS.items()}
        found[name] = {k: v for k, v in counts.items() if v}
    return found


async def restart(sim: Fleet, layout: Layout, idle_cores: float, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """Every node gone, then back within a minute; the center's CPU per 30 s until idle."""
    before_jobs = len([j for j in sim.jobs if j.recorded_at is not None])
    begin = (datetime.now(UTC) + timedelta(seconds=90)).replace(second=0, microsecond=0)
    jobs = sim.wave_jobs(begin, 2, args.restart_jobs_per_node_hour)
    await sim.preplan(jobs, args.start_concurrency)  # the nodes' plans held them before
    nodes = {node.name: node for node in sim.nodes}
    await sim.stop_all()
    tasks = [asyncio.create_task(nodes[j.node].run_job(j)) for j in jobs]
    gone = time.time()
    await asyncio.sleep(20)
    samples = []
    back = asyncio.create_task(sim.start_all(
        again=True, spread_s=args.restart_spread_s,
        concurrency=args.restart_concurrency or args.start_concurrency))
    for _ in range(int(args.restart_minutes * 2)):
        sample = await measure(sim, layout.parts, 30, "restart")
        samples.append({"t_s": time.time() - gone, "cores": sample["center_cores"],
                        "parts": sample["parts_cores"], "http_5xx": sample["http_5xx"],
                        "prefect_p99_ms": sample["latency"]["prefect"]["p99_ms"]})
        print(f"  restart +{samples[-1]['t_s']:.0f} s: {sample['center_cores']:.2f} cores",
              flush=True)
    back_s = await back if back.done() else float("nan")
    back_at = 20 + back_s  # after the stop: the nodes were gone 20 s
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(t.done() for t in tasks):
        await asyncio.sleep(1)
    recorded = await count_completed(sim, begin, begin + timedelta(minutes=2))
    where = await accounted(sim, jobs, begin, begin + timedelta(minutes=2))
    print(f"  restart: {recorded}/{len(jobs)} completed in Prefect; {json.dumps(where)}",
          flush=True)
    idle_again = next((s["t_s"] for s in samples if s["cores"] <= max(idle_cores * 1.25,
                                                                      idle_cores + 0.05)), None)
    return {"samples": samples, "back_in_s": back_s, "idle_cores": idle_cores,
            "idle_again_after_s": idle_again,
            "idle_again_after_back_s": None if idle_again is None or back_at != back_at
            else idle_again - back_at,
            "jobs_per_node_hour": args.restart_jobs_per_node_hour or sim.wave_rate,
            "jobs": len(jobs),
            "completed_in_prefect": recorded, "recorded_before": before_jobs, **where}


# -- the report ---------------------------------------------------------------------------

BEGIN, END = "<!-- fleet:begin -->", "<!-- fleet:end -->"
HEADING = "## A fleet of simulated nodes on each layout (bench/fleet_sim.py)"


def _restart_gate(args: dict[str, Any]) -> Any:
    """The most nodes the simulator let restart at once in a run of these arguments."""
    return args.get("restart_concurrency") or args.get("start_concurrency", "?")


def _f(value: Any, fmt: str = "{:.2f}") -> str:
    try:
        if value != value:  # NaN
            return "-"
        return fmt.format(value)
    except (TypeError, ValueError):
        return "-"


LAYOUT_ORDER = ("sqlite", "postgres", "scaled")
"""The table's order: the smallest layout first."""


def _layouts(found: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    items = [(k, v) for k, v in found.items() if isinstance(v, dict) and "sizes" in v]
    return sorted(items, key=lambda kv: (LAYOUT_ORDER.index(kv[0])
                                         if kv[0] in LAYOUT_ORDER else len(LAYOUT_ORDER)))


RUN_TARGETS = ("Targets (issue 40), per run: every wave window recorded, lag p99 <= 30 s, "
               "0 x 5xx to nodes and to the probing user, the user's health and runs-list "
               "p99 <= 2 s in the wave, center cores in the wave <= 1.2, start <= 300 s, "
               "idle <= 0.5 cores (the controllers <= 0.2).")


def runs_table(found: dict[str, Any]) -> list[str]:
    """One row per run that had a probing user (each run kept, not only the best)."""
    rows = []
    for layout, item in _layouts(found):
        for size, r in item["sizes"].items():
            wave = r.get("wave", {})
            if "probe" not in wave:
                continue
            st, idle = r["start"], r.get("idle", {})
            probe, later = wave["probe"], r.get("after_wave_probe", {})
            ctl = sum(v for k, v in idle.get("parts_cores", {}).items() if "controller" in k)
            restart = r.get("restart", {})
            again = (f"{restart['completed_in_prefect']:,} of {restart['jobs']:,}"
                     if "completed_in_prefect" in restart else "-")

            def p99(side: dict[str, Any], what: str) -> str:
                got = side.get(what, {})
                return (f"{_f(got.get('p99_ms', float('nan')) / 1000, '{:.2f}')} "
                        f"({got.get('http_5xx', 0)})")

            rows.append(
                f"| {layout} | {int(size):,} | {r.get('measured', '')} | "
                f"{_f(idle.get('load_before', [float('nan')])[0], '{:.1f}')}-"
                f"{_f(wave['load_after'][0], '{:.1f}')} | "
                f"{_f(st['seconds'], '{:.0f}')} ({st['http_5xx']}) | "
                f"{_f(idle.get('center_cores'), '{:.3f}')} ({_f(ctl, '{:.3f}')}) | "
                f"{_f(wave['center_cores'], '{:.2f}')} | "
                f"{wave.get('completed_in_prefect', 0):,} of {wave.get('jobs', 0):,} | "
                f"{_f(wave.get('lag_p99_s'), '{:.1f}')} | {wave['http_5xx']} | "
                f"{p99(probe, 'health')} / {p99(probe, 'runs list')} | "
                f"{p99(later, 'health')} / {p99(later, 'runs list')} | {again} |")
    if not rows:
        return []
    return ["", RUN_TARGETS, "",
            "| run | nodes | measured | load (1 min) | start s (5xx) | idle cores (controllers) "
            "| wave cores | windows recorded | lag p99 s | nodes' 5xx in the wave | user in the "
            "wave: health / runs list p99 s (5xx) | user in the minute after | restart: "
            "recorded |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]


def report(found: dict[str, Any]) -> str:
    """The docs section: the method, one table row per layout and size, one row per run with
    a probing user (the rest of each size's figures: :func:`details`)."""
    lines = [
        "`.venv/bin/python bench/fleet_sim.py --layout scaled --nodes 100,1000 --restart` (and "
        "`--layout postgres`, `--layout sqlite`). Layouts: **sqlite**, one `prefect server "
        "start` on SQLite (as `make run`); **postgres**, one `prefect server start` on "
        "PostgreSQL (pool 5 + 10); **scaled**, `scripts/scaled.py up` (PostgreSQL, Redis, 2 "
        "Prefect API processes, the services process, HAProxy, 2 controllers). A real node is "
        "recorded through logging proxies; N simulated nodes in one asyncio process replay its "
        "calls with their own names, ids and times. Each size: start, a few idle minutes (long "
        "poll every 60 s, a reconcile every 15 min), then a slice of the nightly wave at its "
        "peak (3.25 jobs per node-hour). Center CPU is user + system of every process of the "
        "layout; record lag is a job's end to Prefect's answer to its final state.", ""]
    lines += ["| layout | nodes | measured | load (1 min) | idle: center cores | idle: "
              "requests / node-h (Prefect + controller) | conns opened / node-h | wave: center "
              "cores | wave: Prefect p50 / p99 ms | 5xx | windows recorded | record lag p50 / "
              "p99 / max s | sim's own cores (idle, wave) |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for layout, item in _layouts(found):
        for size, r in item["sizes"].items():
            if "ended" in r:
                st = r["start"]
                lines.append(
                    f"| {layout} | {int(size):,} | {r.get('measured', item.get('measured', ''))} | "
                    "- | - | - | - | "
                    f"- | - | {st['http_5xx']:,} (start) | **not carried**: {r['ended']} | - | "
                    "- |")
                continue
            idle, wave = r["idle"], r["wave"]
            req = idle["requests_per_node_hour"]
            conns = idle["connections_opened_per_node_hour"]
            lines.append(
                f"| {layout} | {int(size):,} | {r.get('measured', item.get('measured', ''))} | "
                f"{_f(idle['load_before'][0], '{:.1f}')}-{_f(wave['load_after'][0], '{:.1f}')} | "
                f"{_f(idle['center_cores'], '{:.3f}')} | "
                f"{_f(req['prefect'], '{:.1f}')} + {_f(req['controller'], '{:.1f}')} | "
                f"{_f(conns['prefect'], '{:.1f}')} + {_f(conns['controller'], '{:.1f}')} | "
                f"{_f(wave['center_cores'], '{:.3f}')} | "
                f"{_f(wave['latency']['prefect']['p50_ms'], '{:.0f}')} / "
                f"{_f(wave['latency']['prefect']['p99_ms'], '{:.0f}')} | "
                f"{idle['http_5xx'] + wave['http_5xx']} | "
                f"{wave['completed_in_prefect']:,} of {wave['jobs']:,} | "
                f"{_f(wave['lag_p50_s'], '{:.1f}')} / {_f(wave['lag_p99_s'], '{:.1f}')} / "
                f"{_f(wave['lag_max_s'], '{:.1f}')} | "
                f"{_f(idle['sim_cores'], '{:.2f}')}, {_f(wave['sim_cores'], '{:.2f}')} |")
    lines += runs_table(found)
    return "\n".join(lines)


def details(found: dict[str, Any]) -> str:
    """Each size's start, parts, pattern check and restart, and the machine (printed at the
    end of a run; the findings written by hand are in ``bench/fleet_sim_findings.md``)."""
    lines: list[str] = []
    for layout, item in _layouts(found):
        for size, r in item["sizes"].items():
            st = r["start"]
            logged = "; ".join(f"{name}: " + ", ".join(f"{k} {v:,}" for k, v in c.items())
                               for name, c in r.get("server_log", {}).items() if c)
            logged = f" The servers' logs: {logged}." if logged else ""
            if "ended" in r:
                statuses = ", ".join(f"{k}: {v:,}" for k, v in sorted(
                    st.get("status", {}).items(), key=lambda kv: int(kv[0])))
                errors = ", ".join(f"{k} {v:,}" for k, v in st.get("errors", {}).items())
                lines.append(
                    f"- **{layout}, {int(size):,} nodes: where the layout ends.** "
                    f"{r['ended'][:1].upper()}{r['ended'][1:]}; "
                    f"{st['center_cpu_s']:.0f} s of center CPU "
                    f"({st.get('center_cores', float('nan')):.2f} cores), {st['requests']:,} "
                    f"requests, answers by status: {statuses} (599: no answer, the simulator's "
                    f"own mark), connection errors: {errors or 'none'}.{logged}")
                continue
            parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(
                r["wave"]["parts_cores"].items()))
            idle_parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(
                r["idle"]["parts_cores"].items()))
            run_args = r.get("args") or item.get("args", {})  # a kept size's own, else the run's
            config = "; ".join(run_args.get("node_config") or [])
            config = f" The recorded node's configuration added `{config}`." if config else ""
            lines.append(
                f"- **{layout}, {int(size):,} nodes.**{config} Start: {st['seconds']:.0f} s, "
                f"{st['center_cpu_s']:.0f} s of center CPU, {st['requests']:,} requests, "
                f"{st['http_5xx']:,} answered 5xx (each asked again); "
                f"{st.get('full_starts', int(size)):,} made a first start's calls (30 planned "
                "runs each), the others a restart's. Idle cores by part: "
                f"{idle_parts}. Wave cores by part: {parts}. Pattern check against the real node: "
                f"{'passed' if r['check']['ok'] else 'FAILED'} ("
                + "; ".join(f"{k.split(' ', 1)[1]} real {v['real']:.1f}, sim {v['sim']:.1f}"
                            for k, v in r["check"]["rows"].items()) + " per node-hour)."
                + logged)
            rs = r.get("restart")
            if rs and "samples" in rs:
                samples = ", ".join(f"+{s['t_s']:.0f} s {s['cores']:.2f}" for s in rs["samples"])
                lines.append(
                    f"- **Fleet-wide restart, {layout}, {int(size):,} nodes**: every node "
                    f"stopped for 20 s, then back, spread over "
                    f"{run_args.get('restart_spread_s', 60):.0f} s with at most "
                    f"{_restart_gate(run_args)} starting at once "
                    "(the simulator's gate): "
                    + (f"the last was back {rs['back_in_s']:.0f} s after the first "
                       if rs["back_in_s"] == rs["back_in_s"] else
                       "not every node was back by the end of the minutes measured ")
                    + "(a restart's calls each); "
                    f"center cores per 30 s after the stop: {samples} (idle "
                    f"{rs['idle_cores']:.3f}); back at idle after "
                    + (f"{rs['idle_again_after_s']:.0f} s" if rs["idle_again_after_s"]
                       else "more than the minutes measured")
                    + (f" ({rs['idle_again_after_back_s']:.0f} s after the last node was back)"
                       if rs.get("idle_again_after_back_s") is not None else "")
                    + (f"; windows at {rs['jobs_per_node_hour']:g} a node-hour"
                       if "jobs_per_node_hour" in rs else "")
                    + f"; windows in the restart's two minutes recorded: "
                    f"{rs['completed_in_prefect']} of {rs['jobs']}"
                    + (f" (counted 2 minutes after the last sample; the simulated nodes' own "
                       f"count by answer: {rs['record_status_by_sim']}; Prefect's runs of "
                       f"those windows by state: {rs['prefect_runs_by_state']})"
                       if "record_status_by_sim" in rs else "") + ".")
            elif rs:
                lines.append(f"- Fleet-wide restart, {layout}, {size}: {rs}")
    lines += ["", f"Machine: {pb.machine().split(', load average')[0]} (each run's load average "
              "in the table: 1-minute figure before its idle minutes and after its wave).", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layout", choices=["scaled", "postgres", "sqlite"], default="scaled")
    parser.add_argument("--nodes", default="100")
    parser.add_argument("--idle-minutes", type=float, default=3)
    parser.add_argument("--wave-minutes", type=float, default=5)
    parser.add_argument("--reconcile-s", type=float, default=0.0,
                        help="the simulated nodes' reconcile interval (default: the node's)")
    parser.add_argument("--plan-ahead-s", type=float, default=3600.0)
    parser.add_argument("--start-concurrency", type=int, default=100)
    parser.add_argument("--jobs-per-node-hour", type=float, default=WAVE_JOBS_PER_NODE_HOUR)
    parser.add_argument("--full-start", type=int, default=10 ** 9,
                        help="nodes making a first start's calls (the rest a restart's)")
    parser.add_argument("--start-timeout-s", type=float, default=900,
                        help="a size whose start (or plan) takes longer ends there, recorded")
    parser.add_argument("--restart", action="store_true")
    parser.add_argument("--restart-spread-s", type=float, default=60)
    parser.add_argument("--restart-minutes", type=float, default=3)
    parser.add_argument("--restart-jobs-per-node-hour", type=float, default=None,
                        help="the rate of the windows run through the restart (default: the "
                        "wave's); each must be recorded")
    parser.add_argument("--restart-concurrency", type=int, default=0,
                        help="nodes restarting at once (default: --start-concurrency); real "
                        "nodes come back on their own, so make it large enough that the "
                        "spread, not the gate, sets when they are back")
    parser.add_argument("--recording", type=Path, help="use this recording (development)")
    parser.add_argument("--label", default="",
                        help="the run's name in the results and the table (default: the "
                        "layout's), e.g. 'scaled, lean record' beside 'scaled'")
    parser.add_argument("--node-config", action="append", default=[], metavar="TOML",
                        help="a line added to the recorded node's configuration, e.g. "
                        "'record_task_run = false' (repeatable; the simulated nodes replay "
                        "what that node sent)")
    parser.add_argument("--record-only", type=Path)
    parser.add_argument("--save-recording", type=Path)
    parser.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md")
    parser.add_argument("--report-only", action="store_true",
                        help="write the docs section from the results file and stop")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "fleet_sim.json")
    args = parser.parse_args()
    args.sizes = [int(n) for n in args.nodes.split(",")]
    if args.report_only:
        pb.write_section(BEGIN, END, HEADING, report(json.loads(args.out.read_text())))
        return 0
    import tempfile

    from sched_node.settings import AgentSettings

    if not args.reconcile_s:
        args.reconcile_s = AgentSettings.model_fields["reconcile_interval"].default.total_seconds()
    args.worker_poll_s = AgentSettings.model_fields["worker_poll"].default.total_seconds()
    args.worker_heartbeat_s = AgentSettings.model_fields["worker_heartbeat"].default.total_seconds()
    work = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
    if args.recording:
        found = json.loads(args.recording.read_text())
    else:
        print("recording a real node ...", flush=True)
        found = record(work, node_config="".join(line + "\n" for line in args.node_config))
    if args.record_only:
        args.record_only.write_text(json.dumps(found, indent=1, default=str))
        return 0
    if args.save_recording:
        args.save_recording.write_text(json.dumps(found, default=str))
    templates = build_templates(found)
    names = [f"fleet-{n:05d}" for n in range(max(args.sizes))]
    layout = (scaled_layout(names) if args.layout == "scaled" else
              postgres_layout(work, names) if args.layout == "postgres" else
              sqlite_layout(work, names))
    results: dict[str, Any] = {"layout": args.layout, "reconcile_s": args.reconcile_s,
                               "recording": str(args.recording or "made in this run"),
                               "args": {k: v for k, v in vars(args).items()
                                        if isinstance(v, (int, float, str, list))},
                               "heartbeat_s": templates.heartbeat_s,
                               "templates": {k: templates.counts(k) for k in
                                             ("start", "restart", "reconcile", "job")},
                               "sizes": {}}
    def save() -> None:
        """This run's sizes into the layout's entry: a size measured again is replaced, the
        layout's other sizes are kept (each with the time and the arguments it was measured
        with)."""
        existing = json.loads(args.out.read_text()) if args.out.exists() else {}
        old = existing.get(args.label or args.layout, {})
        sizes = {size: {"measured": old.get("measured", ""), "args": old.get("args", {}), **r}
                 for size, r in old.get("sizes", {}).items() if size not in results["sizes"]}
        sizes.update(results["sizes"])
        existing[args.label or args.layout] = {**results, "sizes": dict(sorted(
            sizes.items(), key=lambda kv: int(kv[0]))),
            "measured": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "load_at_end": os.getloadavg()}
        args.out.write_text(json.dumps(existing, indent=1, default=str) + "\n")

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped run saves too
    try:
        for size in args.sizes:
            entry: dict[str, Any] = {"stopped": "before the end (partial figures)"}
            results["sizes"][str(size)] = entry
            try:
                asyncio.run(run_size(templates, layout, size, args, entry))
                entry.pop("stopped")
            finally:
                entry["measured"] = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
                print(json.dumps(entry, default=str)[:3000], flush=True)
                save()  # each size as soon as it is measured, or as far as it got
    finally:
        if layout.stop is not None:
            layout.stop()
        else:  # the scaled layout stays up to be looked at; a later run must not share it
            print("the scaled layout is still up (its logs in .scaled/logs): stop it with "
                  "`scripts/scaled.py down` before measuring anything else", flush=True)
    found = json.loads(args.out.read_text())
    print(details(found), flush=True)
    if not args.no_write:
        pb.write_section(BEGIN, END, HEADING, report(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
