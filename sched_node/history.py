"""The node's memory of the jobs that ended: what the chain, the report and the status read.

``<state_dir>/history.json`` holds, newest last, one summary per ended job
(:class:`Ended`), at most :data:`KEEP` of them and none older than
:data:`KEEP_FOR`. Written atomically under its lock when a job ends, so it
survives a restart; losing it costs the chain one day's wave (a first boot
fires nothing for a wave it did not see) and the report its latest outcomes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sched_core.jsonwire import MAX_DEPTH
from sched_core.statefile import locked, read_json_file, write_atomic
from sched_node.outbox import COMPLETED, JobView, parse_time, utc_text

log = logging.getLogger(__name__)

KEEP = 1000
KEEP_FOR = timedelta(days=2)


# `duplicates` pairs this record with sched_node/planner.py's PlannedEntry and
# sched_core/firing.py's Due by shape (a constant, a frozen dataclass, a docstring, typed
# fields): different records with nothing to share.
@dataclass(frozen=True)
class Ended:
    """One ended job: its schedule, action, trigger, window, outcome and times."""

    job_id: str
    schedule_id: str
    action: str
    trigger_key: str
    window: str | None
    key: str
    state: str
    started_at: str | None
    ended_at: str
    message: str
    error: str | None
    run_name: str

    @property
    def succeeded(self) -> bool:
        """True when the job ran and completed."""
        return self.state == COMPLETED

    @property
    def ended(self) -> datetime:
        """When the job ended."""
        found = parse_time(self.ended_at)
        assert found is not None
        return found

    @classmethod
    def of(cls, view: JobView) -> Ended:
        """Return the summary of an ended job."""
        spec = view.spec
        started = view.started_at
        return cls(
            job_id=spec.job_id, schedule_id=spec.schedule_id, action=spec.action,
            trigger_key=spec.trigger_key,
            window=utc_text(spec.window) if spec.window else None, key=spec.key,
            state=view.end_state or "", started_at=utc_text(started) if started else None,
            ended_at=utc_text(view.end_at or spec.accepted_at), message=view.message,
            error=view.error, run_name=spec.run_name,
        )


class History:
    """The ended jobs, in memory and in ``history.json``."""

    def __init__(self, path: Path, *, now: datetime) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._items: list[Ended] = []
        self._missed: list[tuple[str, str, int]] = []  # (at, schedule id, windows)
        data = read_json_file(path, now=now, max_depth=MAX_DEPTH)
        for raw in data.get("ended", []) if isinstance(data, dict) else []:
            try:
                self._items.append(Ended(**raw))
            except TypeError:
                log.warning("dropped an unreadable entry of %s", path)
        for raw in data.get("missed", []) if isinstance(data, dict) else []:
            if (isinstance(raw, list) and len(raw) == 3 and parse_time(raw[0])
                    and isinstance(raw[2], int)):
                self._missed.append((str(raw[0]), str(raw[1]), raw[2]))

    def add(self, view: JobView, *, now: datetime) -> Ended:
        """Remember an ended job (keeping the newest :data:`KEEP` of :data:`KEEP_FOR`)."""
        item = Ended.of(view)
        with self._lock:
            if any(old.job_id == item.job_id for old in self._items):
                return item
            self._items.append(item)
            self._save(now)
        return item

    def add_missed(self, schedule_id: str, count: int, *, now: datetime) -> None:
        """Remember that a schedule missed count windows (the node was not running)."""
        with self._lock:
            self._missed.append((utc_text(now), schedule_id, count))
            self._save(now)

    def missed_since(self, instant: datetime) -> int:
        """Return how many windows were missed since instant."""
        with self._lock:
            return sum(count for at, _, count in self._missed
                       if (parse_time(at) or instant) >= instant)

    def _save(self, now: datetime) -> None:
        """Prune to the newest :data:`KEEP` of :data:`KEEP_FOR` and write; the caller locks."""
        since = now - KEEP_FOR
        self._items = [old for old in self._items[-KEEP:] if old.ended >= since]
        self._missed = [item for item in self._missed[-KEEP:]
                        if (parse_time(item[0]) or now) >= since]
        body = json.dumps({"ended": [asdict(old) for old in self._items],
                           "missed": [list(item) for item in self._missed]},
                          separators=(",", ":")).encode()
        with locked(self.path):
            write_atomic(self.path, body)

    def items(self) -> list[Ended]:
        """Return the ended jobs, oldest first."""
        with self._lock:
            return list(self._items)

    def since(self, instant: datetime, *, actions: Iterable[str] | None = None) -> list[Ended]:
        """Return the jobs that ended at or after instant (of actions, when given)."""
        wanted = None if actions is None else set(actions)
        return [item for item in self.items()
                if item.ended >= instant and (wanted is None or item.action in wanted)]

    def latest_by_schedule(self) -> dict[str, Ended]:
        """Return each schedule's latest ended job that ran or was skipped."""
        found: dict[str, Ended] = {}
        for item in self.items():
            found[item.schedule_id] = item
        return found

    def to_json(self) -> list[dict[str, Any]]:
        """Return the ended jobs as JSON objects (oldest first)."""
        return [asdict(item) for item in self.items()]
