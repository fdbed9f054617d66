"""The node fires, Prefect records: measured against a cron-like loop and the node before.

Every part starts its own throwaway ``prefect server start`` on SQLite (the
environment ``make run`` gives it), and the real node process (``python -m
sched_node.node``) or the real node code in this process (the fleet part). Times are
the commands' own: each job's command is ``date +%s.%N``, so its output line is
the instant it started. CPU is user + system time from ``/proc`` (a process tree,
reaped children included).

1. ``latency``: window (its run's start, after the row's jitter) to command start,
   p50/p99/max, and early starts, for the node (30 every-minute rows jittered
   across the minute; then again with 5 long jobs running) and, in the same
   minutes, a cron-like loop that sleeps until each of the same instants and
   forks ``date``; then the node before (``python -m flows.node`` of commit
   ``OLD_COMMIT``, its own REST client, run from a git worktree) with the same 30 rows.
   Per job: the node's CPU beyond the command, and the keeper's memory (max RSS),
   against the node before's.
2. ``idle``: one idle node pulling from a real controller (which relays Prefect's
   events to its long poll), for ``--idle-minutes`` (default 16: one periodic
   reconcile), against a server with no planned runs and one with 200,000 (other
   nodes' planned runs, as their planners make them: in the work pool's paused queue
   ``planned``, 30 per node; the first node's made through the API, the others copied
   into the server's database, :func:`_populate`): the node's requests to Prefect (by
   endpoint: its worker heartbeats and polls of its queue among them) and connections to
   it, and the server's CPU, per node-hour, beside the same server's CPU alone for as
   long before the node starts (its own services: what the node adds is the difference).
3. ``fleet``: 200 nodes (the real node code, ``Node`` objects in this process,
   each pulling from the controller) on the SQLite server, idle, checked against
   part 2's real node process (requests per node-hour): the server's CPU, and the
   latency of a health probe every second (a request waiting on SQLite's limiter
   of 100 would show as seconds), and the server's busy answers (429/503), while
   the fleet starts and in the measured minutes.
4. ``outage``: a node with two every-minute rows; the server killed for 10
   minutes (20 windows): each window's command start, and how long after the
   server's return each run reached its final state.
5. ``restart``: what one node's restart with nothing changed costs the center, the node
   before and this checkout's
   (the node of commit ``RESTART_BEFORE``, from a git worktree, and this checkout's, on
   one server, their restarts taken in turns): each restart's requests to Prefect (read
   off a logging proxy) and the CPU of the Prefect server and of the controller from the
   node's spawn to its exit, less their idle CPU for as long (measured around them).

    .venv/bin/python bench/bench_node.py [--parts latency,idle,fleet,outage,restart]
        [--no-write]

All parts take about 110 minutes (`--filled` keeps the server of 200,000 planned runs for
the next run; `--fill` sets how many). Writes the figures into docs/benchmarks.md
between ``node:begin`` and ``node:end``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.prefect_bench import (
    answers,
    free_port,
    load_text,
    machine,
    percentile,
    start_server,
    stop_group,
    tree_cpu,
    wait_until,
    write_section,
)
from sched_core.model import LocalSchedule
from sched_core.policies import window_starts
from sched_node.prefect_api import TERMINAL, PrefectApi, PrefectUnavailable, new_state

ROOT = Path(__file__).resolve().parent.parent

BEGIN, END = "<!-- node:begin -->", "<!-- node:end -->"
HEADING = "## The node fires, Prefect records (Prefect)"
RESULTS = ROOT / "bench" / "bench_node.json"
"""The last figures of each part (a run of some parts keeps the others')."""
OLD_COMMIT = "af9e7ab"
"""The node before it moved to ``sched_node/`` and recorded through Prefect's client (its code
under ``flows/``, run as ``python -m flows.node``; no work pool, no worker): part 1's "before".
"""
RESTART_BEFORE = OLD_COMMIT
"""Part 5's "before": the same node."""
NY = "America/New_York"
PLANNED = re.compile(r"\bplanned \d+ windows: |the plan reached Prefect")
"""The node's log lines at the end of a plan (both nodes'; the second after a plan that
failed part way, done again)."""

ACTIONS = """
[actions.stamp]
argv = ["date", "+%s.%N"]
timeout = 60

[actions.hold]
argv = ["sleep", "{param:seconds}"]
timeout = 300

[actions.hold.params.seconds]
type = "int"
min = 1
max = 300
"""


def _row(sid: str, action: str = "stamp", *, jitter: int = 0, every: int = 1,
         **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"id": sid, "name": sid, "repo_id": sid, "action": action,
                            "schedule": {"days": ["*"], "hours": ["*"], "minute": "0",
                                         "interval_minutes": every},
                            "miss_policy": "skip", "enabled": True, "version": 1, **extra}
    if jitter:
        data["jitter"] = jitter
    return data


def _config(folder: Path, name: str, pull: str, *, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "agent.toml"
    config.write_text(f'node_name = "{name}"\npull_url = "{pull}"\nstate_dir = "state"\n'
                      f'timezone = "{NY}"\njob_limit = 40\nwave = []\n{extra}\n{ACTIONS}')
    return config


def _stats(values: list[float]) -> str:
    if not values:
        return "no samples"
    ms = [v * 1000 for v in values]
    return (f"p50 {statistics.median(ms):.0f} ms, p99 {percentile(ms, 0.99):.0f} ms, "
            f"max {max(ms):.0f} ms ({len(ms)} jobs, {sum(1 for v in values if v < 0)} early)")


def _logs(api: PrefectApi, run_id: str) -> list[str]:
    from prefect.client.schemas.filters import LogFilter

    return [str(item["message"]) for item in api.filter_logs(
        LogFilter.model_validate({"flow_run_id": {"any_": [run_id]}}), limit=200)]


def _runs(api: PrefectApi, offset: int = 0, **flow_runs: Any) -> list[dict[str, Any]]:
    """Return one page (200) of the flow runs a filter (the API's ``flow_runs`` object) selects,
    by expected start."""
    from prefect.client.schemas.filters import FlowRunFilter

    return api.filter_runs(FlowRunFilter.model_validate(flow_runs),
                           sort="EXPECTED_START_TIME_ASC", limit=200, offset=offset)


def _starts(api: PrefectApi, node: str, since: datetime, until: datetime,
            action: str = "stamp") -> list[float]:
    """Return, per finished job of node in [since, until), its command's start minus its start."""
    found: list[float] = []
    offset = 0
    while True:
        runs = _runs(api, offset, tags={"all_": [f"node:{node}", f"action:{action}"]},
                     state={"type": {"any_": ["COMPLETED"]}})
        for run in runs:
            planned = datetime.fromisoformat(run["expected_start_time"])
            if not since <= planned < until:
                continue
            stamped = [line for line in _logs(api, run["id"]) if line[:10].isdigit()
                       and "." in line and " " not in line]
            if stamped:
                found.append(float(stamped[0]) - planned.timestamp())
        if len(runs) < 200:
            return found
        offset += 200


def _cron_loop(instants: list[datetime], stop: threading.Event) -> list[float]:
    """Fork ``date`` at each instant (a cron-like loop); return each command's lateness."""
    late: list[float] = []
    for instant in sorted(instants):
        while not stop.is_set():
            left = (instant - datetime.now(UTC)).total_seconds()
            if left <= 0:
                break
            time.sleep(min(left, 0.5) if left > 0.002 else 0.0005)
        if stop.is_set():
            break
        out = subprocess.run(["date", "+%s.%N"], capture_output=True, text=True, check=True)
        late.append(float(out.stdout.strip()) - instant.timestamp())
    return late


def _instants(rows: list[dict[str, Any]], node: str, since: datetime,
              until: datetime) -> list[datetime]:
    from zoneinfo import ZoneInfo

    found = []
    for raw in rows:
        row = LocalSchedule.model_validate(raw)
        found += [start for _, start in window_starts(row, since, until, node=node,
                                                       tz=ZoneInfo(NY)) if since <= start < until]
    return found


def _max_rss_of(pattern: str, stop: threading.Event, found: list[int]) -> None:
    """Sample the RSS (kB) of processes whose command line holds pattern until stop."""
    while not stop.wait(0.2):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ")
                if pattern.encode() not in cmd:
                    continue
                for line in Path(f"/proc/{entry.name}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        found.append(int(line.split()[1]))
            except OSError:
                continue


def _spawn_node(config: Path, api_url: str, log: Path, *, cwd: Path = ROOT,
                old: bool = False) -> subprocess.Popen[bytes]:
    """Start a node: this checkout's (``python -m sched_node``), or with old the node of
    the tree cwd (a worktree of OLD_COMMIT: ``python -m flows.node``)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHED_")}
    env.update({"SCHED_CONFIG": str(config), "PREFECT_API_URL": api_url,
                "PYTHONPATH": str(cwd), "PREFECT_LOGGING_EXTRA_LOGGERS":
                    "sched_core,flows" if old else "sched_core,sched_node,flows"})
    argv = [sys.executable, "-m", "flows.node" if old else "sched_node"]
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _planned(log: Path, since: float, timeout_s: float = 900) -> float:
    """Wait until a node's log says its first plan is done (``planned N windows``); return the
    seconds since since (``time.monotonic``). A node's first plan of many windows takes
    minutes on SQLite, and this checkout's recorder waits for it (the planner's lock): the
    parts measure the node once it has planned."""
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and PLANNED.search(log.read_text(errors="replace")):
            return time.monotonic() - since
        time.sleep(0.5)
    raise RuntimeError(f"the node did not plan within {timeout_s:.0f} s (see {log})")


def _recorded(api: PrefectApi, node: str, since: datetime, until: datetime, expected: int,
              timeout_s: float = 600, action: str = "stamp") -> int:
    """Wait until expected runs of node's action in [since, until) are Completed in Prefect
    (the node's records may lag its jobs), at most timeout_s; return how many are."""
    from prefect.client.schemas.filters import FlowRunFilter

    wanted = FlowRunFilter.model_validate({
        "tags": {"all_": [f"node:{node}", f"action:{action}"]},
        "state": {"type": {"any_": ["COMPLETED"]}},
        "expected_start_time": {"after_": since.isoformat(),
                                "before_": (until - timedelta(microseconds=1)).isoformat()}})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done = int(api.call(lambda c: c.count_flow_runs(flow_run_filter=wanted),
                                "count the node's records"))
        except PrefectUnavailable:
            done = 0
        if done >= expected or time.monotonic() > deadline:
            return done
        time.sleep(5)


def _next_minute(after: float = 20.0) -> datetime:
    now = datetime.now(UTC) + timedelta(seconds=after)
    return now.replace(second=0, microsecond=0) + timedelta(minutes=1)


# -- 1. latency and per-job cost ----------------------------------------------------------


def latency(work: Path, minutes: int) -> dict[str, Any]:
    proc, url = start_server(work / "prefect-new")
    api = PrefectApi(url)
    result: dict[str, Any] = {}
    node: subprocess.Popen[bytes] | None = None
    try:
        name = f"lat-{uuid.uuid4().hex[:6]}"
        rows = [_row(f"j{n}", jitter=59) for n in range(30)]
        pull = work / "new" / "rows.json"
        config = _config(work / "new", name, str(pull))
        pull.write_text(json.dumps({"schedules": rows}))
        spawned = time.monotonic()
        node = _spawn_node(config, url, work / "new.log")
        result["new_first_plan_s"] = _planned(work / "new.log", spawned)
        begin = _next_minute(30)
        idle_end = begin + timedelta(minutes=minutes)
        busy_end = idle_end + timedelta(minutes=minutes)
        stop = threading.Event()
        cron: list[float] = []
        cron_thread = threading.Thread(target=lambda: cron.extend(_cron_loop(
            _instants(rows, name, begin, busy_end), stop)), daemon=True)
        cron_thread.start()
        while datetime.now(UTC) < begin:
            time.sleep(0.5)
        cpu0 = tree_cpu(node.pid)
        time.sleep((idle_end - datetime.now(UTC)).total_seconds())
        cpu1 = tree_cpu(node.pid)
        # Then with 5 long jobs running the whole time (one row each, every minute, 55 s).
        pull.write_text(json.dumps({"schedules": rows + [
            _row(f"h{n}", "hold", every=1, params={"seconds": 55}) for n in range(5)]}))
        rss: list[int] = []
        sampler = threading.Thread(target=_max_rss_of, args=(f"{ROOT}/sched_node/shim.py", stop,
                                                              rss),
                                   daemon=True)
        sampler.start()
        time.sleep(max((busy_end - datetime.now(UTC)).total_seconds(), 0) + 20)
        stop.set()
        cron_thread.join(5)
        fired = len(_instants(rows, name, begin, idle_end))
        t0 = time.monotonic()
        _recorded(api, name, begin, busy_end, len(_instants(rows, name, begin, busy_end)))
        result["new_records_lag_s"] = time.monotonic() - t0
        jobs_idle = _starts(api, name, begin, idle_end)
        jobs_busy = _starts(api, name, idle_end + timedelta(minutes=1), busy_end)
        stop_group(node)
        date_cpu = _date_cpu()
        result["new_idle"] = jobs_idle
        result["new_busy"] = jobs_busy
        result["cron"] = cron
        per_job = (cpu1 - cpu0) / max(fired, 1) - date_cpu
        result["new_cpu_per_job"] = per_job
        result["new_keeper_rss_mb"] = max(rss) / 1024 if rss else None
        result["new_jobs"] = len(jobs_idle)
        result["new_fired"] = fired
    finally:
        stop_group(node)
        api.close()
        stop_group(proc)
    result.update(_old_design(work, minutes))
    return result


def _date_cpu() -> float:
    """Return the CPU of one ``date`` command (what a job's own command costs)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for _ in range(20):
        subprocess.run(["date", "+%s.%N"], capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)) / 20


def _old_design(work: Path, minutes: int) -> dict[str, Any]:
    """Run the node of OLD_COMMIT (from a git worktree) with the same 30 jittered rows, for
    minutes; its latency and its cost per job (CPU beyond the command, the keeper's RSS)."""
    tree = work / "old-tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                    OLD_COMMIT], check=True, capture_output=True)
    proc, url = start_server(work / "prefect-old")
    api = PrefectApi(url)
    node: subprocess.Popen[bytes] | None = None
    try:
        name = f"old-{uuid.uuid4().hex[:6]}"
        rows = [_row(f"j{n}", jitter=59) for n in range(30)]
        pull = work / "old" / "rows.json"
        config = _config(work / "old", name, str(pull))
        pull.write_text(json.dumps({"schedules": rows}))
        spawned = time.monotonic()
        node = _spawn_node(config, url, work / "old.log", cwd=tree, old=True)
        first_plan_s = _planned(work / "old.log", spawned)
        begin = _next_minute(30)
        end = begin + timedelta(minutes=minutes)
        stop = threading.Event()
        rss: list[int] = []
        sampler = threading.Thread(target=_max_rss_of, args=(f"{tree}/flows/shim.py", stop, rss),
                                   daemon=True)
        sampler.start()
        while datetime.now(UTC) < begin:
            time.sleep(0.5)
        cpu0 = tree_cpu(node.pid)
        time.sleep((end - datetime.now(UTC)).total_seconds())
        cpu1 = tree_cpu(node.pid)
        stop.set()
        fired = len(_instants(rows, name, begin, end))
        t0 = time.monotonic()
        _recorded(api, name, begin, end, fired)
        lag = time.monotonic() - t0
        jobs = _starts(api, name, begin, end)
        stop_group(node)
        return {"old": jobs, "old_commit": OLD_COMMIT, "old_first_plan_s": first_plan_s,
                "old_cpu_per_job": (cpu1 - cpu0) / max(fired, 1) - _date_cpu(),
                "old_rss_mb": max(rss) / 1024 if rss else None, "old_fired": fired,
                "old_records_lag_s": lag}
    finally:
        stop_group(node)
        api.close()
        stop_group(proc)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)


# -- 2. the idle node's cost on the Prefect server ----------------------------------------


class Controller:
    """A real controller (SQLite) with the relay of Prefect's events, in its own process."""

    ADMIN = "bench-admin-token-0123456789abcdef"

    def __init__(self, work: Path, prefect_url: str, nodes: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.tokens = {node: f"{node}-token-0123456789abcdef" for node in nodes}
        work.mkdir(parents=True, exist_ok=True)
        tokens = work / "tokens.json"
        tokens.write_text(json.dumps({"admin": [self.ADMIN], "nodes": {
            node: [token] for node, token in self.tokens.items()}}))
        tokens.chmod(0o600)
        env = {**os.environ, "PREFECT_API_URL": prefect_url, "SCHED_TOKENS_FILE": str(tokens)}
        url = f"sqlite:///{work / 'controller.db'}"
        subprocess.run([str(Path(sys.executable).parent / "sched"), "controller", "migrate",
                        "--database-url", url], env=env, check=True, capture_output=True)
        with (work / "controller.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "sched"), "controller", "serve",
                 "--database-url", url, "--port", str(self.port), "--api-only"],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        import httpx

        wait_until(lambda: answers(f"{self.base}/healthz"), 60)
        self.http = httpx.Client(base_url=self.base, timeout=30,
                                 headers={"Authorization": f"Bearer {self.ADMIN}"})

    def put(self, node: str, row: dict[str, Any]) -> None:
        answer = self.http.put(f"/api/nodes/{node}/schedules/{row['id']}", json=row)
        answer.raise_for_status()

    def pull_url(self, node: str) -> str:
        return f"{self.base}/api/schedules?node={node}"

    def stop(self) -> None:
        self.http.close()
        stop_group(self.proc)


def _idle_rows() -> list[dict[str, Any]]:
    """Ten daily schedules (UTC), none due within the next 5 hours."""
    hour = datetime.now(UTC).hour
    return [{"id": f"i{n}", "name": f"idle {n}", "repo_id": f"r{n}", "action": "stamp",
             "schedule": {"days": ["*"], "hours": [str((hour + 6 + n) % 24)],
                          "minute": str(n * 5)},
             "timezone": "UTC", "miss_policy": "skip", "enabled": True, "version": 1}
            for n in range(10)]


class CountingProxy:
    """A TCP proxy in front of the Prefect server that counts the requests and connections
    passing through it: what a node really sends, read off the wire."""

    def __init__(self, target_port: int) -> None:
        import socket

        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        self.endpoints: dict[str, int] = {}
        """Requests by ``METHOD /path`` (ids as ``{id}``, the query left out)."""
        self.open = 0
        self.opened = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self.open += 1
                self.opened += 1
            threading.Thread(target=self._pipe, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False),
                             daemon=True).start()

    def _pipe(self, source: Any, sink: Any, counting: bool) -> None:
        import re

        line = re.compile(rb"(GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) (/\S*) HTTP/1\.1\r\n")
        ids = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
        tail = b""
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if counting:
                    # Each request line counted once: what follows the last one seen is kept
                    # (its end, at most 4 kB) for the next read, where a line cut in two ends.
                    seen = tail + data
                    last = 0
                    with self._lock:
                        for found in line.finditer(seen):
                            self.requests += 1
                            path = found.group(2).decode(errors="replace").split("?")[0]
                            key = f"{found.group(1).decode()} {ids.sub('{id}', path)}"
                            self.endpoints[key] = self.endpoints.get(key, 0) + 1
                            last = found.end()
                    tail = seen[last:][-4096:]
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(2)
                except OSError:
                    pass
            if counting:
                with self._lock:
                    self.open -= 1

    def close(self) -> None:
        self.listener.close()


FILL_PER_NODE = 30
"""Planned runs per node of the fill (each node's deployment ``run-job/fill-<n>``)."""


def _populate(api: PrefectApi, count: int, database: Path) -> None:
    """Create count planned runs for other nodes (Scheduled, a day ahead): a busy fleet's plan,
    as each node's planner makes it: its deployment ``run-job/fill-<n>`` in the work pool, in
    a queue of its own, and its 30 planned runs in the pool's paused queue ``planned``.

    The first node's are made through the API (the pool, the flow, the deployment and its
    queue, one bulk create of its runs, as the planner sends it); the others' rows are copies
    of those, with their own ids, names, keys and tags, written straight into the server's
    SQLite database (database): through the API each node's deployment and runs take 1-3 s
    on this machine's two shared cores (the server creates a run in ~50 ms under load), so
    200,000 runs would take hours. Resumable: a node whose deployment is there is skipped
    (``--filled`` keeps the server).
    """
    import sqlite3

    from prefect.client.schemas.actions import DeploymentFlowRunCreate
    from prefect.states import to_state_create

    from sched_node.registration import DEFAULT_POOL, PLANNED_QUEUE, RUN_JOB, pool_and_queue

    if count <= 0 or _fill_count(api) >= count:
        return
    start = datetime.now(UTC) + timedelta(days=1)
    api.call(lambda c: pool_and_queue(c, DEFAULT_POOL), "make the work pool")
    flow_id = api.call(lambda c: c.create_flow_from_name(RUN_JOB), "make the flow")
    template = str(api.call(lambda c: c.create_deployment(
        flow_id=flow_id, name="fill-0", work_pool_name=DEFAULT_POOL, work_queue_name="fill-0",
        enforce_parameter_schema=False), "deploy run-job/fill-0"))
    pending = list(range(min(FILL_PER_NODE, count)))
    for _ in range(30):  # SQLite fails a bulk entry as locked now and then: sent again
        results = api.create_runs(template, [DeploymentFlowRunCreate(
            name=f"fill-0-{k}", parameters={"schedule_id": f"s{k}"},
            tags=["node:fill-0", "trigger:schedule"], idempotency_key=f"fill-0:{k}",
            state=to_state_create(new_state("SCHEDULED",
                                            scheduled_time=start + timedelta(minutes=k))),
            enforce_parameter_schema=False, work_queue_name=PLANNED_QUEUE) for k in pending])
        pending = [k for k, result in zip(pending, results, strict=True)
                   if result.get("status") != "CREATED"]
        if not pending:
            break
        time.sleep(1)
    else:
        raise RuntimeError("the fill's first node could not make its planned runs")

    def uid() -> str:
        return str(uuid.uuid4())

    with sqlite3.connect(database, timeout=120) as db:
        db.row_factory = sqlite3.Row

        def rows(sql: str, *args: Any) -> list[dict[str, Any]]:
            return [dict(row) for row in db.execute(sql, args).fetchall()]

        def insert(table: str, items: list[dict[str, Any]]) -> None:
            if items:
                names = list(items[0])
                db.executemany(f"INSERT INTO {table} ({', '.join(names)}) VALUES "
                               f"({', '.join('?' for _ in names)})",
                               [[item[name] for name in names] for item in items])

        (deployment,) = rows("SELECT * FROM deployment WHERE id = ?", template)
        (queue,) = rows("SELECT * FROM work_queue WHERE id = ?", deployment["work_queue_id"])
        runs = rows("SELECT * FROM flow_run WHERE deployment_id = ? ORDER BY name", template)
        states = {item["id"]: item for item in rows(
            "SELECT * FROM flow_run_state WHERE flow_run_id IN (SELECT id FROM flow_run "
            "WHERE deployment_id = ?)", template)}
        there = {item["name"] for item in rows(
            "SELECT name FROM deployment WHERE flow_id = ? AND name LIKE 'fill-%'",
            deployment["flow_id"])}
        nodes = (count + FILL_PER_NODE - 1) // FILL_PER_NODE
        made = 0
        for n in range(1, nodes):
            name = f"fill-{n}"
            if name in there:
                continue
            now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
            queue_id, deployment_id = uid(), uid()
            insert("work_queue", [{**queue, "id": queue_id, "name": name, "created": now,
                                   "updated": now, "priority": queue["priority"] + n}])
            labels = json.loads(deployment["labels"] or "{}")
            insert("deployment", [{**deployment, "id": deployment_id, "name": name,
                                   "work_queue_name": name, "work_queue_id": queue_id,
                                   "created": now, "updated": now,
                                   "labels": json.dumps(labels)}])
            new_runs, new_states = [], []
            for run in runs[:min(FILL_PER_NODE, count - FILL_PER_NODE * n)]:
                k = run["name"].rsplit("-", 1)[1]
                run_id, state_id = uid(), uid()
                state = states[run["state_id"]]
                details = json.loads(state["state_details"])
                details["flow_run_id"] = run_id
                run_labels = json.loads(run["labels"] or "{}")
                run_labels["prefect.deployment.id"] = deployment_id
                new_runs.append({**run, "id": run_id, "name": f"{name}-{k}",
                                 "idempotency_key": f"{name}:{k}", "deployment_id": deployment_id,
                                 "tags": json.dumps([f"node:{name}", "trigger:schedule"]),
                                 "labels": json.dumps(run_labels), "state_id": state_id,
                                 "created": now, "updated": now})
                new_states.append({**state, "id": state_id, "flow_run_id": run_id,
                                   "state_details": json.dumps(details), "created": now,
                                   "updated": now})
            insert("flow_run_state", new_states)
            insert("flow_run", new_runs)
            made += 1
            if made % 500 == 0:
                db.commit()
                print(f"  fill: {n + 1:,} of {nodes:,} nodes' planned runs written", flush=True)
        db.commit()


def _fill_count(api: PrefectApi) -> int:
    """Return how many of the fill's planned runs the server holds."""
    from prefect.client.schemas.filters import FlowRunFilter

    fill = FlowRunFilter.model_validate({"name": {"like_": "fill-"}})
    return int(api.call(lambda c: c.count_flow_runs(flow_run_filter=fill), "count the fill"))


def idle(work: Path, minutes: int, keep: Path | None = None,
         fill: int = 200_000) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, planned in (("0 planned runs", 0), (f"{fill:,} planned runs", fill)):
        folder = work / f"idle-{planned}"
        home = keep / f"prefect-{planned}" if planned and keep is not None else folder / "prefect"
        proc, url = start_server(home)
        api = PrefectApi(url)
        controller: Controller | None = None
        node: subprocess.Popen[bytes] | None = None
        proxy = CountingProxy(int(url.rsplit(":", 1)[1].split("/")[0]))
        try:
            t0 = time.monotonic()
            _populate(api, planned, home / "prefect.db")
            filled = time.monotonic() - t0
            # The server alone first: its own services' cost, which the node's is beside.
            time.sleep(30)
            alone0 = tree_cpu(proc.pid)
            time.sleep(minutes * 60)
            alone = (tree_cpu(proc.pid) - alone0) / (minutes / 60)
            name = f"idle-{uuid.uuid4().hex[:6]}"
            controller = Controller(folder, url, [name])
            for row in _idle_rows():
                controller.put(name, row)
            config = _config(folder / "node", name, controller.pull_url(name),
                             extra=f'token = "{controller.tokens[name]}"')
            spawned = time.monotonic()
            node = _spawn_node(config, proxy.url, folder / "node.log")
            _planned(folder / "node.log", spawned)
            time.sleep(max(60 - (time.monotonic() - spawned), 0))  # its start: registration and
            # the first plan
            load0 = os.getloadavg()[0]
            server0, requests0, opened0 = tree_cpu(proc.pid), proxy.requests, proxy.opened
            endpoints0 = dict(proxy.endpoints)
            samples = []
            deadline = time.monotonic() + minutes * 60
            while time.monotonic() < deadline:
                samples.append(proxy.open)
                time.sleep(5)
            server1, requests1, opened1 = tree_cpu(proc.pid), proxy.requests, proxy.opened
            hours = minutes / 60
            by_endpoint = {key: (count - endpoints0.get(key, 0)) / hours
                           for key, count in sorted(proxy.endpoints.items())
                           if count > endpoints0.get(key, 0)}
            results[label] = {
                "server_cpu_s_per_hour": (server1 - server0) / hours,
                "server_alone_cpu_s_per_hour": alone,
                "requests_per_hour": (requests1 - requests0) / hours,
                "requests_per_hour_by_endpoint": by_endpoint,
                "connections_opened_per_hour": (opened1 - opened0) / hours,
                "connections_max": max(samples), "connections_mean": statistics.mean(samples),
                "filled_s": filled, "minutes": minutes,
                "planned_runs": _fill_count(api) if planned else 0,
                "load": [load0, os.getloadavg()[0]],
            }
        finally:
            stop_group(node)
            if controller is not None:
                controller.stop()
            proxy.close()
            api.close()
            stop_group(proc)
    return results


# -- 3. 200 nodes on the SQLite server ----------------------------------------------------


def fleet(work: Path, count: int, minutes: int) -> dict[str, Any]:
    from sched_node.node import Node
    from sched_node.settings import load_settings

    proc, url = start_server(work / "fleet-prefect")
    names = [f"f{n:03d}" for n in range(count)]
    controller = Controller(work / "fleet", url, names)
    nodes: list[Node] = []
    threads: list[threading.Thread] = []
    probe: list[float] = []
    stop = threading.Event()
    try:
        for name in names:
            for row in _idle_rows():
                controller.put(name, row)
        t0 = time.monotonic()
        for name in names:
            config = _config(work / "fleet" / name, name, controller.pull_url(name),
                             extra=f'token = "{controller.tokens[name]}"')
            node = Node(load_settings(config), api=PrefectApi(url))
            nodes.append(node)
            thread = threading.Thread(target=node.run, daemon=True)
            thread.start()
            threads.append(thread)
        started = time.monotonic() - t0
        # Every node registered and planned: on SQLite, 200 nodes starting at once get
        # busy answers and register over minutes, so wait until the fleet's calls fall
        # to an idle fleet's (under one per two nodes a minute), at most 20 minutes.
        settle_deadline = time.monotonic() + 20 * 60
        before = sum(node.api.requests for node in nodes)
        while time.monotonic() < settle_deadline:
            time.sleep(60)
            now_requests = sum(node.api.requests for node in nodes)
            if now_requests - before < count / 2:
                break
            before = now_requests
        settled = time.monotonic() - t0
        busy_at_start = sum(node.api.busy for node in nodes)
        import httpx

        def health() -> None:
            with httpx.Client(timeout=60) as client:
                while not stop.wait(1.0):
                    t = time.perf_counter()
                    client.get(f"{url}/health")
                    probe.append(time.perf_counter() - t)

        prober = threading.Thread(target=health, daemon=True)
        prober.start()
        server0 = tree_cpu(proc.pid)
        requests0 = sum(node.api.requests for node in nodes)
        time.sleep(minutes * 60)
        server1 = tree_cpu(proc.pid)
        requests1 = sum(node.api.requests for node in nodes)
        busy1 = sum(node.api.busy for node in nodes)
        stop.set()
        prober.join(5)
        hours = minutes / 60
        return {"nodes": count, "minutes": minutes, "start_s": started, "settled_s": settled,
                "server_cpu_s_per_hour": (server1 - server0) / hours,
                "requests_per_node_hour": (requests1 - requests0) / hours / count,
                "busy_at_start": busy_at_start, "busy_measured": busy1 - busy_at_start,
                "health_p50_ms": statistics.median(probe) * 1000,
                "health_p99_ms": percentile(probe, 0.99) * 1000, "health_max_ms": max(probe) * 1000}
    finally:
        stop.set()
        for node in nodes:
            node.stop()
        for thread in threads:
            thread.join(10)
        controller.stop()
        stop_group(proc)


# -- 4. a ten-minute outage ---------------------------------------------------------------


def outage(work: Path, minutes: int = 10) -> dict[str, Any]:
    proc, url = start_server(work / "outage-prefect")
    home = work / "outage-prefect"
    api = PrefectApi(url)
    name = f"out-{uuid.uuid4().hex[:6]}"
    pull = work / "outage" / "rows.json"
    config = _config(work / "outage", name, str(pull))
    pull.write_text(json.dumps({"schedules": [_row("a"), _row("b")]}))
    spawned = time.monotonic()
    node = _spawn_node(config, url, work / "outage.log")
    try:
        _planned(work / "outage.log", spawned)
        begin = _next_minute(40)
        while datetime.now(UTC) < begin - timedelta(seconds=20):
            time.sleep(0.5)
        stop_group(proc, grace_s=0)
        down = datetime.now(UTC)
        end = begin + timedelta(minutes=minutes)
        time.sleep((end - datetime.now(UTC)).total_seconds() - 5)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        proc = _restart(home, port)
        back = datetime.now(UTC)
        api.close()
        api = PrefectApi(url)
        deadline = time.monotonic() + 300
        finals: dict[str, float] = {}
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                runs = _runs(api, tags={"all_": [f"node:{name}"]},
                             expected_start_time={"after_": begin.isoformat(),
                                                  "before_": end.isoformat()})
            except PrefectUnavailable:
                runs = []
            window_runs = [run for run in runs if begin <= datetime.fromisoformat(
                run["expected_start_time"]) < end]
            for run in window_runs:
                kind = (run.get("state") or {}).get("type")
                if kind in TERMINAL and run["id"] not in finals:
                    finals[run["id"]] = (datetime.now(UTC) - back).total_seconds()
                    states[run["id"]] = str(kind)
            if len(finals) >= 2 * minutes and len(window_runs) >= 2 * minutes:
                break
            time.sleep(1)
        starts = _starts(api, name, begin, end)
        return {"down_s": (back - down).total_seconds(), "windows": 2 * minutes,
                "starts": starts, "recorded_after_return_s": sorted(finals.values()),
                "final_states": {kind: list(states.values()).count(kind)
                                 for kind in sorted(set(states.values()))}}
    finally:
        stop_group(node)
        api.close()
        stop_group(proc)


def _restart(home: Path, port: int) -> subprocess.Popen[bytes]:
    """Start the Prefect server again on its port, on the same home."""
    return start_server(home, port=port)[0]


# -- the report ---------------------------------------------------------------------------


# -- 5. one node's restart: its cost on the center, before and after --------------------


def _idle_rate(pids: list[int], seconds: float) -> float:
    """Return the CPU seconds per second the processes (trees) use while nothing happens."""
    cpu0 = sum(tree_cpu(pid) for pid in pids)
    time.sleep(seconds)
    return (sum(tree_cpu(pid) for pid in pids) - cpu0) / seconds


def restart(work: Path, rounds: int) -> dict[str, Any]:
    """Restart a node of RESTART_BEFORE and one of this checkout in turns, rounds times each;
    return each restart's requests to Prefect and the center's CPU beyond its idle."""
    from bench.fleet_sim import LoggingProxy, endpoint_class

    tree = work / "restart-before-tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                    RESTART_BEFORE], check=True, capture_output=True)
    proc, url = start_server(work / "prefect-restart", late_runs=False)
    names = {"before": f"rb-{uuid.uuid4().hex[:6]}", "after": f"ra-{uuid.uuid4().hex[:6]}"}
    controller = Controller(work / "restart-ctl", url, list(names.values()))
    proxy = LoggingProxy("prefect", url.removesuffix("/api"))
    trees = {"before": tree, "after": ROOT}
    found: dict[str, Any] = {"rounds": rounds, "before_commit": RESTART_BEFORE,
                             "restarts": {"before": [], "after": []}, "first": {}}
    try:
        for name in names.values():
            for row in _idle_rows():
                controller.put(name, row)
        pids = [proc.pid, controller.proc.pid]
        idle = [_idle_rate(pids, 30)]

        def once(variant: str) -> dict[str, Any]:
            name = names[variant]
            config = _config(work / f"restart-{variant}", name, controller.pull_url(name),
                             extra=f'token = "{controller.tokens[name]}"\n')
            log = work / f"restart-{variant}.log"
            mark = log.stat().st_size if log.exists() else 0
            calls0 = len(proxy.calls)
            cpu0 = [tree_cpu(pid) for pid in pids]
            t0 = time.monotonic()
            node = _spawn_node(config, f"{proxy.base}/api", log, cwd=trees[variant],
                               old=variant == "before")
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not PLANNED.search(log.read_bytes()[
                        mark:].decode(errors="replace")):
                    time.sleep(0.2)
                # Its record (the code before sent it after the plan): until 3 s pass quietly.
                seen, quiet_since = len(proxy.calls), time.monotonic()
                while time.monotonic() - quiet_since < 3 and time.monotonic() < deadline:
                    time.sleep(0.2)
                    if len(proxy.calls) != seen:
                        seen, quiet_since = len(proxy.calls), time.monotonic()
            finally:
                stop_group(node)
            seconds = time.monotonic() - t0
            cpu = [tree_cpu(pid) - before for pid, before in zip(pids, cpu0, strict=True)]
            calls: dict[str, int] = {}
            for call in proxy.calls[calls0:]:
                key = endpoint_class(call.side, call.method, call.path, name)
                calls[key] = calls.get(key, 0) + 1
            return {"seconds": seconds, "prefect_cpu_s": cpu[0], "controller_cpu_s": cpu[1],
                    "requests": sum(calls.values()), "calls": calls}

        for variant in names:  # each node's first start: it registers and plans
            found["first"][variant] = once(variant)
        for _ in range(rounds):
            for variant in names:
                found["restarts"][variant].append(once(variant))
        idle.append(_idle_rate(pids, 30))
        found["idle_cores"] = idle
        rate = sum(idle) / len(idle)
        for variant, items in found["restarts"].items():
            center = [item["prefect_cpu_s"] + item["controller_cpu_s"] - rate * item["seconds"]
                      for item in items]
            found[variant] = {
                "requests": statistics.median(item["requests"] for item in items),
                "calls": items[-1]["calls"],
                "prefect_cpu_s": statistics.median(item["prefect_cpu_s"] for item in items),
                "controller_cpu_s": statistics.median(item["controller_cpu_s"]
                                                      for item in items),
                "seconds": statistics.median(item["seconds"] for item in items),
                "center_cpu_s_beyond_idle": statistics.median(center),
                "center_cpu_s_beyond_idle_mean": statistics.mean(center),
            }
        return found
    finally:
        proxy.close()
        controller.stop()
        stop_group(proc)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)


def _busy_text(fleet_found: dict[str, Any]) -> str:
    """What the server's busy answers (429/503: too busy to do anything) say of the fleet."""
    if "busy_measured" not in fleet_found:
        return "the server's busy answers (429/503) were not counted in this run."
    return (f"the server answered "
            f"{fleet_found['busy_at_start']} requests busy (429/503) while the fleet started "
            f"and {fleet_found['busy_measured']} in the measured minutes (each is asked again; "
            "no node holds a websocket).")


def _when(part: dict[str, Any]) -> str:
    """When a part was measured, and the machine's load (1-minute average) then."""
    load = part.get("load")
    if not load:
        return str(part.get("measured", ""))
    return f"{part.get('measured', '')}, load {load[0]:.1f} at its start, {load[1]:.1f} at its end"


def report(found: dict[str, Any]) -> str:
    lines = [f"On {machine()}. `.venv/bin/python bench/bench_node.py` (all parts about 110 "
             "minutes; `--parts latency,idle,fleet,outage,restart` runs some, keeping the "
             "others' last figures, each with the time it was measured and the machine's load "
             "then: the 1-minute average at the part's start and end).", ""]
    lat = found.get("latency")
    if lat:
        old_commit = lat.get("old_commit")
        old_row = (f"the node of commit {old_commit} (`flows/`, its own REST client; the same "
                   "30 rows, alone)" if old_commit else
                   "the old design (runner polls, a flow-run process per job; 10 rows)")
        old_cost = (f"the node of commit {old_commit} {lat['old_cpu_per_job']:.3f} s of CPU and "
                    f"its keeper {lat['old_rss_mb'] or 0:.1f} MB" if old_commit else
                    f"the old design {lat['old_cpu_per_job']:.2f} s of CPU and "
                    f"{lat['old_rss_mb'] or 0:.0f} MB per flow-run process")
        ratio = lat["old_cpu_per_job"] / max(lat["new_cpu_per_job"], 1e-6)
        lines += [
            f"**Firing latency** ({_when(lat)}), window (after its jitter) to "
            "the command's own first instant (`date +%s.%N`):", "",
            "| what | latency |", "|---|---|",
            f"| the node, 30 rows jittered over each minute | {_stats(lat['new_idle'])} |",
            f"| the node, with 5 long jobs running | {_stats(lat['new_busy'])} |",
            f"| a cron-like fork loop, same instants, same minutes | {_stats(lat['cron'])} |",
            f"| {old_row} | {_stats(lat['old'])} |", "",
            f"**Per job, beyond its command**: the node {lat['new_cpu_per_job']:.3f} s of CPU "
            f"(node and keeper), the keeper {lat['new_keeper_rss_mb'] or 0:.1f} MB (max RSS); "
            f"{old_cost} ({ratio:.{0 if ratio >= 10 else 2}f}x the CPU)."
            + (f" The first plan (each row's windows of the next hour), from the node's spawn "
               f"to its log's `planned`, before the minutes measured: "
               f"{lat['new_first_plan_s']:.0f} s for this checkout's node, "
               f"{lat['old_first_plan_s']:.0f} s for the node before."
               if "new_first_plan_s" in lat and "old_first_plan_s" in lat else ""), ""]
    idle_found = found.get("idle")
    if idle_found:
        when = idle_found.get("measured", "")
        minutes = next((item["minutes"] for item in idle_found.values()
                        if isinstance(item, dict) and "minutes" in item), None)
        if minutes:
            when += f"; {minutes} minutes each"
        lines += [f"**An idle node's cost on the Prefect server** ({when}), per node-hour "
                  "(10 schedules, "
                  "none due; pulling from a controller that relays Prefect's events to its "
                  "long poll; requests and connections counted by a proxy in front of the "
                  "server; server CPU is the whole server's while it serves that one node, its "
                  "own services included, beside the same server alone where measured):", "",
                  "| server holds | server CPU with the node (alone) | requests | "
                  "connections opened | open (max, mean) |", "|---|---|---|---|---|"]
        for label, item in idle_found.items():
            if not isinstance(item, dict):
                continue
            alone = item.get("server_alone_cpu_s_per_hour")
            alone_text = "not measured" if alone is None else f"{alone:.2f} s"
            held = item.get("planned_runs")
            if held and f"{held:,}" not in label:
                label = f"{held:,} planned runs (the fill asked {label.split(' ')[0]})"
            if item.get("load"):
                label += f" (load {item['load'][0]:.1f}, {item['load'][1]:.1f})"
            lines.append(f"| {label} | {item['server_cpu_s_per_hour']:.2f} s ({alone_text}) | "
                         f"{item['requests_per_hour']:.1f} | "
                         f"{item['connections_opened_per_hour']:.1f} | "
                         f"{item['connections_max']}, {item['connections_mean']:.2f} |")
        shown: list[Any] = []  # each server's endpoints, once when they are the same
        for label, item in idle_found.items():
            by_endpoint = item.get("requests_per_hour_by_endpoint") if isinstance(
                item, dict) else None
            if by_endpoint and by_endpoint not in shown:
                shown.append(by_endpoint)
                lines += ["", f"Requests per node-hour by endpoint, {label}: " + ", ".join(
                    f"`{key}` {value:.1f}" for key, value in by_endpoint.items()) + "."]
        lines += [""]
    fleet_found = found.get("fleet")
    if fleet_found:
        lines += [f"**{fleet_found['nodes']} nodes on the embedded SQLite server** "
                  f"({fleet_found.get('measured', '')}; the real "
                  "node code, each pulling from the controller; started in "
                  f"{fleet_found['start_s']:.0f} s"
                  + (f", every node registered and planned after "
                     f"{fleet_found['settled_s'] / 60:.1f} min, then measured"
                     if "settled_s" in fleet_found else "")
                  + "): server CPU "
                  f"{fleet_found['server_cpu_s_per_hour']:.0f} s per hour for the whole fleet, "
                  f"{fleet_found['requests_per_node_hour']:.1f} requests per node-hour "
                  "(the real node process of the part above: "
                  f"{(idle_found or {}).get('0 planned runs', {}).get('requests_per_hour', 0):.1f}"
                  + (f"; these {fleet_found['minutes']} minutes hold none of the node's "
                     "periodic reconciles, every 15 minutes"
                     if fleet_found.get("minutes", 16) < 15 else "")
                  + "), a health probe every second answered in p50 "
                  f"{fleet_found['health_p50_ms']:.0f} ms, p99 {fleet_found['health_p99_ms']:.0f} "
                  f"ms, max {fleet_found['health_max_ms']:.0f} ms; "
                  + _busy_text(fleet_found), ""]
    out = found.get("outage")
    if out:
        late = out["starts"]
        finals = out["recorded_after_return_s"]
        states = out.get("final_states")
        lines += [f"**A {out['down_s'] / 60:.0f}-minute outage** ({_when(out)}; "
                  "the server killed, "
                  f"{out['windows']} windows of two every-minute rows): {len(late)} ran, "
                  f"{_stats(late)}; recorded after the server's return in "
                  f"{min(finals or [0]):.0f}-{max(finals or [0]):.0f} s"
                  + (f" ({len(finals)} of {out['windows']} runs in a final state: "
                     + ", ".join(f"{count} {kind}" for kind, count in states.items()) + ")"
                     if states is not None else "") + ".", ""]
    rs = found.get("restart")
    if rs and "before" in rs and "after" in rs:
        b, a = rs["before"], rs["after"]
        lines += [f"**One node's restart, nothing changed** ({_when(rs)}; "
                  f"{rs['rounds']} restarts each of the node of commit {rs['before_commit']} "
                  "and of this checkout, in turns, on one SQLite server and one controller; "
                  "medians): requests to Prefect "
                  f"{b['requests']:.0f} before, {a['requests']:.0f} after; the center's CPU "
                  "beyond its idle from the node's spawn to its exit "
                  f"{b['center_cpu_s_beyond_idle']:.3f} s before, "
                  f"{a['center_cpu_s_beyond_idle']:.3f} s after (the Prefect server "
                  f"{b['prefect_cpu_s']:.3f} s and {a['prefect_cpu_s']:.3f} s, idle included; "
                  f"the controller {b['controller_cpu_s']:.3f} s and "
                  f"{a['controller_cpu_s']:.3f} s). Before: "
                  + ", ".join(f"{k.removeprefix('prefect ')} {v}" for k, v in b["calls"].items())
                  + "; after: "
                  + ", ".join(f"{k.removeprefix('prefect ')} {v}" for k, v in a["calls"].items())
                  + ".", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--parts", default="latency,idle,fleet,outage")
    parser.add_argument("--minutes", type=int, default=4, help="latency minutes per phase")
    parser.add_argument("--idle-minutes", type=int, default=16)
    parser.add_argument("--fleet", type=int, default=200)
    parser.add_argument("--fleet-minutes", type=int, default=10)
    parser.add_argument("--restart-rounds", type=int, default=10,
                        help="restarts of each node (before, after) in the restart part")
    parser.add_argument("--fill", type=int, default=200_000,
                        help="planned runs of other nodes on the idle part's second server")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the work folder (servers' homes, the nodes' logs)")
    parser.add_argument("--filled", type=Path, default=None,
                        help="keep the Prefect server with 200,000 planned runs in this folder "
                             "and reuse it next time (filling it takes a minute or two)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-node-"))
    # The figures of the parts not run now are the last run's (each part says its date).
    found: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    parts: dict[str, Callable[[], Any]] = {
        "latency": lambda: latency(work, args.minutes),
        "idle": lambda: idle(work, args.idle_minutes, args.filled, args.fill),
        "fleet": lambda: fleet(work, args.fleet, args.fleet_minutes),
        "outage": lambda: outage(work),
        "restart": lambda: restart(work, args.restart_rounds),
    }
    failed = []
    try:
        for part in args.parts.split(","):
            load0 = os.getloadavg()[0]
            print(f"running {part} ... (load {load_text()}, {datetime.now(UTC):%H:%M:%S} UTC)",
                  flush=True)
            try:
                result = parts[part]()
            except Exception:  # the other parts still run; this one keeps its last figures
                traceback.print_exc()
                failed.append(part)
                continue
            found[part] = {**result, "measured": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
                           "load": [load0, os.getloadavg()[0]]}
            print(f"{part} done (load {load_text()}, {datetime.now(UTC):%H:%M:%S} UTC): "
                  + json.dumps(found[part], default=str), flush=True)
            (work / "found.json").write_text(json.dumps(found, default=str, indent=1))
    finally:
        print(f"work folder: {work}", flush=True)
    text = report(found)
    print(text)
    if not args.no_write:
        RESULTS.write_text(json.dumps(found, default=str, indent=1) + "\n")
        write_section(BEGIN, END, HEADING, text)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        print(f"failed parts (their last figures kept): {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
