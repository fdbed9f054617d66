"""An idle node's CPU with 10 and with 1,000 daily rows, side by side on one server.

Two real node processes (``python -m sched_node``, bench/bench_node.py's helpers) pull from
one real controller (SQLite) and record to one throwaway ``prefect server start`` (SQLite):
one with 10 daily rows, one with 1,000 (one a minute over the 18 hours starting 6 hours from
now), none due while they are measured. Once both made their first plan (1,000 rows:
``plan_max_runs`` runs, minutes on SQLite) and settled for a minute, each node's process tree
CPU (``tree_cpu``, keepers included) is read over ``--minutes`` (default 16: one periodic
reconcile of each, every 15 minutes) and given per hour; the ratio 1,000 / 10 is the figure
(the one-engine issue's target: at most 2x). Both nodes run in the same minutes, so the
machine's load weighs on both alike.

    .venv/bin/python bench/bench_idle_rows.py [--minutes 16] [--write]

About minutes + 10; ``--write`` puts the figures into docs/benchmarks.md between
``idle-rows:begin`` and ``idle-rows:end``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.bench_node import Controller, _config, _planned, _spawn_node
from bench.prefect_bench import (
    load_text,
    machine,
    start_server,
    stop_group,
    tree_cpu,
    write_section,
)

MARKERS = ("<!-- idle-rows:begin -->", "<!-- idle-rows:end -->")


def daily_rows(count: int) -> list[dict[str, Any]]:
    """count daily rows (UTC), one a minute from 6 hours from now on: none due for 6 hours."""
    hour = datetime.now(UTC).hour
    return [{"id": f"i{n}", "name": f"idle {n}", "repo_id": f"r{n}", "action": "stamp",
             "schedule": {"days": ["*"], "hours": [str((hour + 6 + n // 60) % 24)],
                          "minute": str(n % 60)},
             "timezone": "UTC", "miss_policy": "skip", "enabled": True, "version": 1}
            for n in range(count)]


def measure(work: Path, sizes: list[int], minutes: float) -> dict[str, Any]:
    proc, url = start_server(work / "prefect")
    names = {size: f"rows{size}-{uuid.uuid4().hex[:6]}" for size in sizes}
    controller = Controller(work / "controller", url, list(names.values()))
    nodes: dict[int, Any] = {}
    try:
        for size, name in names.items():
            for row in daily_rows(size):
                controller.put(name, row)
        began = time.monotonic()
        for size, name in names.items():
            config = _config(work / name, name, controller.pull_url(name),
                             extra=f'token = "{controller.tokens[name]}"')
            nodes[size] = _spawn_node(config, url, work / f"{name}.log")
        first_plan = {size: _planned(work / f"{names[size]}.log", began, timeout_s=1800)
                      for size in sizes}
        time.sleep(60)
        load0 = load_text()
        cpu0 = {size: tree_cpu(node.pid) for size, node in nodes.items()}
        time.sleep(minutes * 60)
        cpu1 = {size: tree_cpu(node.pid) for size, node in nodes.items()}
        return {"minutes": minutes, "first_plan_s": first_plan, "load": [load0, load_text()],
                "cpu_s_per_hour": {size: (cpu1[size] - cpu0[size]) / (minutes / 60)
                                   for size in sizes},
                "measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    finally:
        for node in nodes.values():
            stop_group(node)
        controller.stop()
        stop_group(proc)


def render(found: dict[str, Any], sizes: list[int]) -> str:
    cpu = found["cpu_s_per_hour"]
    small, large = min(sizes), max(sizes)
    lines = [
        "`bench/bench_idle_rows.py`: two real node processes side by side, one with "
        f"{small} daily rows and one with {large:,}, none due, against one controller and one "
        "Prefect server (both SQLite); each node's process tree CPU over "
        f"{found['minutes']:g} minutes (one periodic reconcile each), per hour. Load (1, 5, 15 "
        f"min) {found['load'][0]} at the start, {found['load'][1]} at the end.",
        "",
        "| daily rows | first plan (s) | node CPU s per idle hour | vs the smallest |",
        "|---:|---:|---:|---:|",
    ]
    for size in sizes:
        lines.append(f"| {size:,} | {found['first_plan_s'][size]:.0f} | {cpu[size]:.2f} | "
                     f"{cpu[size] / cpu[small]:.2f}x |")
    lines += ["", f"Measured {found['measured']}; {machine()}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--minutes", type=float, default=16.0)
    parser.add_argument("--rows", default="10,1000", help="daily rows of each node")
    parser.add_argument("--write", action="store_true", help="write into docs/benchmarks.md")
    args = parser.parse_args(argv)
    sizes = sorted(int(part) for part in args.rows.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-idle-rows-") as folder:
        found = measure(Path(folder), sizes, args.minutes)
    text = render(found, sizes)
    print(text, flush=True)
    if args.write:
        write_section(*MARKERS, "## An idle node with 10 and with 1,000 rows", text)


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    main()
