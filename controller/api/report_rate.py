"""How often one node may report: a bucket per node, refilled at a steady rate.

Rule: a node's report is counted before its body is read (after its token is
checked, so nobody else can spend a node's reports); past the bucket it is
answered ``429`` with ``Retry-After`` and its connection closed, and the node's
reporter sends it again after that many seconds, with whatever else it has to say
(its outbox keeps every job record until a report carrying it is accepted:
:mod:`sched_node.node_report`). A node reports after each reconcile, 1 s after a
burst of job starts and ends, and at each heartbeat: well under one report every
:data:`REPORT_EVERY_S` on average, so the limit holds back only a node (or its
token) gone wrong. The buckets are this process's: an instance counts the reports
it is sent.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

REPORT_BURST = 10
"""Reports a node may send at once (a full bucket)."""
REPORT_EVERY_S = 2.0
"""One more report is allowed every this many seconds, up to REPORT_BURST."""
MAX_NODES = 100_000
"""Buckets kept at most (the least recently used forgotten first: it starts full again)."""


class ReportRate:
    """One bucket per node (the module's rule); :meth:`take` spends a report."""

    def __init__(self, burst: int = REPORT_BURST, every: float = REPORT_EVERY_S, *,
                 clock: Callable[[], float] = time.monotonic, max_nodes: int = MAX_NODES) -> None:
        if burst < 1 or not every > 0:
            raise ValueError(f"a report rate needs burst >= 1 and every > 0, got {burst} "
                             f"and {every!r}")
        self.burst = burst
        self.every = every
        self.clock = clock
        self.max_nodes = max_nodes
        self.refused = 0
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        """Per node: (reports left, when that was counted)."""
        self._lock = threading.Lock()

    def take(self, node: str) -> int:
        """Spend one of node's reports: 0 if it may report now, else the seconds to wait."""
        now = self.clock()
        with self._lock:
            left, at = self._buckets.pop(node, (float(self.burst), now))
            left = min(float(self.burst), left + (now - at) / self.every)
            if left >= 1:
                left -= 1
                wait = 0
            else:
                self.refused += 1
                wait = max(1, math.ceil((1 - left) * self.every))
            self._buckets[node] = (left, now)  # the newest last
            while len(self._buckets) > self.max_nodes:
                self._buckets.popitem(last=False)
        return wait
