"""The controller process: the HTTP API under uvicorn, the central scheduler, or both.

Rule: this is the imperative shell. It opens the API's engine (the central
scheduler opens its own from the same URL: its claiming and listening
connections carry settings of their own, see :mod:`controller.central`),
starts what was asked for, waits for SIGINT/SIGTERM (uvicorn's, or ours when
there is no API), then stops the scheduler and disposes the engine, in that
order, whatever failed in between.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from sqlalchemy.engine import Engine

from controller.api import PULL_CACHE_BYTES, create_app
from controller.auth import Tokens
from controller.db import make_engine, safe_url
from controller.events import PrefectEvents
from controller.fleet import FleetSettings

if TYPE_CHECKING:
    from controller.central import CentralSettings

log = logging.getLogger("controller.server")


def uvicorn_config(app: object, *, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """Return the uvicorn settings the controller runs with.

    uvicorn's own access log is off: :class:`controller.api.access_log.AccessLogMiddleware`
    logs each request with its node and principal and never a header.
    """
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        access_log=False,
        ws="none",
        lifespan="off",
        log_level=log_level,
        server_header=False,
    )


@contextmanager
def central_scheduler(
    engine: Engine, enabled: bool, settings: CentralSettings | None = None
) -> Iterator[object | None]:
    """Run the central scheduler while the block runs (or nothing when not enabled).

    ``settings`` default to :meth:`controller.central.CentralSettings.from_env`.
    """
    if not enabled:
        yield None
        return
    from controller.central import CentralScheduler

    scheduler = CentralScheduler(engine, settings)
    scheduler.start()
    log.info("central scheduler started")
    try:
        yield scheduler
    finally:
        scheduler.stop()
        log.info("central scheduler stopped")


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """Yield an event set by SIGINT or SIGTERM, with our handlers installed meanwhile.

    uvicorn restores the handlers it found and re-raises the signal it caught
    once it has shut down; finding ours, it sets the event instead of killing
    the process, so the scheduler is stopped and the engine disposed after it.
    """
    stop = threading.Event()

    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping on signal", extra={"signal": signal.Signals(signum).name})
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(
    *,
    url: str | None,
    tokens: Tokens | None,
    host: str = "127.0.0.1",
    port: int = 8080,
    api: bool = True,
    scheduler: bool = True,
    log_level: str = "info",
    pull_cache_bytes: int = PULL_CACHE_BYTES,
    scheduler_settings: CentralSettings | None = None,
    fleet_settings: FleetSettings | None = None,
) -> None:
    """Run the API and/or the central scheduler until SIGINT or SIGTERM.

    The API announces every write of a node's schedules as a Prefect event
    when ``PREFECT_API_URL`` is set (else it says so here, at start-up, and in
    every write's answer), and records every pull it answers.
    """
    engine = make_engine(url)
    log.info("controller starting", extra={"database": safe_url(engine), "api": api,
                                            "scheduler": scheduler})
    try:
        with stop_on_signals() as stop, central_scheduler(
            engine, scheduler, scheduler_settings
        ) as central:
            if not api:
                stop.wait()
                return
            if tokens is None:
                raise ValueError("the API needs a token configuration")
            wake = getattr(central, "wake", None)
            events = PrefectEvents.from_settings()
            app = create_app(
                engine,
                tokens,
                on_task_saved=(lambda _name: wake()) if wake else None,
                pull_cache_bytes=pull_cache_bytes,
                events=events,
                fleet_settings=fleet_settings,
            )
            try:
                if not stop.is_set():  # a signal during start-up
                    uvicorn.Server(
                        uvicorn_config(app, host=host, port=port, log_level=log_level)
                    ).run()
            finally:
                if app.state.pull_recorder is not None:
                    app.state.pull_recorder.close()
                events.close()
    finally:
        engine.dispose()
        log.info("controller stopped")
