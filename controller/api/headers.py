"""Headers every answer carries, whatever route (or error handler) made it.

Rule: every response gets ``X-Content-Type-Options: nosniff`` (a browser never
reads a JSON answer as HTML or script) and ``Referrer-Policy: no-referrer`` (a
link followed from the fleet page names no controller URL); over HTTPS also
``Strict-Transport-Security`` (a browser that saw it once never talks plain
HTTP to this host for HSTS_MAX_AGE seconds). A header a route set itself wins.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HSTS_MAX_AGE = 31_536_000
"""How long (seconds, a year) a browser keeps to HTTPS after one answer over it."""

SECURITY_HEADERS = {"x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


class HttpMiddleware:
    """A pure ASGI middleware for HTTP requests: any other scope (lifespan) passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle one HTTP request (``self.app`` is the next layer)."""
        raise NotImplementedError


class SecurityHeadersMiddleware(HttpMiddleware):
    """Add SECURITY_HEADERS to every HTTP answer, and HSTS to those over HTTPS."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        https = scope.get("scheme") == "https"

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
                if https:
                    headers.setdefault("strict-transport-security", f"max-age={HSTS_MAX_AGE}")
            await send(message)

        await self.app(scope, receive, with_headers)
