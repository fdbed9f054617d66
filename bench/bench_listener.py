"""What the nodes' listeners cost the Prefect server: one event-stream websocket per node.

Each served node keeps a websocket to the server's event stream
(``flows/pull_listener.py``), filtered to its own ``sched.schedules.updated``.
The server checks every event it receives against every subscriber's filter,
and wakes each subscriber once a second, so the cost grows with nodes (idle)
and with nodes x events (busy): this measures both, against a real
``prefect server start`` (the environment ``make run`` gives it).

CPU is user + system time of the server's process tree from ``/proc``, over
windows of ``--window`` seconds, in four cases, each bracketed the same way:

1. no subscriber, no event (the baseline);
2. ``--nodes`` subscribers (real ``PrefectEventSubscriber`` clients, as the
   listener opens them, in one separate process), no event;
3. no subscriber, ``--rate`` events a second (sent in batches by this process,
   each a ``prefect.flow-run.*``-like event about another resource, as a
   busy fleet sends);
4. ``--nodes`` subscribers and ``--rate`` events a second.

From those: the server CPU per idle subscriber-hour (2 - 1), and per event per
subscriber (4 - 3 - (2 - 1)), then what 1,000 listening nodes cost at a given
event rate. Writes docs/benchmarks.md between ``listener:begin`` and ``listener:end``.

    .venv/bin/python bench/bench_listener.py [--nodes 50] [--rate 20] [--window 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prefect_bench import (
    ROOT,
    machine,
    start_server,
    stop_group,
    tree_cpu,
    write_section,
)

BEGIN, END = "<!-- listener:begin -->", "<!-- listener:end -->"
HEADING = "## The nodes' listeners: what the event stream costs the Prefect server"

SUBSCRIBERS = textwrap.dedent("""
    import asyncio, sys
    from prefect.events.clients import PrefectEventSubscriber
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    async def one(index: int, entered: asyncio.Event) -> None:
        flt = EventFilter(event=EventNameFilter(name=["sched.schedules.updated"]),
                          resource=EventResourceFilter(id=[f"sched.agent.bench-{index}"]))
        async with PrefectEventSubscriber(api_url=sys.argv[1], filter=flt,
                                          reconnect_on_clean_close=True) as sub:
            entered.set()
            async for _event in sub:
                pass

    async def main() -> None:
        tasks = []
        for index in range(int(sys.argv[2])):  # one at a time, as nodes start
            entered = asyncio.Event()
            tasks.append(asyncio.create_task(one(index, entered)))
            try:
                await asyncio.wait_for(entered.wait(), 60)
            except TimeoutError:
                print(f"subscriber {index + 1} did not connect in 60 s", flush=True)
                raise SystemExit(1)
        print("ready", flush=True)
        await asyncio.gather(*tasks)

    asyncio.run(main())
""")


def events(count: int) -> list[dict[str, Any]]:
    now = datetime.now(UTC).isoformat()
    return [{
        "id": str(uuid.uuid4()), "occurred": now, "event": "prefect.flow-run.Running",
        "resource": {"prefect.resource.id": f"prefect.flow-run.{uuid.uuid4()}"},
        "related": [{"prefect.resource.id": f"prefect.flow.{uuid.uuid4()}",
                     "prefect.resource.role": "flow"}],
        "payload": {},
    } for _ in range(count)]


class Sender:
    """Send rate events a second to the server in one batch per second, until stopped."""

    def __init__(self, api: str, rate: int) -> None:
        self.api, self.rate = api, rate
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.wait(1.0):
                client.post(f"{self.api}/events", json=events(self.rate)).raise_for_status()
                self.sent += self.rate


def window(server: subprocess.Popen[bytes], seconds: float) -> float:
    """Return the server tree's CPU seconds over a window of seconds."""
    before = tree_cpu(server.pid)
    time.sleep(seconds)
    return tree_cpu(server.pid) - before


def with_events(server: subprocess.Popen[bytes], api: str, rate: int, seconds: float
                ) -> tuple[float, int]:
    """Return the server tree's CPU seconds over a window with rate events a second, and
    how many events were sent."""
    sender = Sender(api, rate)
    sender.thread.start()
    try:
        return window(server, seconds), sender.sent
    finally:
        sender.stop.set()
        sender.thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--rate", type=int, default=20)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-listener-"))
    server, api = start_server(home, late_runs=False)
    subs: subprocess.Popen[bytes] | None = None
    cpu: dict[str, float] = {}
    sent: dict[str, int] = {}
    try:
        time.sleep(10)  # let the server's start-up work end
        cpu["idle"] = window(server, args.window)
        cpu["events"], sent["events"] = with_events(server, api, args.rate, args.window)
        subs = subprocess.Popen([sys.executable, "-c", SUBSCRIBERS, api, str(args.nodes)],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT)
        assert subs.stdout is not None
        line = subs.stdout.readline()
        if b"ready" not in line:
            raise SystemExit(f"the subscribers did not connect: {line!r}")
        time.sleep(5)
        cpu["subscribed"] = window(server, args.window)
        cpu["subscribed+events"], sent["subscribed+events"] = with_events(
            server, api, args.rate, args.window)
        assert subs.poll() is None, "the subscribers' process ended"
    finally:
        stop_group(subs, grace_s=5)
        stop_group(server)
    hour = 3600 / args.window
    per_sub_hour = (cpu["subscribed"] - cpu["idle"]) * hour / args.nodes
    extra = cpu["subscribed+events"] - cpu["events"] - (cpu["subscribed"] - cpu["idle"])
    per_check_us = extra / (sent["subscribed+events"] * args.nodes) * 1e6
    rows = [
        ("no subscriber, no event", cpu["idle"], 0),
        (f"no subscriber, {args.rate} events/s", cpu["events"], sent["events"]),
        (f"{args.nodes} subscribers, no event", cpu["subscribed"], 0),
        (f"{args.nodes} subscribers, {args.rate} events/s", cpu["subscribed+events"],
         sent["subscribed+events"]),
    ]
    table = ["| case | events sent | server CPU s per window | vs no subscriber, no event |",
             "|---|---:|---:|---:|"]
    for name, value, count in rows:
        table.append(f"| {name} | {count} | {value:.2f} | {value / cpu['idle']:.2f}x |")

    def fleet(nodes: int, rate: float) -> str:
        cores = (per_sub_hour * nodes / 3600) + rate * nodes * per_check_us / 1e6
        return f"{cores:.2f}"

    body = "\n".join([
        f"Measured by `bench/bench_listener.py` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC "
        f"({machine()}); windows of {args.window:g} s.",
        "",
        "CPU of the Prefect server's process tree (`prefect server start`, SQLite, as "
        "`make run` starts it) while real `PrefectEventSubscriber` clients hold the event "
        "stream open, each filtered to one node's `sched.schedules.updated` as the serve "
        "process's listener does, and while events arrive that none of them wants.",
        "",
        *table,
        "",
        f"- an idle listening node: {per_sub_hour:.2f} s of server CPU an hour "
        "(the server wakes each subscriber every second);",
        f"- each event checked against each subscriber's filter: {per_check_us:.1f} us;",
        "- so, in cores of server CPU: 100 nodes at 10 events/s "
        f"{fleet(100, 10)}; 1,000 nodes at 10 events/s {fleet(1000, 10)}; 1,000 nodes at "
        f"100 events/s {fleet(1000, 100)}.",
        "",
        "A served node already holds one such stream without the listener: Prefect's "
        "runner watches its runs' cancellations over it (`FlowRunCancellingObserver`); the "
        "listener adds a second. "
        "The check is per event per subscriber, so the busy cost grows with nodes times "
        "events. A default Prefect server also caps the streams it takes (99 were "
        "accepted here, the 100th timed out), and a served node already holds one: past "
        "about 50 listening nodes per server, listeners that cannot connect retry every "
        "30 s and their nodes keep the trigger path (figures in the propagation section). "
        "A larger fleet should turn the listener off (`listen = false`, `SCHED_LISTEN=0`) "
        "or spread its nodes over several Prefect servers.",
    ])
    print(body)
    if not args.no_write:
        write_section(BEGIN, END, HEADING, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
