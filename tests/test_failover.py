"""Failover under chaos, small: four scheduler processes, SIGKILLs, listener terminations.

Real components: four ``sched controller serve --scheduler-only`` processes on
one Postgres, dispatching deployment runs to a real Prefect server; a chaos
loop SIGKILLs random instances (restarting them) and terminates LISTEN
connections. Everything due must reach Prefect exactly once (flow runs per
idempotency key), and nothing may be lost. The harness is
``bench/bench_failover.py``'s, which measures the delays at full size.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

pytestmark = [pytest.mark.postgres, pytest.mark.prefect]

ROOT = Path(__file__).resolve().parent.parent


def _harness() -> ModuleType:
    return load_script("bench/bench_failover.py", "bench_failover")


def test_killed_instances_lose_and_double_nothing_in_prefect(
    postgres_url: str, prefect_server: str, tmp_path: Path
) -> None:
    harness = _harness()
    result = harness.run_chaos(
        postgres_url, prefect_server, tmp_path, seconds=20, instances=4,
        one_shot_every=0.5, crons=3, kill_every=(2.0, 4.0), down_for=(0.5, 2.0),
        listener_every=(1.5, 3.0), settle=45, seed=11,
    )
    assert result.kills >= 3 and result.listener_kills >= 2  # the chaos really happened
    assert result.lost == []
    assert result.duplicated == {}
    assert result.one_shots == 40
    # The crons add their windows that fell within the 20 s, if a minute turned.
    assert len(result.delays) == result.runs >= result.expected >= result.one_shots
