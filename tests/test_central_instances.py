"""Several scheduler processes against one Postgres, and a listener killed 50 times.

The database is shared state only: each scheduler process writes what its
dispatcher was given to its own file, so a duplicate dispatch shows up even
though the store's unique dispatch record would hide it.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import update
from sqlmodel import Session

from controller import claims, db, tasks
from controller.central import CentralScheduler, CentralSettings
from controller.models import DispatchStatus, ScheduledTask, TaskIn, TaskStatus
from controller.testing import RecordingDispatcher

pytestmark = pytest.mark.postgres

DEADLINE = 180.0  # seconds; only ever reached when something is broken
PROCESSES = 4
ONE_SHOT = 900
CRON = 100


class _FileDispatcher:
    """Append each dispatch to a file; a few tasks dispatch slower than the lease."""

    def __init__(self, path: Path, worker_id: str, slow_suffix: str, slow: float) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.worker_id = worker_id
        self.slow_suffix = slow_suffix
        self.slow = slow

    def __call__(self, claim: claims.Claim) -> None:
        if claim.name.endswith(self.slow_suffix):
            time.sleep(self.slow)  # the lease runs out mid-dispatch
        self.file.write(f"{claim.name}\t{claim.scheduled_at.isoformat()}\t{self.worker_id}\n")
        self.file.flush()


def _scheduler_process(url: str, worker_id: str, out: str, start: Any, stop: Any) -> None:
    # The lease is short and a slow dispatch outlasts it, so only its renewal keeps the
    # claim; not so short that a process the machine starves for a moment loses it (at 1 s,
    # a whole batch went out twice once in five full runs of the suite on a loaded machine).
    dispatcher = _FileDispatcher(Path(out), worker_id, slow_suffix="77", slow=3.0)
    scheduler = CentralScheduler(
        url, CentralSettings(poll_interval=0.2, lease=2.0, batch_size=20, retry_delay=0.05),
        worker_id=worker_id, dispatcher=dispatcher,
    )
    start.wait()
    scheduler.start()
    try:
        stop.wait(DEADLINE)
    finally:
        scheduler.stop()
        dispatcher.file.close()


def _all_handled(url: str, first_cron_run: dict[str, datetime]) -> bool:
    engine = db.make_engine(url, application_name="sched-test-watch")
    try:
        with Session(engine) as session:
            stored = tasks.list_tasks(session)
            records = claims.list_dispatches(session)
    finally:
        engine.dispose()
    if any(record.status == DispatchStatus.DISPATCHING for record in records):
        return False  # a dispatch still in flight: its window is not handled yet
    for task in stored:
        if task.name in first_cron_run:
            if task.next_run_at is None or task.next_run_at <= first_cron_run[task.name]:
                return False
        elif task.status != TaskStatus.DONE:
            return False
    return True


def test_four_processes_dispatch_each_task_time_exactly_once(
    postgres_url: str, scratch_dir: Path
) -> None:
    engine = db.make_engine(postgres_url, application_name="sched-test-setup")
    now = datetime.now(UTC)
    first_cron_run: dict[str, datetime] = {}
    try:
        with Session(engine) as session:
            tasks.save_tasks(session, [
                TaskIn(name=f"once-{i:04d}", run_at=now - timedelta(seconds=i), event="job.run")
                for i in range(ONE_SHOT)
            ])
            crons = [f"cron-{i:03d}" for i in range(CRON)]
            tasks.save_tasks(session, [
                TaskIn(name=name, cron="* * * * *", timezone="UTC", deployment="f/d")
                for name in crons
            ])
            # Due now: each first runs a minute ago (as if the controller had been down).
            first = (now - timedelta(minutes=1)).replace(second=0, microsecond=0)
            first_cron_run.update(dict.fromkeys(crons, first))
            session.execute(update(ScheduledTask).where(
                ScheduledTask.name.in_(crons)).values(next_run_at=first))  # type: ignore[attr-defined]
            session.commit()
    finally:
        engine.dispose()

    # fork is instant; with other threads about, forking is unsafe: use a forkserver.
    method = "fork" if threading.active_count() == 1 else "forkserver"
    context = multiprocessing.get_context(method)
    start, stop = context.Barrier(PROCESSES), context.Event()
    outputs = [scratch_dir / f"p{i}.tsv" for i in range(PROCESSES)]
    processes = [
        context.Process(
            target=_scheduler_process,
            args=(postgres_url, f"p{i}", str(outputs[i]), start, stop),
        )
        for i in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    try:
        end = time.monotonic() + DEADLINE
        while not _all_handled(postgres_url, first_cron_run) and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        stop.set()
        for process in processes:
            process.join(60)
            if process.is_alive():  # pragma: no cover - only when broken
                process.kill()
                process.join()
    assert [p.exitcode for p in processes] == [0] * PROCESSES

    lines = [
        line.split("\t")
        for path in outputs if path.exists()
        for line in path.read_text(encoding="utf-8").splitlines()
    ]
    counts = Counter((name, at) for name, at, _ in lines)
    duplicates = {key: n for key, n in counts.items() if n > 1}
    assert duplicates == {}
    expected = {(f"once-{i:04d}", (now - timedelta(seconds=i)).isoformat())
                for i in range(ONE_SHOT)}
    assert expected - set(counts) == set()  # no one-shot lost
    # A cron task's first window a minute ago was followed by this minute's: the
    # catch-up rule dispatches only the latest missed window and records the first
    # as skipped (counted on the task); if the minute had not turned yet, the first
    # itself is dispatched. Either way each first window is accounted for, and
    # what the records call dispatched is exactly what the dispatchers were given.
    engine = db.make_engine(postgres_url, application_name="sched-test-check")
    try:
        with Session(engine) as session:
            records = claims.list_dispatches(session)
            stored = {t.name: t for t in tasks.list_tasks(session)}
    finally:
        engine.dispose()
    status = {(r.task_name, r.scheduled_at.isoformat()): r.status for r in records}
    for name, at in first_cron_run.items():
        assert status.get((name, at.isoformat())) in ("dispatched", "skipped"), name
        skipped = status[(name, at.isoformat())] == "skipped"
        if skipped:
            # One window, or two if the minute turned again before the claim.
            assert stored[name].skipped_windows in (1, 2), name
            later = [key for key, value in status.items()
                     if key[0] == name and value == "dispatched"]
            assert later, f"{name}: skipped its first window and dispatched none"
        else:
            assert stored[name].skipped_windows == 0, name
    assert {key for key, value in status.items() if value == "dispatched"} == set(counts)
    assert len({worker for _, _, worker in lines}) >= 2  # the work really was shared


def _listen_pid(admin_url: str, scheduler: CentralScheduler) -> int | None:
    with psycopg.connect(db.libpq_conninfo(admin_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
            (scheduler.db.listen_application_name,),
        ).fetchone()
    return int(row[0]) if row else None


def _scheduler_connections(admin_url: str, scheduler: CentralScheduler) -> int:
    with psycopg.connect(db.libpq_conninfo(admin_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name IN (%s, %s)",
            (scheduler.db.application_name, scheduler.db.listen_application_name),
        ).fetchone()
    return int(row[0]) if row else 0


def _terminate(admin_url: str, pid: int) -> None:
    with psycopg.connect(db.libpq_conninfo(admin_url), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_listener_killed_50_times_loses_no_task_and_leaks_no_connection(
    postgres_url: str, pg_admin_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHED_RETRY_DELAY", "0.01")
    recorder = RecordingDispatcher()
    # A poll far beyond the test: only NOTIFY or the re-check after reconnecting can wake it.
    scheduler = CentralScheduler(
        postgres_url, CentralSettings.from_env(poll_interval=600, wake_on_local_saves=False),
        worker_id="w-kill", dispatcher=recorder,
    )
    assert scheduler.settings.retry_delay == 0.01
    saver = db.make_engine(postgres_url, application_name="sched-test-saver")
    most = 0
    killed: set[int] = set()
    try:
        scheduler.start()
        with Session(saver) as session:
            for i in range(50):
                end = time.monotonic() + DEADLINE
                pid = None
                while time.monotonic() < end:
                    pid = _listen_pid(pg_admin_url, scheduler)
                    listening = scheduler.listener.listening.is_set()
                    if pid is not None and pid not in killed and listening:
                        break
                    time.sleep(0.005)
                assert pid is not None and pid not in killed
                task = TaskIn(name=f"t{i:02d}", run_at=datetime.now(UTC), event="job.run")
                if i % 2 == 0:
                    tasks.save_task(session, task)  # saved while listening
                _terminate(pg_admin_url, pid)
                killed.add(pid)
                if i % 2 == 1:
                    tasks.save_task(session, task)  # saved while the listener is down
                most = max(most, _scheduler_connections(pg_admin_url, scheduler))
        assert recorder.wait_for(50, DEADLINE)
        assert scheduler.listener.listening.wait(DEADLINE)
    finally:
        scheduler.stop()
        saver.dispose()
    assert sorted(name for name, _ in recorder.keys()) == [f"t{i:02d}" for i in range(50)]
    assert scheduler.listener.connects >= 51
    # The pool (2), the claim connection, the listener, and at most one backend exiting.
    assert most <= 5
    end = time.monotonic() + DEADLINE
    while _scheduler_connections(pg_admin_url, scheduler) and time.monotonic() < end:
        time.sleep(0.02)
    assert _scheduler_connections(pg_admin_url, scheduler) == 0
