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

import time
from collections.abc import Callable

from controller.rate import Buckets

REPORT_BURST = 10
"""Reports a node may send at once (a full bucket)."""
REPORT_EVERY_S = 2.0
"""One more report is allowed every this many seconds, up to REPORT_BURST."""
MAX_NODES = 100_000
"""Buckets kept at most (the least recently used forgotten first: it starts full again)."""


class ReportRate(Buckets):
    """One bucket per node (the module's rule); :meth:`take` spends a report."""

    def __init__(self, burst: int = REPORT_BURST, every: float = REPORT_EVERY_S, *,
                 clock: Callable[[], float] = time.monotonic, max_nodes: int = MAX_NODES) -> None:
        super().__init__(burst, every, max_keys=max_nodes, clock=clock)
