"""The node's two baselines in bench/bench_limit.py, each run as a process of its own.

    python bench/limit_loops.py warm|apscheduler --rows N --stamps FILE [--cpu FILE]

Both fire ``rows`` jobs at every minute (second 0, UTC) until SIGTERM; each job
``posix_spawn``s :func:`command` (the same command the node's rows run), which stamps
its own start into the stamps file. Rule: the standard library only, and APScheduler 4
for its part: nothing of the project is imported, so neither loop pays for it.

- ``warm``: one process that sleeps until each instant and ``posix_spawn``s the command
  once per row, then reaps them. With ``--cpu`` it appends, at its start (as instant 0)
  and after each instant, the instant and its own CPU so far (itself and its reaped
  children: ``getrusage``).
- ``apscheduler``: APScheduler 4's ``Scheduler`` (memory store, its thread-pool
  executor), one ``CronTrigger(minute="*")`` schedule per row, whose job spawns the
  command and waits for it.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import threading
import time
from pathlib import Path

STAMPS: list[str] = []
"""The argv of :func:`command` for this process's stamps file (set by :func:`main`)."""


def command(stamps: Path) -> list[str]:
    """Return the argv of the job every contender runs: it appends its own start to stamps."""
    return ["/bin/sh", "-c", f"date +%s.%N >> {stamps}"]


def spawn(argv: list[str]) -> int:
    """Start argv (no shell of ours, no copy of this process: ``posix_spawn``); return its pid."""
    return os.posix_spawn(argv[0], argv, {"PATH": "/usr/bin:/bin"})


def stamp_job() -> None:
    """APScheduler's job: spawn the command and wait for it."""
    os.waitpid(spawn(STAMPS), 0)


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def warm(rows: int, stop: threading.Event, cpu_file: Path | None) -> None:
    """Sleep until each minute, spawn the command rows times, reap them; until stop."""
    if cpu_file is not None:  # instant 0: what the start cost, before any job
        with cpu_file.open("a") as out:
            out.write(f"0 {_cpu():.6f}\n")
    while not stop.is_set():
        instant = (time.time() // 60 + 1) * 60
        while (left := instant - time.time()) > 0:
            # One sleep until 5 ms before (a wake-up per job), then 0.5 ms ones.
            if stop.wait(left - 0.005 if left > 0.006 else 0.0005):
                return
        pids = [spawn(STAMPS) for _ in range(rows)]
        for pid in pids:
            os.waitpid(pid, 0)
        if cpu_file is not None:
            with cpu_file.open("a") as out:
                out.write(f"{instant:.0f} {_cpu():.6f}\n")


def apscheduler(rows: int, stop: threading.Event) -> None:
    """Run APScheduler 4 with one every-minute cron schedule per row until stop."""
    from datetime import UTC

    from apscheduler import Scheduler
    from apscheduler.triggers.cron import CronTrigger

    with Scheduler() as scheduler:
        for row in range(rows):
            scheduler.add_schedule(stamp_job, CronTrigger(minute="*", timezone=UTC),
                                   id=f"row{row}")
        scheduler.start_in_background()
        print("apscheduler started", flush=True)
        stop.wait()
        scheduler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=["warm", "apscheduler"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--stamps", type=Path, required=True)
    parser.add_argument("--cpu", type=Path, default=None)
    args = parser.parse_args()
    STAMPS[:] = command(args.stamps)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.loop == "warm":
        warm(args.rows, stop, args.cpu)
    else:
        apscheduler(args.rows, stop)


if __name__ == "__main__":
    main()
