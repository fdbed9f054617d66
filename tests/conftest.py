"""Shared fixtures live in plugin modules, one per real component; the files' order here."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.fixtures_pg", "tests.fixtures_prefect"]

LONG_FIRST = (
    "tests/test_node_outage.py",
    "tests/test_node_kill.py",
    "tests/test_flows.py",
    "tests/test_scaled_layout.py",
    "tests/test_failover.py",
)
"""The files that wait on real minutes (``--durations``: 3.5, 1.7, 0.9 and 0.8 min on an idle
machine), started first: ``make test`` runs whole files on three workers (``--dist loadfile
--no-loadscope-reorder``, so in this order), and the others fill in beside them. In
pytest-xdist's own order (the most tests first) they came last and ran nearly alone at the
end: 6:47 then, 5:52 in this order."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the :data:`LONG_FIRST` files first, then every other file by its number of tests,
    the most first (what pytest-xdist does itself); each file's tests keep their order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(name: str) -> tuple[int, int]:
        if name in LONG_FIRST:
            return LONG_FIRST.index(name), 0
        return len(LONG_FIRST), -len(files[name])

    items[:] = [item for name in sorted(files, key=rank) for item in files[name]]
