"""The CPU one idle long poll costs the controller: a wait answered "nothing changed".

An idle node holds one wait, answered when its heartbeat is up (``timeout``), and
asks again at once on the same kept-alive connection: one *wait cycle* per
heartbeat per node, the idle fleet's largest cost (``bench/fleet_sim_findings.md``
item 2). This benchmark measures the controller's CPU per cycle, before and after a
change, in the same run:

- a throwaway PostgreSQL (pgserver) holds ``--nodes`` nodes (2 rows each) and a
  tokens file one token per node, as a fleet's controller has them;
- each server (``--before REV``: a ``git archive`` of that commit, default the one
  before the wait was made cheaper; and this tree) runs as ``sched controller serve
  --api-only`` with logging at ``info`` (one access-log line per request, as
  deployed) and the fleet watch off (its passes would count in the waits' CPU);
- ``--clients`` nodes (asyncio, one kept-alive connection each, as a node's
  ``ControllerWait``; a comma-separated list measures each load, e.g. ``100,17``:
  ~100 cycles/s is an instance with 6,000 nodes at a 60 s heartbeat, ~17/s one
  with 1,000) each pull once (their ETag), then loop for ``--seconds``:
  ``GET /api/nodes/<node>/wait?etag=<its ETag>&seen=<the last answer's>&timeout=1``,
  each answered after 1 s (the shortest timeout, so many cycles fit in a run;
  an idle cycle's work does not depend on how long it waited);
- the server's CPU (``/proc/<pid>/stat``) over the loop, less its idle CPU over
  ``--idle-seconds`` with no request (its timers: the tokens file, the pull
  recorder), divided by the cycles answered: **ms of CPU
  per idle wait cycle**; rounds alternate the servers.

From the per-cycle CPU it prints the ratio after/before and the idle cores per 1,000
nodes at a heartbeat of 60 s and others (``1000 / heartbeat x ms per cycle``; the
pulls and reports, 8 per node-hour, come on top). ``--profile SECONDS`` also runs
``py-spy`` on each server for that long under the same load and prints its top
functions (not written to the docs). ``--write-docs`` puts the table into
``docs/benchmarks.md`` between ``<!-- wait-cycle:begin -->`` and ``<!-- wait-cycle:end -->``.

Run: ``flock /tmp/bench.lock .venv/bin/python bench/bench_controller_wait.py [--write-docs]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.bench_controller_api import temporary_postgres
from bench.bench_controller_fleet import (
    exchange,
    node_name,
    node_token,
    once,
    proc_cpu,
    request_bytes,
    served_in_turns,
)
from bench.prefect_bench import publish

ROOT = Path(__file__).resolve().parent.parent

MARKERS = ("<!-- wait-cycle:begin -->", "<!-- wait-cycle:end -->")
BEFORE_REV = "0d6642b"
"""The commit before the wait was made cheaper."""
HEARTBEATS = (60.0, 300.0, 600.0)


@dataclass
class Round:
    server: str
    clients: int
    cycles: int
    seconds: float
    cpu_s: float
    idle_cpu_per_s: float
    statuses: Counter[str] = field(default_factory=Counter)

    @property
    def wait_cpu_s(self) -> float:
        return max(0.0, self.cpu_s - self.idle_cpu_per_s * self.seconds)


def ms_per_cycle(rounds: list[Round]) -> float:
    return sum(r.wait_cpu_s for r in rounds) / max(1, sum(r.cycles for r in rounds)) * 1000


def measure(name: str, port: int, pid: int, *, clients: int, seconds: float,
            idle_seconds: float) -> Round:
    """Idle CPU with no request, then clients' wait loops for seconds."""
    counts: Counter[str] = Counter()

    async def go() -> tuple[int, float, float, float]:
        started = asyncio.Event()
        deadline = [time.perf_counter() + 10_000.0]
        tasks: list[asyncio.Task[int]] = []

        async def node(i: int) -> int:
            return await node_loop(port, i, deadline, counts, started)

        tasks = [asyncio.create_task(node(i)) for i in range(clients)]
        await asyncio.sleep(max(2.0, clients / 200))  # every node has its ETag and connection
        idle_before = proc_cpu(pid)
        await asyncio.sleep(idle_seconds)
        idle = (proc_cpu(pid) - idle_before) / idle_seconds
        cpu_before = proc_cpu(pid)
        t0 = time.perf_counter()
        deadline[0] = t0 + seconds
        started.set()
        cycles = sum(await asyncio.gather(*tasks))
        elapsed = time.perf_counter() - t0
        return cycles, elapsed, proc_cpu(pid) - cpu_before, idle

    cycles, elapsed, cpu, idle = asyncio.run(go())
    row = Round(name, clients, cycles, elapsed, cpu, idle, counts)
    print(f"  {name}: {cycles:,} cycles in {elapsed:.1f} s, server {cpu / elapsed:.3f} core "
          f"(idle {idle:.3f}), {ms_per_cycle([row]):.2f} ms of CPU per cycle", flush=True)
    return row


async def node_loop(port: int, index: int, deadline: list[float], counts: Counter[str],
                    started: asyncio.Event) -> int:
    """One node: pull its ETag, then wait (timeout 1 s) until deadline[0]; return the cycles."""
    auth = {"authorization": f"Bearer {node_token(index)}"}
    answer = await once("127.0.0.1", port, request_bytes(
        "GET", f"/api/schedules?node={node_name(index)}", "127.0.0.1", auth))
    etag = answer.headers.get("etag", "")
    seen = ""
    cycles = 0
    await started.wait()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline[0]:
            target = (f"/api/nodes/{node_name(index)}/wait?etag={etag}&seen={seen}"
                      "&timeout=1").replace('"', "%22")
            answer = await asyncio.wait_for(
                exchange(reader, writer, request_bytes("GET", target, "127.0.0.1", auth)), 30)
            counts[str(answer.status)] += 1
            if answer.status != 200:
                raise RuntimeError(f"wait answered {answer.status}: {answer.body[:200]!r}")
            data = json.loads(answer.body)
            if data["etag"] != etag:
                counts["changed"] += 1
            seen = data["prefect"]
            cycles += 1
    finally:
        writer.close()
    return cycles


def profile(pid: int, seconds: float, port: int, clients: int, raw_copy: str = "") -> str:
    """Run py-spy on pid for seconds under the wait load; return its top functions."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.txt"
        proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                 "--format", "raw", "--output", str(out), "--nonblocking",
                                 "--gil", "--rate", "500"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        measure("profiled", port, pid, clients=clients, seconds=seconds, idle_seconds=1)
        proc.wait()
        if not out.exists():
            return "py-spy wrote nothing"
        if raw_copy:
            shutil.copy(out, raw_copy)
        return top_functions(out.read_text())


def top_functions(raw: str, limit: int = 40) -> str:
    """Return the functions with most samples (self and inclusive) from py-spy's raw output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        if frames[0].startswith(("process ", "thread ")):
            frames = frames[1:]
        if not frames:
            continue
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples; self:"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in own.most_common(limit)]
    lines.append("inclusive:")
    lines += [f"  {n / total:6.1%}  {name}" for name, n in inclusive.most_common(limit)]
    return "\n".join(lines)


def archive(rev: str, into: Path) -> str:
    """Extract rev's tree into into; return its short hash."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                           check=True, capture_output=True, text=True).stdout.strip()
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=data, check=True)
    return short


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000,
                        help="nodes (2 rows and a token each) in the database")
    parser.add_argument("--clients", default="100,17",
                        help="nodes waiting at once (a comma-separated list: each a load)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of waits per round")
    parser.add_argument("--idle-seconds", type=float, default=5.0,
                        help="seconds of the server's idle CPU measured before each round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", default=BEFORE_REV,
                        help="the commit measured as before ('' for this tree only)")
    parser.add_argument("--profile", type=float, default=0.0,
                        help="also py-spy each server for this many seconds under the load")
    parser.add_argument("--profile-raw", default="",
                        help="keep py-spy's raw stacks in this path (.0, .1 per server)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    loads_asked = [int(item) for item in str(args.clients).split(",") if item.strip()]

    loads = [os.getloadavg()]
    rounds: list[Round] = []
    profiles: dict[str, str] = {}
    with temporary_postgres() as url, tempfile.TemporaryDirectory(prefix="bench-wait-") as tmp:
        servers: list[tuple[str, Path]] = []
        if args.before:
            before_tree = Path(tmp) / "before"
            before_tree.mkdir()
            servers.append((f"before ({archive(args.before, before_tree)})", before_tree))
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "controller"],
                               capture_output=True, text=True).stdout.strip()
        servers.append((f"after ({head}{' + changes' if dirty else ''})", ROOT))
        for rnd, name, _, port, pid in served_in_turns(url, Path(tmp), args.nodes, servers,
                                                       args.rounds, loads):
            for clients in loads_asked:
                rounds.append(measure(name, port, pid, clients=clients, seconds=args.seconds,
                                      idle_seconds=args.idle_seconds))
            if args.profile and rnd == args.rounds - 1:
                raw = f"{args.profile_raw}.{len(profiles)}" if args.profile_raw else ""
                profiles[name] = profile(pid, args.profile, port, loads_asked[0], raw)
    for name, text in profiles.items():
        print(f"--- py-spy, {name}\n{text}")
    section = render(rounds, args, loads)
    publish(section, *MARKERS, "## The controller's idle long poll: CPU per wait cycle",
            write=args.write_docs)


def render(rounds: list[Round], args: argparse.Namespace,
           loads: list[tuple[float, float, float]]) -> str:
    names = list(dict.fromkeys(r.server for r in rounds))
    levels = list(dict.fromkeys(r.clients for r in rounds))
    lines = [
        f"`bench/bench_controller_wait.py`: one `sched controller serve --api-only` process on "
        f"PostgreSQL (pgserver, Unix socket) with {args.nodes:,} nodes (2 rows each) and one "
        "token per node; N nodes each hold a wait on a kept-alive connection (`timeout=1`, "
        "answered \"nothing changed\" after 1 s) and ask again at once: N cycles a second, "
        "as an instance holding N x 60 nodes at a 60 s heartbeat. "
        f"{args.seconds:g} s per load, {args.rounds} round(s) alternating the servers. Server "
        "CPU from `/proc/<pid>/stat` less its idle CPU (measured before each load with no "
        "request), per cycle answered; logging at `info`, the fleet watch off. Idle cores per "
        "1,000 nodes = 1,000 / heartbeat x CPU per cycle (the pulls and reports, 8 per "
        "node-hour, come on top).",
        "",
        "| server | N (cycles/s) | cycles | server cores | CPU ms per wait cycle | vs before "
        + "".join(f"| cores per 1,000 nodes, heartbeat {h:g} s " for h in HEARTBEATS) + "|",
        "|---|---:|---:|---:|---:|---:" + "|---:" * len(HEARTBEATS) + "|",
    ]
    for level in levels:
        base = ms_per_cycle([r for r in rounds if r.server == names[0] and r.clients == level])
        for name in names:
            group = [r for r in rounds if r.server == name and r.clients == level]
            seconds = sum(r.seconds for r in group)
            cycles = sum(r.cycles for r in group)
            cores = sum(r.cpu_s for r in group) / seconds
            ms = ms_per_cycle(group)
            lines.append(
                f"| {name} | {level} | {cycles:,} | {cores:.3f} | {ms:.2f} | {ms / base:.2f} "
                + "".join(f"| {1000 / h * ms / 1000:.3f} " for h in HEARTBEATS) + "|")
    statuses: Counter[str] = Counter()
    for r in rounds:
        statuses.update(r.statuses)
    lines += [
        "",
        f"Answers: {dict(statuses)}. Load average (1 min) at the start and after each "
        "server: " + ", ".join(f"{load[0]:.2f}" for load in loads)
        + f". Machine: {platform.machine()}, {os.cpu_count()} CPUs shared with other work, "
        f"Python {platform.python_version()}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
