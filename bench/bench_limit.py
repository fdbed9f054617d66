"""At the limit: window to command start for the node, APScheduler 4 and a warm loop.

Three contenders fire the same every-minute rows in the same minutes, each job running
the same command, which stamps its own start (:func:`bench.limit_loops.command`:
``sh -c 'date +%s.%N >> FILE'``, a file per contender):

- the node: the real node process (``python -m sched_node``), recording to a
  throwaway ``prefect server start`` on SQLite (bench/bench_node.py's helpers);
- APScheduler 4 (``apscheduler==4.0.0a6``, a pre-release): a ``CronTrigger`` per row, a job
  that ``posix_spawn``s the command (bench/limit_loops.py, a process of its own);
- a warm loop: one Python process that sleeps until each instant and ``posix_spawn``s the
  command once per row (bench/limit_loops.py).

Scenarios: 1 row and 10 rows on the same instant, every minute, for ``--minutes`` each, at
the machine's own load and with ``--busy`` processes spinning beside them (default 2). A
stamp belongs to the last minute at most 5 s after it (``EARLY_S``): window to command is
the stamp minus that minute.
Per contender: p50/p99/max, early starts, and with 10 rows the spread (the 10th start
minus the 1st) per instant. CPU per job: the node's process tree (node and keepers, the
keepers' commands included, from ``/proc``: ``tree_cpu``, 10 ms ticks) over the phase's
minutes (each instant with 30 s either side: idle work, its reconciles and records
included) per job, less the command's own CPU (20 spawns of it, ``os.wait4``); the warm
loop's own ``getrusage`` (itself and its reaped commands) per job: a bare ``posix_spawn``
of the same command. Memory: the PSS (``/proc/<pid>/smaps_rollup``) of each keeper while
5 rows of ``sleep 20`` run. The 1-minute load average is sampled every minute of a phase.

    .venv/bin/python bench/bench_limit.py [--minutes 5] [--busy 2] [--rows 1,10] [--write]

About 2 x (3 + 2 x (minutes + 1)) minutes; ``--write`` puts the figures into
docs/benchmarks.md between ``limit:begin`` and ``limit:end`` (and bench/bench_limit.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.bench_node import _next_minute, _planned, _row, _spawn_node
from bench.limit_loops import command
from bench.prefect_bench import (
    load_text,
    machine,
    percentile,
    start_server,
    stop_group,
    tree_cpu,
    write_section,
)

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ROOT / "bench" / "limit_loops.py"
BEGIN, END = "<!-- limit:begin -->", "<!-- limit:end -->"
HEADING = "## At the limit: window to command (node, APScheduler 4, a warm loop)"
RESULTS = ROOT / "bench" / "bench_limit.json"
CONTENDERS = ("node", "apscheduler", "warm")
HOLD_ROWS, HOLD_S = 5, 20
EARLY_S = 5.0
"""A stamp belongs to the last minute at most this many seconds after it: up to 5 s early
and 55 s late (a node started late fires its last missed window at once: not early)."""


@dataclass
class Phase:
    """One scenario's minutes: rows on each minute's instant, with busy spinners or none."""

    rows: int
    busy: int
    begin: datetime
    minutes: int
    loads: list[float] = field(default_factory=list)
    latency: dict[str, list[float]] = field(default_factory=dict)
    spread: dict[str, list[float]] = field(default_factory=dict)
    missing: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds per job: ``node`` beyond the command, ``warm`` with it."""

    def instants(self) -> list[float]:
        start = self.begin.timestamp()
        return [start + 60 * k for k in range(self.minutes)]

    def window(self) -> tuple[datetime, datetime]:
        """Return the CPU window: each instant with 30 s either side."""
        return (self.begin - timedelta(seconds=30),
                self.begin + timedelta(minutes=self.minutes, seconds=-30))


def _sleep_until(moment: datetime) -> None:
    time.sleep(max((moment - datetime.now(UTC)).total_seconds(), 0))


def _stamps(path: Path) -> list[float]:
    if not path.exists():
        return []
    return [float(line) for line in path.read_text().split() if line]


def _score(phase: Phase, name: str, stamps: list[float]) -> None:
    """Put the phase's latencies, spreads and missing jobs of one contender into phase."""
    by_instant: dict[float, list[float]] = {instant: [] for instant in phase.instants()}
    for stamp in stamps:
        instant = (stamp + EARLY_S) // 60 * 60.0
        if instant in by_instant:
            by_instant[instant].append(stamp - instant)
    phase.latency[name] = sorted(late for lates in by_instant.values() for late in lates)
    phase.spread[name] = [max(lates) - min(lates) for lates in by_instant.values()
                          if len(lates) == phase.rows and phase.rows > 1]
    phase.missing[name] = sum(max(phase.rows - len(lates), 0) for lates in by_instant.values())


def _warm_cpu(path: Path, phase: Phase) -> float:
    """Return the warm loop's CPU per job over the phase's instants (from its ``--cpu`` file)."""
    marks = [(float(instant), float(cpu)) for instant, cpu in
             (line.split() for line in path.read_text().splitlines() if line)]
    first, last = phase.instants()[0], phase.instants()[-1]
    before = [cpu for instant, cpu in marks if instant < first]
    after = [cpu for instant, cpu in marks if instant == last]
    if not before or not after:
        return float("nan")
    return (after[0] - before[-1]) / (phase.minutes * phase.rows)


def _command_cpu(stamps: Path, times: int = 20) -> float:
    """Return the CPU of one run of the command (its own, and its children's), by ``wait4``."""
    total = 0.0
    for _ in range(times):
        pid = os.posix_spawn("/bin/sh", command(stamps), {"PATH": "/usr/bin:/bin"})
        _pid, _status, usage = os.wait4(pid, 0)
        total += usage.ru_utime + usage.ru_stime
    stamps.unlink(missing_ok=True)
    return total / times


def _spinners(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"],
                             start_new_session=True) for _ in range(count)]


def _loops(work: Path, rows: int) -> dict[str, subprocess.Popen[bytes]]:
    """Start the warm loop and APScheduler with rows each (their stamps under work)."""
    procs = {}
    for name in ("warm", "apscheduler"):
        argv = [sys.executable, str(LOOPS), name, "--rows", str(rows),
                "--stamps", str(work / f"{name}.stamps")]
        if name == "warm":
            argv += ["--cpu", str(work / f"warm-{rows}.cpu")]
        with (work / f"{name}.log").open("ab") as log:
            procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
    return procs


def _config(folder: Path, name: str, pull: Path, stamps: Path) -> Path:
    """Write a node's agent.toml: action ``stamp`` runs the command, ``hold`` sleeps."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "agent.toml"
    argv = json.dumps(command(stamps))
    config.write_text(
        f'node_name = "{name}"\npull_url = "{pull}"\nstate_dir = "state"\n'
        f'timezone = "America/New_York"\njob_limit = 40\nwave = []\n\n'
        f'[actions.stamp]\nargv = {argv}\ntimeout = 60\n\n'
        f'[actions.hold]\nargv = ["sleep", "{HOLD_S}"]\ntimeout = 120\n')
    return config


def _run_phase(phase: Phase, node_pid: int, work: Path) -> None:
    """Wait out one phase: its spinners, the load every minute, the node's CPU around it."""
    start, end = phase.window()
    _sleep_until(start - timedelta(seconds=10))
    spinners = _spinners(phase.busy)
    try:
        _sleep_until(start)
        cpu0 = tree_cpu(node_pid)
        for k in range(phase.minutes):
            _sleep_until(phase.begin + timedelta(minutes=k, seconds=30))
            phase.loads.append(os.getloadavg()[0])
        _sleep_until(end)
        cpu1 = tree_cpu(node_pid)
    finally:
        for spinner in spinners:
            stop_group(spinner, grace_s=1)
    phase.cpu["node"] = (cpu1 - cpu0) / (phase.minutes * phase.rows)
    print(f"{phase.rows} rows, busy {phase.busy}: done (load {load_text()})", flush=True)


def _pss_kb(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))


def _keepers() -> list[tuple[int, bool]]:
    """Return this checkout's keeper processes, each with whether it runs a command now."""
    shim = str(ROOT / "sched_node" / "shim.py").encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if shim not in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                continue
            children = Path(f"/proc/{entry.name}/task/{entry.name}/children").read_text()
        except OSError:
            continue
        found.append((int(entry.name), bool(children.strip())))
    return found


def _memory(pull: Path, node_pid: int, after: datetime) -> dict[str, Any]:
    """Put HOLD_ROWS rows of ``sleep`` on the node's next minute after after (then empty);
    return the PSS of its keepers (MB) while they run, and of the node itself."""
    pull.write_text(json.dumps({"schedules": [_row(f"hold{n}", "hold")
                                              for n in range(HOLD_ROWS)]}))
    instant = _next_minute(60) if after < datetime.now(UTC) else after
    best: list[tuple[int, bool]] = []
    for seconds in (6, 10, 14):
        _sleep_until(instant + timedelta(seconds=seconds))
        found = _keepers()
        if sum(running for _, running in found) >= sum(running for _, running in best):
            best = [(_pss_kb(pid), running) for pid, running in found]
    pull.write_text(json.dumps({"schedules": []}))
    running = [kb / 1024 for kb, is_running in best if is_running]
    waiting = [kb / 1024 for kb, is_running in best if not is_running]
    return {"running": running, "waiting": waiting, "node_mb": _pss_kb(node_pid) / 1024,
            "load": os.getloadavg()[0]}


def _group(work: Path, url: str, rows: int, minutes: int, busy: list[int],
           memory: bool) -> tuple[list[Phase], dict[str, Any]]:
    """Run one node with rows (and the two loops with as many) through a phase per busy
    level; then, with memory, the memory check on the same node."""
    folder = work / f"rows{rows}"
    pull = folder / "rows.json"
    config = _config(folder, f"lim-{uuid.uuid4().hex[:6]}", pull, work / "node.stamps")
    pull.write_text(json.dumps({"schedules": [_row(f"r{n}") for n in range(rows)]}))
    spawned = time.monotonic()
    node = _spawn_node(config, url, folder / "node.log")
    loops: dict[str, subprocess.Popen[bytes]] = {}
    mem: dict[str, Any] = {}
    try:
        plan_s = _planned(folder / "node.log", spawned)
        print(f"{rows} rows: the node planned in {plan_s:.0f} s", flush=True)
        loops = _loops(work, rows)
        begin = _next_minute(30)
        phases = [Phase(rows, spin, begin + timedelta(minutes=k * (minutes + 1)), minutes)
                  for k, spin in enumerate(busy)]
        for phase in phases:
            _run_phase(phase, node.pid, work)
        if memory:
            mem = _memory(pull, node.pid, phases[-1].window()[1] + timedelta(seconds=90))
    finally:
        for proc in loops.values():
            stop_group(proc, grace_s=5)
        stop_group(node)
    for phase in phases:
        for name in CONTENDERS:
            _score(phase, name, _stamps(work / f"{name}.stamps"))
        phase.cpu["warm"] = _warm_cpu(work / f"warm-{rows}.cpu", phase)
    return phases, mem


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.0f}" if values else "-"


def _ratio(top: float, bottom: float, target: float) -> str:
    if not bottom or bottom != bottom or top != top:
        return "-"
    ratio = top / bottom
    return f"{ratio:.1f}x ({'met' if ratio <= target else 'missed'}: <= {target:g}x)"


def _load(phase: Phase) -> str:
    loads = phase.loads or [float("nan")]
    return f"{sum(loads) / len(loads):.1f} ({min(loads):.1f}-{max(loads):.1f})"


def _scenario(phase: Phase) -> str:
    spin = f"{phase.busy} busy loops" if phase.busy else "no busy loop"
    return f"{phase.rows} row{'s' if phase.rows > 1 else ''}, {spin}"


def _latency_table(phases: list[Phase]) -> list[str]:
    lines = ["| scenario | load (1 min: mean, range) | contender | p50 | p99 | max | early "
             "| jobs (missing) | spread p50 / p99 (10th start minus 1st) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for phase in phases:
        for name in CONTENDERS:
            lates = phase.latency[name]
            spread = (f"{_ms(phase.spread[name], 0.5)} / {_ms(phase.spread[name], 0.99)} ms "
                      f"({len(phase.spread[name])} instants)" if phase.rows > 1 else "-")
            lines.append(
                f"| {_scenario(phase)} | {_load(phase)} | {name} | {_ms(lates, 0.5)} ms "
                f"| {_ms(lates, 0.99)} ms | {_ms(lates, 1.0)} ms "
                f"| {sum(1 for late in lates if late < 0)} | {len(lates)} "
                f"({phase.missing[name]}) | {spread} |")
    return lines


def _ratio_table(phases: list[Phase], command_cpu: float) -> list[str]:
    lines = ["| scenario | load | node / APScheduler p50 | node / APScheduler p99 "
             "| node spread p50 / max (10th of 10 <= 50 ms after the 1st) "
             "| node CPU per job beyond the command "
             "| bare posix_spawn per job (warm loop, command included) | node / bare spawn |",
             "|---|---|---|---|---|---|---|---|"]
    for phase in phases:
        node, aps = phase.latency["node"], phase.latency["apscheduler"]
        spread = phase.spread["node"]
        within = ("-" if phase.rows == 1 or not spread else
                  f"{_ms(spread, 0.5)} / {_ms(spread, 1.0)} ms "
                  f"({'met' if max(spread) <= 0.05 else 'missed'})")
        beyond = phase.cpu["node"] - command_cpu
        lines.append(
            f"| {_scenario(phase)} | {_load(phase)} "
            f"| {_ratio(percentile(node, 0.5), percentile(aps, 0.5), 2)} "
            f"| {_ratio(percentile(node, 0.99), percentile(aps, 0.99), 3)} | {within} "
            f"| {beyond * 1000:.1f} ms | {phase.cpu['warm'] * 1000:.2f} ms "
            f"| {_ratio(beyond, phase.cpu['warm'], 10)} |")
    return lines


def _report(phases: list[Phase], mem: dict[str, Any], meta: dict[str, Any]) -> str:
    early = sum(1 for phase in phases for late in phase.latency["node"] if late < 0)
    lines = [
        f"On {meta['machine']}; {meta['when']}. `{meta['command']}`: the same every-minute "
        f"rows for the three contenders in the same minutes ({meta['minutes']} per scenario), "
        "each job the same command stamping its own start (`sh -c 'date +%s.%N >> FILE'`); "
        "window = the minute. The node is the real node process on a throwaway SQLite "
        "Prefect server; APScheduler 4.0.0a6 a CronTrigger per row, its job a `posix_spawn`; "
        "the warm loop one process sleeping until each instant, then `posix_spawn` per row. "
        "The other work on the machine ran on: the load is beside each figure.", "",
        *_latency_table(phases), "",
        f"Per job (the command itself: {meta['command_cpu'] * 1000:.2f} ms of CPU, by "
        "`wait4`): the node's process tree (node, keepers and their commands; `/proc`, "
        "10 ms ticks) over each phase's minutes, idle work and records included, per job, "
        "less the command; the bare spawn is the warm loop's own `getrusage` per job (itself "
        "and its reaped command). Targets from issue 37, reported, not asserted:", "",
        *_ratio_table(phases, meta["command_cpu"]), ""]
    if mem:
        running = mem["running"]
        mean = sum(running) / len(running) if running else float("nan")
        lines.append(
            f"**Memory per running job** (load {mem['load']:.1f}): {len(running)} keepers "
            f"running `sleep {HOLD_S}` of {HOLD_ROWS} same-instant rows, PSS "
            f"{mean:.1f} MB each ({', '.join(f'{mb:.1f}' for mb in running)}; target <= 5 MB: "
            f"{'met' if mean <= 5 else 'missed'}); {len(mem['waiting'])} warm keepers waiting "
            f"({', '.join(f'{mb:.1f}' for mb in mem['waiting'])} MB); the node itself "
            f"{mem['node_mb']:.1f} MB (`/proc/<pid>/smaps_rollup`).")
    lines.append(f"\nEarly starts of the node: {early} (target 0).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=5, help="minutes per scenario")
    parser.add_argument("--busy", type=int, default=2,
                        help="processes spinning beside the busy scenarios (0: none run)")
    parser.add_argument("--rows", default="1,10", help="rows on each instant, per scenario")
    parser.add_argument("--no-memory", action="store_true", help="skip the keepers' PSS")
    parser.add_argument("--write", action="store_true",
                        help="put the figures into docs/benchmarks.md (and bench_limit.json)")
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-limit-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"working in {work}", flush=True)
    started = load_text(1)
    meta: dict[str, Any] = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "minutes": args.minutes,
        "command": "bench/bench_limit.py " + " ".join(sys.argv[1:]),
        "command_cpu": _command_cpu(work / "probe.stamps")}
    server, url = start_server(work / "prefect")
    phases: list[Phase] = []
    mem: dict[str, Any] = {}
    try:
        for index, rows in enumerate(int(value) for value in args.rows.split(",")):
            found, memory = _group(work, url, rows, args.minutes,
                                   [0, args.busy] if args.busy else [0],
                                   not args.no_memory and index == 0)
            phases += found
            mem = mem or memory
    finally:
        stop_group(server)
    meta["machine"] = machine(start=started)
    results = {"meta": meta, "memory": mem, "phases": [
        {**asdict(phase), "begin": phase.begin.isoformat()} for phase in phases]}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    section = _report(phases, mem, meta)
    print(section)
    if args.write:
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        write_section(BEGIN, END, HEADING, section)


if __name__ == "__main__":
    main()
