"""Fixtures for a real Prefect server (a session-scoped test harness).

Only tests that request ``prefect_server`` pay for it (~10 s once per session):
the harness starts a throwaway server on a fresh SQLite database. When
``PREFECT_API_URL`` already points at a running server, that server is used as
is. Flow-run heartbeats are off: each sync flow run would otherwise wait ~1 s
for its heartbeat thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[str]:
    """Yield the API URL of a Prefect server every flow in the session talks to."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    quiet = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    with temporary_settings(quiet):
        if os.environ.get("PREFECT_API_URL"):
            yield os.environ["PREFECT_API_URL"]
            return
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=60):
            yield str(PREFECT_API_URL.value())


@pytest.fixture
def prefect(prefect_server: str) -> Iterator[Any]:
    """Yield a reader of the session's Prefect server (tests.nodekit.Prefect), closed after."""
    from tests.nodekit import Prefect

    reader = Prefect(prefect_server)
    yield reader
    reader.close()


def agent_events(
    name: str, node: str, done: Callable[[list[dict[str, Any]]], bool], timeout: float = 15
) -> list[dict[str, Any]]:
    """Return the events called name about node's agent once done(events) holds (or timeout s).

    Events reach the server's store in batches, so tests poll.
    """
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            response = client.request(
                "POST",
                "/events/filter",
                json={"filter": {
                    "event": {"name": [name]},
                    "resource": {"id": [f"sched.agent.{node}"]},
                    "any_resource": None,
                }},
            )
            events: list[dict[str, Any]] = response.json()["events"]
            if done(events) or time.monotonic() > deadline:
                return events
            time.sleep(0.3)
