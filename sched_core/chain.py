"""The chain: ordered stages (prune, then check) fired after the nightly wave drains.

Rules:
1. Stage 0 fires when a wave job completes and ``wave_complete()`` is true.
2. Stage i+1 fires on any job completion once stage i has fired for the
   current chain day and ``stage[i].active()`` is false. A stage that fired
   nothing does not wait for its (absent) jobs.
3. Each stage fires at most once per chain day. The chain day is the local
   date on which stage 0 fired; later stages are recorded under it, so a prune
   fired at 23:55 that drains at 00:10 still leads to the check.
4. A stage follows its predecessor's latest firing only within 24 hours, and
   the chain only acts on completions it witnesses: a first boot fires nothing
   for a wave that finished before it.
5. The markers live in one JSON file, written atomically under a lock
   (:mod:`sched_core.statefile`; a start removes the temporaries a killed write
   left), so a restart neither re-fires nor skips a stage. A stage some of whose fires
   failed is retried (only the failed schedules) on the next completion of
   any job, a wave job or not, within 24 hours and for the chain day it
   fired for (the wave that let stage 0 fire has usually finished by then,
   and its day's prune and check must not wait for tomorrow's wave); stage 0
   is retried only while the wave is complete, and a new chain day
   supersedes an incomplete one. :meth:`Chain.incomplete` names such stages.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from sched_core.clock import now_or_clock
from sched_core.errors import ConfigError
from sched_core.jsonwire import MAX_DEPTH
from sched_core.matcher import zone
from sched_core.model import LocalSchedule
from sched_core.scheduler import Scheduler
from sched_core.statefile import locked, read_json_file, remove_stale_temporaries, write_atomic
from sched_core.values import format_go_time, parse_go_time

log = logging.getLogger(__name__)

FOLLOW_WINDOW = timedelta(hours=24)
"""How long after its predecessor fired a stage may still follow it."""


@dataclass(frozen=True)
class Stage:
    """One step of the chain and how to tell whether its jobs are still running."""

    name: str
    trigger_key: str
    match: Callable[[LocalSchedule], bool]
    active: Callable[[], bool]


@dataclass
class Spec:
    """The stages in order, how to recognise the wave, and where the markers live."""

    stages: Sequence[Stage]
    is_wave_job: Callable[[str], bool]
    wave_complete: Callable[[], bool]
    marker_path: str | Path
    timezone: ZoneInfo | str | None = None


@dataclass
class Mark:
    """A stage's latest firing: its chain day, when, which schedules, and whether all fired."""

    day: date
    fired_at: datetime
    fired: list[str] = field(default_factory=list)
    complete: bool = True

    def to_json(self) -> dict[str, Any]:
        """Return the marker's JSON object."""
        return {
            "date": self.day.isoformat(),
            "fired_at": format_go_time(self.fired_at),
            "fired": sorted(self.fired),
            "complete": self.complete,
        }

    @classmethod
    def from_json(cls, data: Any) -> Mark:
        """Parse a stage's marker object."""
        fired_at = parse_go_time(data["fired_at"])
        if fired_at is None:
            raise ValueError("fired_at is the zero time")
        return cls(
            day=date.fromisoformat(data["date"]),
            fired_at=fired_at,
            fired=[str(item) for item in data.get("fired", [])],
            complete=bool(data.get("complete", True)),
        )


class Chain:
    """Turns a stream of job completions into ordered, once-a-day stage fires."""

    def __init__(self, scheduler: Scheduler, spec: Spec) -> None:
        if not spec.stages:
            raise ConfigError("Spec.stages is empty")
        names = [stage.name for stage in spec.stages]
        if len(set(names)) != len(names) or not all(names):
            raise ConfigError(f"Spec.stages names must be unique and non-empty, got {names}")
        if not spec.marker_path:
            raise ConfigError("Spec.marker_path is required")
        self._path = Path(spec.marker_path)
        if not self._path.parent.is_dir():
            raise ConfigError(f"Spec.marker_path folder {self._path.parent} does not exist")
        tz = spec.timezone or scheduler.timezone
        if isinstance(tz, str):
            try:
                tz = zone(tz)
            except ValueError as exc:
                raise ConfigError(f"Spec.timezone {tz!r} is unknown") from exc
        self._tz: ZoneInfo = tz
        self._scheduler = scheduler
        self._spec = spec
        with locked(self._path):
            remove_stale_temporaries(self._path)

    def marks(self, *, now: datetime | None = None) -> dict[str, Mark]:
        """Return the stages' markers as stored on disk."""
        return self._load(now_or_clock(now))

    def _load(self, now: datetime) -> dict[str, Mark]:
        data = read_json_file(self._path, now=now, max_depth=MAX_DEPTH)
        stages = data.get("stages", {}) if isinstance(data, dict) else {}
        marks: dict[str, Mark] = {}
        for name, raw in stages.items() if isinstance(stages, dict) else []:
            try:
                marks[name] = Mark.from_json(raw)
            except (KeyError, TypeError, ValueError) as exc:
                log.error(
                    "ignored the unreadable chain marker of stage %s: %s", name, exc,
                    extra={"stage": name, "error": str(exc)},
                )
        return marks

    def _save(self, marks: dict[str, Mark]) -> None:
        body = {"stages": {name: mark.to_json() for name, mark in sorted(marks.items())}}
        write_atomic(self._path, json.dumps(body, indent=1).encode())

    def on_job_complete(self, action: str, *, now: datetime | None = None) -> list[str]:
        """Feed one job completion to the chain; return the names of the stages it fired."""
        now = now_or_clock(now)
        stages = self._spec.stages
        fired_stages: list[str] = []
        with locked(self._path):
            marks = self._load(now)
            today = now.astimezone(self._tz).date()
            first = marks.get(stages[0].name)
            if self._spec.is_wave_job(action) and (first is None or first.day < today):
                # A new chain day (it supersedes an older, incomplete one).
                if self._spec.wave_complete():
                    marks[stages[0].name] = self._fire(stages[0], today, now, None)
                    self._save(marks)
                    fired_stages.append(stages[0].name)
            elif (
                first is not None
                and not first.complete
                and now - first.fired_at <= FOLLOW_WINDOW
                and self._spec.wave_complete()
            ):
                # Retry the failed schedules of stage 0 for its own chain day.
                marks[stages[0].name] = self._fire(stages[0], first.day, now, first)
                self._save(marks)
                fired_stages.append(stages[0].name)
            for before, stage in itertools.pairwise(stages):
                previous = marks.get(before.name)
                if previous is None or not previous.complete:
                    break
                if now - previous.fired_at > FOLLOW_WINDOW:
                    break
                mark = marks.get(stage.name)
                if mark is not None and mark.day >= previous.day and mark.complete:
                    continue
                if previous.fired and before.active():
                    break
                retry = mark if mark is not None and mark.day == previous.day else None
                marks[stage.name] = self._fire(stage, previous.day, now, retry)
                self._save(marks)
                fired_stages.append(stage.name)
        return fired_stages

    def incomplete(self, *, now: datetime | None = None) -> dict[str, Mark]:
        """Return the stages whose latest firing left failed schedules, still to be retried.

        Only markers within the follow window count: an older one is never
        retried (the next day's chain supersedes it).
        """
        now = now_or_clock(now)
        return {
            name: mark for name, mark in self._load(now).items()
            if not mark.complete and now - mark.fired_at <= FOLLOW_WINDOW
        }

    def _fire(self, stage: Stage, day: date, now: datetime, retry: Mark | None) -> Mark:
        """Fire a stage's schedules for a chain day and return its new marker."""
        done = frozenset(retry.fired) if retry else frozenset()
        fired, failed = self._scheduler.fire_matching_report(
            stage.trigger_key,
            stage.match,
            now=now,
            key=f"{stage.name}@{day.isoformat()}",
            skip_ids=done,
        )
        log.info(
            "chain stage %s fired for %s: %d fired, %d failed",
            stage.name, day.isoformat(), len(fired), len(failed),
            extra={
                "stage": stage.name,
                "chain_day": day.isoformat(),
                "fired": len(fired),
                "failed": len(failed),
            },
        )
        return Mark(
            day=day,
            fired_at=retry.fired_at if retry else now,
            fired=sorted(done | {fire.schedule.id for fire in fired}),
            complete=not failed,
        )
