"""One daemon thread that runs a body until stopped, and can be woken early (``Worker``);
a service run for a ``with`` block (``Running``).

The shell the node's recorder, reporter and controller wait share: the body
loops ``while not worker.stopping.is_set()`` and sleeps on ``worker.woken``
(new work) or ``worker.stopping`` (the end). ``start()`` starts the thread once;
``stop()`` sets both events and joins it for at most ``timeout`` seconds
(``None``: does not wait, for a body blocked in a long poll that ends by itself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Self


class Worker:
    """A named daemon thread running ``body()``, with its wake and stop events."""

    def __init__(self, name: str, body: Callable[[], None]) -> None:
        self.name = name
        self._body = body
        self.woken = threading.Event()
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._body, name=self.name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Wake the body from its wait on ``woken``."""
        self.woken.set()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Tell the body to end, and wait at most ``timeout`` s for the thread (None: not)."""
        self.stopping.set()
        self.woken.set()
        if self._thread is not None and timeout is not None:
            self._thread.join(timeout)


class Running:
    """``with thing:`` runs it for the block: ``start()`` on entry, ``stop()`` on exit."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
