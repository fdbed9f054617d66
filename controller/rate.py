"""A token bucket per key: ``burst`` at once, one more every ``every`` seconds.

The report rate per node (:mod:`controller.api.report_rate`) and the long poll's replacement
budget per (node, token) (:mod:`controller.waits`, rule 7) are both one of these.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable


class Buckets:
    """One bucket per key; :meth:`take` spends from it, :meth:`wait_s` only looks. At most
    ``max_keys`` are kept (the least recently used forgotten first: it starts full again)."""

    def __init__(self, burst: int, every: float, *, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or not every > 0:
            raise ValueError(f"a rate needs burst >= 1 and every > 0, got {burst} and "
                             f"{every!r}")
        self.burst = burst
        self.every = every
        self.clock = clock
        self.max_keys = max_keys
        self.refused = 0
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()
        """Per key: (spends left, when that was counted)."""
        self._lock = threading.Lock()

    def _left(self, key: Hashable, now: float) -> float:
        left, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), left + (now - at) / self.every)

    def _wait(self, left: float) -> int:
        return 0 if left >= 1 else max(1, math.ceil((1 - left) * self.every))

    def wait_s(self, key: Hashable) -> int:
        """Return 0 if key may spend now, else the seconds until it may (nothing spent)."""
        with self._lock:
            return self._wait(self._left(key, self.clock()))

    def take(self, key: Hashable) -> int:
        """Spend one of key's: 0 if it may now, else the seconds to wait (nothing spent)."""
        now = self.clock()
        with self._lock:
            left = self._left(key, now)
            wait = self._wait(left)
            if wait:
                self.refused += 1
            else:
                left -= 1
            self._buckets.pop(key, None)
            self._buckets[key] = (left, now)  # the newest last
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return wait
