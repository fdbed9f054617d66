"""PrefectDispatcher against a real Prefect server (the session's test harness).

Each test saves a one-shot task on a fresh SQLite store, lets
``CentralScheduler.run_once`` claim and dispatch it, then dispatches the very
same claim again, as a worker taking over a stale "dispatching" record would
(see :mod:`controller.store`), and reads back what the server kept.

What Prefect dedupes, and what these tests rely on:

- events: one per event id. The dispatcher derives the id from the claim's
  idempotency key; the server's event bus drops an id it saw in the last
  5 minutes and its event store skips an id it already holds;
- deployment runs: one per (flow, idempotency key); creating a run with a known
  key returns the existing run.

Task names carry a random suffix and scheduled times are the current second,
so a run against a long-lived server (``PREFECT_API_URL``) never finds what an
earlier run left behind.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from prefect import flow
from sqlalchemy.engine import Engine
from sqlmodel import Session

from controller import claims, db, tasks
from controller.central import CentralScheduler, CentralSettings
from controller.claims import Claim
from controller.dispatch import PrefectDispatcher, event_id
from controller.errors import DispatchError
from controller.models import DispatchStatus, TaskIn
from tests.procs import free_port

DEADLINE = 60.0  # seconds; only ever reached when something is broken


@flow(name="sched-dispatch-probe")
def dispatch_probe(agent: str = "", n: int = 0) -> str:
    """Do nothing: the tests only need its runs to exist (no worker runs them)."""
    return f"{agent}:{n}"


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    engine = db.make_engine(sqlite_url)
    try:
        yield engine
    finally:
        engine.dispose()


def _now() -> datetime:
    # A real clock read on purpose: the server's event store keeps events for a
    # retention period counted from its own clock, and a reused server must not
    # already hold this test's times.
    return datetime.now(UTC).replace(microsecond=0)


def _suffix() -> str:
    return uuid.uuid4().hex[:10]


def _dispatch_once(engine: Engine, body: dict[str, Any], at: datetime) -> list[Claim]:
    """Save a one-shot task due at ``at``, run one scheduler pass; return what it dispatched."""
    with Session(engine) as session:
        tasks.save_task(session, TaskIn.model_validate({**body, "run_at": at}), now=at)
    prefect = PrefectDispatcher()
    sent: list[Claim] = []

    def dispatcher(claim: Claim) -> None:
        sent.append(claim)
        prefect(claim)

    scheduler = CentralScheduler(
        engine, CentralSettings(wake_on_local_saves=False), dispatcher=dispatcher,
    )
    try:
        assert scheduler.run_once(now=at) == 1
        assert scheduler.run_once(now=at + timedelta(minutes=1)) == 0  # one-shot: done
    finally:
        scheduler.stop()
    with Session(engine) as session:
        records = claims.list_dispatches(session, body["name"])
    assert [(r.scheduled_at, r.status) for r in records] == [(at, DispatchStatus.DISPATCHED)]
    assert len(sent) == 1
    return sent


def _events_of(resource_id: str, at: datetime) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventOccurredFilter, EventResourceFilter

    wanted = EventFilter(
        occurred=EventOccurredFilter(since=at - timedelta(minutes=1),
                                     until=at + timedelta(minutes=1)),
        resource=EventResourceFilter(id=[resource_id]),
    )
    with get_client(sync_client=True) as client:
        return list(client.read_events(filter=wanted, limit=50).events)


def _wait_for_events(resource_id: str, at: datetime) -> list[Any]:
    """Poll until the server's event persister has stored an event of resource_id."""
    end = time.monotonic() + DEADLINE
    while True:
        found = _events_of(resource_id, at)
        if found or time.monotonic() > end:
            return found
        time.sleep(0.25)  # the persister flushes every few seconds


@pytest.mark.prefect
def test_an_event_task_is_one_prefect_event_even_when_dispatched_twice(
    prefect_server: str, engine: Engine
) -> None:
    name, at = f"probe-{_suffix()}", _now()
    (claim,) = _dispatch_once(
        engine, {"name": name, "event": "probe.fired", "payload": {"agent": "node-a", "n": 3}},
        at,
    )
    PrefectDispatcher()(claim)  # the same (task, scheduled time) again
    # A later event on another resource: once it is stored, a duplicate sent
    # before it would have been stored too.
    sentinel = Claim(task_id=0, name=f"{name}-sentinel", scheduled_at=at, worker_id="test",
                     locked_until=at, event="sched.task.probe.sentinel", deployment=None)
    PrefectDispatcher()(sentinel)
    assert _wait_for_events(f"sched.task.{sentinel.name}", at), "sentinel never stored"

    events = _events_of(f"sched.task.{name}", at)

    assert len(events) == 1, events
    (event,) = events
    assert event.event == "sched.task.probe.fired"
    assert event.id == event_id(claim)
    assert event.occurred == at
    assert event.resource.id == f"sched.task.{name}"
    assert event.resource.get("prefect.resource.name") == name
    key = f"{name}:{at.isoformat()}"
    assert event.payload == {"agent": "node-a", "n": 3, "scheduled_at": at.isoformat(),
                             "idempotency_key": key}


@pytest.mark.prefect
def test_a_deployment_task_is_one_flow_run_even_when_dispatched_twice(
    prefect_server: str, engine: Engine
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.objects import StateType

    suffix, at = _suffix(), _now()
    deployment_id = dispatch_probe.to_deployment(name=f"probe-{suffix}").apply()
    name = f"run-{suffix}"
    (claim,) = _dispatch_once(
        engine,
        {"name": name, "deployment": f"sched-dispatch-probe/probe-{suffix}",
         "payload": {"agent": "node-b", "n": 7}},
        at,
    )
    PrefectDispatcher()(claim)  # the same (task, scheduled time) again

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )

    assert len(runs) == 1, runs
    (run,) = runs
    assert run.idempotency_key == f"{name}:{at.isoformat()}"
    assert run.parameters == {"agent": "node-b", "n": 7}
    assert run.state is not None and run.state.type == StateType.SCHEDULED


@pytest.mark.prefect
def test_a_missing_deployment_fails_the_dispatch_naming_it(prefect_server: str) -> None:
    at = _now()
    claim = Claim(task_id=0, name="nowhere", scheduled_at=at, worker_id="test",
                  locked_until=at, event=None, deployment="no-such-flow/no-such-deployment")
    with pytest.raises(LookupError) as raised:
        PrefectDispatcher()(claim)
    message = str(raised.value)
    assert "'no-such-flow/no-such-deployment' not found on http" in message
    assert prefect_server in message


FAILED_AT = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _one_pass(engine: Engine, name: str) -> tuple[Any, list[Any]]:
    """Save event task name due at FAILED_AT, run one pass with the default dispatcher.

    Returns the task and its dispatch records as the pass left them.
    """
    with Session(engine) as session:
        tasks.save_task(session, TaskIn(name=name, run_at=FAILED_AT, event="probe.x"),
                        now=FAILED_AT)
    scheduler = CentralScheduler(engine, CentralSettings(wake_on_local_saves=False))
    try:
        assert scheduler.run_once(now=FAILED_AT) == 1
    finally:
        scheduler.stop()
    with Session(engine) as session:
        task = tasks.get_task(session, name)
        assert task is not None
        return task, claims.list_dispatches(session, name)


def test_an_unreachable_server_fails_the_dispatch_and_the_task_is_retried(
    engine: Engine,
) -> None:
    """No server needed: an event that cannot be delivered must not count as dispatched."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings({PREFECT_API_URL: url}):
        claim = Claim(task_id=0, name="lost", scheduled_at=FAILED_AT, worker_id="test",
                      locked_until=FAILED_AT, event="sched.task.probe.lost", deployment=None)
        with pytest.raises(DispatchError) as info:
            PrefectDispatcher()(claim)
        assert isinstance(info.value.__cause__, httpx.ConnectError)
        # The error names where it tried, and what it was sending.
        assert f"the Prefect API at {url} did not answer" in str(info.value)
        assert "event 'sched.task.probe.lost' of task 'lost'" in str(info.value)
        task, records = _one_pass(engine, "lost")
    assert (task.status, task.attempts, task.next_run_at) == ("active", 1, FAILED_AT)
    assert task.last_error is not None and "ConnectError" in task.last_error
    assert f"the Prefect API at {url} did not answer" in task.last_error
    assert [r.status for r in records] == [DispatchStatus.FAILED]


def test_an_unreachable_server_fails_a_deployment_run_naming_the_url(engine: Engine) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port = free_port()
    with temporary_settings({PREFECT_API_URL: f"http://user:pw-secret@127.0.0.1:{port}/api"}):
        claim = Claim(task_id=0, name="lost-run", scheduled_at=FAILED_AT, worker_id="test",
                      locked_until=FAILED_AT, event=None, deployment="flow/dep")
        with pytest.raises(DispatchError) as info:
            PrefectDispatcher()(claim)
    message = str(info.value)
    where = f"the Prefect API at http://127.0.0.1:{port}/api did not answer"
    assert f"run of deployment 'flow/dep': {where}" in message
    assert "pw-secret" not in message


def test_the_prefect_api_check_names_the_url_and_the_problem(prefect_server: str) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from controller.dispatch import check_prefect_api

    assert check_prefect_api() is None  # the session's server answers
    url = f"http://127.0.0.1:{free_port()}/api"
    with temporary_settings({PREFECT_API_URL: url}):
        problem = check_prefect_api(timeout=5)
    assert problem is not None and problem.startswith(f"the Prefect API at {url} does not answer")
    assert "ConnectError" in problem


def test_without_a_prefect_api_every_dispatch_fails_naming_the_setting(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never a temporary server of Prefect's own: the dispatch fails, recorded and retried."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        task, records = _one_pass(engine, "nowhere")
    assert (task.status, task.attempts) == ("active", 1)
    assert [r.status for r in records] == [DispatchStatus.FAILED]
    assert task.last_error is not None
    assert task.last_error.startswith("ConfigError: no Prefect API to dispatch to")
    assert "PREFECT_API_URL" in task.last_error
