"""The HTTP connection guard: slow and idle clients are closed, open connections are bounded.

Rule: every connection the controller accepts has a deadline until the server
has its whole request, and the number of open connections has a ceiling, and
none of this writes a log line per connection. uvicorn's h11 protocol has
neither: a connection that sends half a header line and waits is kept forever,
as is one that never sends anything, and a request body that never finishes
keeps its handler waiting forever (its keep-alive timer only starts after a
response). :class:`GuardedH11Protocol` is uvicorn's protocol with:

1. A ceiling: at ``max_connections`` open connections, a new one takes the place
   of the oldest connection still waiting for its request headers (that one is
   answered ``503`` and closed), so slow clients holding every slot cannot keep
   a client that sends its request at once out; when no connection is waiting
   for headers (every one is sending a body or being answered), the new one is
   answered ``503`` and closed at once, before it is read.
2. A header deadline: from the moment a connection opens (or the first byte of
   its next request after a keep-alive pause) its request line and headers must
   arrive within ``header_timeout`` seconds, in total, however they trickle in;
   otherwise ``408`` and close.
3. A body deadline: once the headers are in, the body must arrive within
   ``body_timeout`` seconds; otherwise ``408`` (when no answer has started,
   the handler sees a disconnect) and close. A body still trickling in after
   an early answer (a ``401`` sent before the body was read) is closed the same way.
4. A write deadline: a client that stops reading its answer (the transport's
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
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("controller.connections")

DEFAULT_MAX_CONNECTIONS = 1000
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
    "refused": "connections refused: over the open-connection limit",
    "evicted": "connections closed to make room for new ones: at the open-connection limit, "
               "the oldest still sending its request headers",
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


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection ceiling and request deadlines (see the module)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    notices: ClassVar[Notices] = Notices(DEFAULT_NOTICE_INTERVAL)
    waiting: ClassVar[dict[GuardedH11Protocol, None]] = {}
    """The server's connections waiting for request headers, oldest wait first
    (a dict keeps insertion order: O(1) to add, remove and find the oldest)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._write_stall: asyncio.TimerHandle | None = None
        self._refused = False

    # --- opening and closing ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            victim = next(iter(self.waiting), None)
            if victim is not None:
                victim._make_room()
        if len(self.connections) >= self.limits.max_connections:
            # Not added to the connection set, nothing parsed: answered and closed.
            self._refused = True
            self.transport = transport
            transport.write(_plain_response(
                503, "Service Unavailable", "too many open connections; try again later"
            ))
            transport.close()
            self.notices.note("refused", self.limits, self.loop)
            return
        super().connection_made(transport)
        self._arm("header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        if self._refused:
            return
        super().connection_lost(exc)

    # --- reading ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase is None and self.conn.their_state is h11.IDLE:
            # The first byte of a request after a keep-alive pause: its headers are due.
            self._arm("header_timeout")
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def _follow_request(self) -> None:
        """Move the deadline along with the request: headers, then body, then none."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body_timeout":
                self._arm("body_timeout")
        elif state is h11.IDLE:
            if self._phase == "body_timeout":
                self._disarm()  # a body that came in after an early answer
            cycle = self.cycle
            waiting = cycle is None or cycle.response_complete
            if self._phase is None and self.timeout_keep_alive_task is None and waiting:
                # Waiting for a request with no timer on it (uvicorn's keep-alive
                # timer was cancelled by the late body's bytes): its headers are due.
                self._arm("header_timeout")
        else:
            # DONE (the whole request is in: the handler's time is its own), or
            # MUST_CLOSE, CLOSED, ERROR: nothing more to wait for.
            self._disarm()

    def _make_room(self) -> None:
        """Close this connection (waiting for its headers) for a new one: 503, closed."""
        self._disarm()
        # Out of the count now: its connection_lost comes later, on the next loop turn.
        self.connections.discard(self)
        if not self.transport.is_closing():
            self.transport.write(_plain_response(
                503, "Service Unavailable",
                "too many open connections: this one had not sent its request headers",
            ))
            self.transport.close()
        self.notices.note("evicted", self.limits, self.loop)

    # --- deadlines --------------------------------------------------------------------------

    def _arm(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        timeout: float = getattr(self.limits, phase)
        self._deadline = self.loop.call_later(timeout, self._expired, phase)
        if phase == "header_timeout":
            self.waiting[self] = None  # the newest wait: last in line to make room

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None
        self.waiting.pop(self, None)

    def _expired(self, phase: str) -> None:
        self._deadline = None
        self._phase = None
        self.waiting.pop(self, None)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if phase == "header_timeout":
            # No request of this round yet (cycle, if any, is the previous one, answered).
            answer = cycle is None or cycle.response_complete
        else:
            # Answer unless the handler already did (a 401 sent before the body was read).
            answer = cycle is not None and not cycle.response_started
        if answer:
            if cycle is not None and not cycle.response_complete:
                # The handler is waiting for the body: it gets a disconnect, and its
                # own answer (sent after this one) is dropped.
                cycle.disconnected = True
                cycle.message_event.set()
            what = "request headers" if phase == "header_timeout" else "request body"
            timeout: float = getattr(self.limits, phase)
            self.transport.write(_plain_response(
                408, "Request Timeout", f"{what} not received within {timeout:g} s"
            ))
        self.transport.close()
        self.notices.note(phase, self.limits, self.loop)

    # --- writing ----------------------------------------------------------------------------

    def pause_writing(self) -> None:
        if self._refused:
            return
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(
                self.limits.write_timeout, self._write_stalled
            )

    def resume_writing(self) -> None:
        if self._refused:
            return
        super().resume_writing()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _write_stalled(self) -> None:
        self._write_stall = None
        if not self.transport.is_closing():
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                # A reset, not a close: the kernel would otherwise keep trickling the
                # send buffer (megabytes) to the client that stopped reading it.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
            self.notices.note("write_timeout", self.limits, self.loop)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """Return the protocol class uvicorn runs connections with, for these limits.

    uvicorn builds one protocol instance per connection from a class, so the
    limits (and one :class:`Notices` per server) ride on a subclass.
    """
    attributes = {"limits": limits, "notices": Notices(limits.notice_interval), "waiting": {}}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attributes)
