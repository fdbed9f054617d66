"""What recording one job costs the Prefect server: the old step list against the new one.

One throwaway Prefect server (SQLite, as ``make run`` starts it). Each path records
the same kind of job, a planned window's, as the node does live: the job's start
(one try, its node lines and first output) is recorded, then its end (the rest
of the output, the exit line). Per job the benchmark counts the requests (by
endpoint) and the server's CPU (``tree_cpu`` of its process group: user + system,
its services included) from before the first request until the server has
stored everything (the task runs and events it writes from its queue), less
what the same server uses idle for as long (measured in between).

The old path is the recorder of commit :data:`OLD_COMMIT` (the last before the
change), loaded from git into modules of its own; the new one is the working
tree's. The two alternate in rounds of :data:`JOBS` jobs each, on one server, after
a warm-up round of each that is not counted.

With ``--lean`` the two paths are the working tree's recorder as the node runs it by
default (``full``) and with ``record_task_run`` and ``record_artifact`` off (``lean``).
With ``--parsers`` they are the working tree's recorder against two servers of their
own, one on uvicorn's pure-Python parser and loop (``h11``: h11 and asyncio, what
uvicorn picks without httptools and uvloop installed) and one on the fast ones
(``httptools``: httptools and uvloop, what it picks with them, as this project
installs it). Each is published in a section of its own.

``python bench/bench_record.py [--rounds 4] [--jobs 30] [--lean | --parsers] [--write-docs]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.prefect_bench import ROOT, machine, start_server, stop_group, tree_cpu, write_section
from sched_node.identity import JobRef
from sched_node.outbox import COMPLETED, JobFolder, JobSpec, Outbox, job_id_for, utc_text
from sched_node.prefect_api import ApiSettings, PrefectApi, state_body
from sched_node.recorder import Recorder
from sched_node.registration import RUN_JOB, Deployments

OLD_COMMIT = "9e32aaf"
"""main before the record took fewer calls (bulk_set_state, the task run created Running, one
logs POST per pass)."""
JOBS = 30
LINES = 20
"""Command output lines per job (half at the start's record, half at the end's)."""
SETTLE_S = 8.0
"""Seconds after a round's last request for the server to store what it queued (events,
task runs: its flush interval is a few seconds); the idle CPU for as long is subtracted."""
BEGIN, END = "<!-- record:begin -->", "<!-- record:end -->"
LEAN_BEGIN, LEAN_END = "<!-- record-lean:begin -->", "<!-- record-lean:end -->"
PARSERS_BEGIN, PARSERS_END = "<!-- record-parsers:begin -->", "<!-- record-parsers:end -->"


def old_recorder() -> type[Recorder]:
    """Return the Recorder class of OLD_COMMIT (its record_steps with it), loaded from git."""
    modules: dict[str, types.ModuleType] = {}
    for name in ("record_steps", "recorder"):
        source = subprocess.run(["git", "show", f"{OLD_COMMIT}:flows/{name}.py"], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
        source = source.replace("from flows.record_steps import", "from old_record_steps import")
        spec = importlib.util.spec_from_loader(f"old_{name}", loader=None)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"old_{name}"] = module
        exec(compile(source, f"{OLD_COMMIT}:flows/{name}.py", "exec"), module.__dict__)
        modules[name] = module
    recorder: type[Recorder] = modules["recorder"].Recorder
    return recorder


class Counting:
    """A PrefectApi whose requests are counted by endpoint (ids shown as ``{id}``)."""

    def __init__(self, url: str) -> None:
        self.calls: Counter[str] = Counter()
        base = httpx.URL(url).path.rstrip("/")

        def note(request: httpx.Request) -> None:
            self.calls[f"{request.method} {id_template(request.url.path.removeprefix(base))}"] += 1

        self.client = httpx.Client(base_url=url, event_hooks={"request": [note]}, timeout=30)
        self.api = PrefectApi(ApiSettings(url=url), client=self.client)


def id_template(path: str) -> str:
    """Return an API path with each id in it written ``{id}`` (tests/test_record_calls.py's too)."""
    return "/".join("{id}" if _is_uuid(part) else part for part in path.split("/"))


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _spec(node: str, window: datetime) -> tuple[JobRef, JobSpec]:
    ref = JobRef(node=node, action="backup", schedule_id="nightly", trigger_key="schedule",
                 window=window, key=f"nightly@{window.isoformat()}")
    spec = JobSpec(job_id=job_id_for(window, ref.idempotency_key), kind="job", node=node,
                   schedule_id="nightly", action="backup", trigger_key="schedule",
                   window=window, key=ref.key, run_name=ref.name(),
                   idempotency_key=ref.idempotency_key, flow_run_id=None, planned_start=window,
                   accepted_at=window, reason="window on time", argv=["restic", "backup"],
                   timeout_s=3600, tags=ref.tags(), parameters=ref.parameters())
    return ref, spec


def _write_start(folder: JobFolder, at: datetime) -> None:
    folder.append({"e": "accepted", "at": utc_text(at)})
    folder.log(at, "start guard: window on time")
    folder.log(at, "job backup of schedule nightly")
    folder.append({"e": "launch", "at": utc_text(at), "attempt": 1})
    folder.append({"e": "spawned", "at": utc_text(at), "attempt": 1, "shim_pid": 4242})
    folder.attempt_path(1, "started").write_text(json.dumps({"pid": 4243, "at": utc_text(at)}))
    _output(folder, at, range(LINES // 2))


def _output(folder: JobFolder, at: datetime, numbers: range) -> None:
    with folder.attempt_path(1, "out").open("a") as handle:
        for n in numbers:
            stamp = utc_text(at + timedelta(seconds=n))
            handle.write(json.dumps({"t": stamp, "m": f"processed file {n}"}) + "\n")


def _write_end(folder: JobFolder, at: datetime, ended: datetime) -> None:
    _output(folder, at, range(LINES // 2, LINES))
    folder.attempt_path(1, "exit").write_text(json.dumps({
        "exit_code": 0, "timed_out": False, "cancelled": False, "at": utc_text(ended),
        "lines": LINES}))
    folder.append({"e": "end", "at": utc_text(ended), "state": COMPLETED,
                   "message": "restic exited 0"})
    folder.log(ended, "restic exited 0")


def round_of(path: str, recorder_class: Callable[..., Recorder], url: str, server_pid: int,
             work: Path, jobs: int, idle_rate: float) -> dict[str, Any]:
    """Record jobs planned windows' jobs with one path; return its calls and server CPU."""
    node = f"bench-{path}-{uuid.uuid4().hex[:6]}"
    counting = Counting(url)
    api = counting.api
    outbox = Outbox(work / node, max_bytes=1 << 30)
    deployments = Deployments(api, node, tags=["sched-agent"])
    recorder = recorder_class(api, outbox, deployments, node=node,
                              clock=lambda: datetime.now(UTC),
                              done=lambda folder: shutil.rmtree(folder.path))
    base = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    windows = [base + timedelta(minutes=n) for n in range(jobs)]
    refs = [_spec(node, window) for window in windows]
    api.create_runs(deployments.get()[RUN_JOB], [{   # the plan, made beforehand: not counted
        "name": ref.name(), "parameters": ref.parameters(), "tags": ref.tags(),
        "idempotency_key": ref.idempotency_key,
        "state": state_body("SCHEDULED", scheduled_time=spec.planned_start),
        "enforce_parameter_schema": False} for ref, spec in refs])
    time.sleep(SETTLE_S)
    counting.calls.clear()
    cpu0, wall0 = tree_cpu(server_pid), time.monotonic()
    for (_ref, spec), window in zip(refs, windows, strict=True):
        started = window + timedelta(seconds=0.05)
        folder = outbox.create(spec)
        _write_start(folder, started)
        if not recorder.drain():
            raise SystemExit(f"{path}: the job's start left nothing open")
        _write_end(folder, started, started + timedelta(seconds=LINES + 5))
        if recorder.drain():
            raise SystemExit(f"{path}: a job's record is not complete")
    busy = time.monotonic() - wall0
    time.sleep(SETTLE_S)
    cpu = tree_cpu(server_pid) - cpu0 - idle_rate * (time.monotonic() - wall0)
    counting.client.close()
    return {"path": path, "jobs": jobs, "calls": dict(counting.calls), "cpu_s": cpu,
            "busy_s": busy}


def idle(server_pid: int, seconds: float) -> float:
    """Return the server's CPU seconds per second while nothing asks it anything."""
    cpu0, wall0 = tree_cpu(server_pid), time.monotonic()
    time.sleep(seconds)
    return (tree_cpu(server_pid) - cpu0) / (time.monotonic() - wall0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--lean", action="store_true",
                        help="compare the node's default record with record_task_run and "
                        "record_artifact off")
    parser.add_argument("--parsers", action="store_true",
                        help="compare two servers: uvicorn on h11 and asyncio, and on "
                        "httptools and uvloop")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    paths: dict[str, Callable[..., Recorder]] = (
        {"full": Recorder, "lean": partial(Recorder, task_run=False, artifact=False)}
        if args.lean else {"h11": Recorder, "httptools": Recorder} if args.parsers
        else {"old": old_recorder(), "new": Recorder})
    work = Path(tempfile.mkdtemp(prefix="bench-record-"))
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    results: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    idles: list[float] = []
    try:
        if args.parsers:
            servers["h11"] = start_server(work / "h11", late_runs=False,
                                          uvicorn=("h11", "asyncio"))
            servers["httptools"] = start_server(work / "httptools", late_runs=False,
                                                uvicorn=("httptools", "uvloop"))
        else:
            servers = dict.fromkeys(paths, start_server(work / "prefect", late_runs=False))
        time.sleep(10)  # the server's start-up work
        for path, recorder_class in paths.items():  # warm-up (first queries, caches): dropped
            proc, url = servers[path]
            round_of(path, recorder_class, url, proc.pid, work, 3, idle(proc.pid, 2.0))
        for number in range(args.rounds):
            for path, recorder_class in (paths.items() if number % 2 == 0
                                         else reversed(paths.items())):
                proc, url = servers[path]
                rate = idle(proc.pid, 2 * SETTLE_S)
                idles.append(rate)
                found = round_of(path, recorder_class, url, proc.pid, work, args.jobs, rate)
                results[path].append(found)
                per_job = sum(found["calls"].values()) / found["jobs"]
                print(f"round {number + 1} {path}: {per_job:.2f} calls and "
                      f"{1000 * found['cpu_s'] / found['jobs']:.1f} ms of server CPU per job "
                      f"(idle {1000 * rate:.1f} ms/s)", flush=True)
    finally:
        for proc, _url in set(servers.values()):
            stop_group(proc)
        shutil.rmtree(work, ignore_errors=True)
    text = report(results, idles, args, *paths)
    print(text)
    if args.write_docs and args.lean:
        write_section(LEAN_BEGIN, LEAN_END, "## A leaner record for a large fleet (Prefect)", text)
    elif args.write_docs and args.parsers:
        write_section(PARSERS_BEGIN, PARSERS_END,
                      "## uvicorn's parser and loop under Prefect's API (Prefect)", text)
    elif args.write_docs:
        write_section(BEGIN, END, "## Recording a job: requests and server CPU (Prefect)", text)
    return 0


HEADS = {
    "old": f"| per job | old (commit {OLD_COMMIT}) | new | new / old |",
    "full": "| per job | full (the default) | lean (`record_task_run` and `record_artifact` "
            "off) | lean / full |",
    "h11": "| per job | h11 and asyncio | httptools and uvloop (installed) | httptools / h11 |",
}
"""The first table's head for each comparison (by its first path)."""


def report(results: dict[str, list[dict[str, Any]]], idles: list[float],
           args: argparse.Namespace, a: str, b: str) -> str:
    """Return the docs section."""
    def totals(path: str) -> tuple[float, float, Counter[str]]:
        jobs = sum(item["jobs"] for item in results[path])
        calls: Counter[str] = Counter()
        for item in results[path]:
            calls.update(item["calls"])
        cpu = sum(item["cpu_s"] for item in results[path])
        return sum(calls.values()) / jobs, 1000 * cpu / jobs, calls

    old_calls, old_cpu, old_by = totals(a)
    new_calls, new_cpu, new_by = totals(b)
    jobs = sum(item["jobs"] for item in results[a])
    rows = sorted(set(old_by) | set(new_by))
    per_round = "; ".join(
        f"{1000 * o['cpu_s'] / o['jobs']:.1f} / {1000 * n['cpu_s'] / n['jobs']:.1f}"
        for o, n in zip(results[a], results[b], strict=True))
    servers_text = "two SQLite servers, one per path" if args.parsers else "one SQLite server"
    lines = [
        f"On {machine()}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. "
        f"`.venv/bin/python bench/bench_record.py --rounds {args.rounds} --jobs {args.jobs}"
        f"{' --lean' if args.lean else ' --parsers' if args.parsers else ''}`: "
        f"{servers_text}; per path {jobs} jobs of planned windows, each recorded as the node "
        f"records it live (its start, then its end; {LINES} output lines and 3 node lines), "
        f"the paths alternating in rounds. Server CPU is the server's process group from the "
        f"first request until it has stored what it queued, less its idle CPU for as long "
        f"(measured before each round: {1000 * min(idles):.1f}-{1000 * max(idles):.1f} ms/s).",
        "",
        HEADS.get(a, f"| per job | {a} | {b} | {b} / {a} |"),
        "|---|---|---|---|",
        f"| requests to Prefect | {old_calls:.2f} | {new_calls:.2f} | "
        f"{new_calls / old_calls:.2f} |",
        f"| server CPU | {old_cpu:.1f} ms | {new_cpu:.1f} ms | {new_cpu / old_cpu:.2f} |",
        "",
        f"Server CPU per job in each round, {a} / {b} (ms): {per_round}.",
        "",
        f"| request | {a} per job | {b} per job |",
        "|---|---|---|",
    ]
    lines += [f"| `{row}` | {old_by[row] / jobs:g} | {new_by[row] / jobs:g} |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
