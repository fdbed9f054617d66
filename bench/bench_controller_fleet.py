"""The controller under a fleet: 10,000 nodes' long polls, pulls and reports, and a change storm.

Two measurements, each printed and (``--write-docs``) written into
``docs/benchmarks.md`` between its own markers.

``ceiling`` (``<!-- fleet-ceiling:begin -->``): what one ``serve --api-only``
process answers with a **new TCP connection per request**, as nodes pull. A
throwaway PostgreSQL (pgserver) holds ``--nodes`` nodes (2 rows each) and a
tokens file with one token per node, as a fleet's controller has them. Each
server (``--before-tree DIR``: also one running the code in DIR, e.g. ``git
archive`` of the commit before a fix, started beside this tree's, in the same
run) gets, for ``--seconds`` each, a closed loop of ``--concurrency`` asyncio
clients, each opening a connection, sending one request, reading the answer
and closing: ``GET /healthz`` (the baseline: no auth, one single-row read),
the node's pull with ``If-None-Match`` (304) and without (200, the cached
body). Per row: requests/s, p50/p99 (connect included), the server's CPU per
request (``/proc/<pid>/stat`` before and after) and its cores in use, and the
ratios to the baseline. Last, the same 304 pull from 8 threads that each make
a new ``httpx.Client`` per pull (what a load script written with
``with httpx.Client() as c: c.get(...)`` does): the client's CPU, not the
server's, sets that rate.

``fleet`` (``<!-- fleet-storm:begin -->``): ``--nodes`` simulated nodes in one
asyncio process against running controllers (``--scaled DIR``: the scaled
layout's instances, each node pinned to one of them by its index, as a
balancer would keep it; or ``--controller URL,...`` with ``--admin-token``).
Each node does what ``sched_node/channel.py``, ``sched_node/control.py``,
``sched_node/reconcile.py`` and ``sched_node/node_report.py`` do:

- at its start (the fleet is started over ``--ramp`` seconds) one pull (200)
  and one report;
- holds the long poll ``GET /api/nodes/<node>/wait?etag=&seen=&timeout=60`` on
  one kept-alive connection, renewed at once after each answer, with the ETag
  of the list it holds; an answer with another ETag pokes its reconciler, and
  the next wait goes out at once (with the ETag it still holds until its pull
  is done, which the controller answers at once: counted as *stale waits*);
- its reconciler pulls (``If-None-Match``, a **new connection** each time:
  ``reconcile_interval`` is 900 s, far past the controller's 5 s keep-alive)
  when poked and every 900 s (the first at a random point of the first 900 s);
  a poke during a pull makes one more pull, as the node's event does;
- its reporter posts ``POST /api/nodes/<node>/report`` (a new connection, as
  ``httpx.post``) 1 s after each reconcile, and every 15 minutes anyway.

After ``--settle`` seconds of quiet (the baseline), the storm: for
``--storm-minutes``, every minute 1 % of the nodes (chosen at random, spread
evenly over the minute) get a schedule change, an admin
``PUT /api/nodes/<node>/schedules/<id>`` sent round-robin over the instances
(so half of them land on the instance the node does not wait on, and reach it
through the controllers' relay of Prefect's events). Measured in the storm
window: pull latency p50/p99 (200 and 304, connect included), report and PUT
latency, the **wake latency** (the PUT sent to the node's wait answering with
the new ETag; same instance and across instances), the change-to-pulled
latency, every 5xx and connection error, the controllers' CPU (``/proc``) and
the load average (sampled every 10 s).

Run: ``bench/bench_controller_fleet.py ceiling [--before-tree DIR] [--write-docs]``;
``SCALED_CONTROLLER_MAX_CONNECTIONS=12000 scripts/scaled.py up`` then
``bench/bench_controller_fleet.py fleet --scaled .scaled [--write-docs]``
(it adds the nodes' tokens to the layout's tokens file and puts the original back
at the end). Wrap measured runs in ``flock /tmp/bench.lock``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.bench_controller_api import make_row, stop_server, temporary_postgres
from bench.prefect_bench import publish

ROOT = Path(__file__).resolve().parent.parent

CEILING = ("<!-- fleet-ceiling:begin -->", "<!-- fleet-ceiling:end -->")
STORM = ("<!-- fleet-storm:begin -->", "<!-- fleet-storm:end -->")
HEARTBEAT_S = 60.0
RECONCILE_S = 900.0
REPORT_EVERY_S = 900.0
REPORT_DEBOUNCE_S = 1.0
TIMEOUT_S = HEARTBEAT_S + 15


# --- a small HTTP/1.1 client (asyncio streams): one request, Content-Length bodies -------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def request_bytes(method: str, target: str, host: str, headers: dict[str, str] | None = None,
                  body: bytes = b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("PUT", "POST"):
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   raw: bytes) -> Answer:
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return Answer(status, headers, body)


async def once(host: str, port: int, raw: bytes, timeout: float = 30.0) -> Answer:
    """Open a connection, send raw, read the answer, close (a new connection per request)."""
    async def go() -> Answer:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            return await exchange(reader, writer, raw)
        finally:
            writer.close()
    return await asyncio.wait_for(go(), timeout)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def proc_cpu(pid: int) -> float:
    """Return the CPU seconds (user + system) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def node_name(index: int) -> str:
    return f"fleet-n{index:05d}"


def node_token(index: int) -> str:
    return f"fleet-tok-{index:05d}-{uuid.UUID(int=index).hex}"


def populate(url: str, count: int, rows_per_node: int = 2) -> None:
    """Store count nodes' rows and revisions (bulk), replacing any fleet-n* rows."""
    from sqlalchemy import delete, insert
    from sqlmodel import Session

    from controller.db import make_engine, migrate
    from controller.models import AgentSchedule, NodeRevision
    from controller.schedules import stored_values

    migrate(url)
    engine = make_engine(url)
    try:
        with Session(engine) as session:
            for table in (AgentSchedule.__table__, NodeRevision.__table__):  # type: ignore[attr-defined]
                session.execute(delete(table).where(table.c.node.like("fleet-n%")))
            rows = [stored_values(node_name(i), make_row(i * rows_per_node + j), version=1)
                    for i in range(count) for j in range(rows_per_node)]
            for start in range(0, len(rows), 5000):
                session.execute(insert(AgentSchedule.__table__), rows[start:start + 5000])  # type: ignore[attr-defined]
            session.execute(insert(NodeRevision.__table__), [  # type: ignore[attr-defined]
                {"node": node_name(i), "epoch": uuid.uuid4().hex[:16], "revision": 1}
                for i in range(count)])
            session.commit()
    finally:
        engine.dispose()


def tokens_toml(admin: list[str], count: int) -> str:
    lines = [f"admin = {json.dumps(admin)}", "[nodes]"]
    lines += [f'{node_name(i)} = "{node_token(i)}"' for i in range(count)]
    return "\n".join(lines) + "\n"


def write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".bench-tmp")
    tmp.touch(mode=0o600)
    tmp.chmod(0o600)
    tmp.write_text(text)
    tmp.replace(path)


# --- ceiling --------------------------------------------------------------------------------


ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"


def served_in_turns(url: str, folder: Path, nodes: int, servers: list[tuple[str, Path]],
                    rounds: int, loads: list[tuple[float, float, float]]
                    ) -> Iterator[tuple[int, str, Path, int, int]]:
    """Seed nodes (their rows and one token each, the token file in folder), then serve each
    of servers' trees in turns (``serve``, the fleet watch off), rounds times: yield (round,
    name, tree, port, pid) while each serves; append the load average after each round."""
    populate(url, nodes)
    tokens = folder / "tokens.toml"
    write_private(tokens, tokens_toml([ADMIN_TOKEN], nodes))
    for rnd in range(rounds):
        for name, tree in servers:
            with serve(tree, url, tokens, "--watch-interval", "0") as (port, pid):
                yield rnd, name, tree, port, pid
        loads.append(os.getloadavg())


@contextmanager
def serve(tree: Path, url: str, tokens_file: Path, *flags: str) -> Iterator[tuple[int, int]]:
    """Run ``serve --api-only`` from tree's code; yield (port, pid)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SCHED_", "PREFECT_API_URL"))}
    env.update(SCHED_DATABASE_URL=url, SCHED_TOKENS_FILE=str(tokens_file),
               PYTHONPATH=str(tree))
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from controller.cli import app; app()", "serve", "--api-only",
         "--port", str(port), "--log-level", "info", *flags],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited: {log.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up within 90 s")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        time.sleep(1.0)
        yield port, proc.pid
    finally:
        stop_server(proc)
        log.close()


@dataclass
class Row:
    server: str
    kind: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    server_cpu_s: float
    statuses: dict[str, int]
    client_cpu_s: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms(self) -> float:
        return self.server_cpu_s / max(1, self.requests) * 1000

    @property
    def cores(self) -> float:
        return self.server_cpu_s / self.seconds


async def closed_loop(port: int, make: Callable[[int], bytes], *, concurrency: int,
                      seconds: float) -> tuple[list[float], Counter[str], float]:
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    stop = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        count = 0
        while time.perf_counter() < stop:
            raw = make(index * 7919 + count)
            count += 1
            started = time.perf_counter()
            try:
                answer = await once("127.0.0.1", port, raw)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                statuses[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - started)
            statuses[str(answer.status)] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies, statuses, time.perf_counter() - started


def etags_of(port: int, count: int) -> list[str]:
    async def go() -> list[str]:
        found = []
        for i in range(count):
            answer = await once("127.0.0.1", port, request_bytes(
                "GET", f"/api/schedules?node={node_name(i)}", "127.0.0.1",
                {"authorization": f"Bearer {node_token(i)}"}))
            assert answer.status == 200, answer
            found.append(answer.headers["etag"])
        return found
    return asyncio.run(go())


def measure_ceiling(name: str, port: int, pid: int, *, nodes: int, concurrency: int,
                    seconds: float) -> list[Row]:
    sample = min(nodes, 200)
    etags = etags_of(port, sample)

    def pull(conditional: bool) -> Callable[[int], bytes]:
        def make(n: int) -> bytes:
            i = n % sample
            headers = {"authorization": f"Bearer {node_token(i)}"}
            if conditional:
                headers["if-none-match"] = etags[i]
            return request_bytes("GET", f"/api/schedules?node={node_name(i)}", "127.0.0.1",
                                 headers)
        return make

    kinds: list[tuple[str, Callable[[int], bytes]]] = [
        ("GET /healthz (baseline)", lambda n: request_bytes("GET", "/healthz", "127.0.0.1")),
        ("pull, If-None-Match, 304", pull(True)),
        ("pull, 200 (cached body)", pull(False)),
    ]
    rows = []
    for kind, make in kinds:
        before = proc_cpu(pid)
        latencies, statuses, elapsed = asyncio.run(
            closed_loop(port, make, concurrency=concurrency, seconds=seconds))
        rows.append(Row(name, kind, len(latencies), elapsed, pct(latencies, 0.5) * 1000,
                        pct(latencies, 0.99) * 1000, proc_cpu(pid) - before, dict(statuses)))
        print(f"  {name}: {kind}: {rows[-1].rps:,.0f}/s p99 {rows[-1].p99_ms:.1f} ms "
              f"cpu {rows[-1].cpu_ms:.2f} ms/request {rows[-1].cores:.2f} core", flush=True)
    return rows


def httpx_client_per_pull(name: str, port: int, pid: int, *, seconds: float,
                          threads: int = 8) -> Row:
    """The 304 pull from threads that each make a new httpx.Client per pull."""
    import httpx

    etag = etags_of(port, 1)[0]
    url = f"http://127.0.0.1:{port}/api/schedules?node={node_name(0)}"
    headers = {"authorization": f"Bearer {node_token(0)}", "if-none-match": etag}
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    stop = time.perf_counter() + seconds

    def work() -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            with httpx.Client(headers=headers) as client:
                status = client.get(url).status_code
            latencies.append(time.perf_counter() - started)
            statuses[str(status)] += 1

    before, client_before = proc_cpu(pid), time.process_time()
    started = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    return Row(name, f"pull 304, a new httpx.Client per pull ({threads} threads)",
               len(latencies), elapsed, pct(latencies, 0.5) * 1000, pct(latencies, 0.99) * 1000,
               proc_cpu(pid) - before, dict(statuses), time.process_time() - client_before)


def ceiling(args: argparse.Namespace) -> None:
    loads = [os.getloadavg()]
    servers: list[tuple[str, Path]] = []
    if args.before_tree:
        servers.append((args.before_label, Path(args.before_tree).resolve()))
    servers.append((args.after_label, ROOT))
    rows: list[Row] = []
    with temporary_postgres() as url, tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for rnd, name, tree, port, pid in served_in_turns(url, Path(tmp), args.nodes, servers,
                                                          args.rounds, loads):
            rows += measure_ceiling(name, port, pid, nodes=args.nodes,
                                    concurrency=args.concurrency, seconds=args.seconds)
            if rnd == args.rounds - 1 and tree == ROOT:
                rows.append(httpx_client_per_pull(name, port, pid, seconds=args.seconds))
                print(f"  {rows[-1].kind}: {rows[-1].rps:,.0f}/s, client "
                      f"{rows[-1].client_cpu_s / rows[-1].seconds:.2f} core, server "
                      f"{rows[-1].cores:.2f} core", flush=True)
    section = render_ceiling(rows, args, loads)
    publish(section, *CEILING, "## The controller's pulls, a new connection each",
            write=args.write_docs)


def render_ceiling(rows: list[Row], args: argparse.Namespace,
                   loads: list[tuple[float, float, float]]) -> str:
    merged: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in rows:
        merged[(row.server, row.kind)].append(row)
    lines = [
        f"`bench/bench_controller_fleet.py ceiling`: one `sched controller serve --api-only` "
        f"process on PostgreSQL (pgserver, Unix socket) with {args.nodes:,} nodes (2 rows each) "
        f"and one token per node; {args.concurrency} asyncio clients in a closed loop, each "
        f"request on a new TCP connection (connect, request, answer, close) for "
        f"{args.seconds:g} s per row, {args.rounds} round(s) alternating the servers "
        "(figures summed over rounds). Server CPU from `/proc/<pid>/stat`; logging at `info` "
        "(one access-log line per request, as deployed); the fleet watch off "
        "(`--watch-interval 0`: its pass over the nodes every 15 s would count in the "
        "requests' CPU).",
        "",
        "| server | request | requests | req/s | p50 ms | p99 ms | server CPU ms/request "
        "| server cores | req/s vs baseline | CPU vs baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes: list[str] = []
    for server in dict.fromkeys(r.server for r in rows):
        base_rows = merged[(server, "GET /healthz (baseline)")]
        base = _sum(base_rows)
        for (srv, _kind), group in merged.items():
            if srv != server:
                continue
            row = _sum(group)
            lines.append(
                f"| {server} | {row.kind} | {row.requests:,} | {row.rps:,.0f} | {row.p50_ms:.1f} "
                f"| {row.p99_ms:.1f} | {row.cpu_ms:.2f} | {row.cores:.2f} "
                f"| {row.rps / base.rps:.2f} | {row.cpu_ms / base.cpu_ms:.2f} |")
            if row.client_cpu_s:
                notes.append(
                    f"- {row.kind}: the client used {row.client_cpu_s / row.seconds:.2f} core, "
                    f"{row.client_cpu_s / max(1, row.requests) * 1000:.1f} ms of CPU per "
                    f"request, while the server used {row.cores:.2f} core.")
    statuses: Counter[str] = Counter()
    for row in rows:
        statuses.update(row.statuses)
    lines += ["", *notes, ""] if notes else [""]
    lines += [
        f"Answers: {dict(statuses)}. Load average (1 min) at the start and after each server: "
        + ", ".join(f"{load[0]:.2f}" for load in loads)
        + f". Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, "
        f"Python {platform.python_version()}.",
    ]
    return "\n".join(lines)


def _sum(group: list[Row]) -> Row:
    first = group[0]
    return Row(first.server, first.kind, sum(r.requests for r in group),
               sum(r.seconds for r in group),
               statistics.median(r.p50_ms for r in group), max(r.p99_ms for r in group),
               sum(r.server_cpu_s for r in group), {}, sum(r.client_cpu_s for r in group))


# --- fleet ----------------------------------------------------------------------------------


@dataclass
class Target:
    host: str
    port: int
    pid: int | None = None
    name: str = ""


@dataclass
class Metrics:
    window: tuple[float, float] | None = None
    pulls: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    reports: list[float] = field(default_factory=list)
    puts: list[float] = field(default_factory=list)
    wakes: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    pulled: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    waits: Counter[str] = field(default_factory=Counter)
    missed_wakes: int = 0

    def inside(self, at: float) -> bool:
        return self.window is not None and self.window[0] <= at <= self.window[1]


class Node:
    """One simulated node (the module's rules)."""

    def __init__(self, index: int, target: Target, fleet: Fleet) -> None:
        self.index = index
        self.name = node_name(index)
        self.token = node_token(index)
        self.target = target
        self.fleet = fleet
        self.etag = ""
        self.seen = ""
        self.poked = asyncio.Event()
        self.report_poke = asyncio.Event()
        self.changed_at: float | None = None
        self.changed_via_same = True
        self.woken = False
        self.told = ""

    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    async def request(self, kind: str, raw: bytes) -> Answer | None:
        fleet, m = self.fleet, self.fleet.metrics
        started = time.perf_counter()
        try:
            answer = await once(self.target.host, self.target.port, raw)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            m.errors[f"{kind}: {type(exc).__name__}"] += 1
            return None
        elapsed = time.perf_counter() - started
        m.statuses[f"{kind} {answer.status}"] += 1
        if m.inside(started) and not fleet.stopping:
            if kind == "pull":
                m.pulls[str(answer.status)].append(elapsed)
            elif kind == "report":
                m.reports.append(elapsed)
        return answer

    async def pull(self) -> None:
        headers = self.auth()
        if self.etag:
            headers["if-none-match"] = self.etag
        answer = await self.request("pull", request_bytes(
            "GET", f"/api/schedules?node={self.name}", self.target.host, headers))
        if answer is not None and answer.status in (200, 304):
            if answer.status == 200:
                self.etag = answer.headers.get("etag", "")
                if self.changed_at is not None and self.woken:
                    now = time.perf_counter()
                    if self.fleet.metrics.inside(self.changed_at):
                        self.fleet.metrics.pulled.append(now - self.changed_at)
                    self.changed_at = None

    async def report(self) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = json.dumps({
            "agent_version": "0.1.0", "timezone": "America/New_York", "grace_s": 3600.0,
            "reported_at": now, "heartbeat_s": HEARTBEAT_S,
            "last_pull": {"at": now, "ok": True, "status": "304"},
            "schedules": [{"id": f"s-{self.index * 2 + j:05d}", "last_fired": None,
                           "next_planned": None, "latest_job": None} for j in range(2)],
            "counts": {"skipped": 0, "missed": 0}, "jobs": [],
        }).encode()
        headers = {**self.auth(), "content-type": "application/json"}
        await self.request("report", request_bytes(
            "POST", f"/api/nodes/{self.name}/report", self.target.host, headers, body))

    async def run(self, start_delay: float) -> None:
        await asyncio.sleep(start_delay)
        await self.pull()
        await self.report()
        tasks = [asyncio.create_task(self.wait_loop()), asyncio.create_task(self.reconciler()),
                 asyncio.create_task(self.reporter())]
        await self.fleet.stop_event.wait()
        pending = set(tasks)
        while pending:
            # Again while any is left: Python 3.11's wait_for can swallow a cancel that lands
            # as the wait it guards ends (a 10-minute run hung here, its result lost).
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=5)

    async def wait_loop(self) -> None:
        m = self.fleet.metrics
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        backoff = 1.0
        while True:
            # As sched_node.control.ControllerWait: told of a version its pull has not brought
            # yet, the node waits on that version.
            target = (f"/api/nodes/{self.name}/wait?etag={self.told or self.etag}"
                      f"&seen={self.seen}"
                      f"&timeout={HEARTBEAT_S:g}").replace('"', "%22")
            raw = request_bytes("GET", target, self.target.host, self.auth())
            sent_with = self.told or self.etag
            try:
                if conn is None:
                    conn = await asyncio.open_connection(self.target.host, self.target.port)
                answer = await asyncio.wait_for(exchange(*conn, raw), TIMEOUT_S)
            except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                m.errors[f"wait: {type(exc).__name__}"] += 1
                if conn is not None:
                    conn[1].close()
                conn = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            if answer.headers.get("connection", "").lower() == "close":
                conn[1].close()
                conn = None
            m.statuses[f"wait {answer.status}"] += 1
            if answer.status != 200:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 1.0
            data = json.loads(answer.body)
            etag = str(data.get("etag") or "")
            if etag and etag != self.etag:
                if sent_with and etag_quoted(sent_with) != etag_quoted(etag) \
                        and not self.woken and self.changed_at is not None:
                    self.woken = True
                    if m.inside(self.changed_at):
                        key = "same instance" if self.changed_via_same else "other instance"
                        m.wakes[key].append(time.perf_counter() - self.changed_at)
                m.waits["answered: stale" if etag == self.told else "answered: changed"] += 1
                self.told = etag
                self.poked.set()
            else:
                m.waits["answered: unchanged"] += 1
                self.told = ""
            prefect = str(data.get("prefect") or "")
            if prefect:
                self.seen = prefect

    async def reconciler(self) -> None:
        first = random.uniform(0, RECONCILE_S)
        deadline = time.monotonic() + first
        while True:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.poked.wait(), max(0.0, deadline - time.monotonic()))
            self.poked.clear()
            await self.pull()
            deadline = time.monotonic() + RECONCILE_S
            self.report_poke.set()

    async def reporter(self) -> None:
        while True:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.report_poke.wait(), REPORT_EVERY_S)
            if self.report_poke.is_set():
                await asyncio.sleep(REPORT_DEBOUNCE_S)
            self.report_poke.clear()
            await self.report()


def etag_quoted(value: str) -> str:
    return value if value.startswith('"') else f'"{value}"'


class Fleet:
    def __init__(self, targets: list[Target], admin_token: str, count: int) -> None:
        self.targets = targets
        self.admin_token = admin_token
        self.metrics = Metrics()
        self.stop_event = asyncio.Event()
        self.stopping = False
        self.nodes = [Node(i, targets[i % len(targets)], self) for i in range(count)]
        self.put_round = 0

    async def change(self, node: Node, version: int) -> None:
        target = self.targets[self.put_round % len(self.targets)]
        self.put_round += 1
        row = make_row(node.index * 2).model_copy(update={"name": f"changed {version}"})
        body = row.model_dump_json().encode()
        raw = request_bytes("PUT", f"/api/nodes/{node.name}/schedules/{row.id}", target.host,
                            {"authorization": f"Bearer {self.admin_token}",
                             "content-type": "application/json"}, body)
        started = time.perf_counter()
        if node.changed_at is None:
            node.changed_at = started
            node.woken = False
            node.changed_via_same = target is node.target
        try:
            answer = await once(target.host, target.port, raw)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            self.metrics.errors[f"put: {type(exc).__name__}"] += 1
            return
        self.metrics.statuses[f"put {answer.status}"] += 1
        if self.metrics.inside(started):
            self.metrics.puts.append(time.perf_counter() - started)

    async def storm(self, minutes: float, share: float) -> None:
        per_minute = max(1, round(len(self.nodes) * share))
        gap = 60.0 / per_minute
        end = time.monotonic() + minutes * 60
        version = 0
        pending: set[asyncio.Task[None]] = set()
        next_at = time.monotonic()
        while time.monotonic() < end:
            node = random.choice(self.nodes)
            version += 1
            task = asyncio.create_task(self.change(node, version))
            pending.add(task)
            task.add_done_callback(pending.discard)
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await asyncio.gather(*pending, return_exceptions=True)


def read_scaled(folder: Path) -> tuple[list[Target], str, str, Path, list[int]]:
    """Return the scaled layout's controllers, admin token, sched URL, tokens file, other pids."""
    state = json.loads((folder / "layout.json").read_text())
    ports = state["config"]["ports"]
    processes = state["processes"]
    targets = [Target("127.0.0.1", port, processes.get(f"controller-{i + 1}", {}).get("pid"),
                      f"controller-{i + 1}") for i, port in enumerate(ports["controller"])]
    url = (f"postgresql://sched:{state['secrets']['pg_sched']}@127.0.0.1:"
           f"{ports['postgres']}/sched")
    others = [record["pid"] for name, record in processes.items()
              if not name.startswith("controller-")]
    return (targets, state["secrets"]["admin_token"], url,
            folder / "controller" / "tokens.toml", others)


async def run_fleet(fleet: Fleet, args: argparse.Namespace,
                    cpu_pids: dict[str, int]) -> dict[str, Any]:
    loads: list[tuple[float, float, float]] = []
    ramp = args.ramp
    starts = [asyncio.create_task(node.run(ramp * i / len(fleet.nodes)))
              for i, node in enumerate(fleet.nodes)]
    print(f"ramp: {len(fleet.nodes):,} nodes over {ramp:g} s", flush=True)
    await asyncio.sleep(ramp + 5)
    print(f"up; statuses so far {dict(fleet.metrics.statuses)}", flush=True)
    fleet.metrics.window = (time.perf_counter(), float("inf"))
    cpu0 = {name: proc_cpu(pid) for name, pid in cpu_pids.items()}
    client0 = time.process_time()
    quiet = Metrics()
    await asyncio.sleep(args.settle)
    # The quiet window's pulls, apart from the storm's.
    quiet.pulls = fleet.metrics.pulls
    quiet.reports = fleet.metrics.reports
    settle_cpu = {name: proc_cpu(pid) - cpu0[name] for name, pid in cpu_pids.items()}
    fleet.metrics.pulls = defaultdict(list)
    fleet.metrics.reports = []
    storm_start = time.perf_counter()
    storm_wall = time.time()
    fleet.metrics.window = (storm_start, float("inf"))
    cpu1 = {name: proc_cpu(pid) for name, pid in cpu_pids.items()}
    client1 = time.process_time()
    print(f"storm for {args.storm_minutes:g} min", flush=True)

    async def sample() -> None:
        while True:
            loads.append(os.getloadavg())
            await asyncio.sleep(10)

    sampler = asyncio.create_task(sample())
    await fleet.storm(args.storm_minutes, args.share)
    # Wait for the last changes' wakes and pulls (at most one heartbeat).
    await asyncio.sleep(min(HEARTBEAT_S, 20.0))
    storm_s = time.perf_counter() - storm_start
    fleet.metrics.window = (storm_start, storm_start + args.storm_minutes * 60)
    storm_cpu = {name: proc_cpu(pid) - cpu1[name] for name, pid in cpu_pids.items()}
    client_cpu = time.process_time() - client1
    sampler.cancel()
    missed = sum(1 for n in fleet.nodes if n.changed_at is not None
                 and fleet.metrics.inside(n.changed_at))
    fleet.stopping = True
    fleet.stop_event.set()
    await asyncio.gather(*starts, return_exceptions=True)
    return {"storm_s": storm_s, "storm_wall": (storm_wall, storm_wall + args.storm_minutes * 60),
            "settle_s": args.settle, "storm_cpu": storm_cpu,
            "settle_cpu": settle_cpu, "client_cpu": client_cpu,
            "client_settle_cpu": client1 - client0, "loads": loads, "quiet": quiet,
            "not_pulled_yet": missed}


def fleet_main(args: argparse.Namespace) -> None:
    nofile = raise_nofile()
    if args.scaled:
        targets, admin, url, tokens_path, others = read_scaled(Path(args.scaled))
    else:
        targets = []
        for item in args.controller.split(","):
            parts = urlsplit(item)
            targets.append(Target(parts.hostname or "127.0.0.1", parts.port or 80,
                                  None, parts.netloc))
        admin, url, others = args.admin_token, args.database_url, []
        tokens_path = Path(args.tokens_file) if args.tokens_file else None
    if args.pids:
        for target, pid in zip(targets, args.pids.split(","), strict=True):
            target.pid = int(pid)
    print(f"open-file limit {nofile}; controllers {[t.name for t in targets]}", flush=True)
    original_tokens = tokens_path.read_text() if tokens_path is not None else None
    if url:
        populate(url, args.nodes)
        print(f"stored {args.nodes:,} nodes' rows", flush=True)
    try:
        if tokens_path is not None:
            write_private(tokens_path, tokens_toml([admin], args.nodes))
            for target in targets:
                if target.pid:
                    os.kill(target.pid, signal.SIGHUP)
            time.sleep(3)
        cpu_pids = {t.name: t.pid for t in targets if t.pid}
        for pid in others:
            with suppress(OSError):
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                cpu_pids[f"{name}-{pid}"] = pid
        load0 = os.getloadavg()

        async def main() -> dict[str, Any]:
            fleet = Fleet(targets, admin, args.nodes)
            result = await run_fleet(fleet, args, cpu_pids)
            result["fleet"] = fleet
            return result

        result = asyncio.run(main())
    finally:
        if tokens_path is not None and original_tokens is not None:
            write_private(tokens_path, original_tokens)
            for target in targets:
                if target.pid:
                    with suppress(OSError):
                        os.kill(target.pid, signal.SIGHUP)
    logs = [Path(item) for item in args.access_logs.split(",") if item]
    if args.scaled and not logs:
        logs = [Path(args.scaled) / "logs" / f"{t.name}.log" for t in targets]
    result["server_times"] = server_times([p for p in logs if p.exists()], result["storm_wall"])
    section = render_storm(result, args, targets, load0)
    publish(section, *STORM, "## The controller under 10,000 nodes and a change storm",
            write=args.write_docs)


ACCESS = re.compile(r"^(\S+ \S+),\d+ INFO controller\.access: (\w+) (\S+) node=\S+ "
                    r"principal=\S+ status=(\d+) ([\d.]+)ms")


def server_times(logs: list[Path], window: tuple[float, float]) -> dict[str, list[float]]:
    """Return the access log's durations (seconds, inside the app) per kind in window.

    The access log writes local time to the second; lines are matched by it.
    """
    found: defaultdict[str, list[float]] = defaultdict(list)
    for path in logs:
        with path.open(errors="replace") as handle:
            for line in handle:
                match = ACCESS.match(line)
                if match is None:
                    continue
                at = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
                if not window[0] <= at <= window[1]:
                    continue
                method, path_, status = match.group(2), match.group(3), match.group(4)
                kind = ("pull" if path_.startswith("/api/schedules") else
                        "wait" if path_.endswith("/wait") else
                        "report" if path_.endswith("/report") else
                        "PUT" if method == "PUT" else "other")
                found[f"{kind} {status}"].append(float(match.group(5)) / 1000)
    return found


def _ms(values: list[float]) -> str:
    if not values:
        return "- | - | -"
    return f"{len(values):,} | {pct(values, 0.5) * 1000:.1f} | {pct(values, 0.99) * 1000:.1f}"


def render_storm(result: dict[str, Any], args: argparse.Namespace, targets: list[Target],
                 load0: tuple[float, float, float]) -> str:
    fleet: Fleet = result["fleet"]
    m = fleet.metrics
    quiet: Metrics = result["quiet"]
    storm_s = result["storm_s"]
    loads = result["loads"]
    five = {k: v for k, v in m.statuses.items() if k.split()[-1].startswith("5")}
    lines = [
        f"`bench/bench_controller_fleet.py fleet`: {args.nodes:,} simulated nodes in one "
        f"asyncio process against {len(targets)} controller instance(s) "
        f"({', '.join(t.name for t in targets)}), each node pinned to one; started over "
        f"{args.ramp:g} s, then {args.settle:g} s quiet, then a storm of "
        f"{args.storm_minutes:g} minutes: {args.share:.0%} of the nodes a minute get a "
        "changed row (admin PUT, round-robin over the instances). Latencies include the TCP "
        "connect (a new connection per pull and per report, as the node's).",
        "",
        "| what | count | p50 ms | p99 ms |",
        "|---|---:|---:|---:|",
        f"| quiet: pull 304 | {_ms(quiet.pulls.get('304', []))} |",
        f"| quiet: report | {_ms(quiet.reports)} |",
        f"| storm: pull 304 | {_ms(m.pulls.get('304', []))} |",
        f"| storm: pull 200 (changed list) | {_ms(m.pulls.get('200', []))} |",
        f"| storm: all pulls | {_ms(m.pulls.get('304', []) + m.pulls.get('200', []))} |",
        f"| storm: report | {_ms(m.reports)} |",
        f"| storm: admin PUT | {_ms(m.puts)} |",
    ]
    for key in ("same instance", "other instance"):
        lines.append(f"| storm: wake (PUT sent to the wait's answer), {key} "
                     f"| {_ms(m.wakes.get(key, []))} |")
    lines.append(f"| storm: change to pulled (PUT sent to the 200) | {_ms(m.pulled)} |")
    inside = result.get("server_times") or {}
    for key in ("pull 304", "pull 200", "report 204", "PUT 200"):
        if inside.get(key):
            lines.append(f"| storm, inside the controller (its access log): {key} "
                         f"| {_ms(inside[key])} |")
    cpu = result["storm_cpu"]
    settle_cpu = result["settle_cpu"]
    names = {t.name for t in targets}
    cpu_text = ", ".join(f"{name} {seconds / storm_s:.2f} core (quiet "
                         f"{settle_cpu.get(name, 0) / max(1, result['settle_s']):.2f})"
                         for name, seconds in cpu.items() if name in names)
    others = sum(s for n, s in cpu.items() if n not in names) / storm_s
    ones = [load[0] for load in loads] or [float("nan")]
    requests = sum(v for k, v in m.statuses.items())
    lines += [
        "",
        f"- Answers over the whole run: {dict(sorted(m.statuses.items()))}; 5xx: "
        f"{sum(five.values())} {dict(five) if five else ''}; connection errors: "
        f"{dict(m.errors) if m.errors else 0}.",
        f"- Waits: {dict(m.waits)} (stale: the node's next wait still carried the old ETag, "
        "its pull not done yet, and was answered at once).",
        f"- Changes not pulled within 20 s of the storm's end: {result['not_pulled_yet']}.",
        f"- Controllers' CPU in the storm: {cpu_text}; the layout's other processes (Prefect, "
        f"PostgreSQL, Redis, HAProxy) {others:.2f} core; the client "
        f"{result['client_cpu'] / storm_s:.2f} core. {requests:,} requests in all.",
        f"- Load average (1 min) before: {load0[0]:.2f}; in the storm every 10 s: min "
        f"{min(ones):.2f}, median {statistics.median(ones):.2f}, max {max(ones):.2f}. "
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("ceiling", help="one process, a new connection per request")
    one.add_argument("--nodes", type=int, default=10_000)
    one.add_argument("--concurrency", type=int, default=8)
    one.add_argument("--seconds", type=float, default=5.0)
    one.add_argument("--rounds", type=int, default=2)
    one.add_argument("--before-tree", default=None,
                     help="a source tree to run as the 'before' server in the same run")
    one.add_argument("--before-label", default="before")
    one.add_argument("--after-label", default="this tree")
    one.add_argument("--write-docs", action="store_true")
    many = sub.add_parser("fleet", help="10,000 nodes and a change storm")
    many.add_argument("--nodes", type=int, default=10_000)
    many.add_argument("--scaled", default=None, help="the scaled layout's folder (.scaled)")
    many.add_argument("--controller", default="", help="controller URLs, comma-separated")
    many.add_argument("--admin-token", default="")
    many.add_argument("--database-url", default="")
    many.add_argument("--pids", default="", help="the controllers' pids, comma-separated")
    many.add_argument("--tokens-file", default="",
                      help="the controllers' tokens file (with --controller): the nodes' "
                      "tokens are added, and the file put back at the end")
    many.add_argument("--ramp", type=float, default=120.0)
    many.add_argument("--settle", type=float, default=60.0)
    many.add_argument("--storm-minutes", type=float, default=10.0)
    many.add_argument("--share", type=float, default=0.01, help="nodes changed a minute")
    many.add_argument("--access-logs", default="",
                      help="the controllers' logs, comma-separated (default with --scaled: "
                      "the layout's), for the time each request spent inside the controller")
    many.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "ceiling":
        ceiling(args)
    else:
        if not args.scaled and not args.controller:
            parser.error("fleet needs --scaled DIR or --controller URL,...")
        fleet_main(args)


if __name__ == "__main__":
    main()
