"""A connection that must stay up: followed in a thread of its own, reconnected after any loss.

Shell: a daemon thread with its own event loop runs ``follow()`` (which connects and
returns or raises when the connection is lost) again and again, waiting between tries
1 s, doubling to 30 s; a connection that stayed up a minute starts the wait over. Used
for the event streams a node or a controller follows (Prefect's websocket), so a lost
server costs a reconnect, never the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Self

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
STEADY_S = 60.0
"""A connection up this long before it was lost starts the backoff over."""


class Reconnecting:
    """Run ``follow()`` in a thread until stopped, reconnecting with a capped backoff.

    ``on_lost(error, wait_s)`` is told of each loss (to log it and clear a flag).
    """

    def __init__(self, name: str, follow: Callable[[], Awaitable[None]],
                 on_lost: Callable[[BaseException, float], None]) -> None:
        self.name = name
        self._follow = follow
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> Reconnecting:
        """Start the thread (once); return self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following: the connection is closed and the thread ends."""
        self._stop.set()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(
                    lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
            except RuntimeError:  # closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._run())
        except asyncio.CancelledError:
            pass
        finally:
            loop.close()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                await self._follow()
                raise ConnectionError("the connection ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started > STEADY_S:
                    backoff = BACKOFF_MIN_S
                self._on_lost(exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)


class Follower:
    """A stream follower run by one :class:`Reconnecting` thread, ``self._thread``."""

    _thread: Reconnecting

    def start(self) -> Self:
        """Start following (once); return self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop following (the stream is closed, the thread ends)."""
        self._thread.stop(timeout)
