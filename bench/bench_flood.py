"""Benchmark the controller's API under a slow-client flood, against baselines in the same run.

A flood of ``--slow`` connections (default 1,100, over the default ceiling of
1,000) that each send half a request and then one header byte a second, and
reconnect at once when the server closes them (a persistent slowloris), for
``--seconds``. Meanwhile a normal client sends ``GET /api/nodes`` on a fresh
connection after another (5 s timeout each) and counts what it gets.

Four runs, each on a fresh SQLite controller started as a subprocess:

1. ``sched controller serve`` without the flood (the baseline latency);
2. ``sched controller serve`` under a flood below its ceiling (``--under``, 800);
3. ``sched controller serve`` under the flood (the guarded protocol, default limits);
4. the same app under plain uvicorn (no guard) under the same flood.

For each: the normal client's answers (200 / 503 / no answer) and latency,
the slow connections the server closed, and the lines and bytes the server
logged during the flood.

Usage: ``python bench/bench_flood.py [--slow 1100] [--seconds 30] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.prefect_bench import answers, free_port, percentile, publish, wait_until

ROOT = Path(__file__).resolve().parent.parent

BEGIN, END = "<!-- flood:begin -->", "<!-- flood:end -->"
TOKEN = "bench-flood-admin-token"

UNGUARDED = """
import sys, uvicorn
from controller.api import create_app
from controller.auth import Tokens
from controller.db import make_engine
app = create_app(make_engine(sys.argv[1]), Tokens(admin=[sys.argv[3]]))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=False, lifespan="off")
"""


@contextmanager
def controller(
    folder: Path, name: str, guarded: bool, nofile: int
) -> Iterator[tuple[str, Path]]:
    """Run a controller subprocess on a fresh SQLite file; yield its URL and log file.

    The subprocess's open-file limit is ``nofile`` (soft), as a service's often is (1,024).
    """
    url = f"sqlite:///{folder / (name + '.db')}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCHED_")}
    env.update(SCHED_DATABASE_URL=url, SCHED_ADMIN_TOKEN=TOKEN)
    subprocess.run([sys.executable, "-c", "from controller.cli import app; app()", "migrate"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
    port = free_port()
    if guarded:
        command = [sys.executable, "-c", "from controller.cli import app; app()", "serve",
                   "--api-only", "--port", str(port), "--log-level", "warning"]
    else:
        command = [sys.executable, "-c", UNGUARDED, url, str(port), TOKEN]
    log_path = folder / f"{name}.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(
                resource.RLIMIT_NOFILE,
                (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])),
        )
    base = f"http://127.0.0.1:{port}"
    try:
        up = wait_until(lambda: proc.poll() is not None or answers(f"{base}/healthz", timeout=5),
                        60, every=0.05)
        if not up or proc.poll() is not None:
            raise RuntimeError(f"{name} did not start: {log_path.read_text()}")
        yield base, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Flood:
    """Slow connections kept open (and reopened) until stopped, from a process of their own.

    A process, not a thread: the flood's loop would otherwise compete with the
    normal client for the benchmark's interpreter lock and slow it down itself.
    """

    def __init__(self, host: str, port: int, count: int) -> None:
        self.host, self.port, self.count = host, port, count
        self._opened = multiprocessing.Value("l", 0)
        self._closed = multiprocessing.Value("l", 0)
        self._failed = multiprocessing.Value("l", 0)
        self._stop = multiprocessing.Event()
        self._process: Any = None  # a fork context's Process

    @property
    def opened(self) -> int:
        return int(self._opened.value)

    @property
    def closed_by_server(self) -> int:
        return int(self._closed.value)

    @property
    def failed_connects(self) -> int:
        return int(self._failed.value)

    def _open(self, selector: selectors.BaseSelector, index: int) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=5)
            sock.sendall(b"GET /api/nodes HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        except OSError:
            self._failed.value += 1
            return
        sock.setblocking(False)
        self._opened.value += 1
        selector.register(sock, selectors.EVENT_READ, index)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        for index in range(self.count):
            if self._stop.is_set():
                break
            self._open(selector, index)
        last_trickle = time.monotonic()
        while not self._stop.is_set():
            for key, _ in selector.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                # Any answer (or end) is the server giving up on it: closed, then reopened.
                selector.unregister(sock)
                sock.close()
                self._closed.value += 1
                if not self._stop.is_set():
                    self._open(selector, key.data)
            if time.monotonic() - last_trickle >= 1.0:
                last_trickle = time.monotonic()
                for key in list(selector.get_map().values()):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        sock.send(b"a")  # one header byte a second: never finished
                    except OSError:
                        pass
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        process = context.Process(target=self._run, name="flood", daemon=True)
        process.start()
        self._process = process

    def stop(self) -> None:
        self._stop.set()
        if self._process is not None:
            self._process.join(timeout=60)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()


@dataclass
class Outcome:
    name: str
    slow: int
    ok: int = 0
    unavailable: int = 0
    no_answer: int = 0
    latencies: list[float] = field(default_factory=list)
    closed_by_server: int = 0
    log_lines: int = 0
    log_bytes: int = 0

    @property
    def total(self) -> int:
        return self.ok + self.unavailable + self.no_answer


def normal_client(base: str, seconds: float, outcome: Outcome) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.perf_counter()
        try:
            status = httpx.get(f"{base}/api/nodes", headers=headers, timeout=5).status_code
        except httpx.HTTPError:
            outcome.no_answer += 1
            continue
        if status == 200:
            outcome.ok += 1
            outcome.latencies.append(time.perf_counter() - started)
        else:
            outcome.unavailable += 1


def measure(
    folder: Path, name: str, *, guarded: bool, slow: int, seconds: float, nofile: int
) -> Outcome:
    outcome = Outcome(name, slow=slow)
    with controller(folder, name, guarded, nofile) as (base, log_path):
        host, port = base.removeprefix("http://").split(":")
        flood = Flood(host, int(port), slow) if slow else None
        if flood is not None:
            flood.start()
            while flood.opened + flood.failed_connects < slow:  # all slow ones in place
                time.sleep(0.05)
        before = log_path.read_bytes()
        normal_client(base, seconds, outcome)
        after = log_path.read_bytes()
        if flood is not None:
            flood.stop()
            outcome.closed_by_server = flood.closed_by_server
    grown = after[len(before):]
    if guarded and grown:  # what the guarded server said (a few lines), for the reader
        print(f"{name}, {slow} slow: " + grown.decode(errors="replace")[:1500], file=sys.stderr)
    outcome.log_bytes = len(grown)
    outcome.log_lines = grown.count(b"\n")
    return outcome


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.1f} ms"  # NaN: nothing answered


def _ratio(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"


def report(outcomes: list[Outcome], slow: int, seconds: float, nofile: int) -> str:
    base_p50 = statistics.median(outcomes[0].latencies) if outcomes[0].latencies else float("nan")
    lines = [
        "### API under a slow-client flood",
        "",
        f"`bench/bench_flood.py`: slow connections that each send half a request and then "
        "one header byte a second, reopened at once when the server closes them, for "
        f"{seconds:g} s, while a normal client sends `GET /api/nodes` on one fresh connection "
        "after another (5 s timeout). Each server is a subprocess on its own SQLite file, "
        f"with an open-file limit of {nofile:,} (a common service default); `serve` runs with "
        "its defaults (1,000 connections, 10 s for headers; it raises its own soft "
        "open-file limit to fit them, up to the hard limit).",
        "",
        "| server | slow connections | normal requests | 200 | 503 | no answer | p50 | p99 "
        "| p50 vs baseline | slow connections closed by the server "
        "| log lines / bytes during the run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for outcome in outcomes:
        p50 = statistics.median(outcome.latencies) if outcome.latencies else float("nan")
        p99 = percentile(outcome.latencies, 0.99)
        lines.append(
            f"| {outcome.name} | {outcome.slow or 'none'} | {outcome.total} "
            f"| {outcome.ok} | {outcome.unavailable} | {outcome.no_answer} "
            f"| {_ms(p50)} | {_ms(p99)} | {_ratio(p50 / base_p50)} "
            f"| {outcome.closed_by_server if outcome.slow else '-'} "
            f"| {outcome.log_lines} / {outcome.log_bytes} |"
        )
    lines += [
        "",
        "Below the ceiling the slow connections cost the normal client nothing (each is "
        "closed with a 408 at its 10 s header deadline and reopened). Over it, every new "
        "connection takes the place of the oldest one still sending its headers, so the "
        "normal client is still answered, every time, but the flood turns into a churn of "
        "closed and reopened connections (the column of closed ones) that competes for the "
        "two CPUs: hence the slower answers. Plain uvicorn never closes a slow connection: "
        "past its open-file limit every accept fails, nothing is answered (each normal "
        "request timed out) and asyncio logs each failed accept (the log column: "
        "76 MB once). `serve` writes at most one line per kind a minute.",
        "",
        f"Measured {datetime.now(UTC):%Y-%m-%d} on this machine ({platform.machine()}, "
        f"{os.cpu_count()} CPUs shared with other work), Python {platform.python_version()}; "
        "the flood (one process) and the normal client (another) run beside the server.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--slow", type=int, default=1100,
                        help="slow clients that hold a connection each, past the ceiling")
    parser.add_argument("--under", type=int, default=800,
                        help="a flood under the ceiling, for the second run")
    parser.add_argument("--seconds", type=float, default=30.0, help="each flood's length (s)")
    parser.add_argument("--nofile", type=int, default=1024,
                        help="the servers' open-file limit (soft)")
    parser.add_argument("--write-docs", action="store_true",
                        help="write the result into docs/benchmarks.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sched-flood-") as tmp:
        folder = Path(tmp)
        outcomes = [
            measure(folder, "`sched controller serve`", guarded=True, slow=0,
                    seconds=args.seconds, nofile=args.nofile),
            measure(folder, "`sched controller serve`", guarded=True, slow=args.under,
                    seconds=args.seconds, nofile=args.nofile),
            measure(folder, "`sched controller serve`", guarded=True, slow=args.slow,
                    seconds=args.seconds, nofile=args.nofile),
            measure(folder, "plain uvicorn (no guard)", guarded=False, slow=args.slow,
                    seconds=args.seconds, nofile=args.nofile),
        ]
    section = report(outcomes, args.slow, args.seconds, args.nofile)
    publish(section, BEGIN, END, "", write=args.write_docs)


if __name__ == "__main__":
    main()
