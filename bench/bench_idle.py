"""Idle-node benchmark: what a node with nothing due costs, old design (fire-tick) against new.

Measures, in one run, against a real ``prefect server start`` (throwaway
PREFECT_HOME, the environment ``make run`` gives it) on a free port, one node
with two schedules (a nightly backup at 02:30, a weekly check on Sunday at
04:00, in a timezone where neither is due for hours). CPU is user + system time
from ``/proc/<pid>/stat``, of the server's process tree and of the node's serve
process tree (its flow-run subprocesses included, reaped or alive), read before
and after each window; the benchmark sends no request during a window.

1. **CPU per flow run of each kind**, server and node: the node's deployments
   served by ``prefect.serve`` in a subprocess, one kind of run accelerated to
   one every ``--every`` seconds (an ``Interval`` schedule, so the server's
   scheduler creates them and the serve process picks them up as at the real
   cadence). In one serve process: the deployment paused (``--idle`` s),
   resumed, exactly ``--runs`` periods, paused again (``--idle`` s); the mean
   rate of the paused windows times the run window is subtracted, the rest
   divided by ``--runs``. The kinds:
   - old ``fire-tick`` (``bench/legacy_tick.py``, the old flow from git history),
   - old ``reconcile`` (pull, missed-run check; the same file),
   - new ``reconcile`` (pull, then plan), served by the real ``deployments/serve.py``.
2. **Per idle node-hour** from those costs and the real cadences, read from the
   deployments each design builds: old 60 ticks + 12 reconciles an hour, new
   ``3600 / reconcile_interval`` reconciles (4 at the default 900 s) and no
   job run (nothing is due).
3. **What a served node costs with no run at all** (the runner polling the
   server every 10 s), both designs and the new one polling every 60 s: a serve
   process with nothing due, bracketed by the server alone before and after;
   and the server's CPU per poll, from ``--polls`` of the same request sent by
   the benchmark.
4. **Flow runs per idle node-day**, from the same schedules.

    .venv/bin/python bench/bench_idle.py [--runs 10] [--every 30] [--idle 120] [--no-write]

Takes about 45 minutes with the defaults. Writes the figures into
docs/benchmarks.md between ``idle:begin`` and ``idle:end``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.prefect_bench import (  # noqa: E402
    machine,
    server_env,
    start_server,
    stop_group,
    tree_cpu,
    write_section,
)

BEGIN, END = "<!-- idle:begin -->", "<!-- idle:end -->"
HEADING = "## Idle node: plan ahead against the per-minute tick (Prefect)"
ZONES = ("Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney")
"""Candidate node timezones: the first where 02:30 and 04:00 are hours away is used."""


def idle_rows() -> list[dict[str, Any]]:
    """Return the idle node's schedules: a nightly backup at 02:30 and a weekly check."""
    return [
        {"id": "nightly-backup", "name": "nightly backup at 02:30", "repo_id": "r-1",
         "action": "backup", "schedule": {"days": ["*"], "hours": ["2"], "minute": "30"},
         "miss_policy": "run-once-within-24h", "enabled": True, "version": 1},
        {"id": "weekly-check", "name": "weekly check, Sunday 04:00", "repo_id": "r-1",
         "action": "check", "schedule": {"days": ["sun"], "hours": ["4"], "minute": "0"},
         "miss_policy": "skip", "enabled": True, "version": 1},
    ]


def pick_zone(now: datetime) -> str:
    """Return a timezone where it is between 07:00 and 21:00: no window for hours either way."""
    for name in ZONES:
        if 7 <= now.astimezone(ZoneInfo(name)).hour < 21:
            return name
    raise SystemExit("no candidate timezone is in daytime (cannot happen with these zones)")


def write_node(work: Path, node: str, zone: str) -> Path:
    """Write a node's agent.toml and schedules.json under work/node; return the toml's path."""
    folder = work / node
    folder.mkdir(parents=True)
    (folder / "schedules.json").write_text(json.dumps({"schedules": idle_rows()}))
    actions = "".join(f'[actions.{name}]\nargv = ["true"]\n' for name in ("backup", "check",
                                                                             "prune"))
    (folder / "agent.toml").write_text(
        f'node_name = "{node}"\npull_url = "schedules.json"\nstate_dir = "state"\n'
        f'timezone = "{zone}"\n{actions}'
    )
    return folder / "agent.toml"


# -- the node's process ------------------------------------------------------------


def serve_old(phase: str, every: float) -> None:
    """Serve the old design's four deployments, one kind accelerated (the bench's subprocess).

    As the old ``deployments/serve.py`` did, except: the tick and the reconcile
    have the schedule the phase asks for (none, or every ``every`` seconds),
    and one reconcile is asked for at start so the tick has a cache (the new
    serve does the same).
    """
    from prefect import serve
    from prefect.schedules import Interval

    from bench.legacy_tick import build_deployments
    from deployments.serve import reconcile_now
    from flows.settings import load_settings

    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "sched_core,flows")
    settings = load_settings()
    fast = Interval(timedelta(seconds=every))
    deployments = build_deployments(
        settings,
        tick=fast if phase == "tick" else None,
        reconcile_every=fast if phase == "reconcile" else None,
    )
    reconcile_now(deployments)  # register them, and one reconcile now
    serve(*deployments, limit=None)


# -- the measurement ---------------------------------------------------------------


@dataclass
class Window:
    """CPU used in one measured window, and the node's runs that started in it."""

    seconds: float
    server: float
    node: float = 0.0
    started: Counter[str] = field(default_factory=Counter)
    """Runs per flow whose start time fell in the window."""
    waited: Counter[str] = field(default_factory=Counter)
    """Runs that waited for a concurrency slot or were marked Late, by that state's name."""
    took: list[float] = field(default_factory=list)
    """Seconds from each run's scheduled start to its end (subprocess start included)."""
    failed: int = 0

    @property
    def server_rate(self) -> float:
        return self.server / self.seconds

    @property
    def node_rate(self) -> float:
        return self.node / self.seconds

    def describe(self) -> str:
        runs = ", ".join(f"{k} {v}" for k, v in sorted(self.started.items())) or "no run"
        waited = ", ".join(f"{k} {v}" for k, v in sorted(self.waited.items())) or "none"
        took = (f", each {min(self.took):.1f}-{max(self.took):.1f} s from its time to its end"
                if self.took else "")
        return (f"{self.seconds:.0f} s, server {self.server:.2f} s, node {self.node:.2f} s of "
                f"CPU; {runs} started{took}; waited for a slot or Late: {waited}; "
                f"failed: {self.failed}")


def node_runs(node: str) -> list[Any]:
    """Return every flow run of the node's deployments (any state)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        runs: list[Any] = []
        while True:
            page = client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[node])),
                limit=200, offset=len(runs),
            )
            runs += page
            if len(page) < 200:
                return runs


def flow_names() -> dict[str, str]:
    """Return flow id -> flow name."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {str(item.id): item.name for item in client.read_flows(limit=200)}


def state_of(run: Any) -> str:
    return str(run.state.type.value) if run.state is not None else ""


def completed_runs(node: str, kind: str) -> int:
    """Return how many runs of the node's deployment of flow `kind` completed."""
    names = flow_names()
    return sum(1 for run in node_runs(node)
               if names.get(str(run.flow_id)) == kind and state_of(run) == "COMPLETED")


def wait_for(node: str, kind: str, *, completed: int, proc: subprocess.Popen[bytes],
             quiet: bool = False, timeout_s: float = 600) -> None:
    """Wait until `completed` runs of the kind finished and none of the node's is running.

    With ``quiet``, also until no run is waiting to start (Scheduled and due).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the serve process of {node} exited with {proc.returncode}")
        runs = node_runs(node)
        done = completed_runs(node, kind)
        busy = any(state_of(run) in ("PENDING", "RUNNING", "CANCELLING") for run in runs)
        if quiet:
            soon = datetime.now(UTC) + timedelta(seconds=60)
            busy = busy or any(state_of(run) == "SCHEDULED" and run.expected_start_time < soon
                               for run in runs)
        failed = [run.name for run in runs if state_of(run) in ("FAILED", "CRASHED")]
        if failed:
            raise SystemExit(f"{node}: runs failed: {failed}")
        if done >= completed and not busy:
            return
        time.sleep(2)
    raise SystemExit(f"{node}: {kind} did not complete {completed} runs in {timeout_s:.0f} s")


def measure_window(seconds: float, server_pid: int, proc: subprocess.Popen[bytes] | None = None,
                   node: str = "") -> Window:
    """Sleep `seconds` and return the CPU the server and the node used meanwhile.

    Nothing of the benchmark talks to the server during the window; the node's
    runs that started in it are read afterwards.
    """
    from prefect.client.orchestration import get_client

    pid = proc.pid if proc is not None else None
    server0, wall0 = tree_cpu(server_pid), datetime.now(UTC)
    node0 = tree_cpu(pid) if pid is not None else 0.0
    time.sleep(seconds)
    server1, wall1 = tree_cpu(server_pid), datetime.now(UTC)
    node1 = tree_cpu(pid) if pid is not None else 0.0
    found = Window(seconds, server1 - server0, node1 - node0)
    if proc is None:
        return found
    if proc.poll() is not None:
        raise SystemExit(f"the serve process of {node} exited during a window")
    names = flow_names()
    with get_client(sync_client=True) as client:
        for run in node_runs(node):
            start = run.start_time
            if start is None or not wall0 <= start < wall1:
                continue
            found.started[names.get(str(run.flow_id), "?")] += 1
            found.waited.update({state.name for state in client.read_flow_run_states(run.id)
                                 if state.name in ("AwaitingConcurrencySlot", "Late")})
            if run.end_time is not None and run.expected_start_time is not None:
                found.took.append((run.end_time - run.expected_start_time).total_seconds())
            found.failed += state_of(run) in ("FAILED", "CRASHED")
    return found


SETTLE_S = 15
"""Seconds between a node going quiet and a window: the server writes the last runs' events."""


class Node:
    """One served node: its serve process, started from a command with its own config."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        print(f"[{name}] starting the serve process", flush=True)
        with (logs / f"{name}.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def deployment_id(self, flow: str) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_deployment_by_name(f"{flow}/{self.name}").id

    def pause(self, flow: str, paused: bool) -> None:
        """Pause (its scheduled runs are deleted) or resume the node's deployment of flow."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            if paused:
                client.pause_deployment(self.deployment_id(flow))
            else:
                client.resume_deployment(self.deployment_id(flow))

    def stop(self) -> None:
        """Stop the serve process and delete the node's deployments (and their scheduled runs)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

        stop_group(self.proc)
        with get_client(sync_client=True) as client:
            for item in client.read_deployments(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[self.name]))
            ):
                client.delete_deployment(item.id)


@dataclass
class IdleResult:
    """A served node with no run due, bracketed by the server with no node at all."""

    name: str
    alone_before: Window
    node: Window
    alone_after: Window

    def server_hour(self) -> float:
        """Return the server's CPU an hour above its own rate: what the served node adds."""
        alone = (self.alone_before.server_rate + self.alone_after.server_rate) / 2
        return (self.node.server_rate - alone) * 3600

    def node_hour(self) -> float:
        return self.node.node_rate * 3600


@dataclass
class RunResult:
    """A kind of run accelerated, bracketed by the same served node with it paused."""

    name: str
    kind: str
    runs: int
    idle_before: Window
    window: Window
    idle_after: Window

    def per_run(self) -> Cost:
        """Return CPU per run: the window's CPU less the bracketing idle rate, per run."""
        server_idle = (self.idle_before.server_rate + self.idle_after.server_rate) / 2
        node_idle = (self.idle_before.node_rate + self.idle_after.node_rate) / 2
        return Cost(
            server=(self.window.server - server_idle * self.window.seconds) / self.runs,
            node=(self.window.node - node_idle * self.window.seconds) / self.runs,
        )


@dataclass
class Cost:
    """CPU seconds of one thing: on the server and on the node."""

    server: float
    node: float


def measure_idle(name: str, node: Node, server_pid: int, seconds: float,
                 alone_before: Window) -> tuple[IdleResult, Window]:
    """Measure a served node with nothing due, then the server alone after it; return both."""
    try:
        wait_for(node.name, "reconcile", completed=1, proc=node.proc, quiet=True)
        time.sleep(SETTLE_S)
        print(f"[{name}] measuring {seconds:.0f} s", flush=True)
        window = measure_window(seconds, server_pid, node.proc, node.name)
        print(f"[{name}] {window.describe()}", flush=True)
    finally:
        node.stop()
    time.sleep(SETTLE_S)
    alone_after = measure_window(seconds, server_pid)
    print(f"[server alone] {alone_after.describe()}", flush=True)
    return IdleResult(name, alone_before, window, alone_after), alone_after


def measure_runs(name: str, kind: str, node: Node, server_pid: int, *, runs: int, every: float,
                 idle_s: float) -> RunResult:
    """Measure one kind of run: idle (paused), accelerated, idle again, in one served node."""
    try:
        wait_for(node.name, kind, completed=2, proc=node.proc)
        node.pause(kind, True)
        wait_for(node.name, kind, completed=2, proc=node.proc, quiet=True)
        time.sleep(SETTLE_S)
        print(f"[{name}] idle (paused) {idle_s:.0f} s", flush=True)
        before = measure_window(idle_s, server_pid, node.proc, node.name)
        print(f"[{name}] {before.describe()}", flush=True)
        done = completed_runs(node.name, kind)
        node.pause(kind, False)
        # Steady state: one run done since the resume (the window starts between two runs).
        wait_for(node.name, kind, completed=done + 1, proc=node.proc)
        print(f"[{name}] {runs} runs, {runs * every:.0f} s", flush=True)
        window = measure_window(runs * every, server_pid, node.proc, node.name)
        print(f"[{name}] {window.describe()}", flush=True)
        node.pause(kind, True)
        wait_for(node.name, kind, completed=0, proc=node.proc, quiet=True)
        time.sleep(SETTLE_S)
        print(f"[{name}] idle (paused) {idle_s:.0f} s", flush=True)
        after = measure_window(idle_s, server_pid, node.proc, node.name)
        print(f"[{name}] {after.describe()}", flush=True)
    finally:
        node.stop()
    return RunResult(name, kind, runs, before, window, after)


@dataclass
class PollResult:
    """The server's CPU for the runner's poll request, sent by the benchmark at a steady pace."""

    polls: int
    window: Window
    alone_before: Window

    def per_poll(self) -> float:
        """Return server CPU seconds per poll, less the server's own rate alone over the loop."""
        return (self.window.server - self.alone_before.server_rate * self.window.seconds) / (
            self.polls)


POLL_PACE_S = 0.5
"""Seconds between the benchmark's polls: slower than the server's follow-up task per poll."""


def measure_polls(work: Path, zone: str, server_pid: int, polls: int,
                  alone_before: Window) -> PollResult:
    """Send the runner's poll for a node's three deployments `polls` times; measure the server.

    The request is the one the serve process sends every 10 s
    (``get_scheduled_flow_runs_for_deployments`` for its deployment ids, scheduled
    before now + 10 s); the server answers it and marks the deployments ready
    in a background task, as for the runner.
    """
    from prefect.client.orchestration import get_client

    from deployments.serve import build_deployments
    from flows.settings import load_settings

    config = write_node(work, "poll", zone)
    os.environ["SCHED_CONFIG"] = str(config)
    deployments = build_deployments(load_settings())
    ids: list[Any] = [item.apply() for item in deployments]  # sync here
    print(f"[runner poll] {polls} polls, one every {POLL_PACE_S:g} s", flush=True)
    with get_client(sync_client=True) as client:
        client.get_scheduled_flow_runs_for_deployments(  # a first one, not measured
            deployment_ids=ids, scheduled_before=datetime.now(UTC) + timedelta(seconds=10))
        time.sleep(SETTLE_S)
        server0, started = tree_cpu(server_pid), time.perf_counter()
        for _ in range(polls):
            client.get_scheduled_flow_runs_for_deployments(
                deployment_ids=ids, scheduled_before=datetime.now(UTC) + timedelta(seconds=10))
            time.sleep(POLL_PACE_S)
        time.sleep(2)  # the last poll's background task
        window = Window(time.perf_counter() - started, tree_cpu(server_pid) - server0)
        for item in ids:
            client.delete_deployment(item)
    print(f"[runner poll] {window.describe()}", flush=True)
    return PollResult(polls, window, alone_before)


def runs_per_day(deployments: list[Any]) -> dict[str, float]:
    """Return, per flow, the runs its deployment's schedules make in one day."""
    from prefect.server.schemas import schedules as server_schedules

    start = datetime(2026, 12, 2, tzinfo=UTC)
    found: dict[str, float] = {}
    for item in deployments:
        total = 0
        for entry in item.schedules or []:
            data = entry.schedule.model_dump()
            model: Any = (server_schedules.CronSchedule if "cron" in data
                          else server_schedules.IntervalSchedule)
            schedule = model.model_validate(data)
            for hour in range(24):  # get_dates looks at 1,000 candidates at most
                lo, hi = start + timedelta(hours=hour), start + timedelta(hours=hour + 1)
                dates = asyncio.run(schedule.get_dates(n=10_000, start=lo, end=hi))
                total += sum(1 for date in dates if lo <= date < hi)
        found[item.flow_name] = float(total)
    return found


def job_runs_per_day(zone: str) -> float:
    """Return the idle node's own job runs per day (its windows over four weeks / 28)."""
    from sched_core.matcher import fire_times
    from sched_core.model import LocalSchedule

    start = datetime(2026, 12, 7, tzinfo=UTC)
    rows = [LocalSchedule.model_validate(row) for row in idle_rows()]
    count = sum(len(list(fire_times(row.schedule, start, start + timedelta(days=28),
                                    ZoneInfo(zone)))) for row in rows)
    return count / 28


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per measured kind")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between runs")
    parser.add_argument("--idle", type=float, default=120.0, help="seconds of each idle window")
    parser.add_argument("--polls", type=int, default=240, help="runner polls sent and measured")
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--serve-old", choices=("idle", "tick", "reconcile"),
                        help=argparse.SUPPRESS)  # the node's process, started by the bench
    args = parser.parse_args()
    if args.serve_old:
        serve_old(args.serve_old, args.every)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the server
    started = time.perf_counter()
    server = None
    try:
        server, url = start_server(work / "prefect-home")
        os.environ["PREFECT_API_URL"] = url
        run(args, work, server.pid, url)
    finally:
        stop_group(server)
        shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.perf_counter() - started:.0f} s")


POLL_VARIANT = 60
"""The runner poll interval (s) of the variant "new, polling every 60 s" (default 10 s)."""


def run(args: argparse.Namespace, work: Path, server_pid: int, url: str) -> None:
    zone = pick_zone(datetime.now(UTC))
    port = urlsplit(url).port
    assert port is not None
    # The serve processes get what `make run` gives them: the server's environment.
    base_env = server_env(work / "prefect-home", port)
    logs = work / "logs"
    logs.mkdir()
    me = [sys.executable, str(Path(__file__).resolve())]
    real_serve = [sys.executable, "-m", "deployments.serve"]
    every = str(args.every)

    def node(name: str, cmd: list[str], **extra: str) -> Node:
        env = {**base_env, "SCHED_CONFIG": str(write_node(work, name, zone)), **extra}
        return Node(name, cmd, env, logs)

    time.sleep(SETTLE_S)
    alone = measure_window(args.idle, server_pid)
    print(f"[server alone] {alone.describe()}", flush=True)
    idle: dict[str, IdleResult] = {}
    for name, cmd, extra in (
        ("old", [*me, "--serve-old", "idle"], {}),
        ("new", real_serve, {}),
        (f"new, polling every {POLL_VARIANT} s", real_serve,
         {"PREFECT_RUNNER_POLL_FREQUENCY": str(POLL_VARIANT)}),
    ):
        served = node(f"idle-{len(idle)}", cmd, **extra)
        idle[name], alone = measure_idle(f"idle {name}", served, server_pid, args.idle, alone)
    poll = measure_polls(work, zone, server_pid, args.polls, alone)
    # The new design runs the real serve, its reconcile_interval shortened (the
    # plan_horizon keeps its 1 h). Interleaved, so load changes hit both designs alike.
    runs: dict[str, RunResult] = {}
    for name, kind, cmd, extra in (
        ("old fire-tick", "fire-tick", [*me, "--serve-old", "tick", "--every", every], {}),
        ("new reconcile", "reconcile", real_serve, {"SCHED_RECONCILE_INTERVAL": every}),
        ("old reconcile", "reconcile", [*me, "--serve-old", "reconcile", "--every", every], {}),
    ):
        served = node(name.replace(" ", "-"), cmd, **extra)
        runs[name] = measure_runs(name, kind, served, server_pid, runs=args.runs,
                                  every=args.every, idle_s=args.idle)
    report(args, idle, runs, poll, zone)


def report(args: argparse.Namespace, idle: dict[str, IdleResult], runs: dict[str, RunResult],
           poll: PollResult, zone: str) -> None:
    from bench.legacy_tick import build_deployments as old_deployments
    from deployments.serve import build_deployments as new_deployments
    from flows.settings import AgentSettings

    settings = AgentSettings(node_name="n", pull_url="schedules.json", timezone=zone)
    old_day = runs_per_day(old_deployments(settings))
    new_day = runs_per_day(new_deployments(settings))
    jobs_day = job_runs_per_day(zone)
    tick = runs["old fire-tick"].per_run()
    old_rec = runs["old reconcile"].per_run()
    new_rec = runs["new reconcile"].per_run()
    per_hour = {"old": {"fire-tick": old_day["fire-tick"] / 24,
                        "reconcile": old_day["reconcile"] / 24},
                "new": {"reconcile": new_day["reconcile"] / 24}}
    cost = {"old": {"fire-tick": tick, "reconcile": old_rec}, "new": {"reconcile": new_rec}}

    def flow_hour(design: str) -> Cost:
        items = per_hour[design].items()
        return Cost(server=sum(n * cost[design][kind].server for kind, n in items),
                    node=sum(n * cost[design][kind].node for kind, n in items))

    def polling(name: str) -> Cost:
        return Cost(server=idle[name].server_hour(), node=idle[name].node_hour())

    variant = f"new, polling every {POLL_VARIANT} s"
    per_poll = poll.per_poll()
    old_h, new_h = flow_hour("old"), flow_hour("new")
    old_p, new_p, var_p = polling("old"), polling("new"), polling(variant)
    old_day_n, new_day_n = sum(old_day.values()), sum(new_day.values())

    def ratio(old: float, new: float) -> str:
        return f"{old / new:.1f}x" if new > 0 else "n/a (new <= 0)"

    def target(old: float, new: float) -> str:
        return "met" if new > 0 and old / new >= 10 else "**missed**"

    def line(label: str, old: float, new: float, fmt: str) -> str:
        return (f"| {label} | {old:{fmt}} | {new:{fmt}} | {ratio(old, new)} "
                f"| {target(old, new)} |")

    per_run_table = [
        "| flow run (served, one every "
        f"{args.every:g} s) | server CPU per run | node CPU per run |",
        "|---|---:|---:|",
        f"| old `fire-tick` (nothing due) | {tick.server * 1000:.0f} ms | {tick.node:.2f} s |",
        f"| old `reconcile` (pull, missed-run check) | {old_rec.server * 1000:.0f} ms "
        f"| {old_rec.node:.2f} s |",
        f"| new `reconcile` (pull, plan: nothing to create) | {new_rec.server * 1000:.0f} ms "
        f"| {new_rec.node:.2f} s |",
        f"| (no flow run) the serve process's poll for scheduled runs, every 10 s "
        f"| {per_poll * 1000:.1f} ms | |",
    ]
    table = [
        "| per idle node | old: `fire-tick` every minute, `reconcile` every 300 s "
        "| new: `reconcile` every 900 s, runs planned ahead | old / new | target 10x |",
        "|---|---:|---:|---:|---|",
        f"| flow runs an hour | {per_hour['old']['fire-tick']:.0f} ticks + "
        f"{per_hour['old']['reconcile']:.0f} reconciles | "
        f"{per_hour['new']['reconcile']:.0f} reconciles, no job | | |",
        line("**flow runs per idle node-day** (ticks, reconciles)", old_day_n, new_day_n, ",.0f"),
        f"| flow runs per node-day with its own jobs (+{jobs_day:.2f}: the nightly backup, the "
        f"weekly check) | {old_day_n + jobs_day:,.2f} | {new_day_n + jobs_day:,.2f} "
        f"| {ratio(old_day_n + jobs_day, new_day_n + jobs_day)} | |",
        line("**server CPU per idle node-hour** (its flow runs), s", old_h.server, new_h.server,
             ".2f"),
        line("**node CPU per idle node-hour** (its flow runs), s", old_h.node, new_h.node, ".1f"),
        line("server CPU per idle node-hour, flow runs + the served node polling, s",
             old_h.server + old_p.server, new_h.server + new_p.server, ".2f"),
        line("node CPU per idle node-hour, flow runs + the served node polling, s",
             old_h.node + old_p.node, new_h.node + new_p.node, ".1f"),
        line(f"the same, server, the new node's runner polling every {POLL_VARIANT} s, s",
             old_h.server + old_p.server, new_h.server + var_p.server, ".2f"),
        line(f"the same, node, the new node's runner polling every {POLL_VARIANT} s, s",
             old_h.node + old_p.node, new_h.node + var_p.node, ".1f"),
    ]
    old_alt = Cost(
        server=per_hour["old"]["fire-tick"] * tick.server
        + per_hour["old"]["reconcile"] * new_rec.server,
        node=per_hour["old"]["fire-tick"] * tick.node + per_hour["old"]["reconcile"] * new_rec.node,
    )
    whole_old = old_h.server + old_p.server
    budget = whole_old / 10 - new_h.server
    met_all = [target(old_h.server, new_h.server), target(old_h.node, new_h.node),
               target(old_day_n, new_day_n)] == ["met"] * 3
    verdict_lines = [
        f"**Against the targets (at least 10x less of each):** flow runs per idle node-day "
        f"{ratio(old_day_n, new_day_n)}, server CPU per idle node-hour from its flow runs "
        f"{ratio(old_h.server, new_h.server)}, node CPU {ratio(old_h.node, new_h.node)}: "
        f"{'all met' if met_all else '**not all met**'}. Counting also what a served node "
        "costs with no run at all, the node's CPU is still "
        f"{ratio(old_h.node + old_p.node, new_h.node + new_p.node)} less, but the server's "
        f"only {ratio(whole_old, new_h.server + new_p.server)}: of an idle new node's "
        f"{new_h.server + new_p.server:.1f} s of server CPU an hour, {new_p.server:.1f} s is "
        "the serve process polling for scheduled runs, which the old design paid too "
        f"(a poll costs the server {per_poll * 1000:.1f} ms: 360 an hour are "
        f"{per_poll * 360:.1f} s). To be 10x less there too, the new node may spend at most "
        f"{whole_old / 10:.2f} s an hour, so {max(budget, 0):.2f} s on polling: "
        + (f"one poll every {3600 * per_poll / budget:.0f} s or more at "
           f"{per_poll * 1000:.1f} ms each. The design change that meets it: serve with a "
           "longer poll (`PREFECT_RUNNER_POLL_FREQUENCY`, or `serve(..., query_seconds=...)`) "
           "and `prefetch_seconds` at least as long, so that planned runs still start on "
           "time (the runner submits a prefetched run early and the server holds it until "
           "its scheduled time); the cost is that event-triggered runs (`advance-chain` "
           "after a job, `reconcile` on `sched.schedules.updated`, ad hoc runs) wait up to "
           "that long. Measured here with polling every "
           f"{POLL_VARIANT} s: {new_h.server + var_p.server:.1f} s an hour, "
           f"{ratio(whole_old, new_h.server + var_p.server)} less." if budget > 0 else
           "the flow runs alone exceed it."),
    ]
    checks = [f"server alone, before the idle nodes: {idle['old'].alone_before.describe()}"]
    checks.append(f"{poll.polls} runner polls sent by the benchmark, one every "
                  f"{POLL_PACE_S:g} s: {poll.window.describe()}")
    for name, result in idle.items():
        checks.append(f"idle node, {name}: {result.node.describe()}")
        checks.append(f"server alone after it: {result.alone_after.describe()}")
    for name, measured in runs.items():
        checks.append(f"{name}, paused before: {measured.idle_before.describe()}")
        checks.append(f"{name}, {measured.runs} runs: {measured.window.describe()}")
        checks.append(f"{name}, paused after: {measured.idle_after.describe()}")
    body = "\n".join([
        f"Measured by `bench/bench_idle.py` on {datetime.now(UTC):%Y-%m-%d} ({machine()}), "
        "against one `prefect server start` (Prefect 3.9.1, SQLite, the environment `make run` "
        "gives it, throwaway PREFECT_HOME) on a free port. One idle node: a nightly backup at "
        f"02:30 and a weekly check on Sunday at 04:00 in {zone}, nothing due for hours.",
        "",
        *per_run_table,
        "",
        *table,
        "",
        *verdict_lines,
        "",
        "How it was measured:",
        "- **Per run.** Each kind of run was served as its design serves it (`prefect.serve` in "
        "a subprocess, each flow run a subprocess of that one) and accelerated to one run every "
        f"{args.every:g} s by an `Interval` schedule, so the server's scheduler created the "
        "runs and the serve process picked them up as at the real cadence: the old "
        "`fire-tick` and `reconcile` from `bench/legacy_tick.py` (the old flows and "
        "deployments copied from commit de7110e, only the imports adapted), the new "
        "`reconcile` by the real `python -m deployments.serve` with "
        f"`SCHED_RECONCILE_INTERVAL={args.every:g}`. CPU is user + system time from "
        "`/proc/<pid>/stat`, of the server's process tree and of the serve process's tree "
        "(the flow-run subprocesses included, reaped or alive), read before and after each "
        "window, with no request from the benchmark in between. In one serve process: the "
        f"deployment paused ({args.idle:g} s), resumed and one run let through, then exactly "
        f"{args.runs} periods ({args.runs * args.every:g} s), then paused again "
        f"({args.idle:g} s); the mean CPU rate of the two paused windows times the run window "
        f"was subtracted and the rest divided by {args.runs}. Bracketing matters: the "
        "server's own rate grows as its database fills (in an earlier run of this benchmark "
        "from 86 to 115 s an hour over 25 minutes, with no node).",
        "- **Per idle node-hour**, from its flow runs: the cost per run times the runs an hour "
        "of the real cadences, counted from the schedules each design's deployments carry "
        "(old `Cron(\"* * * * *\")` for `fire-tick` and `Interval(300)` for `reconcile`; new "
        "`Interval(reconcile_interval)`, 900 s by default), and no job run since nothing is "
        "due. This is what the issue measured for the old design (136 ms and 2.5 s a tick, "
        "8 s and 150 s an hour).",
        "- **The served node polling**, which both designs pay whatever their schedules: a "
        "serve process with its deployments registered and no run due, bracketed by the "
        "server alone before and after it: the serve process's CPU an hour (old "
        f"{old_p.node:.1f} s, new {new_p.node:.1f} s, new polling every {POLL_VARIANT} s "
        f"{var_p.node:.1f} s) and the server's above its rate alone (old {old_p.server:.1f} s, "
        f"new {new_p.server:.1f} s, new polling every {POLL_VARIANT} s {var_p.server:.1f} s). "
        "The runner asks the server for its scheduled runs every 10 s "
        "(`PREFECT_RUNNER_POLL_FREQUENCY`); the variant is the real serve with "
        f"`PREFECT_RUNNER_POLL_FREQUENCY={POLL_VARIANT}`. These are differences of a few "
        "seconds an hour between windows of "
        f"{args.idle:g} s: the noisiest figures here. The cost of one poll was measured on "
        f"its own: the benchmark sent the serve process's request ({poll.polls} times, one "
        f"every {POLL_PACE_S:g} s, for a node's three deployments) and the server's CPU "
        "less its rate alone was divided by the polls.",
        "- The old design with the new `reconcile` (pull and plan) in place of its own, at its "
        f"300 s cadence: {old_alt.server:.2f} s server and {old_alt.node:.1f} s node CPU an "
        "hour.",
        "- The pull reads a file (no controller): an HTTP pull of an unchanged list (a 304) "
        "costs a little more per reconcile, in both designs.",
        "- Each window (checks: the runs that started, none waited for a concurrency slot or "
        "went Late, none failed):",
        *[f"  - {item}" for item in checks],
    ])
    print(body)
    if not args.no_write:
        write_section(BEGIN, END, HEADING, body)


if __name__ == "__main__":
    main()
