"""What recording one job costs the Prefect server: the old step list against the new one.

One throwaway Prefect server (SQLite, as ``make run`` starts it). Each path records
the same kind of job, a planned window's, as the node does live: the job's start
(one try, its node lines and first output) is recorded, then its end (the rest
of the output, the exit line). Per job the benchmark counts the requests (by
endpoint) and the server's CPU (``tree_cpu`` of its process group: user + system,
its services included) from before the first request until the server has
stored everything (the task runs and events it writes from its queue), less
what the same server uses idle for as long (measured in between).

Each path is a node's recorder in a process of its own (``bench/record_side.py``), one
client for all its rounds as the node holds one. The old path is the node of commit
:data:`OLD_COMMIT` (its code under ``flows/``, its hand-written REST client), run from a git
worktree of that commit under the temporary folder; the new one is the working tree's
(``sched_node/``, Prefect's client). The two alternate in rounds of :data:`JOBS` jobs each,
on one server, after a warm-up round of each that is not counted (so a process's first
requests, Prefect's ``GET /csrf-token`` among them, are not a job's).

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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.prefect_bench import (
    ROOT,
    load_text,
    machine,
    start_server,
    stop_group,
    tree_cpu,
    write_section,
)

OLD_COMMIT = "af9e7ab"
"""main before the node moved to ``sched_node/`` and recorded through Prefect's client (its
code under ``flows/``: a planned window's run set Running by ``bulk_set_state``, a try's task
run created Running, one logs POST per pass)."""
JOBS = 30
LINES = 20
"""Command output lines per job (half at the start's record, half at the end's;
bench/record_side.py's)."""
SETTLE_S = 8.0
"""Seconds after a round's last request for the server to store what it queued (events,
task runs: its flush interval is a few seconds); the idle CPU for as long is subtracted."""
BEGIN, END = "<!-- record:begin -->", "<!-- record:end -->"
LEAN_BEGIN, LEAN_END = "<!-- record-lean:begin -->", "<!-- record-lean:end -->"
PARSERS_BEGIN, PARSERS_END = "<!-- record-parsers:begin -->", "<!-- record-parsers:end -->"
SIDE = Path(__file__).resolve().parent / "record_side.py"


@dataclass
class Variant:
    """One path: the tree its node's code comes from, its package there, and its options."""

    tree: Path
    package: str = "sched_node"
    lean: bool = False


class Side:
    """A path's recorder process (bench/record_side.py), asked over its stdin and stdout."""

    def __init__(self, name: str, path: Variant, url: str, work: Path) -> None:
        self.name = name
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("SCHED_", "PREFECT_"))}
        env.update({"PYTHONPATH": str(path.tree), "PREFECT_API_URL": url,
                    "PREFECT_HOME": str(work / f"home-{name}")})
        argv = [sys.executable, str(SIDE), "--package", path.package, "--url", url,
                "--work", str(work / name)] + (["--lean"] if path.lean else [])
        self.log = (work / f"side-{name}.log").open("ab")
        self.proc = subprocess.Popen(argv, cwd=path.tree, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        files = self._read()["files"]
        wrong = [f for f in files.values() if not Path(f).is_relative_to(path.tree)]
        if wrong:
            raise SystemExit(f"{name}: the node's code came from outside {path.tree}: {wrong}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                found: dict[str, Any] = json.loads(line[3:])
                return found
        raise SystemExit(f"{self.name}: the recorder process ended (see its log, "
                         f"{self.log.name})")

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        stop_group(self.proc, grace_s=5)  # type: ignore[arg-type]
        self.log.close()


def round_of(side: Side, server_pid: int, jobs: int, idle_rate: float) -> dict[str, Any]:
    """Record jobs planned windows' jobs with one path; return its calls and server CPU."""
    side.ask(op="plan", jobs=jobs)  # the plan, made beforehand: not counted
    time.sleep(SETTLE_S)
    cpu0, wall0 = tree_cpu(server_pid), time.monotonic()
    found = side.ask(op="record")
    busy = time.monotonic() - wall0
    time.sleep(SETTLE_S)
    cpu = tree_cpu(server_pid) - cpu0 - idle_rate * (time.monotonic() - wall0)
    return {"path": side.name, "jobs": found["jobs"], "calls": found["calls"],
            "busy_answers": found["busy"], "cpu_s": cpu, "busy_s": busy,
            "load": os.getloadavg()[0]}


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
    work = Path(tempfile.mkdtemp(prefix="bench-record-"))
    old_tree = work / f"tree-{OLD_COMMIT}"
    paths: dict[str, Variant] = (
        {"full": Variant(ROOT), "lean": Variant(ROOT, lean=True)} if args.lean
        else {"h11": Variant(ROOT), "httptools": Variant(ROOT)} if args.parsers
        else {"old": Variant(old_tree, "flows"), "new": Variant(ROOT)})
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    sides: dict[str, Side] = {}
    results: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    idles: list[float] = []
    load_start = load_text()
    try:
        if "old" in paths:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                            str(old_tree), OLD_COMMIT], check=True, capture_output=True)
        if args.parsers:
            servers["h11"] = start_server(work / "h11", late_runs=False,
                                          uvicorn=("h11", "asyncio"))
            servers["httptools"] = start_server(work / "httptools", late_runs=False,
                                                uvicorn=("httptools", "uvloop"))
        else:
            servers = dict.fromkeys(paths, start_server(work / "prefect", late_runs=False))
        for path, variant in paths.items():
            sides[path] = Side(path, variant, servers[path][1], work)
        time.sleep(10)  # the server's start-up work
        for path, side in sides.items():  # warm-up (first queries, caches): dropped
            proc, _url = servers[path]
            round_of(side, proc.pid, 3, idle(proc.pid, 2.0))
        for number in range(args.rounds):
            for path in (list(paths) if number % 2 == 0 else list(reversed(paths))):
                proc, _url = servers[path]
                rate = idle(proc.pid, 2 * SETTLE_S)
                idles.append(rate)
                found = round_of(sides[path], proc.pid, args.jobs, rate)
                results[path].append(found)
                per_job = sum(count for key, count in found["calls"].items()
                              if not key.startswith("WS ")) / found["jobs"]
                print(f"round {number + 1} {path}: {per_job:.2f} requests and "
                      f"{1000 * found['cpu_s'] / found['jobs']:.1f} ms of server CPU per job "
                      f"(idle {1000 * rate:.1f} ms/s; load {load_text()})", flush=True)
    finally:
        for side in sides.values():
            side.close()
        for proc, _url in set(servers.values()):
            stop_group(proc)
        if "old" in paths:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(old_tree)], check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    args.load = (load_start, load_text())
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
        requests = sum(count for key, count in calls.items() if not key.startswith("WS "))
        return requests / jobs, 1000 * cpu / jobs, calls

    def messages(by: Counter[str]) -> float:
        """Events sent over Prefect's event websocket per job (no HTTP request)."""
        return sum(count for key, count in by.items() if key.startswith("WS ")) / jobs

    old_calls, old_cpu, old_by = totals(a)
    new_calls, new_cpu, new_by = totals(b)
    jobs = sum(item["jobs"] for item in results[a])
    rows = sorted(set(old_by) | set(new_by))
    per_round = "; ".join(
        f"{1000 * o['cpu_s'] / o['jobs']:.1f} / {1000 * n['cpu_s'] / n['jobs']:.1f} "
        f"(load {o['load']:.1f} / {n['load']:.1f})"
        for o, n in zip(results[a], results[b], strict=True))
    busy = {path: sum(item["busy_answers"] for item in results[path]) for path in (a, b)}
    where = (f" The old path is the node of commit {OLD_COMMIT} (`flows/`, its own REST "
             "client) run from a git worktree of that commit, the new one this checkout's "
             "(`sched_node/`, Prefect's client); each in a process of its own with one client "
             "for all its rounds, after a warm-up round not counted."
             if a == "old" else "")
    servers_text = "two SQLite servers, one per path" if args.parsers else "one SQLite server"
    lines = [
        f"On {machine(start=args.load[0])}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. "
        f"`.venv/bin/python bench/bench_record.py --rounds {args.rounds} --jobs {args.jobs}"
        f"{' --lean' if args.lean else ' --parsers' if args.parsers else ''}`: "
        f"{servers_text}; per path {jobs} jobs of planned windows, each recorded as the node "
        f"records it live (its start, then its end; {LINES} output lines and 3 node lines), "
        f"the paths alternating in rounds. Server CPU is the server's process group from the "
        f"first request until it has stored what it queued, less its idle CPU for as long "
        f"(measured before each round: {1000 * min(idles):.1f}-{1000 * max(idles):.1f} ms/s)."
        f"{where} Busy answers (429/503, each asked again and counted): {busy[a]} {a}, "
        f"{busy[b]} {b}.",
        "",
        HEADS.get(a, f"| per job | {a} | {b} | {b} / {a} |"),
        "|---|---|---|---|",
        f"| requests to Prefect | {old_calls:.2f} | {new_calls:.2f} | "
        f"{new_calls / old_calls:.2f} |",
        f"| server CPU | {old_cpu:.1f} ms | {new_cpu:.1f} ms | {new_cpu / old_cpu:.2f} |",
    ]
    if messages(old_by) or messages(new_by):
        lines.append(f"| events on Prefect's event websocket (no HTTP request; Prefect's "
                     f"client opens it and keeps it) | {messages(old_by):g} | "
                     f"{messages(new_by):g} | |")
    lines += [
        "",
        f"Server CPU per job in each round, {a} / {b} (ms; the 1-minute load average at the "
        f"round's end): {per_round}.",
        "",
        f"| request | {a} per job | {b} per job |",
        "|---|---|---|",
    ]
    lines += [f"| `{row}` | {old_by[row] / jobs:g} | {new_by[row] / jobs:g} |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
