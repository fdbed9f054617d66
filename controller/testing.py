"""A test kit for the controller, shipped on purpose (as procrastinate's ``testing.py``).

Tests and benchmarks, ours and a user's, need two things the production code
does not: a dispatcher that records instead of sending, and the API served
in a thread on a free port. They live here rather than inside the modules
that run in production, and nothing in production imports this module.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import uvicorn

from controller.api.report_rate import ReportRate
from controller.claims import Claim
from controller.connections import ConnectionLimits
from controller.server import uvicorn_config


@dataclass(frozen=True)
class RecordedDispatch:
    """One recorded dispatch: the claim, and when (monotonic clock) the dispatch began."""

    name: str
    scheduled_at: datetime
    worker_id: str
    started: float


class RecordingDispatcher:
    """A :class:`controller.dispatch.TaskDispatcher` that records every claim, nothing else.

    ``fail_names`` makes the dispatch of those task names raise; ``on_dispatch``
    is called with each record (e.g. to wake a waiting test).
    """

    def __init__(
        self,
        *,
        fail_names: set[str] | None = None,
        on_dispatch: Callable[[RecordedDispatch], Any] | None = None,
    ) -> None:
        self.records: list[RecordedDispatch] = []
        self.fail_names = set(fail_names or ())
        self.on_dispatch = on_dispatch
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    def __call__(self, claim: Claim) -> None:
        record = RecordedDispatch(
            claim.name, claim.scheduled_at, claim.worker_id, time.perf_counter()
        )
        if self.on_dispatch is not None:
            self.on_dispatch(record)
        if claim.name in self.fail_names:
            raise RuntimeError(f"dispatch of {claim.name} failed (as asked)")
        with self.changed:
            self.records.append(record)
            self.changed.notify_all()

    def keys(self) -> list[tuple[str, datetime]]:
        """Return the (task, scheduled time) of every recorded dispatch, in order."""
        with self._lock:
            return [(r.name, r.scheduled_at) for r in self.records]

    def wait_for(self, count: int, timeout: float) -> bool:
        """Wait until at least count dispatches are recorded; False on timeout."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.records) >= count, timeout)


def fast_reports() -> ReportRate:
    """Return a report rate no test's node reaches: tests report faster than agents do
    (the rate itself is tested in tests/test_capacity.py)."""
    return ReportRate(burst=100_000)


@contextmanager
def serve_in_thread(
    app: object,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ConnectionLimits | None = None,
) -> Iterator[str]:
    """Serve app with uvicorn in a thread while the block runs; yield its base URL.

    The socket is bound first (port 0 picks a free one), so the URL is known
    before the server starts. Connections are guarded as ``sched controller
    serve`` guards them (``limits``, or the defaults). On exit the app's pull
    recorder (if any) is closed.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(app, host=host, port=port, log_level="warning", limits=limits)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{port}")
            time.sleep(0.01)  # uvicorn has no started event to wait on
        yield f"http://{host}:{port}"
    finally:
        waits = getattr(getattr(app, "state", None), "waits", None)
        if waits is not None:
            waits.close()  # the nodes' long polls answer now, so the server can stop
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        # The app's pull recorder writes behind: write what is pending and stop its timer
        # while the caller's engine is still open (uvicorn runs no lifespan here).
        recorder = getattr(getattr(app, "state", None), "pull_recorder", None)
        if recorder is not None:
            recorder.close()
