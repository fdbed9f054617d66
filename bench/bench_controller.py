"""Benchmark the controller's central scheduler on a real Postgres, against raw baselines.

1. Claim throughput with 1, 4 and 8 claimer processes over the same due tasks:
   ``claims.claim_for_dispatch`` (the batch claim: lease + dispatch record) and
   the scheduler's full pass (``CentralScheduler.run_once``:
   claim + dispatch record in one statement, no-op dispatch, batch completion),
   each against a raw ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)``
   loop on the same database in the same run. Every claimed id is collected, so
   duplicates are counted, not assumed.
2. Wake latency: from the commit of a task save to the start of its (no-op)
   dispatch in a scheduler woken by NOTIFY (by default, and with
   ``durable_claims=True``), against the raw latency from the commit of a
   ``NOTIFY`` to a listening connection's wake-up.
3. If ``bench/bench_controller_api.py`` is present, its ``main()`` (GET /api/schedules),
   with ``--api-args``; ``--no-api`` skips it, ``--api-only`` runs only it.

Usage: ``python bench/bench_controller.py [--database-url URL] [--tasks N] [--write-docs]``.
Without ``--database-url`` a throwaway pgserver is started and stopped.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import event
from sqlmodel import Session

from bench.prefect_bench import publish
from controller import claims, db, tasks
from controller.central import CentralScheduler, CentralSettings
from controller.models import TaskIn
from controller.testing import RecordingDispatcher

BEGIN, END = "<!-- controller:begin -->", "<!-- controller:end -->"

RAW_CLAIM = """
UPDATE scheduled_task SET locked_by = %(worker)s, locked_until = now() + interval '1 hour'
WHERE id IN (
    SELECT id FROM scheduled_task
    WHERE status = 'active' AND next_run_at <= now()
      AND (locked_until IS NULL OR locked_until < now())
    ORDER BY next_run_at, id LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)
RETURNING id, name, next_run_at, locked_by, locked_until, event, deployment, payload, cron,
          schedule, timezone, attempts
"""


# ---------------------------------------------------------------- database


@contextmanager
def postgres(url: str | None) -> Iterator[str]:
    """Yield the URL of a fresh benchmark database (on url's server, or a throwaway pgserver)."""
    server = folder = None
    if url is None:
        folder = tempfile.mkdtemp(prefix="sched-bench-pg-")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
            import pgserver

            server = pgserver.get_server(Path(folder) / "data", cleanup_mode="delete")
        url = server.get_uri("postgres")
    admin = db.database_url(url).render_as_string(hide_password=False)
    name = f"sched_bench_{os.getpid()}"
    conninfo = db.libpq_conninfo(admin)
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name}")  # type: ignore[arg-type]
            conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
        bench_url = db.database_url(admin).set(database=name)
        rendered = bench_url.render_as_string(hide_password=False)
        db.migrate(rendered)
        try:
            yield rendered
        finally:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]
    finally:
        if server is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
                server._cleanup()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def reset_tasks(url: str, count: int) -> None:
    """Make exactly count one-shot tasks, all due, none leased, no dispatch records."""
    with psycopg.connect(db.libpq_conninfo(url), autocommit=True) as conn:
        conn.execute("DELETE FROM task_dispatch")
        conn.execute("DELETE FROM scheduled_task")
        conn.execute(
            """
            INSERT INTO scheduled_task (name, timezone, run_at, event, payload, status,
                                        next_run_at, attempts, created_at, updated_at)
            SELECT 'bench-' || lpad(i::text, 6, '0'), 'UTC', t, 'sched.task.bench', '{}',
                   'active', t, 0, now(), now()
            FROM generate_series(1, %(n)s) AS i,
                 LATERAL (SELECT now() - interval '1 hour' + i * interval '1 ms' AS t) AS at
            """,
            {"n": count},
        )
        conn.execute("VACUUM ANALYZE scheduled_task")
        conn.execute("VACUUM ANALYZE task_dispatch")


# ---------------------------------------------------------------- claim throughput


def _claimer(kind: str, url: str, worker: str, batch: int, start: Any, out: Any) -> None:
    """Claim until nothing is left; put (worker, claimed ids or names, start, end) on out."""
    claimed: list[Any] = []
    if kind == "raw":
        conn = psycopg.connect(db.libpq_conninfo(url), application_name=f"bench-raw:{worker}",
                               autocommit=True)
        start.wait()
        began = time.monotonic()
        while True:
            rows = conn.execute(RAW_CLAIM, {"worker": worker, "limit": batch}).fetchall()
            if not rows:
                break
            claimed.extend(row[0] for row in rows)
        ended = time.monotonic()
        conn.close()
    elif kind == "claim":
        engine = db.make_engine(url, application_name=f"bench-claim:{worker}",
                                pool_size=1, pool_pre_ping=False)
        # One statement needs no transaction around it: autocommit, like the raw loop.
        with Session(engine.execution_options(isolation_level="AUTOCOMMIT")) as session:
            session.connection()  # connect before the clock starts, like raw
            session.commit()
            start.wait()
            began = time.monotonic()
            while batch_claims := claims.claim_for_dispatch(
                session, worker_id=worker, lease=3600, limit=batch
            ):
                claimed.extend(c.task_id for c, _ in batch_claims)
            ended = time.monotonic()
        engine.dispose()
    else:
        recorder = RecordingDispatcher()
        scheduler = CentralScheduler(
            url, CentralSettings(lease=3600, batch_size=batch), worker_id=worker,
            dispatcher=recorder,
        )
        scheduler.seconds_to_next_due()  # connect before the clock starts
        start.wait()
        began = time.monotonic()
        while scheduler.run_once():
            pass
        ended = time.monotonic()
        scheduler.stop()
        claimed = [name for name, _ in recorder.keys()]
    out.put((worker, claimed, began, ended))


@dataclass
class Throughput:
    kind: str
    instances: int
    tasks: int
    seconds: float
    duplicates: int
    missing: int

    @property
    def per_second(self) -> float:
        return self.tasks / self.seconds if self.seconds else 0.0


def measure_claims(kind: str, url: str, instances: int, tasks: int, batch: int) -> Throughput:
    """Run instances claimer processes of kind over tasks due tasks; return the throughput."""
    reset_tasks(url, tasks)
    context = multiprocessing.get_context("fork")
    start, out = context.Barrier(instances), context.Queue()
    processes = [
        context.Process(target=_claimer, args=(kind, url, f"{kind}-{i}", batch, start, out))
        for i in range(instances)
    ]
    for process in processes:
        process.start()
    results = [out.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(60)
    everything = [item for _, claimed, _, _ in results for item in claimed]
    seconds = max(r[3] for r in results) - min(r[2] for r in results)
    return Throughput(kind, instances, len(everything), seconds,
                      len(everything) - len(set(everything)), tasks - len(set(everything)))


# ---------------------------------------------------------------- wake latency


def paired_ratios(
    runs: dict[tuple[str, int], list[Throughput]], instances: int
) -> dict[str, float]:
    """Return, per kind, the median over trials of its throughput over raw's in that trial."""
    raw = runs[("raw", instances)]
    return {
        kind: statistics.median(
            ours.per_second / base.per_second
            for ours, base in zip(runs[(kind, instances)], raw, strict=True)
        )
        for kind in ("claim", "pipeline")
    }


def ratio_range(runs: dict[tuple[str, int], list[Throughput]], instances: int, kind: str) -> str:
    """Return the lowest and highest per-trial ratio of kind over raw, as text."""
    pairs = zip(runs[(kind, instances)], runs[("raw", instances)], strict=True)
    ratios = [ours.per_second / base.per_second for ours, base in pairs]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def _median_rate(results: list[Throughput]) -> float:
    return statistics.median(r.per_second for r in results)


def _quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.median(ordered), p99


def raw_notify_latency(url: str, samples: int) -> list[float]:
    """Return ms from the commit of a row insert + NOTIFY to a listening thread's wake-up."""
    conninfo = db.libpq_conninfo(url)
    woke: list[float] = []
    ready, stop = threading.Event(), threading.Event()
    got = threading.Semaphore(0)

    def listen() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("LISTEN bench_raw")
            ready.set()
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.25):
                    woke.append(time.perf_counter())
                    got.release()

    thread = threading.Thread(target=listen)
    thread.start()
    ready.wait(30)
    latencies = []
    with psycopg.connect(conninfo) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_raw_save (id serial, at timestamptz)")
        conn.commit()
        for _ in range(samples):
            time.sleep(0.005)
            # Like a save: write a row and notify in one transaction.
            conn.execute("INSERT INTO bench_raw_save (at) VALUES (now())")
            conn.execute("SELECT pg_notify('bench_raw', 'x')")
            sent = time.perf_counter()  # the commit below delivers it
            conn.commit()
            got.acquire(timeout=30)
            latencies.append((woke[-1] - sent) * 1000)
    stop.set()
    thread.join()
    return latencies


def _saver(url: str, pipe: Any) -> None:
    """Save the one-shot task named by each message on pipe; answer with its commit time.

    Runs in a process of its own, like an API instance or another client: its
    work after a commit never holds the scheduler's interpreter lock. The time
    is ``time.perf_counter()``, the system-wide monotonic clock on Linux.
    """
    saver = db.make_engine(url, application_name="bench-saver", pool_pre_ping=False)
    commits: list[float] = []
    event.listen(saver, "commit", lambda _conn: commits.append(time.perf_counter()))
    with Session(saver) as session:
        while (name := pipe.recv()) is not None:
            due = datetime.now(UTC) - timedelta(seconds=1)
            tasks.save_task(session, TaskIn(name=name, run_at=due, event="bench"))
            pipe.send(commits[-1])
    saver.dispose()


def scheduler_wake_latency(
    url: str, samples: int, *, durable_claims: bool = False, same_process: bool = False
) -> list[float]:
    """Return ms from a task save's commit to the start of its dispatch (woken by NOTIFY).

    The saves come from another process, or with same_process from a thread of
    the scheduler's own process (as in ``sched controller serve``, API and
    scheduler together), whose work after each commit competes for the
    interpreter lock with the listener.
    """
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(
        url,
        CentralSettings(poll_interval=60, wake_on_local_saves=False, durable_claims=durable_claims),
        worker_id="bench-wake", dispatcher=recorder,
    )
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = None
    if same_process:
        thread = threading.Thread(target=_saver, args=(url, theirs), daemon=True)
        thread.start()
    else:
        child = context.Process(target=_saver, args=(url, theirs))
        child.start()
    latencies = []
    scheduler.start()
    try:
        scheduler.listener.listening.wait(30)
        for i in range(samples):
            # Measure a wake-up from idle: the previous pass must have finished.
            scheduler.waiting.wait(30)
            time.sleep(0.005)
            ours.send(f"wake-{i}")
            committed = ours.recv()
            recorder.wait_for(i + 1, 30)
            latencies.append((recorder.records[i].started - committed) * 1000)
    finally:
        ours.send(None)
        if child is not None:
            child.join(30)
        scheduler.stop()
    return latencies


# ---------------------------------------------------------------- report

WAKE_LABELS = {
    "raw": "raw: commit of an insert + NOTIFY to a listening thread's wake-up",
    "scheduler": "scheduler: commit of a task save (another process) to the start of its "
                 "dispatch",
    "durable": "the same with `--durable-claims` (the claim waits for the WAL flush)",
    "same": "the same, the save from a thread of the scheduler's process (API + scheduler "
            "in one `serve`)",
}
WAKE_VERDICTS = {
    "scheduler": "by default",
    "durable": "with --durable-claims",
    "same": "with the save in the scheduler's process",
}


def _machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} CPUs shared with other work, "
            f"Python {platform.python_version()}")


def report(
    server: str,
    runs: dict[tuple[str, int], list[Throughput]],
    wakes: dict[str, list[float]],
    tasks: int,
    batch: int,
    trials: int,
) -> str:
    """Return the Markdown of the controller section (without its markers)."""
    lines = [
        "### Central scheduler",
        "",
        f"`bench/bench_controller.py` on PostgreSQL {server} (a throwaway pgserver, unix "
        f"socket), all figures from one run. Claim throughput: {tasks:,} due one-shot tasks "
        f"per trial, claimed in batches of {batch} by 1, 4 and 8 processes, {trials} trials "
        "each, raw and ours back to back in alternating order; rates are medians over the "
        "trials and each ratio is the median of the per-trial ratios. The raw baseline is "
        "a bare psycopg loop of `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) "
        "RETURNING <the claim's columns>` in autocommit; `claim` runs "
        "`claims.claim_for_dispatch` (the same lease, plus each claim's dispatch record, "
        "in one statement) through a SQLModel session and returns `Claim` objects. Every "
        "claimed id is "
        "collected from every process, so duplicates and misses are counted.",
        "",
        "| instances | raw claims/s | `claim` claims/s | vs raw | (per-trial range) | "
        "scheduler pass tasks/s | vs raw | duplicates | missing |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in (1, 4, 8):
        ratios = paired_ratios(runs, n)
        every = [r for kind in ("raw", "claim", "pipeline") for r in runs[(kind, n)]]
        lines.append(
            f"| {n} | {_median_rate(runs[('raw', n)]):,.0f} | "
            f"{_median_rate(runs[('claim', n)]):,.0f} | {ratios['claim']:.2f} | "
            f"{ratio_range(runs, n, 'claim')} | "
            f"{_median_rate(runs[('pipeline', n)]):,.0f} | {ratios['pipeline']:.2f} | "
            f"{sum(r.duplicates for r in every)} | {sum(r.missing for r in every)} |"
        )
    lines += [
        "",
        "The scheduler pass is claim + dispatch record (one statement), a no-op dispatch, and "
        "the batch's completion (next run or done, record marked dispatched): one more "
        "durable commit per batch than the raw loop's claim alone.",
        "",
        "| wake latency (ms) | samples | median | p99 |",
        "|---|---:|---:|---:|",
    ]
    for label, samples in wakes.items():
        median, p99 = _quantiles(samples)
        lines.append(f"| {WAKE_LABELS[label]} | {len(samples)} | {median:.2f} | {p99:.2f} |")
    claim_ratios = [paired_ratios(runs, n)["claim"] for n in (1, 4, 8)]
    duplicates = sum(r.duplicates for results in runs.values() for r in results)
    verdicts = []
    for label in ("scheduler", "durable", "same"):
        median, p99 = _quantiles(wakes[label])
        met = "met" if median < 3 and p99 < 10 else "missed"
        verdicts.append(f"{WAKE_VERDICTS[label]} {met} (median {median:.2f} ms, "
                        f"p99 {p99:.2f} ms)")
    claim_met = "met" if min(claim_ratios) >= 0.90 and duplicates == 0 else "missed"
    lines += [
        "",
        f"**This run against the targets.** Claim throughput (`claim` at least 0.90 of "
        f"raw, zero duplicates): {claim_met}, ratios "
        f"{' / '.join(f'{r:.2f}' for r in claim_ratios)} for 1 / 4 / 8 instances and "
        f"{duplicates} duplicates. Wake latency (median under 3 ms, p99 under 10 ms): "
        f"{'; '.join(verdicts)}.",
    ]
    lines += [
        "",
        "On a notification the listener thread claims on its own connection (that backend "
        "has just delivered the notification and is awake), so the scheduler's wake-up is "
        "the raw one plus the claim statement (lease + dispatch record). By default that "
        "claim commits with `synchronous_commit = off` (its connections only; the save, "
        "the completion and the raw side stay durable, the database's default), so the "
        "dispatch does not wait for a second WAL flush; the completion's durable commit "
        "flushes the claim with it, and a claim lost in a database crash is re-dispatched "
        "under the same idempotency key (docs/controller.md). `--durable-claims` "
        "waits for the flush. The saves come from a process of their own, as from an API "
        "instance or another client; in the last row they come from a thread of the "
        "scheduler's own process, whose Python work after each commit holds the "
        "interpreter lock the woken listener needs (up to the 5 ms switch interval): that "
        "is the cost of running the API and the scheduler in one `serve` process, and why "
        "`--scheduler-only` instances are the ones to scale. Before the latency runs the table is "
        "emptied and vacuumed: thousands of dead row versions left by the throughput runs "
        "would otherwise slow every claim until autovacuum came by. Machine: "
        f"{_machine()}; the machine is shared with other work, so figures vary between "
        "runs and so do the per-trial ratios (their range is in the table).",
    ]
    return "\n".join(lines)


def run_api_benchmark(args: list[str]) -> None:
    """Run ``bench.bench_controller_api.main(args)`` when that module exists."""
    try:
        module = importlib.import_module("bench.bench_controller_api")
    except ModuleNotFoundError:
        print("bench/bench_controller_api.py not present: skipping GET /api/schedules")
        return
    main_function: Callable[[list[str]], Any] = module.main
    main_function(args)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmarks, print figures and ratios, optionally write the docs section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--database-url", help="a Postgres server to use (default: pgserver)")
    parser.add_argument("--tasks", type=int, default=5_000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--wake-samples", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--no-api", action="store_true", help="skip the API benchmark")
    parser.add_argument("--api-args", default="",
                        help="arguments for bench/bench_controller_api.py, e.g. '--seconds 1'")
    parser.add_argument("--api-only", action="store_true", help="run only the API benchmark")
    args = parser.parse_args(argv)
    if args.api_only:
        run_api_benchmark(shlex.split(args.api_args))
        return

    with postgres(args.database_url) as url:
        engine = db.make_engine(url)
        with Session(engine) as session:
            server = db.server_version(session)
        engine.dispose()
        runs: dict[tuple[str, int], list[Throughput]] = {}
        kinds = ("raw", "claim", "pipeline")
        for instances in (1, 4, 8):
            for trial in range(args.trials):
                # Alternate the order so drift in the machine's load favours neither side.
                for kind in kinds if trial % 2 == 0 else kinds[::-1]:
                    result = measure_claims(kind, url, instances, args.tasks, args.batch)
                    runs.setdefault((kind, instances), []).append(result)
                    print(f"{kind:>10} x{instances}: {result.per_second:8,.0f}/s "
                          f"dup={result.duplicates} missing={result.missing}", flush=True)
            ratios = paired_ratios(runs, instances)
            print(f"x{instances}: claim/raw = {ratios['claim']:.2f}, "
                  f"pass/raw = {ratios['pipeline']:.2f} (medians of per-trial ratios)")
        # The throughput runs leave thousands of dead row versions behind; a claim would
        # wade through their index entries until autovacuum came by.
        reset_tasks(url, 0)
        wakes = {
            "raw": raw_notify_latency(url, args.wake_samples),
            "scheduler": scheduler_wake_latency(url, args.wake_samples),
            "durable": scheduler_wake_latency(url, args.wake_samples, durable_claims=True),
            "same": scheduler_wake_latency(url, args.wake_samples, same_process=True),
        }
        for label, samples in wakes.items():
            print("wake latency, {}: median {:.2f} ms, p99 {:.2f} ms".format(
                label, *_quantiles(samples)))
        section = report(server, runs, wakes, args.tasks, args.batch, args.trials)
    publish(section, BEGIN, END, "", write=args.write_docs)
    if not args.no_api:
        run_api_benchmark(shlex.split(args.api_args))


if __name__ == "__main__":
    main(sys.argv[1:])
