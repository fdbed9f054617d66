"""The app's side of the connection guard (:mod:`controller.connections`, rules 2-4).

:class:`RequestGuard` is the outermost middleware. For each request it finds its
connection in the scope (``scope["state"]["sched.connection"]``, put there by
:class:`controller.connections.GuardedConnection`; none when the app is called
otherwise, e.g. by a test client: then it only passes the request on) and:

1. tells it the request reached the app (its header deadline ends) and, when
   the app is done, that it is idle until its next request;
2. keeps the body's deadline: a body not all received ``body_timeout`` seconds
   after the request reached the app is answered ``408`` and the connection is
   closed; the handler's next read sees a disconnect, and what it sends after is
   dropped;
3. closes refused connections: an answer that starts before the body was all
   read, or has a status of :data:`REFUSALS`, carries ``Connection: close``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import Message, Receive, Scope, Send

from controller.api.headers import HttpMiddleware
from controller.connections import CONNECTION_KEY, GuardedConnection

REFUSALS = frozenset({401, 403, 408, 413, 429})
"""Statuses whose connection is closed after the answer (rule 3)."""


def connection_of(scope: Scope) -> GuardedConnection | None:
    """Return the guarded connection a request came on, or None (not served by it)."""
    found = (scope.get("state") or {}).get(CONNECTION_KEY)
    return found if isinstance(found, GuardedConnection) else None


def has_body(scope: Scope) -> bool:
    """Return whether the request's headers announce a body (a length above 0, or chunks)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
    return False


class RequestGuard(HttpMiddleware):
    """Rules 1-3 of the module, per request."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = connection_of(scope)
        if connection is None:
            await self.app(scope, receive, send)
            return
        connection.request_started()
        guarded = _GuardedRequest(connection, scope, receive, send)
        try:
            await self.app(scope, guarded.receive, guarded.send)
        finally:
            connection.answered()


class _GuardedRequest:
    """One request's receive and send, with its body deadline (rules 2 and 3)."""

    def __init__(self, connection: GuardedConnection, scope: Scope, receive: Receive,
                 send: Send) -> None:
        self.connection = connection
        self._receive = receive
        self._send = send
        self.body_done = not has_body(scope)
        self.started = False
        self.timed_out = False
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + connection.limits.body_timeout

    async def receive(self) -> Message:
        if self.body_done or self.timed_out:
            return await self._receive() if not self.timed_out else {"type": "http.disconnect"}
        left = self.deadline - asyncio.get_running_loop().time()
        try:
            message: Message = await asyncio.wait_for(self._receive(), max(left, 0))
        except TimeoutError:
            await self._late()
            return {"type": "http.disconnect"}
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_done = True
        return message

    async def _late(self) -> None:
        self.timed_out = True
        limits = self.connection.limits
        if not self.started:
            self.started = True
            text = f"request body not received within {limits.body_timeout:g} s".encode()
            await self._send({"type": "http.response.start", "status": 408, "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(text)).encode()), (b"connection", b"close")]})
            await self._send({"type": "http.response.body", "body": text})
        else:  # an answer under way while the body is still due: nothing more to say
            self.connection.close()
        self.connection.notices.note("body_timeout", limits, asyncio.get_running_loop())

    async def send(self, message: Message) -> None:
        if self.timed_out:
            return  # answered 408 already: the handler's own answer goes nowhere
        if message["type"] == "http.response.start":
            self.started = True
            status: Any = message.get("status")
            if not self.body_done or status in REFUSALS:
                headers = MutableHeaders(scope=message)
                headers["connection"] = "close"
        await self._send(message)
