"""One access-log line per request, with its node and principal, and never a header."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.auth import Principal

access_log = logging.getLogger("controller.access")


def _printable(text: str) -> str:
    """Return text with control characters escaped, so a request cannot forge log lines."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


class AccessLogMiddleware:
    """Log one line per request: method, path, node, principal, status, duration.

    Headers are never logged, so neither is the ``Authorization`` header.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        state: dict[str, Any] = scope.setdefault("state", {})

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            principal = state.get("principal")
            node = _printable(str(state.get("node", "-")))
            path = _printable(scope["path"])
            who = principal.label if isinstance(principal, Principal) else "-"
            elapsed_ms = (time.perf_counter() - started) * 1000
            access_log.info(
                "%s %s node=%s principal=%s status=%d %.1fms",
                scope["method"], path, node, who, status, elapsed_ms,
                extra={
                    "method": scope["method"], "path": path, "node": node,
                    "principal": who, "status": status, "duration_ms": round(elapsed_ms, 3),
                },
            )
