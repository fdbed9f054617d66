"""The CPU of the controller's fleet watch: one pass over every node, and one interval of
two instances, before and after a change, in the same run.

Each instance's fleet watch reads every node's state every ``--watch-interval`` (15 s) to
raise the fleet's alerts (a silent node, a missed or failed window). At 10,000 nodes the
scaled layout's two controllers used ~0.12 core each on it with nothing else to do
(``bench/fleet_sim_findings.md`` item 8). This benchmark measures it alone:

- a throwaway PostgreSQL (pgserver) holds ``--nodes`` nodes, each with the fleet
  simulator's ten rows (``bench/fleet_sim.py``), each row with the node's own repository (so
  no two nodes' rows are the same text), and a report with a 60 s heartbeat, as a
  fleet's controller has them (seeded with this tree's code, migrated to its head);
- for each tree (``--before REV``: a ``git archive`` of that commit; and this tree), in
  turns, a fresh process opens the database, runs one pass (its first: it looks back
  6 hours), then ``--passes`` passes, each timed by the process's CPU clock
  (``time.process_time``): **CPU per pass** (the median); each with the fleet **healthy**
  (every node seen just now) and **silent** (every node last seen an hour ago: a
  fleet-wide outage, an alert per node);
- **two instances' interval**: the CPU both instances spend in one interval. Before, each
  ran its own pass (2 x the pass); after, one takes the turn and runs the pass, the other
  finds it taken and only sends what is pending (measured: the median of ``--passes``
  such steps).

Prints the table and the ratios; ``--write-docs`` puts it into ``docs/benchmarks.md``
between ``<!-- watch-pass:begin -->`` and ``<!-- watch-pass:end -->``.

Run: ``flock /tmp/bench.lock .venv/bin/python bench/bench_watch.py [--write-docs]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.bench_controller_api import temporary_postgres
from bench.bench_controller_wait import archive
from bench.prefect_bench import machine, publish

ROOT = Path(__file__).resolve().parent.parent

MARKERS = ("<!-- watch-pass:begin -->", "<!-- watch-pass:end -->")
MODES = ("healthy", "silent")
BEFORE_REV = "457e37b"
"""The last commit before the watch's turn and its linear summary."""

MEASURE = r"""
import json, statistics, sys, time
from sqlalchemy import text
from controller.db import make_engine
from controller.fleet import FleetSettings
from controller.watch import FleetWatch
passes, mode = int(sys.argv[2]), sys.argv[3]
engine = make_engine(sys.argv[1])
# healthy: every node seen just now; silent: every node last seen an hour ago (a fleet-wide
# outage: the first pass raises an alert per node, the later ones find them raised).
seen = "now()" if mode == "healthy" else "now() - interval '1 hour'"
def fleet_state():
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE node_seen SET seen_at = {seen}"))
with engine.begin() as conn:
    conn.execute(text("DELETE FROM fleet_alert"))
fleet_state()
watch = FleetWatch(engine, FleetSettings(), emit=None, interval=15.0)
t0 = time.process_time(); watch.check(); first = time.process_time() - t0
times = []
for _ in range(passes):
    fleet_state()
    t0 = time.process_time(); watch.check(); times.append(time.process_time() - t0)
out = {"first_s": first, "pass_s": statistics.median(times), "passes": times}
if hasattr(watch, "tick"):
    from sqlalchemy import text
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM watch_turn"))
    other = FleetWatch(engine, FleetSettings(), emit=None, interval=15.0)
    fleet_state()
    assert watch.tick() is True
    skips = []
    for _ in range(passes):
        t0 = time.process_time(); taken = other.tick(); skips.append(time.process_time() - t0)
        assert taken is False
    out["skip_s"] = statistics.median(skips)
engine.dispose()
print(json.dumps(out))
"""


def seed(url: str, nodes: int) -> float:
    """Migrate, then give each node the fleet's ten rows and a report (this tree's code)."""
    from sqlmodel import Session

    from bench.fleet_sim import _rows
    from controller import db
    from controller.db import make_engine
    from controller.nodes import record_report
    from controller.schedules import put_schedule

    t0 = time.monotonic()
    db.migrate(url)
    engine = make_engine(url)
    rows = _rows()
    now = datetime.now(UTC)
    try:
        with Session(engine) as session:
            for n in range(nodes):
                name = f"watch-{n:05d}"
                for row in rows:  # each node its own repository: a text of its own
                    put_schedule(session, name, row.model_copy(
                        update={"repo_id": f"{row.repo_id}-{name}"}), now=now)
                record_report(session, name, {"timezone": "UTC", "grace_s": 60},
                              received_at=now, heartbeat_s=60)
    finally:
        engine.dispose()
    return time.monotonic() - t0


def measure(tree: Path, url: str, passes: int, mode: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", MEASURE, url, str(passes), mode], cwd=tree,
                          env=env, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", default=BEFORE_REV)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    loads = [os.getloadavg()]
    results: dict[str, list[dict[str, float]]] = {}
    with temporary_postgres() as url, tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        seeded = seed(url, args.nodes)
        print(f"{args.nodes:,} nodes seeded in {seeded:.0f} s", flush=True)
        before_tree = Path(tmp) / "before"
        before_tree.mkdir()
        trees = [(f"before ({archive(args.before, before_tree)})", before_tree),
                 ("after (this tree)", ROOT)]
        for rnd in range(args.rounds):
            for mode in MODES:
                for name, tree in trees:
                    got = measure(tree, url, args.passes, mode)
                    results.setdefault(f"{mode}|{name}", []).append(got)
                    print(f"round {rnd + 1} {mode} {name}: {json.dumps(got)}", flush=True)
        loads.append(os.getloadavg())
    section = render(results, args, loads)
    publish(section, *MARKERS, "## The controller's fleet watch: CPU per pass",
            write=args.write_docs)


def render(results: dict[str, list[dict[str, float]]], args: argparse.Namespace,
           loads: list[tuple[float, float, float]]) -> str:
    rows = []
    per: dict[str, tuple[float, float]] = {}
    for key, runs in results.items():
        mode, name = key.split("|", 1)
        pass_s = statistics.median(r["pass_s"] for r in runs)
        skip = [r["skip_s"] for r in runs if "skip_s" in r]
        interval = pass_s + statistics.median(skip) if skip else 2 * pass_s
        per[key] = (pass_s, interval)
        rows.append(f"| {mode} | {name} | {statistics.median(r['first_s'] for r in runs):.2f} | "
                    f"{pass_s:.2f} | "
                    + (f"{statistics.median(skip) * 1000:.1f} ms" if skip else "- (each "
                       "instance runs its own pass)")
                    + f" | {interval:.2f} | {interval / 15:.3f} |")
    ratios = []
    for mode in MODES:
        (b_pass, b_int), (a_pass, a_int) = [v for k, v in per.items() if k.startswith(mode)][:2]
        ratios.append(f"{mode}: a pass x{a_pass / b_pass:.2f}, two instances' interval "
                      f"x{a_int / b_int:.2f}")
    return "\n".join([
        f"`bench/bench_watch.py --nodes {args.nodes} --passes {args.passes} --rounds "
        f"{args.rounds}`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {args.nodes:,} nodes with "
        "ten rows (no two nodes' the same text) and a report each on a throwaway PostgreSQL "
        "(pgserver); each figure the "
        "median over the rounds of the process's CPU (the pass's own thread and the database "
        "driver; PostgreSQL's side not counted).",
        "",
        "The fleet **healthy** (every node seen just now) or **silent** (every node last seen an "
        "hour ago, as in a fleet-wide outage: the first pass raises an alert per node, the "
        "later ones propose them again and find them raised).",
        "",
        "| fleet | tree | first pass (6 h back), CPU s | a pass, CPU s | the other instance's "
        "step (turn taken) | two instances, CPU s per interval | cores at a 15 s interval |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"After / before: {'; '.join(ratios)}.",
        "",
        f"Machine: {machine().split(', load average')[0]}; load average (1, 5, 15 min) "
        f"before {', '.join(f'{x:.1f}' for x in loads[0])}, after "
        f"{', '.join(f'{x:.1f}' for x in loads[-1])}.",
    ])


if __name__ == "__main__":
    main()
