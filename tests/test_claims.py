"""One contract suite for the claim protocol (controller.claims), on SQLite and a real Postgres.

Time is pinned: every call gets ``now`` (T0 = 2026-12-02 12:00 UTC, no DST nearby),
except the tests that check the database clock is the authority. Every step goes
through the batch API the scheduler uses; a single claim is a batch of one.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller import claims, db, tasks
from controller.claims import DispatchOutcome
from controller.models import TaskStatus
from controller.timing import plan_after_give_up, plan_catch_up
from tests.factories import T0, claimed, complete, complete_all, cron_task, one_shot

US = timedelta(microseconds=1)


def test_earliest_next_run_skips_inactive_tasks_and_honours_holds(session: Session) -> None:
    assert claims.earliest_next_run_at(session) is None
    tasks.save_task(session, one_shot("later", T0 + timedelta(minutes=9)), now=T0)
    tasks.save_task(session, one_shot("off", T0, status="disabled"), now=T0)
    tasks.save_task(session, one_shot("soon", T0 + timedelta(minutes=2)), now=T0)
    assert claims.earliest_next_run_at(session) == T0 + timedelta(minutes=2)
    [claim] = claimed(session, worker_id="w", now=T0 + timedelta(minutes=2), lease=600)
    # A leased task becomes claimable again when its lease ends.
    assert claims.earliest_next_run_at(session) == T0 + timedelta(minutes=9)
    claims.fail(session, claim, "boom", retry_delay=60, now=T0 + timedelta(minutes=3))
    assert claims.earliest_next_run_at(session) == T0 + timedelta(minutes=4)


def test_claim_takes_only_due_active_tasks_in_time_order(session: Session) -> None:
    tasks.save_task(session, one_shot("b", T0), now=T0)
    tasks.save_task(session, one_shot("a", T0), now=T0)
    tasks.save_task(session, one_shot("early", T0 - timedelta(minutes=1)), now=T0)
    tasks.save_task(session, one_shot("future", T0 + US), now=T0)
    tasks.save_task(session, one_shot("off", T0, status="disabled"), now=T0)
    claims = claimed(session, worker_id="w1", now=T0, lease=30)
    assert [c.name for c in claims] == ["early", "a", "b"]
    assert all(c.worker_id == "w1" and c.locked_until == T0 + timedelta(seconds=30) for c in claims)
    assert claims[1].idempotency_key == "a:2026-12-02T12:00:00+00:00"
    assert claimed(session, worker_id="w2", now=T0, lease=30) == []


def test_claim_respects_limit(session: Session) -> None:
    for i in range(5):
        tasks.save_task(session, one_shot(f"t{i}"), now=T0)
    assert len(claimed(session, worker_id="w", now=T0, limit=2)) == 2
    assert len(claimed(session, worker_id="w", now=T0, limit=10)) == 3


def test_lease_boundary_held_at_expiry_free_just_after(session: Session) -> None:
    tasks.save_task(session, one_shot("t"), now=T0)
    [first] = claimed(session, worker_id="w1", now=T0, lease=timedelta(seconds=30))
    expiry = T0 + timedelta(seconds=30)
    assert first.locked_until == expiry
    assert claimed(session, worker_id="w2", now=expiry - US, lease=30) == []
    assert claimed(session, worker_id="w2", now=expiry, lease=30) == []
    [second] = claimed(session, worker_id="w2", now=expiry + US, lease=30)
    assert second.worker_id == "w2" and second.scheduled_at == first.scheduled_at


def test_claims_of_several_workers_are_disjoint(session: Session) -> None:
    for i in range(30):
        tasks.save_task(session, one_shot(f"t{i:02d}"), now=T0)
    seen: list[set[str]] = []
    for worker in ("w1", "w2", "w3", "w4"):
        seen.append({c.name for c in claimed(session, worker_id=worker, now=T0, limit=8)})
    assert [len(s) for s in seen] == [8, 8, 8, 6]
    assert set().union(*seen) == {f"t{i:02d}" for i in range(30)}


def test_concurrent_claimers_in_threads_are_disjoint(engine: Engine) -> None:
    with Session(engine) as session:
        for i in range(200):
            tasks.save_task(session, one_shot(f"t{i:03d}"), now=T0)
    by_worker: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def claimer(worker: str) -> None:
        mine = by_worker.setdefault(worker, [])
        try:
            with Session(engine) as session:
                while batch := claimed(session, worker_id=worker, now=T0, limit=7):
                    mine.extend(c.name for c in batch)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    names = [name for mine in by_worker.values() for name in mine]
    assert len(names) == len(set(names)) == 200


# ---------------------------------------------------------------- complete, fail, dispatch records


def test_complete_reschedules_cron_from_the_later_of_now_and_scheduled(session: Session) -> None:
    tasks.save_task(session, cron_task("t"), now=T0 - timedelta(minutes=1))  # next: T0
    [(claim, outcome)] = claims.claim_for_dispatch(session, worker_id="w", now=T0, lease=30)
    assert claim.scheduled_at == T0
    assert outcome is DispatchOutcome.OWNED
    # Completed 12 minutes late: the next run is after now, missed ones are not replayed.
    assert complete(session, claim, now=T0 + timedelta(minutes=12)) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.status == TaskStatus.ACTIVE
    assert task.next_run_at == T0 + timedelta(minutes=15)
    assert task.last_run_at == T0 and task.locked_by is None and task.locked_until is None
    [record] = claims.list_dispatches(session, "t")
    assert (record.scheduled_at, record.status) == (T0, "dispatched")


def test_complete_on_time_moves_past_the_scheduled_time(session: Session) -> None:
    tasks.save_task(session, cron_task("t"), now=T0 - timedelta(minutes=1))
    [claim] = claimed(session, worker_id="w", now=T0, lease=30)
    # The database clock reads a bit before the scheduled time (clock skew): still T0 + 5.
    assert complete(session, claim, now=T0 - timedelta(seconds=2)) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.next_run_at == T0 + timedelta(minutes=5)


def test_complete_stops_a_one_shot_task(session: Session) -> None:
    tasks.save_task(session, one_shot("t"), now=T0)
    [claim] = claimed(session, worker_id="w", now=T0, lease=30)
    assert complete(session, claim, now=T0) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.status == TaskStatus.DONE and task.next_run_at is None
    assert claimed(session, worker_id="w", now=T0 + timedelta(days=1)) == []
    assert claims.earliest_next_run_at(session) is None


def test_fail_records_the_error_and_retries_after_the_delay(session: Session) -> None:
    tasks.save_task(session, one_shot("t"), now=T0)
    [(claim, outcome)] = claims.claim_for_dispatch(session, worker_id="w", now=T0, lease=30)
    assert outcome is DispatchOutcome.OWNED
    assert claims.fail(session, claim, "prefect unreachable", retry_delay=60, now=T0) is True
    task = tasks.get_task(session, "t")
    assert task is not None
    assert (task.attempts, task.last_error, task.next_run_at) == (1, "prefect unreachable", T0)
    hold = T0 + timedelta(seconds=60)
    assert claimed(session, worker_id="w2", now=hold, lease=30) == []
    [(retry, outcome)] = claims.claim_for_dispatch(
        session, worker_id="w2", now=hold + US, lease=30
    )
    assert retry.idempotency_key == claim.idempotency_key and retry.attempts == 1
    # The failed record is taken over by the retry.
    assert outcome is DispatchOutcome.OWNED
    assert complete(session, retry, now=hold) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.attempts == 0 and task.last_error is None


def test_an_expired_lease_mid_dispatch_does_not_dispatch_twice(session: Session) -> None:
    tasks.save_task(session, cron_task("t"), now=T0 - timedelta(minutes=1))
    [(slow, outcome)] = claims.claim_for_dispatch(session, worker_id="slow", now=T0, lease=10)
    assert outcome is DispatchOutcome.OWNED
    # slow's lease runs out while it is still dispatching; fast claims the same time.
    [(fast, outcome)] = claims.claim_for_dispatch(
        session, worker_id="fast", now=T0 + timedelta(seconds=11), lease=10
    )
    assert fast.scheduled_at == slow.scheduled_at
    assert outcome is DispatchOutcome.BUSY
    assert complete(session, slow, now=T0 + timedelta(seconds=12)) is True
    # fast's own completion is fenced out: the task already moved on.
    assert complete(session, fast, now=T0 + timedelta(seconds=12)) is False
    task = tasks.get_task(session, "t")
    assert task is not None and task.next_run_at == T0 + timedelta(minutes=5)
    assert len(claims.list_dispatches(session, "t")) == 1


def test_a_dispatched_record_tells_a_late_claimer_to_complete_only(session: Session) -> None:
    tasks.save_task(session, one_shot("t"), now=T0)
    [(first, outcome)] = claims.claim_for_dispatch(session, worker_id="w1", now=T0, lease=10)
    assert outcome is DispatchOutcome.OWNED
    complete(session, first, now=T0)
    # The same (task, time) saved again (say, an identical re-save) is never re-dispatched.
    tasks.save_task(session, one_shot("t"), now=T0)
    [(again, outcome)] = claims.claim_for_dispatch(session, worker_id="w2", now=T0, lease=10)
    assert outcome is DispatchOutcome.DONE
    assert complete(session, again, now=T0) is True


def test_a_stale_dispatching_record_is_taken_over(session: Session) -> None:
    tasks.save_task(session, one_shot("t"), now=T0)
    [(dead, outcome)] = claims.claim_for_dispatch(session, worker_id="dead", now=T0, lease=10)
    assert outcome is DispatchOutcome.OWNED
    # dead's record was started at T0: at later it is exactly stale_after old, not more.
    # A zero lease lets alive claim again a microsecond later.
    later = T0 + timedelta(seconds=11)
    [(alive, outcome)] = claims.claim_for_dispatch(
        session, worker_id="alive", now=later, lease=0, stale_after=11
    )
    assert alive.scheduled_at == dead.scheduled_at and outcome is DispatchOutcome.BUSY
    [(alive, outcome)] = claims.claim_for_dispatch(
        session, worker_id="alive", now=later + US, lease=0, stale_after=11
    )
    assert outcome is DispatchOutcome.OWNED


def test_saving_a_claimed_task_fences_out_the_old_claim(session: Session) -> None:
    tasks.save_task(session, cron_task("t"), now=T0 - timedelta(minutes=1))
    [claim] = claimed(session, worker_id="w", now=T0, lease=30)
    tasks.save_task(session, cron_task("t", cron="0 * * * *"), now=T0 + timedelta(seconds=1))
    assert complete(session, claim, now=T0 + timedelta(seconds=2)) is False
    task = tasks.get_task(session, "t")
    assert task is not None and task.next_run_at == T0 + timedelta(hours=1)


# ---------------------------------------------------------------- the database clock


def test_claim_with_no_now_uses_the_database_clock(session: Session) -> None:
    wall = datetime.now(UTC)
    tasks.save_task(session, one_shot("past", wall - timedelta(hours=1)))
    tasks.save_task(session, one_shot("future", wall + timedelta(hours=1)))
    [claim] = claimed(session, worker_id="w", lease=30)
    assert claim.name == "past"
    assert abs(claim.locked_until - (db.db_now(session) + timedelta(seconds=30))) < timedelta(
        minutes=5
    )


# ---------------------------------------------------------------- claim and record in one step


def test_claim_for_dispatch_claims_and_records_in_one_step(session: Session) -> None:
    tasks.save_task(session, one_shot("a"), now=T0)
    tasks.save_task(session, cron_task("b"), now=T0 - timedelta(minutes=1))
    pairs = claims.claim_for_dispatch(session, worker_id="w1", now=T0, lease=10)
    assert [(c.name, o) for c, o in pairs] == [("a", DispatchOutcome.OWNED),
                                              ("b", DispatchOutcome.OWNED)]
    assert all(c.worker_id == "w1" and c.scheduled_at == T0 for c, _ in pairs)
    assert {r.task_name for r in claims.list_dispatches(session)} == {"a", "b"}
    # Both leases run out mid-dispatch: another worker claims them but must not dispatch.
    later = T0 + timedelta(seconds=11)
    again = claims.claim_for_dispatch(session, worker_id="w2", now=later, lease=10)
    assert [(c.name, o) for c, o in again] == [("a", DispatchOutcome.BUSY),
                                              ("b", DispatchOutcome.BUSY)]
    complete_all(session, [c for c, _ in pairs], now=later)
    a, b = tasks.get_task(session, "a"), tasks.get_task(session, "b")
    assert a is not None and a.status == TaskStatus.DONE
    assert b is not None and b.next_run_at == T0 + timedelta(minutes=5) and b.locked_by is None
    assert {r.status for r in claims.list_dispatches(session)} == {"dispatched"}
    assert claims.claim_for_dispatch(session, worker_id="w2", now=later, lease=10) == []


def test_claim_for_dispatch_reports_an_already_dispatched_time_as_done(session: Session) -> None:
    tasks.save_task(session, one_shot("a"), now=T0)
    [(first, _)] = claims.claim_for_dispatch(session, worker_id="w1", now=T0, lease=10)
    complete_all(session, [first], now=T0)
    tasks.save_task(session, one_shot("a"), now=T0)  # the same (task, time) again
    [(second, outcome)] = claims.claim_for_dispatch(session, worker_id="w2", now=T0, lease=10)
    assert outcome is DispatchOutcome.DONE and second.scheduled_at == first.scheduled_at


@pytest.mark.postgres
def test_claim_on_a_raw_connection_reports_done_busy_and_owned(postgres_url: str) -> None:
    """The listener's path: the same outcomes as claim_for_dispatch, on its own connection."""
    import psycopg

    engine = db.make_engine(postgres_url)
    try:
        with Session(engine) as session:
            for name in ("done", "busy", "mine"):
                tasks.save_task(session, one_shot(name), now=T0)
            pairs = dict((c.name, c) for c, _ in claims.claim_for_dispatch(
                session, worker_id="w1", now=T0, lease=10, limit=2))
            assert set(pairs) == {"busy", "done"}
            complete_all(session, [pairs["done"]], now=T0)
            tasks.save_task(session, one_shot("done"), now=T0)  # the same time, again
        with psycopg.connect(db.libpq_conninfo(postgres_url), autocommit=True) as conn:
            outcomes = {c.name: o for c, o in claims.claim_for_dispatch(
                conn, worker_id="w2", now=T0 + timedelta(seconds=11), lease=10)}
            with pytest.raises(ValueError, match="autocommit"):
                conn.autocommit = False
                claims.claim_for_dispatch(conn, worker_id="w2")
    finally:
        engine.dispose()
    assert outcomes == {"done": DispatchOutcome.DONE, "busy": DispatchOutcome.BUSY,
                        "mine": DispatchOutcome.OWNED}


@pytest.mark.postgres
def test_controller_connections_speak_utc_whatever_the_server_zone(postgres_url: str) -> None:
    import psycopg

    name = db.database_url(postgres_url).database
    admin = db.libpq_conninfo(postgres_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {name} SET timezone = 'America/New_York'")  # type: ignore[arg-type]
    engine = db.make_engine(postgres_url)
    try:
        with Session(engine) as session:
            assert session.connection().exec_driver_sql("SHOW TimeZone").scalar() == "UTC"
            tasks.save_task(session, one_shot("utc"), now=T0)
            [claim] = claimed(session, worker_id="w1", now=T0)
        assert claim.scheduled_at == T0 and claim.scheduled_at.tzinfo is UTC
        assert claim.locked_until.tzinfo is UTC
    finally:
        engine.dispose()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {name} RESET timezone")  # type: ignore[arg-type]


def test_claim_for_dispatch_takes_over_failed_and_stale_records(session: Session) -> None:
    tasks.save_task(session, one_shot("failed"), now=T0)
    tasks.save_task(session, one_shot("stale"), now=T0)
    pairs = dict((c.name, c) for c, _ in claims.claim_for_dispatch(
        session, worker_id="w1", now=T0, lease=10))
    claims.fail(session, pairs["failed"], "boom", retry_delay=5, now=T0)
    later = T0 + timedelta(seconds=11)
    outcomes = {c.name: o for c, o in claims.claim_for_dispatch(
        session, worker_id="w2", now=later, lease=10, stale_after=11)}
    assert outcomes == {"failed": DispatchOutcome.OWNED, "stale": DispatchOutcome.BUSY}
    outcomes = {c.name: o for c, o in claims.claim_for_dispatch(
        session, worker_id="w3", now=later + timedelta(seconds=11), lease=10, stale_after=11)}
    assert outcomes == {"failed": DispatchOutcome.BUSY, "stale": DispatchOutcome.OWNED}


def _break_task(session: Session, name: str, column: str, value: str) -> None:
    """Store a value the model would refuse, as a row written before a check existed would."""
    assert column in ("cron", "timezone")
    session.execute(
        text(f"UPDATE scheduled_task SET {column} = :value WHERE name = :name"),
        {"value": value, "name": name},
    )
    session.commit()


BROKEN = [
    ("cron", "0 0 30 2 *", "cron expression '0 0 30 2 *' never matches"),
    ("timezone", "Mars/Olympus", "Mars/Olympus"),
]


@pytest.mark.parametrize(("column", "value", "words"), BROKEN)
def test_a_task_with_no_computable_next_run_does_not_block_its_batch(
    session: Session, caplog: pytest.LogCaptureFixture, column: str, value: str, words: str
) -> None:
    for name in ("a-good", "b-broken", "c-good"):
        tasks.save_task(session, cron_task(name), now=T0 - timedelta(minutes=1))
    tasks.save_task(session, one_shot("d-once"), now=T0)
    _break_task(session, "b-broken", column, value)
    pairs = claims.claim_for_dispatch(session, worker_id="w", now=T0, lease=60)
    assert [(c.name, o) for c, o in pairs] == [
        (n, DispatchOutcome.OWNED) for n in ("a-good", "b-broken", "c-good", "d-once")
    ]
    with caplog.at_level(logging.ERROR, logger="controller"):
        complete_all(session, [claim for claim, _ in pairs], now=T0)
    for name in ("a-good", "c-good"):
        good = tasks.get_task(session, name)
        assert good is not None and good.status == TaskStatus.ACTIVE and good.last_error is None
        assert good.next_run_at == T0 + timedelta(minutes=5) and good.locked_by is None
    once = tasks.get_task(session, "d-once")
    assert once is not None and once.status == TaskStatus.DONE
    # The broken one was dispatched: its record says so, and it stops, loudly.
    broken = tasks.get_task(session, "b-broken")
    assert broken is not None and broken.status == TaskStatus.DISABLED
    assert broken.last_error is not None and words in broken.last_error
    assert broken.last_error.startswith("disabled: cannot compute the run after")
    assert (broken.next_run_at, broken.last_run_at, broken.locked_by) == (T0, T0, None)
    assert {r.task_name: r.status for r in claims.list_dispatches(session)} == {
        name: "dispatched" for name in ("a-good", "b-broken", "c-good", "d-once")
    }
    [logged] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert logged.task_name == "b-broken"  # type: ignore[attr-defined]
    assert words in logged.error  # type: ignore[attr-defined]
    # Nothing is left claimable but the good ones' next runs.
    assert claims.earliest_next_run_at(session) == T0 + timedelta(minutes=5)
    # Saving it again (fixed) resumes it.
    tasks.save_task(session, cron_task("b-broken"), now=T0 + timedelta(minutes=1))
    resumed = tasks.get_task(session, "b-broken")
    assert resumed is not None and resumed.status == TaskStatus.ACTIVE
    assert resumed.last_error is None


def test_complete_and_give_up_disable_a_task_with_no_computable_next_run(
    session: Session,
) -> None:
    tasks.save_task(session, cron_task("done-ok"), now=T0 - timedelta(minutes=1))
    tasks.save_task(session, cron_task("given-up"), now=T0 - timedelta(minutes=1))
    _break_task(session, "done-ok", "cron", "0 0 31 4,6 *")
    _break_task(session, "given-up", "cron", "0 0 31 4,6 *")
    first, second = claimed(session, worker_id="w", now=T0, lease=60)
    assert complete(session, first, now=T0) is True
    completion, message = plan_after_give_up(second, T0, attempts=3, error="prefect down")
    assert claims.give_up(session, completion, message, now=T0) is True
    done_ok, given_up = tasks.get_task(session, "done-ok"), tasks.get_task(session, "given-up")
    assert done_ok is not None and given_up is not None
    assert (done_ok.status, given_up.status) == (TaskStatus.DISABLED, TaskStatus.DISABLED)
    assert done_ok.last_error is not None and "never matches" in done_ok.last_error
    assert given_up.last_error is not None
    assert given_up.last_error.startswith("gave up after 3 failed dispatch attempts: prefect down")
    assert "never matches" in given_up.last_error


def test_release_gives_claims_back_and_drops_unsent_records(session: Session) -> None:
    tasks.save_task(session, one_shot("a"), now=T0)
    [(claim, _)] = claims.claim_for_dispatch(session, worker_id="w1", now=T0, lease=60)
    assert claims.release(session, [claim]) == 1
    assert claims.list_dispatches(session) == []
    [(again, outcome)] = claims.claim_for_dispatch(session, worker_id="w2", now=T0, lease=60)
    assert outcome is DispatchOutcome.OWNED and again.name == "a"


# ---------------------------------------------------------------- renewal, catch-up


def test_a_renewed_claim_is_neither_claimable_nor_taken_over_until_renewals_stop(
    session: Session,
) -> None:
    tasks.save_task(session, one_shot("t"), now=T0)
    [(held, outcome)] = claims.claim_for_dispatch(
        session, worker_id="alive", now=T0, lease=10, stale_after=10
    )
    assert outcome is DispatchOutcome.OWNED
    # The worker renews at T0+8 and T0+16: its lease runs to T0+26.
    for beat in (8, 16):
        assert claims.renew(session, [held], lease=10, now=T0 + timedelta(seconds=beat)) == 1
    [record] = claims.list_dispatches(session, "t")
    assert record.renewed_at == T0 + timedelta(seconds=16)
    assert claimed(session, worker_id="other", now=T0 + timedelta(seconds=26),
                   stale_after=10) == []
    # Renewals stop (the worker was killed): a microsecond after its lease ends,
    # another worker claims it. The record counts as alive for stale_after after
    # its last renewal: with 20 s it is still busy, with 10 s (the lease) it is
    # taken over at once.
    [(late, outcome)] = claims.claim_for_dispatch(
        session, worker_id="other", now=T0 + timedelta(seconds=26) + US, lease=0, stale_after=20
    )
    assert late.scheduled_at == T0 and outcome is DispatchOutcome.BUSY
    [(late, outcome)] = claims.claim_for_dispatch(
        session, worker_id="other", now=T0 + timedelta(seconds=26) + 2 * US, lease=0,
        stale_after=10,
    )
    assert outcome is DispatchOutcome.OWNED
    # The dead worker's renewal no longer touches what it lost.
    assert claims.renew(session, [held], lease=10, now=T0 + timedelta(seconds=27)) == 0


def test_skip_moves_a_task_to_its_latest_missed_window_and_counts_the_rest(
    session: Session, caplog: pytest.LogCaptureFixture
) -> None:
    tasks.save_task(session, cron_task("t"), now=T0 - timedelta(minutes=1))  # next: T0
    now = T0 + timedelta(minutes=17)  # 12:05, 12:10 and 12:15 came due too
    [(claim, outcome)] = claims.claim_for_dispatch(session, worker_id="w", now=now, lease=30)
    assert outcome is DispatchOutcome.OWNED
    catch_up = plan_catch_up(claim, now)
    assert catch_up is not None
    assert (catch_up.next_run_at, catch_up.skipped) == (T0 + timedelta(minutes=15), 3)
    with caplog.at_level(logging.WARNING, logger="controller"):
        assert claims.skip(session, catch_up, now=now) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.skipped_windows == 3 and task.locked_by is None
    assert task.next_run_at == T0 + timedelta(minutes=15) and task.status == TaskStatus.ACTIVE
    [record] = claims.list_dispatches(session, "t")
    assert (record.scheduled_at, record.status) == (T0, "skipped")
    assert record.error is not None and "3 missed window(s)" in record.error
    [logged] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (logged.task_name, logged.skipped) == ("t", 3)  # type: ignore[attr-defined]
    assert logged.first_skipped == T0  # type: ignore[attr-defined]
    assert logged.last_skipped == T0 + timedelta(minutes=10)  # type: ignore[attr-defined]
    # The latest window is due at once, and dispatched as usual.
    [(latest, outcome)] = claims.claim_for_dispatch(session, worker_id="w", now=now, lease=30)
    assert latest.scheduled_at == T0 + timedelta(minutes=15) and outcome is DispatchOutcome.OWNED
    assert plan_catch_up(latest, now) is None
    assert complete(session, latest, now=now) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.next_run_at == T0 + timedelta(minutes=20)
    assert task.skipped_windows == 3


def test_a_late_completion_counts_the_windows_it_passed_over(session: Session) -> None:
    tasks.save_task(session, cron_task("t"), now=T0 - timedelta(minutes=1))
    [claim] = claimed(session, worker_id="w", now=T0, lease=30)
    assert complete(session, claim, now=T0 + timedelta(minutes=12)) is True
    task = tasks.get_task(session, "t")
    assert task is not None and task.next_run_at == T0 + timedelta(minutes=15)
    assert task.skipped_windows == 2  # 12:05 and 12:10
