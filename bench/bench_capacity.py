"""The controller under floods from one client, and a 1,000-node change storm (issue 36).

One ``sched controller serve --api-only`` with its defaults, on the embedded SQLite, with
``--nodes`` nodes' rows and tokens (``bench/bench_controller_fleet.py``'s). Healthy nodes'
pulls (``GET /api/schedules?node=N`` with ``If-None-Match``: a 304, a new connection each,
as a node's) go on for ``--seconds`` per scenario, one every 50 ms, while another process
(the attacker) does one of:

1. nothing (the baseline of this run);
2. **long polls**: ``--attackers`` (320) waits at once with one node's token, each sent
   again 1 s after it is answered;
3. **slow login forms**: 320 ``POST /login`` whose body never finishes (a byte a second),
   no token, each opened again 1 s after the server closes it;
4. **reports**: 2,000 large reports (1,000 job records, ~0.3 MB) from one node, 20 at once,
   a new connection each.

Per scenario: the healthy pulls' p50 / p99 / max and their ratio to the baseline, their
answers (a 5xx or no answer is a failure), what the attacker got, the server's CPU and the
1-minute load average beside. Then (``--storm``) the 1,000-node change storm of
``bench/bench_controller_fleet.py fleet`` against the same server (each node holding its
long poll, pulling and reporting on changes). ``--before-tree DIR`` runs the same against
the code in DIR too (e.g. ``git worktree add /tmp/before main``), in the same run.

Usage: ``flock /tmp/bench.lock .venv/bin/python bench/bench_capacity.py [--write-docs]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.bench_controller_fleet import node_name as name_of
from bench.bench_controller_fleet import node_token as token_of
from bench.bench_controller_fleet import (
    once,
    pct,
    proc_cpu,
    raise_nofile,
    request_bytes,
    serve,
    tokens_toml,
    write_private,
)
from bench.prefect_bench import publish

ROOT = Path(__file__).resolve().parent.parent
MARKERS = ("<!-- capacity:begin -->", "<!-- capacity:end -->")
ADMIN = "bench-capacity-admin-token-0123456789"
HOST = "127.0.0.1"
PROBE_EVERY_S = 0.05
HEALTHY = range(1, 200)
"""The nodes whose pulls are measured; node 0 is the attacker's."""


@dataclass
class Outcome:
    tree: str
    scenario: str
    latencies: list[float] = field(default_factory=list)
    answers: Counter[str] = field(default_factory=Counter)
    attacker: dict[str, int] = field(default_factory=dict)
    cpu_cores: float = 0.0
    load: float = 0.0


# --- the attacker, in a process of its own ------------------------------------------------


def _auth(index: int) -> dict[str, str]:
    return {"authorization": f"Bearer {token_of(index)}"}


async def _waits(port: int, count: int, stop: Any, got: Counter[str]) -> None:
    raw = request_bytes("GET", f"/api/nodes/{name_of(0)}/wait?timeout=300", HOST, _auth(0))

    async def one() -> None:
        while not stop.is_set():
            try:
                got[str((await once(HOST, port, raw, timeout=330)).status)] += 1
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                got["no answer"] += 1
            await asyncio.sleep(1.0)

    await _until(stop, [one() for _ in range(count)])


async def _slow_logins(port: int, count: int, stop: Any, got: Counter[str]) -> None:
    head = (b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\ntoken=")

    async def one() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(HOST, port)
            except OSError:
                got["no connection"] += 1
                await asyncio.sleep(1.0)
                continue
            writer.write(head)
            try:
                while not stop.is_set():
                    try:
                        answer = await asyncio.wait_for(reader.read(200), 1.0)
                    except TimeoutError:
                        writer.write(b"a")  # one more byte a second: never finished
                        continue
                    status = answer.split(b" ", 2)[1].decode() if answer else "closed"
                    got[status] += 1
                    break
            except OSError:
                got["reset"] += 1
            finally:
                writer.close()
            await asyncio.sleep(1.0)

    await _until(stop, [one() for _ in range(count)])


def large_report() -> bytes:
    jobs = [{"key": f"s-{i % 50}@2026-12-07T02:{i % 60:02d}:00Z-{i}", "schedule_id": f"s-{i % 50}",
             "window": "2026-12-07T02:30:00Z", "trigger_key": "schedule", "state": "Failed",
             "started_at": "2026-12-07T02:30:01Z", "ended_at": "2026-12-07T02:31:00Z",
             "error": "restic exited with code 1: " + "x" * 180, "offline": False, "seq": i}
            for i in range(1000)]
    return json.dumps({"agent_version": "0.1.0", "timezone": "UTC", "grace_s": 300,
                       "reported_at": "2026-12-07T07:31:00Z", "schedules": [],
                       "jobs": jobs}).encode()


async def _reports(port: int, count: int, stop: Any, got: Counter[str]) -> None:
    raw = request_bytes("POST", f"/api/nodes/{name_of(0)}/report", HOST,
                        {**_auth(0), "content-type": "application/json"}, large_report())
    left = [count]

    async def one() -> None:
        while left[0] > 0 and not stop.is_set():
            left[0] -= 1
            try:
                got[str((await once(HOST, port, raw, timeout=60)).status)] += 1
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                got["no answer"] += 1

    await _until(stop, [one() for _ in range(20)])


async def _until(stop: Any, work: list[Any]) -> None:
    tasks = [asyncio.ensure_future(item) for item in work]
    while not stop.is_set() and not all(task.done() for task in tasks):
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


ATTACKS = {"long polls": _waits, "slow login forms": _slow_logins, "reports": _reports}


def _attack(kind: str, port: int, count: int, stop: Any, shared: Any) -> None:
    raise_nofile()
    got: Counter[str] = Counter()

    async def main() -> None:
        reporter = asyncio.ensure_future(_share(got, shared, stop))
        await ATTACKS[kind](port, count, stop, got)
        reporter.cancel()

    asyncio.run(main())
    shared.update(got)


async def _share(got: Counter[str], shared: Any, stop: Any) -> None:
    while not stop.is_set():
        shared.update(got)
        await asyncio.sleep(1.0)


# --- the healthy nodes' pulls -------------------------------------------------------------


def probe(port: int, etags: dict[int, str], seconds: float, outcome: Outcome) -> None:
    async def go() -> None:
        until = time.monotonic() + seconds
        turn = 0
        while time.monotonic() < until:
            index = HEALTHY[turn % len(HEALTHY)]
            turn += 1
            raw = request_bytes("GET", f"/api/schedules?node={name_of(index)}", HOST,
                                {**_auth(index), "if-none-match": etags[index]})
            started = time.perf_counter()
            try:
                answer = await once(HOST, port, raw, timeout=30)
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                outcome.answers["no answer"] += 1
                continue
            outcome.answers[str(answer.status)] += 1
            if answer.status == 304:
                outcome.latencies.append(time.perf_counter() - started)
            await asyncio.sleep(PROBE_EVERY_S)

    asyncio.run(go())


def etags(port: int) -> dict[int, str]:
    async def go() -> dict[int, str]:
        found = {}
        for index in HEALTHY:
            answer = await once(HOST, port, request_bytes(
                "GET", f"/api/schedules?node={name_of(index)}", HOST, _auth(index)))
            found[index] = answer.headers["etag"]
        return found
    return asyncio.run(go())


def scenario(tree: str, kind: str, port: int, pid: int, tags: dict[int, str],
             args: argparse.Namespace) -> Outcome:
    outcome = Outcome(tree, kind)
    manager = multiprocessing.Manager()
    shared, stop = manager.dict(), manager.Event()
    attacker = None
    if kind != "baseline":
        count = args.reports if kind == "reports" else args.attackers
        attacker = multiprocessing.get_context("fork").Process(
            target=_attack, args=(kind, port, count, stop, shared), daemon=True)
        attacker.start()
        time.sleep(3.0)  # the flood in place before the measurement
    cpu0, wall0 = proc_cpu(pid), time.monotonic()
    probe(port, tags, args.seconds, outcome)
    outcome.cpu_cores = (proc_cpu(pid) - cpu0) / (time.monotonic() - wall0)
    outcome.load = os.getloadavg()[0]
    stop.set()
    if attacker is not None:
        attacker.join(60)
        if attacker.is_alive():
            attacker.kill()
    outcome.attacker = dict(shared)
    manager.shutdown()
    time.sleep(args.pause)  # what the flood left behind ends before the next one
    return outcome


def storm(tree: str, code: Path, port: int, pid: int, url: str, tokens: Path,
          args: argparse.Namespace) -> str:
    """The fleet bench's storm, run with the tree's own code (it reads the tree's database)."""
    done = subprocess.run(
        [sys.executable, str(code / "bench" / "bench_controller_fleet.py"), "fleet",
         "--controller", f"http://{HOST}:{port}", "--admin-token", ADMIN,
         "--database-url", url, "--tokens-file", str(tokens), "--pids", str(pid),
         "--nodes", str(args.nodes), "--ramp", "30", "--settle", "20",
         "--storm-minutes", str(args.storm_minutes), "--share", "0.05"],
        cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True,
        text=True, timeout=3600, check=True)
    return storm_line(tree, args.nodes, done.stdout)


def storm_line(tree: str, nodes: int, text: str) -> str:
    """Return the storm's figures in one sentence (its full report is the fleet bench's)."""
    rows = {cells[0]: cells[1:] for line in text.splitlines()
            if line.startswith("| ") and len(cells := [c.strip() for c in
                                                       line.strip("|").split("|")]) == 4}
    parts = [f"{what} p50 {rows[key][1]} / p99 {rows[key][2]} ms"
             for key, what in (("storm: all pulls", "pulls"), ("storm: report", "reports"),
                               ("storm: change to pulled (PUT sent to the 200)",
                                "a change to its pull")) if key in rows]
    extra = [line.strip("- ").rstrip(".") for line in text.splitlines()
             if line.startswith(("- Answers over the whole run", "- Changes not pulled"))]
    fivexx = [e.split("5xx: ", 1)[1].split(";")[0].strip() for e in extra if "5xx: " in e]
    late = [e.split(": ", 1)[1] for e in extra if e.startswith("Changes not pulled")]
    return (f"The {nodes:,}-node change storm of `bench/bench_controller_fleet.py fleet` "
            f"({tree}): {'; '.join(parts)}; 5xx: {fivexx[0] if fivexx else '?'}; changes not "
            f"pulled within 20 s of its end: {late[0] if late else '?'}.")


def run_tree(tree: str, code: Path, folder: Path, args: argparse.Namespace
             ) -> tuple[list[Outcome], str]:
    database = folder / (re.sub(r"\W+", "-", tree) + ".db")
    url = f"sqlite:///{database}"
    # The tree's own code makes its database: its migrations, not this tree's.
    subprocess.run([sys.executable, "-c", "import sys; from bench.bench_controller_fleet "
                    "import populate; populate(sys.argv[1], int(sys.argv[2]))", url,
                    str(args.nodes)], cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
                   check=True)
    tokens = folder / "tokens.toml"
    write_private(tokens, tokens_toml([ADMIN], args.nodes))
    outcomes = []
    with serve(code, url, tokens, "--watch-interval", "0") as (port, pid):
        tags = etags(port)
        for kind in ("baseline", *ATTACKS):
            outcomes.append(scenario(tree, kind, port, pid, tags, args))
            print(render([outcomes[-1]], outcomes[0]), flush=True)
        section = storm(tree, code, port, pid, url, tokens, args) if args.storm_minutes else ""
    return outcomes, section


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f}"


def render(outcomes: list[Outcome], baseline: Outcome) -> str:
    base99 = pct(baseline.latencies, 0.99)
    lines = []
    for item in outcomes:
        p99 = pct(item.latencies, 0.99)
        failed = sum(n for k, n in item.answers.items() if k != "304")
        lines.append(
            f"| {item.tree} | {item.scenario} | {len(item.latencies)} | {failed} "
            f"| {_ms(pct(item.latencies, 0.5))} | {_ms(p99)} "
            f"| {_ms(max(item.latencies, default=float('nan')))} | x{p99 / base99:.2f} "
            f"| {dict(sorted(item.attacker.items())) or '-'} | {item.cpu_cores:.2f} "
            f"| {item.load:.2f} |")
    return "\n".join(lines)


def report(results: list[tuple[list[Outcome], str]], args: argparse.Namespace) -> str:
    lines = [
        f"`bench/bench_capacity.py`: one `sched controller serve --api-only` with its defaults "
        f"on SQLite, {args.nodes:,} nodes' rows and tokens. Healthy nodes pull (a 304 with "
        f"`If-None-Match`, a new connection each) one every {PROBE_EVERY_S * 1000:g} ms for "
        f"{args.seconds:g} s while an attacker process floods: {args.attackers} long polls "
        "with one node's token (each sent again 1 s after its answer); "
        f"{args.attackers} slow login forms, no token (a byte a second, reopened 1 s after "
        f"the server closes one); {args.reports:,} reports of 1,000 job records (~0.3 MB) "
        "from one node, 20 at once. Failed: a healthy pull answered other than 304 (a 5xx, "
        "no answer). x: the pulls' p99 over the baseline's, same run. Load: the 1-minute "
        "load average at the scenario's end (2 CPUs).",
        "",
        "| code | flood | healthy pulls | failed | p50 ms | p99 ms | max ms | p99 vs baseline "
        "| the attacker got | server CPU (cores) | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for outcomes, _ in results:
        lines.append(render(outcomes, outcomes[0]))
    for _, section in results:
        if section:
            lines += ["", section]
    lines += ["", f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
              f"{os.cpu_count()} CPUs shared with other work, Python "
              f"{platform.python_version()}; the attacker and the pulls are processes beside "
              "the server."]
    return "\n".join(lines)


def _commit(tree: Path) -> str:
    """Return tree's commit, short (the table names the code it measured)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--attackers", type=int, default=320)
    parser.add_argument("--reports", type=int, default=2000)
    parser.add_argument("--pause", type=float, default=10.0)
    parser.add_argument("--storm-minutes", type=float, default=2.0,
                        help="the 1,000-node storm's length (0: no storm)")
    parser.add_argument("--before-tree", default=None, help="also measure this code")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    raise_nofile()
    trees = [(f"this tree ({_commit(ROOT)})", ROOT)]
    if args.before_tree:
        before = Path(args.before_tree).resolve()
        trees.insert(0, (f"before ({_commit(before)})", before))
    with tempfile.TemporaryDirectory(prefix="sched-capacity-") as tmp:
        results = [run_tree(name, code, Path(tmp), args) for name, code in trees]
    publish(report(results, args), *MARKERS, "## The controller under floods",
            write=args.write_docs)


if __name__ == "__main__":
    main()
