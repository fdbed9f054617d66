"""The controller process: the HTTP API under uvicorn, the central scheduler, or both.

Rule: this is the imperative shell. It opens the API's engine (the central
scheduler opens its own from the same URL: its claiming and listening
connections carry settings of their own, see :mod:`controller.central`),
starts what was asked for, waits for SIGINT/SIGTERM (uvicorn's, or ours when
there is no API), then stops the scheduler and disposes the engine, in that
order, whatever failed in between. ``SIGHUP`` never stops it: it asks the
:class:`controller.auth.TokensReloader` to reload the tokens file.

uvicorn runs each connection with :class:`controller.connections.GuardedConnection`
(deadlines for slow clients, a ceiling on open connections), optionally over
TLS (``ssl_certfile``/``ssl_keyfile``), and logs through the root logger like
everything else (no dictConfig of its own), so one formatter escapes every line.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from sqlalchemy.engine import Engine

from controller.api import PULL_CACHE_BYTES, create_app
from controller.auth import Tokens, TokensReloader
from controller.connections import ConnectionLimits, guarded_protocol, quiet_repeated_lines
from controller.db import make_engine, safe_url
from controller.events import PrefectEvents, ScheduleEvents
from controller.fleet import FleetSettings
from controller.settings import Network
from controller.waits import NodeWaits, PrefectRelay
from sched_core.errors import ConfigError

if TYPE_CHECKING:
    from controller.central import CentralSettings

log = logging.getLogger("controller.server")


def uvicorn_config(
    app: object,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    limits: ConnectionLimits | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> uvicorn.Config:
    """Return the uvicorn settings the controller runs with.

    uvicorn's own access log is off: :class:`controller.api.access_log.AccessLogMiddleware`
    logs each request with its node and principal and never a header. Connections
    are guarded by ``limits`` (:mod:`controller.connections`; defaults when None),
    lowered to fit the process's open-file limit.
    """
    limits = (limits or ConnectionLimits()).within_file_limit()
    quiet_repeated_lines(limits.notice_interval)
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        http=guarded_protocol(limits),
        access_log=False,
        # Forwarded headers are believed from the configured proxies only, by the app
        # (controller.api.client); uvicorn's own would believe 127.0.0.1's.
        proxy_headers=False,
        ws="none",
        lifespan="off",
        log_level=log_level,
        log_config=None,
        server_header=False,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
    )


GC_THRESHOLDS = (700, 10, 10_000)
"""The cyclic garbage collector's thresholds while the API serves (CPython's: 700, 10, 10).

Only the third differs: a full pass (over every object the collector tracks) comes after
10,000 middle ones instead of 10. Each held long poll keeps ~100 tracked objects (the
request's coroutines through the middleware, closures, futures) for up to a minute, and a
fleet watch pass holds its own for a second or more: they outlive the young collections and
count towards a full pass, which then came every 4-15 s and took 200-800 ms with 5,000 waits,
holding the GIL: the whole process stood still, which was most of the pull p99 of 500-700 ms
(measured with the collector's callbacks; docs/controller.md, "Garbage collection"). What
dies by its reference count (most) is freed at once whatever the thresholds; cyclic garbage
that reached the oldest generation waits for the next full pass, still due after 70 million
net allocations of tracked objects."""


SWITCH_INTERVAL_S = 0.0005
"""How long a thread may hold the GIL while another waits for it (CPython's: 5 ms).

The event loop gives up the GIL at every socket call; a worker thread busy in Python (a
large report parsed, a database call) then keeps it up to the whole interval before the
loop gets it back, many times per request. Under a flood that made a healthy pull wait
behind tens of such hand-overs (docs/benchmarks.md, "The controller under floods")."""


def quiet_collector() -> None:
    """Collect once, freeze what survives (the imports and the app: ~380,000 objects that
    live as long as the process, which no pass need walk again), then set GC_THRESHOLDS and
    SWITCH_INTERVAL_S."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Raise ConfigError naming the file if a TLS certificate or key cannot be used.

    A key file other users may read is served anyway, with a warning (group
    read is common, e.g. the ``ssl-cert`` group).
    """
    if keyfile and not certfile:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile")
    for flag, name in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not name:
            continue
        path = Path(name)
        try:
            with path.open("rb") as handle:
                mode = os.fstat(handle.fileno()).st_mode
                handle.read(1)
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot read it: {exc.strerror}") from None
        if flag == "--ssl-keyfile" and mode & stat.S_IROTH:
            log.warning("TLS key file is readable by other users; chmod 600 it",
                        extra={"path": str(path), "mode": f"{stat.S_IMODE(mode):04o}"})
    if certfile:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(certfile, keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"--ssl-certfile {certfile}"
                + (f" / --ssl-keyfile {keyfile}" if keyfile else "")
                + f": not a certificate and key that belong together ({exc})"
            ) from None


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
def fleet_watch(
    engine: Engine, settings: FleetSettings | None, events: ScheduleEvents, interval: float,
) -> Iterator[object | None]:
    """Raise the fleet's alerts while the block runs (nothing when interval is 0)."""
    if not interval > 0:
        yield None
        return
    from controller.watch import FleetWatch

    send = getattr(events, "send", None) if events.configured else None
    watch = FleetWatch(engine, settings or FleetSettings(), emit=send, interval=interval)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()


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


@contextmanager
def on_sighup(callback: Callable[[], None]) -> Iterator[None]:
    """Call callback on SIGHUP while the block runs (it must only set a flag or an event).

    SIGHUP's default action ends the process; a controller keeps running and
    reloads its tokens instead. uvicorn handles only SIGINT and SIGTERM.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(_signum: int, _frame: FrameType | None) -> None:
        callback()

    previous = signal.signal(signal.SIGHUP, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


class WaitingServer(uvicorn.Server):
    """uvicorn's server, which first answers the nodes' long polls when it shuts down.

    Without it a stop would wait for every node's wait to time out (up to 5 minutes).
    """

    def __init__(self, config: uvicorn.Config, waits: NodeWaits) -> None:
        super().__init__(config)
        self.waits = waits

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.waits.close()
        await super().shutdown(sockets)


def start_relay(waits: NodeWaits) -> PrefectRelay | None:
    """Follow Prefect's events for the nodes' waits when a Prefect API is configured.

    Without one, a node's wait answers only its schedule changes (and says
    ``relay: false``): the node then follows Prefect's events itself.
    """
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        log.warning("no PREFECT_API_URL: nodes' waits carry no ad hoc runs or cancels from "
                    "Prefect (each node then holds its own Prefect event stream)")
        return None
    return PrefectRelay(waits, str(url)).start()


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
    limits: ConnectionLimits | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    environ: Mapping[str, str] | None = None,
    tokens_check_interval: float = 2.0,
    check_prefect: bool = True,
    fleet_settings: FleetSettings | None = None,
    watch_interval: float = 15.0,
    trusted_proxies: Sequence[Network] = (),
) -> None:
    """Run the API and/or the central scheduler until SIGINT or SIGTERM.

    ``environ`` (default ``os.environ``) names the tokens file to watch (an ``insecure``
    ``tokens`` has none). With the scheduler on and ``check_prefect``, a warning names a
    Prefect API that does not answer. The API announces each write of a node's schedules as
    a Prefect event when ``PREFECT_API_URL`` is set, and records every pull it answers.
    Unless ``watch_interval`` is 0, every instance raises the fleet's alerts
    (:class:`controller.watch.FleetWatch`), each sent once by the database's rule.
    ``trusted_proxies`` may forward a client's address (:mod:`controller.api.client`).
    """
    engine = make_engine(url)
    log.info("controller starting", extra={"database": safe_url(engine), "api": api,
                                            "scheduler": scheduler, "tls": bool(ssl_certfile)})
    watched = tokens if tokens is not None and not tokens.insecure else None
    reloader = TokensReloader(watched, environ, interval=tokens_check_interval)
    events = PrefectEvents.from_settings()
    try:
        with stop_on_signals() as stop, reloader, on_sighup(reloader.request), \
                central_scheduler(engine, scheduler, scheduler_settings) as central, \
                fleet_watch(engine, fleet_settings, events, watch_interval):
            if scheduler and check_prefect:
                from controller.dispatch import warn_if_prefect_unreachable

                warn_if_prefect_unreachable()
            if not api:
                stop.wait()
                return
            config = functools.partial(uvicorn_config, host=host, port=port, log_level=log_level,
                                       limits=limits, ssl_certfile=ssl_certfile,
                                       ssl_keyfile=ssl_keyfile)
            _serve_api(engine, tokens, stop, wake=getattr(central, "wake", None), events=events,
                       pull_cache_bytes=pull_cache_bytes, fleet_settings=fleet_settings,
                       config=config, trusted_proxies=trusted_proxies)
    finally:
        events.close()
        engine.dispose()
        log.info("controller stopped")


def _serve_api(
    engine: Engine, tokens: Tokens | None, stop: threading.Event, *,
    wake: Callable[[], None] | None, events: ScheduleEvents, pull_cache_bytes: int,
    fleet_settings: FleetSettings | None, config: Callable[[object], uvicorn.Config],
    trusted_proxies: Sequence[Network] = (),
) -> None:
    """Serve the API under uvicorn until stopped (not at all if a signal came first): the
    nodes' waits and their Prefect relay, the app; then close the pull recorder and the relay.
    """
    if tokens is None:
        raise ValueError("the API needs a token configuration")
    waits = NodeWaits()
    relay = start_relay(waits)
    app = create_app(
        engine,
        tokens,
        on_task_saved=(lambda _name: wake()) if wake else None,
        pull_cache_bytes=pull_cache_bytes,
        events=events,
        fleet_settings=fleet_settings,
        waits=waits,
        trusted_proxies=trusted_proxies,
    )
    settings = config(app)
    quiet_collector()
    try:
        if not stop.is_set():  # a signal during start-up
            WaitingServer(settings, waits).run()
    finally:
        if app.state.pull_recorder is not None:
            app.state.pull_recorder.close()
        if relay is not None:
            relay.stop()
