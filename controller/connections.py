"""The HTTP connection guard: slow and idle clients are closed, open connections are bounded.

Rule: every connection the controller accepts has a deadline until the server
has its whole request, and the number of open connections has a ceiling, and
none of this writes a log line per connection. uvicorn's h11 protocol has
neither: a connection that sends half a header line and waits is kept forever,
as is one that never sends anything, and a request body that never finishes
keeps its handler waiting forever (its keep-alive timer only starts after a
response). The guard is two small parts that use uvicorn's public surface only
(nothing of it subclassed, none of its state read):

- :class:`GuardedConnection`, the asyncio protocol uvicorn is given
  (``http=``): it holds uvicorn's own h11 protocol, built with the arguments
  uvicorn passes, and hands it every event of the connection; it adds itself
  to the per-connection state uvicorn copies into each request's scope
  (``scope["state"]["sched.connection"]``);
- :class:`RequestGuard`, an ASGI middleware, the outermost: it tells the
  connection when a request reached the app and when its answer was sent, and
  keeps the request body's deadline.

1. A ceiling: at ``max_connections`` open connections, a new one takes the place
   of the oldest connection that is idle between requests or still waiting for
   its request headers (a header-waiting one is answered ``503`` and closed; an
   idle one is closed), so slow clients holding every slot cannot keep a client
   that sends its request at once out; when every connection is being answered
   (or sending a body), the new one is answered ``503`` and closed at once,
   before it is read, and a WARNING says the ceiling is reached.
2. A header deadline: from the moment a connection opens (or the first byte of
   its next request after a keep-alive pause) its request must reach the app
   within ``header_timeout`` seconds, however its bytes trickle in; otherwise
   ``408`` and close.
3. A body deadline (the middleware): once the request reached the app, its body
   must arrive within ``body_timeout`` seconds; otherwise ``408`` (the handler
   sees a disconnect) and the connection is closed.
4. A refusal frees its connection: an answer sent before the request's body was
   all read, and every ``401``, ``403``, ``408``, ``413`` and ``429``, carries
   ``Connection: close`` (uvicorn then closes the connection after it), so a
   refused client holds no socket for the keep-alive timeout or its body.
5. A write deadline: a client that stops reading its answer (the transport's
   buffer stays full) for ``write_timeout`` seconds is cut off.

The waiting between requests stays uvicorn's keep-alive timeout. Each kind of
closed connection is counted; :class:`Notices` writes at most one line per kind
per ``notice_interval`` (the first at once, then a summary with the count), and
:class:`QuietRepeats` does the same for the lines uvicorn and asyncio write per
bad connection ("Invalid HTTP request received.", an accept that ran out of
file descriptors), so a flood cannot grow the log faster than a few lines a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("controller.connections")

DEFAULT_MAX_CONNECTIONS = 4000
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_WRITE_TIMEOUT = 30.0
DEFAULT_NOTICE_INTERVAL = 60.0

FD_RESERVE = 128
"""File descriptors kept free of client connections: the database pool, Prefect's
client, log files, the listening socket."""

ACCEPT_BURST = 2048
"""Connections asyncio may accept in one go (uvicorn's listen backlog): a connection
closed to make room for one of them frees its descriptor only on the next turn of the
loop, so a burst needs this many descriptors beyond the ceiling. Short of them,
accept fails and asyncio stops accepting for a whole second."""


def raise_file_limit(wanted: int) -> int:
    """Raise this process's soft open-file limit towards wanted (never past the hard one).

    Returns the soft limit in force afterwards. A service's soft limit is often
    1,024 while its hard limit is far higher; raising the soft one needs no privilege.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target <= soft:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open-file limit",
                    extra={"soft": soft, "hard": hard, "wanted": wanted, "error": str(exc)})
        return soft
    log.info("open-file limit raised for the connection ceiling",
             extra={"from": soft, "to": target, "hard": hard})
    return target


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send a request, and how many may be connected."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    notice_interval: float = DEFAULT_NOTICE_INTERVAL

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        for name in ("header_timeout", "body_timeout", "write_timeout", "notice_interval"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def within_file_limit(self, soft_limit: int | None = None) -> ConnectionLimits:
        """Return these limits with max_connections lowered to fit the process's file limit.

        Past ``RLIMIT_NOFILE`` every accept fails (and asyncio logs each failure
        and stops accepting for a second), so the soft limit is first raised (when
        ``soft_limit`` is not given) to leave room for a burst of accepts and
        :data:`FD_RESERVE` descriptors for everything else; if the hard limit is
        lower, the ceiling is lowered to leave :data:`FD_RESERVE`.
        """
        if soft_limit is None:
            soft_limit = raise_file_limit(self.max_connections + FD_RESERVE + ACCEPT_BURST)
        if soft_limit == resource.RLIM_INFINITY:
            return self
        fits = max(1, soft_limit - FD_RESERVE)
        if self.max_connections <= fits:
            return self
        log.warning(
            "max_connections lowered to fit the open-file limit",
            extra={"asked": self.max_connections, "max_connections": fits,
                   "open_file_limit": soft_limit},
        )
        return ConnectionLimits(fits, self.header_timeout, self.body_timeout,
                                self.write_timeout, self.notice_interval)


_REASONS = {
    "refused": "the open-connection ceiling (--max-connections) is reached and every "
               "connection is being answered: new connections refused with 503; if this is "
               "the fleet's own load, raise --max-connections (and the open-file limit)",
    "evicted": "connections closed to make room for new ones at the open-connection ceiling "
               "(--max-connections): the oldest idle or still sending its request headers",
    "header_timeout": "connections closed: request headers not received in time",
    "body_timeout": "connections closed: request body not received in time",
    "write_timeout": "connections closed: the client stopped reading its answer",
}


class Notices:
    """Count closed connections per kind; log at most one line per kind per interval.

    The first event of a quiet period is logged at once; later ones are counted
    and summed up in one line when the interval has passed (a timer on the
    event loop), so a flood of N connections writes a bounded number of lines.
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.totals: dict[str, int] = dict.fromkeys(_REASONS, 0)
        self._pending: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._flush_armed: set[str] = set()

    def note(self, kind: str, limits: ConnectionLimits,
             loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Count one event of kind; log it now, or later in a summary."""
        self.totals[kind] += 1
        now = self.clock()
        last = self._last.get(kind)
        if last is None or now - last >= self.interval:
            self._last[kind] = now
            self._emit(kind, 1 + self._pending.pop(kind, 0), limits)
            return
        self._pending[kind] = self._pending.get(kind, 0) + 1
        if loop is not None and kind not in self._flush_armed:
            self._flush_armed.add(kind)
            loop.call_later(last + self.interval - now, self._flush, kind, limits)

    def _flush(self, kind: str, limits: ConnectionLimits) -> None:
        self._flush_armed.discard(kind)
        count = self._pending.pop(kind, 0)
        if count:
            self._last[kind] = self.clock()
            self._emit(kind, count, limits)

    def _emit(self, kind: str, count: int, limits: ConnectionLimits) -> None:
        log.warning(
            "%s (%d since the last such line; at most one line per %g s)",
            _REASONS[kind], count, self.interval,
            extra={"kind": kind, "count": count, "total": self.totals[kind],
                   "max_connections": limits.max_connections,
                   "header_timeout": limits.header_timeout,
                   "body_timeout": limits.body_timeout},
        )


class QuietRepeats(logging.Filter):
    """A log filter passing each listed message at most once per interval.

    A passed line after suppressed ones says how many were suppressed. Messages
    are matched by prefix (asyncio's accept failure carries the socket after it).
    """

    def __init__(self, prefixes: tuple[str, ...], interval: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        prefix = next((p for p in self.prefixes if message.startswith(p)), None)
        if prefix is None:
            return True
        now = self.clock()
        last = self._last.get(prefix)
        if last is not None and now - last < self.interval:
            self._suppressed[prefix] = self._suppressed.get(prefix, 0) + 1
            return False
        self._last[prefix] = now
        suppressed = self._suppressed.pop(prefix, 0)
        if suppressed:
            record.msg = f"{message} ({suppressed} more such lines suppressed)"
        return True


NOISY_UVICORN = (
    "Invalid HTTP request received.",
    "Unsupported upgrade request.",
    "No supported WebSocket library detected.",
    "Exceeded concurrency limit.",
)
NOISY_ASYNCIO = ("socket.accept() out of system resource",)


def quiet_repeated_lines(interval: float = DEFAULT_NOTICE_INTERVAL) -> None:
    """Install :class:`QuietRepeats` on uvicorn's and asyncio's loggers (once per process)."""
    for name, prefixes in (("uvicorn.error", NOISY_UVICORN), ("asyncio", NOISY_ASYNCIO)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietRepeats) for f in logger.filters):
            logger.addFilter(QuietRepeats(prefixes, interval))


def _plain_response(status: int, reason: str, text: str) -> bytes:
    body = text.encode("ascii")
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii") + body


CONNECTION_KEY = "sched.connection"
"""Where a request's scope holds its :class:`GuardedConnection` (``scope["state"]``)."""


class GuardedConnection(asyncio.Protocol):
    """One connection: uvicorn's h11 protocol inside, the ceiling and deadlines around it."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    notices: ClassVar[Notices] = Notices(DEFAULT_NOTICE_INTERVAL)
    open: ClassVar[set[GuardedConnection]] = set()
    evictable: ClassVar[dict[GuardedConnection, None]] = {}
    """The server's connections idle or waiting for a request, oldest first (a dict keeps
    insertion order: O(1) to add, remove and find the oldest)."""

    def __init__(self, **uvicorn: Any) -> None:
        # uvicorn copies app_state into each request's scope: this connection rides on it.
        state = {**(uvicorn.pop("app_state", None) or {}), CONNECTION_KEY: self}
        self.inner = H11Protocol(app_state=state, **uvicorn)
        self.loop: asyncio.AbstractEventLoop = uvicorn.get("_loop") or asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.phase = "new"
        """``headers`` (its request is due), ``request`` (the app has it), ``idle``."""
        self._deadline: asyncio.TimerHandle | None = None
        self._write_stall: asyncio.TimerHandle | None = None
        self._refused = False

    # --- what the transport says, handed on to uvicorn's protocol -------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (asyncio's or uvloop's, which is no asyncio.Transport subclass).
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        if len(self.open) >= self.limits.max_connections:
            victim = next(iter(self.evictable), None)
            if victim is not None:
                victim._make_room()
        if len(self.open) >= self.limits.max_connections:
            self._refused = True  # never handed on: nothing parsed, answered, closed
            transport.write(_plain_response(
                503, "Service Unavailable", "too many open connections; try again later"))
            transport.close()
            self.notices.note("refused", self.limits, self.loop)
            return
        self.open.add(self)
        self.inner.connection_made(transport)
        self._await_request()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.phase == "idle":  # the first byte of its next request: the request is due
            self._await_request()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self._refused:
            self.inner.eof_received()
        return None  # the transport closes itself (uvicorn's protocol keeps nothing open)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        if self._refused:
            return
        self.open.discard(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._refused:
            return
        self.inner.pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(
                self.limits.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        if self._refused:
            return
        self.inner.resume_writing()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    # --- what the app's side says (RequestGuard) -----------------------------------------

    def request_started(self) -> None:
        """The request reached the app: its time is its own (the body has its deadline)."""
        self._disarm()
        self.phase = "request"

    def answered(self) -> None:
        """The request's answer was sent: idle until its next request (may make room)."""
        self._disarm()
        self.phase = "idle"
        self.evictable[self] = None

    def may_make_room(self) -> None:
        """The app reads a body nobody vouched for (a login form): may make room meanwhile."""
        self.evictable[self] = None

    # --- the ceiling and the header deadline ---------------------------------------------

    def _await_request(self) -> None:
        self._disarm()
        self.phase = "headers"
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._late)
        self.evictable[self] = None  # the newest: last in line to make room

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.evictable.pop(self, None)

    def close(self, answer: bytes | None = None) -> None:
        """Write answer (if any) and close the connection, out of the count at once."""
        self._disarm()
        self.open.discard(self)  # out of the count now: connection_lost comes a turn later
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if answer is not None:
                transport.write(answer)
            transport.close()

    def _make_room(self) -> None:
        """Close this connection (idle, or waiting for its request) for a new one."""
        self.close(None if self.phase != "headers" else _plain_response(
            503, "Service Unavailable",
            "too many open connections: this one had not sent its request headers"))
        self.notices.note("evicted", self.limits, self.loop)

    def _late(self) -> None:
        self._deadline = None
        self.close(_plain_response(
            408, "Request Timeout",
            f"request headers not received within {self.limits.header_timeout:g} s"))
        self.notices.note("header_timeout", self.limits, self.loop)

    def _write_stalled(self) -> None:
        self._write_stall = None
        transport = self.transport
        if transport is not None and not transport.is_closing():
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # A reset, not a close: the kernel would otherwise keep trickling the
                # send buffer (megabytes) to the client that stopped reading it.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            self.notices.note("write_timeout", self.limits, self.loop)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedConnection]:
    """Return the protocol class uvicorn runs connections with, for these limits.

    uvicorn builds one protocol instance per connection from a class, so the
    limits (and one :class:`Notices` and connection registry per server) ride on
    a subclass of our own.
    """
    attributes = {"limits": limits, "notices": Notices(limits.notice_interval),
                  "open": set(), "evictable": {}}
    return type("GuardedConnection", (GuardedConnection,), attributes)
