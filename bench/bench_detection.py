"""How soon the controller says a node is dead, or a window passed with nothing run.

Real time, real components: a controller (the API served over loopback, on a
SQLite file) and its fleet watch at its default interval (15 s), sending its
alerts to a throwaway Prefect server on which ``sched alerts install``'s
automations are installed. Nodes are simulated over HTTP with their own tokens,
as an agent reports (a heartbeat announced, a job record per window):

- ``--healthy`` nodes report every ``--heartbeat`` seconds (with a few seconds
  of random lateness), each with an every-minute schedule whose every window
  they report Completed: false alerts on them must be 0;
- one node reports like them, then stops (killed) right after a report.

Measured: from the kill to the ``sched.node.silent`` alert (the watch's insert,
and the automation's ``prefect.automation.triggered``); from the first window
after the kill to its ``sched.node.window-missed`` alert. Prints the figures.

    .venv/bin/python bench/bench_detection.py [--heartbeat 60] [--grace 60] [--healthy 3]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx


def report(node: str, heartbeat: float, grace: float,
           jobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node": node, "agent_version": "bench", "timezone": "UTC", "grace_s": grace,
            "reported_at": datetime.now(UTC).isoformat(), "heartbeat_s": heartbeat,
            "jobs": jobs}


def window_jobs(now: datetime, seq: int) -> list[dict[str, Any]]:
    """The every-minute schedule's windows of the last 3 minutes, Completed."""
    jobs = []
    minute = now.replace(second=0, microsecond=0)
    for back in range(3):
        window = minute - timedelta(minutes=back)
        jobs.append({"key": f"m@{window:%Y-%m-%dT%H:%M}+00:00", "schedule_id": "m",
                     "window": window.isoformat(), "trigger_key": "schedule",
                     "state": "Completed", "started_at": window.isoformat(),
                     "ended_at": (window + timedelta(seconds=1)).isoformat(),
                     "seq": seq * 10 + back})
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heartbeat", type=float, default=60.0)
    parser.add_argument("--grace", type=float, default=60.0)
    parser.add_argument("--healthy", type=int, default=3)
    parser.add_argument("--interval", type=float, default=15.0, help="the watch's interval")
    parser.add_argument("--soak", type=float, default=0.0,
                        help="seconds to keep the healthy nodes reporting after the dead "
                        "node's alerts (false alerts counted over the whole run)")
    args = parser.parse_args()

    from prefect.client.orchestration import get_client
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness
    from typer.testing import CliRunner

    from controller.api import create_app
    from controller.auth import Tokens
    from controller.db import make_engine, migrate
    from controller.events import PrefectEvents
    from controller.fleet import FleetSettings
    from controller.testing import serve_in_thread
    from controller.watch import FleetWatch
    from sched_cli import app as sched

    nodes = [f"healthy-{n}" for n in range(args.healthy)]
    dead = "dead-1"
    folder = Path(tempfile.mkdtemp(prefix="bench-detection-"))
    url = f"sqlite:///{folder / 'c.db'}"
    migrate(url)
    engine = make_engine(url)
    tokens = Tokens(admin=["bench-admin"], nodes={n: [f"{n}-t"] for n in [*nodes, dead]})
    settings = FleetSettings()
    with temporary_settings({PREFECT_SERVER_ANALYTICS_ENABLED: False}), \
            prefect_test_harness(server_startup_timeout=60):
        api = str(PREFECT_API_URL.value())
        prefix = f"bench-{uuid.uuid4().hex[:6]}"
        installed = CliRunner().invoke(sched, ["alerts", "install", "--prefix", prefix])
        assert installed.exit_code == 0, installed.output
        events = PrefectEvents(api)
        app = create_app(engine, tokens, fleet_settings=settings)
        watch = FleetWatch(engine, settings, emit=events.send, interval=args.interval)
        raised: list[tuple[float, str, str]] = []
        original = watch._insert

        def timed(session: Any, planned: Any, now: datetime) -> Any:
            found = original(session, planned, now)
            for alert in found:
                raised.append((time.time(), alert.node, alert.kind))
            return found

        watch._insert = timed  # type: ignore[method-assign]
        stop = threading.Event()
        with serve_in_thread(app) as base:
            admin = {"Authorization": "Bearer bench-admin"}
            row = {"id": "m", "name": "m", "action": "backup", "miss_policy": "skip",
                   "enabled": True, "schedule": {"interval_minutes": 1}}
            for node in [*nodes, dead]:
                httpx.put(f"{base}/api/nodes/{node}/schedules/m", json=row, headers=admin)

            def node_loop(node: str, die_after: float | None) -> None:
                started = time.monotonic()
                seq = 0
                while not stop.is_set():
                    seq += 1
                    body = report(node, args.heartbeat, args.grace,
                                  window_jobs(datetime.now(UTC), seq))
                    httpx.post(f"{base}/api/nodes/{node}/report", json=body,
                               headers={"Authorization": f"Bearer {node}-t"}, timeout=10)
                    if die_after is not None and time.monotonic() - started >= die_after:
                        killed.append(time.time())
                        return
                    stop.wait(args.heartbeat - random.uniform(0, 5))

            killed: list[float] = []
            threads = [threading.Thread(target=node_loop, args=(n, None)) for n in nodes]
            threads.append(threading.Thread(target=node_loop, args=(dead, 65.0)))
            watch.start()
            for thread in threads:
                thread.start()
            begun = time.monotonic()
            deadline = begun + 3 * args.heartbeat + args.grace + 240
            while time.monotonic() < deadline:
                kinds = {(n, k) for _, n, k in raised}
                if {(dead, "node-silent"), (dead, "window-missed")} <= kinds and killed:
                    break
                time.sleep(1)
            stop.wait(args.soak)
            ran = time.monotonic() - begun
            stop.set()
            watch.stop()
            for thread in threads:
                thread.join(30)
        kill = killed[0]
        silent_at = next(t for t, n, k in raised if n == dead and k == "node-silent")
        missed = [(t, n) for t, n, k in raised if n == dead and k == "window-missed"]
        first_window = (datetime.fromtimestamp(kill, UTC).replace(second=0, microsecond=0)
                        + timedelta(minutes=1)).timestamp()
        false = [(n, k) for _, n, k in raised if n != dead]
        fired: list[float] = []
        until = time.monotonic() + 60
        with get_client(sync_client=True) as client:
            while not fired and time.monotonic() < until:
                found = client.request("POST", "/events/filter", json={"filter": {
                    "event": {"name": ["prefect.automation.triggered"]}}, "limit": 50}).json()
                fired = sorted(datetime.fromisoformat(e["occurred"]).timestamp()
                               for e in found["events"]
                               if "went silent" in e["resource"].get("prefect.resource.name",
                                                                     ""))
                time.sleep(1)
        print(f"heartbeat {args.heartbeat:g} s (silent after {3 * args.heartbeat:g} s), grace "
              f"{args.grace:g} s, watch every {args.interval:g} s, {args.healthy} healthy nodes")
        print(f"dead node: silent alert {silent_at - kill:.1f} s after its last report; "
              f"automation fired {fired[0] - kill:.1f} s after it" if fired else
              f"dead node: silent alert {silent_at - kill:.1f} s after its last report")
        if missed:
            print(f"missed window: alert {missed[0][0] - first_window:.1f} s after the first "
                  f"window after the kill ({len(missed)} missed alerts in all)")
        print(f"false alerts on healthy nodes over {ran / 60:.0f} min: {len(false)} {false[:5]}")
        events.close()
    engine.dispose()


if __name__ == "__main__":
    main()
