"""Dispatch benchmark: one tick with 1,000 schedules due at the same minute.

Starts a local Prefect server (SQLite, throwaway PREFECT_HOME) unless
``PREFECT_API_URL`` is set, registers a ``run-job`` deployment, and measures in
one run:

1. the ``fire-tick`` flow ticking 1,000 due schedules: the time until all
   1,000 ``run-job`` runs exist (target: under 10 s); with 20 or more due
   windows the dispatcher creates their runs through Prefect's bulk endpoint
   (100 per request, the same idempotency keys, entries the server reports
   failed retried in bulk) before the tick confirms them;
2. a plain loop of 1,000 ``run_deployment(timeout=0, idempotency_key=...)``
   calls, the floor any dispatcher pays;

and prints the per-fire overhead of the tick over the plain loop, how many bulk
requests the dispatcher had to retry, and the server's CPU time in each phase.

    .venv/bin/python bench/bench_dispatch.py [--schedules 1000]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(home: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start `prefect server start` on a free port; return it and its API URL once healthy."""
    import httpx

    port = free_port()
    # The late-runs service is off: nothing executes the 2,000 runs made here, so
    # it would mark hundreds of them Late during the measurement, each a state
    # change competing for SQLite's one writer (measured: a create then slows
    # from ~0.13 s to ~0.7 s). A node's worker starts its runs before that.
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
         "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("the Prefect server did not start")


def count_runs(node: str) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        return client.count_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"node:{node}"]))
        )


class RetryCounter(logging.Handler):
    """Count the dispatcher's bulk retries and fallbacks (its log lines)."""

    def __init__(self) -> None:
        super().__init__()
        self.retried = 0
        self.left: int = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "bulk create retried":
            self.retried += 1
        elif record.getMessage() == "bulk create left fires to run_deployment":
            self.left += int(getattr(record, "fires", 0))


def cpu_seconds(pid: int | None) -> float:
    """Return the user and system CPU seconds a process has used so far (0 if unknown)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=1000)
    args = parser.parse_args()
    n = args.schedules
    work = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the server
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        t = time.perf_counter()
        server, url = start_server(work / "prefect-home")
        os.environ["PREFECT_API_URL"] = url
        print(f"server up in {time.perf_counter() - t:.1f} s at {url}")
    try:
        run(work, n, server.pid if server is not None else None)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, n: int, server_pid: int | None) -> None:
    from prefect.deployments import run_deployment

    from flows.job import run_job
    from flows.reconcile import reconcile
    from flows.tick import fire_tick

    node = "bench"
    rows = [
        {"id": f"s-{i:05d}", "name": f"bench {i}", "repo_id": f"r-{i}", "action": "backup",
         "schedule": {"days": ["*"], "hours": ["*"], "minute": "30"},
         "miss_policy": "skip", "enabled": True, "version": 1}
        for i in range(n)
    ]
    (work / "schedules.json").write_text(json.dumps({"schedules": rows}))
    (work / "agent.toml").write_text(
        f'node_name = "{node}"\npull_url = "schedules.json"\nstate_dir = "state"\n'
        '[actions.backup]\nargv = ["true"]\n'
    )
    os.environ["SCHED_CONFIG"] = str(work / "agent.toml")
    run_job.to_deployment(name=node).apply()
    window = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
    window = window.replace(minute=30) if window.minute >= 30 else (
        window.replace(minute=30) - timedelta(hours=1)
    )
    reconcile(now=window - timedelta(minutes=1))

    # 1. The tick, through the fire-tick flow.
    retries = RetryCounter()
    logging.getLogger("flows.agent").addHandler(retries)
    cpu = cpu_seconds(server_pid)
    started = time.perf_counter()
    fired = fire_tick(now=window + timedelta(seconds=5))
    tick_s = time.perf_counter() - started
    while count_runs(node) < n:
        time.sleep(0.05)
    all_exist_s = time.perf_counter() - started
    tick_cpu = cpu_seconds(server_pid) - cpu
    assert fired == n, f"fired {fired}, expected {n}"
    assert count_runs(node) == n

    # 2. A plain run_deployment loop, the floor.
    cpu = cpu_seconds(server_pid)
    started = time.perf_counter()
    for i in range(n):
        run_deployment(
            f"run-job/{node}", parameters={"schedule_id": f"s-{i:05d}"}, timeout=0,
            idempotency_key=f"plain-{i}", tags=["node:plain"], as_subflow=False,
        )
    plain_s = time.perf_counter() - started
    plain_cpu = cpu_seconds(server_pid) - cpu
    assert count_runs("plain") == n

    print(f"{n} schedules due at {window.isoformat()}")
    print(f"fire-tick flow (bulk create, tick, {n} confirmed fires, artifact): {tick_s:.2f} s")
    print(f"all {n} run-job runs exist after: {all_exist_s:.2f} s  (target < 10 s: "
          f"{'met' if all_exist_s < 10 else 'MISSED'})")
    print(f"bulk requests retried: {retries.retried}; fires left to run_deployment: "
          f"{retries.left}")
    if server_pid is not None:
        print(f"server CPU during the tick: {tick_cpu:.1f} s = {tick_cpu / n * 1000:.1f} ms per "
              f"run; during the plain loop: {plain_cpu:.1f} s = {plain_cpu / n * 1000:.1f} ms")
    print(f"plain run_deployment loop: {plain_s:.2f} s = {plain_s / n * 1000:.2f} ms per run")
    print(f"per-fire overhead of the tick over the plain loop: "
          f"{(all_exist_s - plain_s) / n * 1000:.2f} ms ({all_exist_s / plain_s:.2f}x)")


if __name__ == "__main__":
    main()
