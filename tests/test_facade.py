"""The facade's forwarded attributes: read through, typed, read-only."""

from __future__ import annotations

import pytest

from sched_core.facade import Forward


class _Part:
    def __init__(self) -> None:
        self.count = 0


class _Facade:
    count: Forward[int] = Forward("part.count", "How many.")

    def __init__(self) -> None:
        self.part = _Part()


def test_reads_the_part_each_time() -> None:
    facade = _Facade()
    assert facade.count == 0
    facade.part.count = 3
    assert facade.count == 3


def test_is_read_only_and_documented() -> None:
    facade = _Facade()
    with pytest.raises(AttributeError, match=r"part\.count"):
        facade.count = 5
    assert facade.part.count == 0
    assert _Facade.count.__doc__ == "How many."
