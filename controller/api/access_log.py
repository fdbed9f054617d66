"""One access-log line per request, with its node and principal, and never a header."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from controller.api.headers import HttpMiddleware
from controller.auth import Principal
from controller.logtext import printable as _printable

access_log = logging.getLogger("controller.access")


class AccessLogMiddleware(HttpMiddleware):
    """Log one line per request: method, path, node, principal, status, duration.

    Headers are never logged, so neither is the ``Authorization`` header.
    """

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
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
