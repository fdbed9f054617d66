"""The central scheduler on SQLite and Postgres: passes with pinned time, then the live loop.

T0 = 2026-12-02 12:00 UTC (no DST nearby). Live-loop tests wait on events with
generous deadlines and assert what happened, never how long it took.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller import claims, db, tasks
from controller.central import CentralScheduler, CentralSettings, backoff, retry_delay_from_env
from controller.dispatch import PrefectDispatcher, event_id
from controller.models import TaskIn, TaskStatus
from controller.testing import RecordingDispatcher
from sched_core.errors import ConfigError

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
DEADLINE = 30.0  # seconds; only ever reached when something is broken


def _save(engine: Engine, body: dict[str, Any], now: datetime | None = None) -> None:
    with Session(engine) as session:
        tasks.save_task(session, TaskIn.model_validate(body), now=now)


def _task(engine: Engine, name: str) -> Any:
    with Session(engine) as session:
        return tasks.get_task(session, name)


# ---------------------------------------------------------------- pure helpers


def test_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    assert [backoff(n, base=0.5, cap=3.0) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff(10_000, base=1.0, cap=30.0) == 30.0


def test_retry_delay_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCHED_RETRY_DELAY", raising=False)
    assert retry_delay_from_env() == 1.0
    monkeypatch.setenv("SCHED_RETRY_DELAY", "0.25")
    assert retry_delay_from_env() == 0.25
    assert CentralScheduler("sqlite:///unused.db").settings.retry_delay == 0.25
    assert CentralSettings.from_env(poll_interval=2).retry_delay == 0.25
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv("SCHED_RETRY_DELAY", bad)
        with pytest.raises(ConfigError, match="SCHED_RETRY_DELAY"):
            retry_delay_from_env()


# ---------------------------------------------------------------- one pass, pinned time


def test_a_pass_dispatches_due_tasks_then_reschedules_or_stops(engine: Engine) -> None:
    _save(engine, {"name": "once", "run_at": T0, "event": "x"}, now=T0)
    _save(engine, {"name": "cron", "cron": "*/5 * * * *", "timezone": "UTC",
                   "deployment": "f/d"}, now=T0 - timedelta(minutes=1))
    _save(engine, {"name": "later", "run_at": T0 + timedelta(hours=1), "event": "x"}, now=T0)
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(engine, worker_id="w1", dispatcher=recorder)
    try:
        assert scheduler.run_once(now=T0) == 2
        assert scheduler.run_once(now=T0) == 0
    finally:
        scheduler.stop()
    assert sorted(recorder.keys()) == [("cron", T0), ("once", T0)]
    assert _task(engine, "once").status == TaskStatus.DONE
    assert _task(engine, "cron").next_run_at == T0 + timedelta(minutes=5)
    assert _task(engine, "later").next_run_at == T0 + timedelta(hours=1)


def test_a_failed_dispatch_is_retried_with_the_same_key_after_a_backoff(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="controller")
    _save(engine, {"name": "flaky", "run_at": T0, "event": "x"}, now=T0)
    failing = RecordingDispatcher(fail_names={"flaky"})
    scheduler = CentralScheduler(
        engine, CentralSettings(dispatch_retry_delay=10), worker_id="w1", dispatcher=failing,
    )
    try:
        assert scheduler.run_once(now=T0) == 1
        task = _task(engine, "flaky")
        assert (task.attempts, task.status) == (1, TaskStatus.ACTIVE)
        assert "failed (as asked)" in task.last_error
        assert scheduler.run_once(now=T0 + timedelta(seconds=10)) == 0  # held
        assert scheduler.run_once(now=T0 + timedelta(seconds=11)) == 1  # 2nd failure
        assert _task(engine, "flaky").attempts == 2
        scheduler.dispatcher = recorder = RecordingDispatcher()
        # The second hold is twice as long: 20 s from T0 + 11 s.
        assert scheduler.run_once(now=T0 + timedelta(seconds=31)) == 0
        assert scheduler.run_once(now=T0 + timedelta(seconds=32)) == 1
    finally:
        scheduler.stop()
    assert recorder.keys() == [("flaky", T0)]
    [warning, _] = [r for r in caplog.records if r.getMessage() == "dispatch failed; will retry"]
    assert (warning.task_name, warning.worker_id, warning.attempts) == ("flaky", "w1", 1)  # type: ignore[attr-defined]
    assert "failed (as asked)" in warning.error  # type: ignore[attr-defined]
    task = _task(engine, "flaky")
    assert (task.status, task.attempts, task.last_error) == (TaskStatus.DONE, 0, None)


def test_after_max_attempts_a_recurring_task_gives_up_on_that_time_and_moves_on(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="controller")
    _save(engine, {"name": "hourly", "cron": "0 * * * *", "timezone": "UTC", "event": "x"},
          now=T0 - timedelta(minutes=1))
    scheduler = CentralScheduler(
        engine, CentralSettings(max_attempts=3, dispatch_retry_delay=10), worker_id="w1",
        dispatcher=RecordingDispatcher(fail_names={"hourly"}),
    )
    try:
        assert scheduler.run_once(now=T0) == 1
        assert scheduler.run_once(now=T0 + timedelta(seconds=11)) == 1
        assert _task(engine, "hourly").attempts == 2
        assert scheduler.passes.gave_up == 0
        assert scheduler.run_once(now=T0 + timedelta(seconds=32)) == 1  # the third: give up
        assert scheduler.passes.gave_up == 1
        task = _task(engine, "hourly")
        assert (task.status, task.next_run_at, task.attempts) == (
            TaskStatus.ACTIVE, T0 + timedelta(hours=1), 0)
        assert task.last_error.startswith("gave up after 3 failed dispatch attempts: ")
        assert "failed (as asked)" in task.last_error
        with Session(engine) as session:
            [record] = claims.list_dispatches(session, "hourly")
        assert (record.scheduled_at, record.status) == (T0, "failed")
        assert record.error == task.last_error
        # Nothing more for 12:00; 13:00 is dispatched normally once the target works.
        scheduler.dispatcher = recorder = RecordingDispatcher()
        assert scheduler.run_once(now=T0 + timedelta(minutes=59)) == 0
        assert scheduler.run_once(now=T0 + timedelta(hours=1)) == 1
    finally:
        scheduler.stop()
    assert recorder.keys() == [("hourly", T0 + timedelta(hours=1))]
    [gave_up] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "gave up on this scheduled time" in gave_up.getMessage()
    assert (gave_up.task_name, gave_up.attempts) == ("hourly", 3)  # type: ignore[attr-defined]


def test_after_max_attempts_a_one_shot_task_is_disabled_until_saved_again(
    engine: Engine,
) -> None:
    _save(engine, {"name": "once", "run_at": T0, "event": "x"}, now=T0)
    scheduler = CentralScheduler(
        engine, CentralSettings(max_attempts=1), worker_id="w1",
        dispatcher=RecordingDispatcher(fail_names={"once"}),
    )
    try:
        assert scheduler.run_once(now=T0) == 1
        task = _task(engine, "once")
        assert (task.status, task.attempts) == (TaskStatus.DISABLED, 1)
        assert task.last_error.startswith("gave up after 1 failed dispatch attempts")
        assert scheduler.run_once(now=T0 + timedelta(days=1)) == 0
        # The operator fixes the target and saves the task again: it is retried.
        scheduler.dispatcher = recorder = RecordingDispatcher()
        _save(engine, {"name": "once", "run_at": T0, "event": "x"}, now=T0 + timedelta(hours=1))
        assert scheduler.run_once(now=T0 + timedelta(hours=1)) == 1
    finally:
        scheduler.stop()
    assert recorder.keys() == [("once", T0)]
    assert _task(engine, "once").status == TaskStatus.DONE
    with Session(engine) as session:
        assert [r.status for r in claims.list_dispatches(session, "once")] == ["dispatched"]


def test_settings_are_checked_naming_the_field() -> None:
    for field, bad in (("poll_interval", 0), ("lease", -1), ("stale_after", -1),
                       ("batch_size", 0), ("retry_delay", float("inf"))):
        with pytest.raises(ConfigError, match=f"{field}="):
            CentralSettings(**{field: bad})
    with pytest.raises(ConfigError, match=r"unknown central scheduler setting.*leese"):
        CentralSettings.from_env(leese=3)
    settings = CentralSettings()
    with pytest.raises(AttributeError):
        settings.lease = 1  # type: ignore[misc]
    assert settings.but(lease=5).lease == 5 and settings.lease == 10


def test_the_attempt_limit_and_retention_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"max_attempts=-1 must be 0 \(no limit\) or more"):
        CentralScheduler("sqlite://", CentralSettings(max_attempts=-1))
    with pytest.raises(ConfigError, match="batch_size=0 must be 1 or more"):
        CentralScheduler("sqlite://", CentralSettings(batch_size=0))
    assert CentralSettings(max_attempts=0, batch_size=1).max_attempts == 0
    with pytest.raises(ConfigError, match="dispatch_retention=0"):
        CentralScheduler("sqlite://", CentralSettings(dispatch_retention=0))


def _dispatch_at(engine: Engine, name: str, at: datetime) -> None:
    _save(engine, {"name": name, "run_at": at, "event": "x"}, now=at)
    scheduler = CentralScheduler(engine, worker_id="w-old", dispatcher=RecordingDispatcher())
    try:
        assert scheduler.run_once(now=at) == 1
    finally:
        scheduler.stop()


def test_old_finished_dispatch_records_are_pruned(engine: Engine) -> None:
    for name, days in (("d40", 40), ("d31", 31), ("d29", 29), ("d1", 1)):
        _dispatch_at(engine, name, T0 - timedelta(days=days))
    # A dispatch in flight (claimed, never finished) is never pruned, however old.
    _save(engine, {"name": "inflight", "run_at": T0 - timedelta(days=50), "event": "x"},
          now=T0 - timedelta(days=50))
    with Session(engine) as session:
        [(claim, _)] = claims.claim_for_dispatch(session, worker_id="w-dead",
                                                now=T0 - timedelta(days=50))
    assert claim.name == "inflight"
    scheduler = CentralScheduler(
        engine, CentralSettings(dispatch_retention=30 * 86400), worker_id="w1",
    )
    try:
        assert scheduler.prune_dispatches(now=T0) == 2
        assert scheduler.prune_dispatches(now=T0) == 0
    finally:
        scheduler.stop()
    with Session(engine) as session:
        left = {r.task_name: r.status for r in claims.list_dispatches(session)}
    assert left == {"inflight": "dispatching", "d29": "dispatched", "d1": "dispatched"}
    with Session(engine) as session:
        # In batches too, and only as many batches as asked for.
        assert claims.prune_dispatches(session, before=T0, batch=1, max_batches=1) == 1
        assert len(claims.list_dispatches(session)) == 2
        assert claims.prune_dispatches(session, before=T0, batch=1) == 1
        assert [r.task_name for r in claims.list_dispatches(session)] == ["inflight"]


def test_the_loop_prunes_with_the_database_clock_a_batch_per_pass(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("controller.central.PRUNE_BATCH", 1)  # three batches of old records
    for i in range(3):
        _dispatch_at(engine, f"old-{i}", datetime.now(UTC) - timedelta(days=31, minutes=i))
    _dispatch_at(engine, "recent", datetime.now(UTC) - timedelta(days=29))
    # Polls far apart and an hourly prune: only working off the backlog pass by pass
    # (no wait while a whole batch went) gets through the three in time.
    scheduler = CentralScheduler(
        engine, CentralSettings(poll_interval=600), worker_id="w1",
        dispatcher=RecordingDispatcher(),
    )
    with Session(engine) as session:
        assert len(claims.list_dispatches(session)) == 4
    with scheduler:
        def names() -> list[str]:
            with Session(engine) as session:
                return [r.task_name for r in claims.list_dispatches(session)]
        assert _wait_until(lambda: names() == ["recent"])


def test_stopping_mid_batch_releases_the_rest(engine: Engine) -> None:
    for i in range(5):
        _save(engine, {"name": f"t{i}", "run_at": T0, "event": "x"}, now=T0)
    scheduler = CentralScheduler(engine, worker_id="w1")

    def stop_after_two(claim: claims.Claim) -> None:
        if claim.name == "t1":
            scheduler._stopping.set()

    scheduler.dispatcher = stop_after_two
    try:
        assert scheduler.run_once(now=T0) == 5
    finally:
        scheduler.stop()
    with Session(engine) as session:
        left = claims.claim_for_dispatch(session, worker_id="w2", now=T0)
    assert [c.name for c, _ in left] == ["t2", "t3", "t4"]
    # Released records were deleted: nothing was sent, so w2 owns each one.
    assert {outcome for _, outcome in left} == {claims.DispatchOutcome.OWNED}


def _at(hour: int, minute: int, second: int = 0, day: int = 1) -> datetime:
    return datetime(2026, 11, day, hour, minute, second, tzinfo=UTC)


def test_a_stepped_fixed_hour_job_runs_through_the_fall_back_hour(engine: Engine) -> None:
    # 2026-11-01 America/New_York: 01:00-01:59 EDT is 05:00-05:59 UTC, then the
    # clocks go back and 01:00-01:59 EST is 06:00-06:59 UTC. "*/15 1 * * *" fires
    # in both copies, as cronsim does; each pass completes its whole batch.
    start = _at(5, 44)  # 01:44 EDT
    for name, cron in (("quarterly-1am", "*/15 1 * * *"), ("every-minute", "* * * * *")):
        _save(engine, {"name": name, "cron": cron, "timezone": "America/New_York",
                       "event": "x"}, now=start)
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(
        engine, CentralSettings(stale_after=600), worker_id="w1", dispatcher=recorder,
    )
    passes = [_at(5, 45, 1), _at(5, 50, 1), _at(6, 0, 1), _at(6, 15, 1), _at(6, 30, 1),
              _at(6, 45, 1), _at(7, 0, 1)]
    try:
        for now in passes:
            scheduler.run_once(now=now)
    finally:
        scheduler.stop()
    keys = recorder.keys()
    assert len(keys) == len(set(keys))
    assert [at for name, at in keys if name == "quarterly-1am"] == [
        _at(5, 45), _at(6, 0), _at(6, 15), _at(6, 30), _at(6, 45)]
    assert len([name for name, _ in keys if name == "every-minute"]) == len(passes)
    assert _task(engine, "quarterly-1am").next_run_at == _at(6, 0, day=2)  # 01:00 EST
    # Each pass dispatches the latest missed minute (the catch-up rule): 05:45, then
    # 05:50 (05:46-05:49 skipped), 06:00 (05:51-05:59 skipped), ...
    assert [at for name, at in keys if name == "every-minute"] == [
        _at(5, 45), _at(5, 50), _at(6, 0), _at(6, 15), _at(6, 30), _at(6, 45), _at(7, 0)]
    with Session(engine) as session:
        records = claims.list_dispatches(session)
        assert {(r.task_name, r.scheduled_at) for r in records
                if r.status == "dispatched"} == set(keys)
        skipped = [r for r in records if r.status == "skipped"]
        assert {r.task_name for r in skipped} == {"every-minute"}
        assert all(r.error and r.error.startswith("skipped: ") for r in skipped)
        assert {r.status for r in records} == {"dispatched", "skipped"}
        assert all(t.locked_by is None for t in tasks.list_tasks(session))
    assert _task(engine, "every-minute").skipped_windows == 4 + 9 + 14 * 4
    assert _task(engine, "quarterly-1am").skipped_windows == 0


def test_a_pass_completes_the_rest_of_a_batch_around_a_broken_task(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("a", "broken", "c"):
        _save(engine, {"name": name, "cron": "*/5 * * * *", "timezone": "UTC", "event": "x"},
              now=T0 - timedelta(minutes=1))
    with Session(engine) as session:  # a row written before never-matching cron was refused
        session.execute(text("UPDATE scheduled_task SET cron = '0 0 30 2 *' WHERE name = 'broken'"))
        session.commit()
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(engine, worker_id="w1", dispatcher=recorder)
    try:
        with caplog.at_level(logging.ERROR, logger="controller"):
            assert scheduler.run_once(now=T0) == 3
        assert scheduler.run_once(now=T0 + timedelta(minutes=5)) == 2
    finally:
        scheduler.stop()
    assert sorted(recorder.keys()) == sorted(
        [(n, T0) for n in ("a", "broken", "c")] + [(n, T0 + timedelta(minutes=5)) for n in "ac"]
    )
    broken = _task(engine, "broken")
    assert broken.status == TaskStatus.DISABLED and "never matches" in broken.last_error
    [logged] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.task_name == "broken"  # type: ignore[attr-defined]
    with Session(engine) as session:
        assert {r.status for r in claims.list_dispatches(session)} == {"dispatched"}


# ---------------------------------------------------------------- the live loop


def test_a_save_in_the_same_process_wakes_the_loop(engine: Engine) -> None:
    recorder = RecordingDispatcher()
    with CentralScheduler(
        engine, CentralSettings(poll_interval=120), worker_id="w1", dispatcher=recorder,
    ):
        time.sleep(0.05)  # let it settle into its long wait
        _save(engine, {"name": "now", "run_at": datetime.now(UTC), "event": "x"})
        assert recorder.wait_for(1, DEADLINE)
    assert [name for name, _ in recorder.keys()] == ["now"]


def test_the_loop_wakes_for_the_earliest_next_run(engine: Engine) -> None:
    recorder = RecordingDispatcher()
    soon = datetime.now(UTC) + timedelta(milliseconds=300)
    _save(engine, {"name": "soon", "run_at": soon, "event": "x"})
    with CentralScheduler(
        engine, CentralSettings(poll_interval=120, wake_on_local_saves=False), worker_id="w1",
        dispatcher=recorder,
    ):
        assert recorder.wait_for(1, DEADLINE)
    assert recorder.keys() == [("soon", soon)]


@pytest.mark.postgres
@pytest.mark.parametrize("claim_on_notify", [True, False], ids=["listener-claims", "loop-claims"])
def test_a_notify_from_another_process_wakes_the_loop(
    postgres_url: str, claim_on_notify: bool
) -> None:
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(
        postgres_url,
        CentralSettings(
            poll_interval=120, wake_on_local_saves=False, claim_on_notify=claim_on_notify
        ),
        worker_id="w-notify", dispatcher=recorder,
    )
    other = db.make_engine(postgres_url, application_name="sched-test-other")
    try:
        scheduler.start()
        assert scheduler.listener.listening.wait(DEADLINE)
        time.sleep(0.05)
        _save(other, {"name": "remote", "run_at": datetime.now(UTC), "event": "x"})
        assert recorder.wait_for(1, DEADLINE)
    finally:
        scheduler.stop()
        other.dispose()
    assert [name for name, _ in recorder.keys()] == ["remote"]


@pytest.mark.postgres
def test_stop_closes_every_connection_it_opened(postgres_url: str, pg_admin_url: str) -> None:
    scheduler = CentralScheduler(
        postgres_url, CentralSettings(poll_interval=0.05), worker_id="w-close",
        dispatcher=RecordingDispatcher(),
    )
    scheduler.start()
    assert scheduler.listener.listening.wait(DEADLINE)
    time.sleep(0.2)  # a few passes
    assert _connections(pg_admin_url, "w-close") >= 2
    scheduler.stop()
    assert _wait_until(lambda: _connections(pg_admin_url, "w-close") == 0)


@pytest.mark.postgres
@pytest.mark.parametrize(("durable_claims", "claims_commit"), [(False, "off"), (True, "on")])
def test_claims_commit_asynchronously_and_completions_durably(
    postgres_url: str, durable_claims: bool, claims_commit: str
) -> None:
    """The two claiming connections skip the flush unless asked; the pool never does."""
    scheduler = CentralScheduler(
        postgres_url, CentralSettings(durable_claims=durable_claims), worker_id="w-commit",
        dispatcher=RecordingDispatcher(),
    )
    engine = scheduler.db.engine()
    listener = scheduler.listener.connect()
    try:
        assert scheduler.db.claimer is not None
        with scheduler.db.claimer.connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == claims_commit
        assert listener.execute("SHOW synchronous_commit").fetchone() == (claims_commit,)
        with engine.connect() as conn:  # completions, failures, releases
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
        # And a pass on those connections still claims, dispatches and completes.
        _save(engine, {"name": "async", "run_at": T0, "event": "x"})
        assert scheduler.run_once() == 1
        assert _task(engine, "async").status == TaskStatus.DONE
    finally:
        listener.close()
        scheduler.stop()


def _connections(admin_url: str, worker_id: str) -> int:
    with psycopg.connect(db.libpq_conninfo(admin_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"sched-%:{worker_id}",),
        ).fetchone()
    return int(row[0]) if row else 0


def _wait_until(check: Any, deadline: float = DEADLINE) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


# ---------------------------------------------------------------- the Prefect dispatcher


def test_prefect_dispatcher_emits_a_task_event_keyed_by_task_and_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stubbed: what is sent. tests/test_controller_dispatch.py checks it on a real server."""
    # prefect.deployments.flow_runs is imported before get_client is patched: imported
    # while it is, it would keep the fake for the rest of the session.
    import prefect.client.orchestration
    import prefect.deployments
    import prefect.deployments.flow_runs

    calls: list[tuple[str, Any]] = []

    class FakeClient:
        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def request(self, method: str, path: str, **kw: Any) -> None:
            calls.append((f"{method} {path}", kw["json"]))

    monkeypatch.setattr(prefect.client.orchestration, "get_client", lambda **kw: FakeClient())
    monkeypatch.setattr(
        prefect.deployments, "run_deployment", lambda name, **kw: calls.append((name, kw))
    )
    claim = claims.Claim(task_id=1, name="nightly", scheduled_at=T0, worker_id="w",
                        locked_until=T0, event="sched.task.backup", deployment=None,
                        payload={"agent": "node-a"})
    run = claims.Claim(task_id=2, name="prune", scheduled_at=T0, worker_id="w",
                      locked_until=T0, event=None, deployment="prune/nightly",
                      payload={"agent": "node-b"})
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # A configured API (never reached: the client is fake); without one it refuses.
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        PrefectDispatcher()(claim)
        PrefectDispatcher()(run)
    (posted, (event,)), (name, deployment) = calls
    assert posted == "POST /events"
    assert event["event"] == "sched.task.backup"
    assert event["resource"]["prefect.resource.id"] == "sched.task.nightly"
    assert event["payload"] == {"agent": "node-a", "scheduled_at": "2026-12-02T12:00:00+00:00",
                                "idempotency_key": "nightly:2026-12-02T12:00:00+00:00"}
    assert event["id"] == str(event_id(claim)) and event["occurred"] == "2026-12-02T12:00:00Z"
    assert name == "prune/nightly"
    assert deployment == {"parameters": {"agent": "node-b"}, "timeout": 0,
                          "idempotency_key": "prune:2026-12-02T12:00:00+00:00",
                          "as_subflow": False}


# ---------------------------------------------------------------- failover and catch-up


def test_a_killed_instances_claim_is_dispatched_by_another_a_lease_later(
    engine: Engine,
) -> None:
    """Defaults: a 10 s lease and stale_after: a dead worker's claim waits 10 s, not 10 min."""
    _save(engine, {"name": "once", "run_at": T0, "event": "x"}, now=T0)
    settings = CentralSettings()
    with Session(engine) as session:  # the dead instance: claimed, recorded, never finished
        [(claim, outcome)] = claims.claim_for_dispatch(
            session, worker_id="dead", now=T0, lease=settings.lease,
            stale_after=settings.stale_after,
        )
    assert outcome is claims.DispatchOutcome.OWNED and claim.worker_id == "dead"
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(engine, settings, worker_id="w1", dispatcher=recorder)
    try:
        assert scheduler.run_once(now=T0 + timedelta(seconds=10)) == 0  # still leased
        assert scheduler.run_once(now=T0 + timedelta(seconds=10, microseconds=1)) == 1
    finally:
        scheduler.stop()
    assert recorder.keys() == [("once", T0)]
    assert _task(engine, "once").status == TaskStatus.DONE


def test_the_heartbeat_renews_a_slow_dispatch_so_nobody_takes_it_over(
    postgres_url: str,
) -> None:
    """A dispatch far slower than the lease keeps its claim: nothing is sent twice."""
    settings = CentralSettings(lease=0.6, stale_after=0.6, poll_interval=0.05)
    release = threading.Event()
    slow = RecordingDispatcher(on_dispatch=lambda _record: release.wait(DEADLINE))
    quick = RecordingDispatcher()
    first = CentralScheduler(postgres_url, settings, worker_id="w-slow", dispatcher=slow)
    second = CentralScheduler(postgres_url, settings, worker_id="w-other", dispatcher=quick)
    engine = db.make_engine(postgres_url, application_name="sched-test-heartbeat")
    try:
        first.start()
        _save(engine, {"name": "slow", "run_at": datetime.now(UTC), "event": "x"})
        # 5 renewals: 3+ leases long
        assert _wait_until(lambda: first.passes.in_flight.renewals >= 5)
        second.start()
        assert _wait_until(lambda: second.waiting.is_set())
        assert _wait_until(lambda: first.passes.in_flight.renewals >= 10)
        assert quick.keys() == []
        release.set()
        assert slow.wait_for(1, DEADLINE)
        assert _wait_until(lambda: _task(engine, "slow").status == TaskStatus.DONE)
        with Session(engine) as session:
            [record] = claims.list_dispatches(session, "slow")
        assert record.status == "dispatched" and record.renewed_at is not None
    finally:
        release.set()
        first.stop()
        second.stop()
        engine.dispose()
    assert quick.keys() == [] and [name for name, _ in slow.keys()] == ["slow"]


def test_a_batch_whose_completion_failed_is_completed_without_a_second_dispatch(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Dispatched, then the completion's statement fails (a deadlock, a lost connection):
    # the records still say "dispatching" by this worker. Its next pass must complete
    # them, not dispatch them again (four instances under load did, 17 tasks twice).
    for name in ("a", "b", "c"):
        _save(engine, {"name": name, "run_at": T0, "event": "x"}, now=T0)
    real, calls = claims.complete_many, []

    def fails_once(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("deadlock detected (as asked)")
        return real(*args, **kwargs)

    monkeypatch.setattr(claims, "complete_many", fails_once)
    recorder = RecordingDispatcher()
    scheduler = CentralScheduler(engine, worker_id="w1", dispatcher=recorder)
    try:
        with pytest.raises(RuntimeError, match="as asked"):
            scheduler.run_once(now=T0)
        for seconds in (1, 15, 60):  # before and after the lease and stale_after ran out
            scheduler.run_once(now=T0 + timedelta(seconds=seconds))
    finally:
        scheduler.stop()
    assert sorted(recorder.keys()) == [("a", T0), ("b", T0), ("c", T0)]
    assert {_task(engine, name).status for name in ("a", "b", "c")} == {TaskStatus.DONE}
