"""What the pure decisions read of one node: a frozen view of its rows, their fires, its zone.

:class:`NodeView` is the value every planner and guard function takes instead of the
same six keywords each time. It holds references, not copies: build it under the
cache's lock (or from a copy) and do not keep it past the decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.model import LocalSchedule


@dataclass(frozen=True)
class NodeView:
    """A node's rows, their last fires and first-seen times, its zone, name and grace."""

    rows: Sequence[LocalSchedule]
    last_fired: Mapping[str, datetime]
    first_seen: Mapping[str, datetime]
    tz: ZoneInfo
    node: str
    grace: timedelta
