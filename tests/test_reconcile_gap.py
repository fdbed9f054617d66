"""The reconciler's pace (sched_node.reconcile): a change announced starts a reconcile at once;
what a burst announces after it waits for one more, at most one each ANNOUNCED_GAP_S; an operator's
Run is never held back. Its loop runs in its thread as in the node; only the reconcile itself
(a pull, a plan) is replaced by one that notes when it began and why."""

from __future__ import annotations

import time
from datetime import timedelta

from sched_node.reconcile import ANNOUNCED_GAP_S, Reconciler
from tests.factories import bare_reconciler
from tests.procs import wait_for


class Noting(Reconciler):
    """A Reconciler whose reconcile notes (when it began, its reasons) and takes 50 ms."""

    seen: list[tuple[float, list[tuple[str, str | None]]]]

    def reconcile(self, reasons: list[tuple[str, str | None]]) -> None:
        self.runs += 1
        self.seen.append((time.monotonic(), list(reasons)))
        time.sleep(0.05)


def _started() -> Noting:
    reconciler = bare_reconciler(Noting, timedelta(hours=1))
    reconciler.seen = []
    reconciler.start()
    wait_for("the start's reconcile", lambda: len(reconciler.seen) == 1, 10)
    time.sleep(ANNOUNCED_GAP_S + 0.2)  # long enough after it: the next announcement is a first
    return reconciler


def test_an_announcement_starts_a_reconcile_at_once_and_a_burst_after_it_one_more() -> None:
    reconciler = _started()
    try:
        announced = time.monotonic()
        reconciler.poke("event")
        wait_for("the announcement's reconcile", lambda: len(reconciler.seen) == 2, 10)
        # Not held back: a gap waited from the announcement would make this a second or more.
        assert reconciler.seen[1][0] - announced < ANNOUNCED_GAP_S
        for _ in range(50):  # a burst, over 0.5 s
            reconciler.poke("event")
            time.sleep(0.01)
        wait_for("the burst's reconcile", lambda: len(reconciler.seen) >= 3, 10)
        time.sleep(ANNOUNCED_GAP_S + 0.5)
        assert len(reconciler.seen) == 3, f"the burst: {len(reconciler.seen) - 2} reconciles"
        assert reconciler.seen[2][0] - reconciler.seen[1][0] >= ANNOUNCED_GAP_S - 0.01
        assert {reason for reason, _ in reconciler.seen[2][1]} == {"event"}
    finally:
        reconciler.stop()


def test_an_operators_run_is_never_held_back() -> None:
    reconciler = _started()
    try:
        reconciler.poke("event")
        wait_for("the announcement's reconcile", lambda: len(reconciler.seen) == 2, 10)
        reconciler.poke("on demand", run_id="run-1")
        wait_for("the Run's reconcile", lambda: len(reconciler.seen) == 3, 10)
        # An announcement here would wait for the gap after the previous reconcile began.
        assert reconciler.seen[2][0] - reconciler.seen[1][0] < ANNOUNCED_GAP_S
        assert reconciler.seen[2][1] == [("on demand", "run-1")]
    finally:
        reconciler.stop()
