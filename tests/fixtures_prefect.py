"""Fixtures for a real Prefect server (a session-scoped test harness).

Only tests that request ``prefect_server`` pay for it (~10 s once per session):
the harness starts a throwaway server on a fresh SQLite database. When
``PREFECT_API_URL`` already points at a running server, that server is used as
is. Flow-run heartbeats are off: each sync flow run would otherwise wait ~1 s
for its heartbeat thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

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
