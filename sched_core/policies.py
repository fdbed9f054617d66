"""A row's policies: which of its windows may fire, and when each window's run starts.

Pure: no clock reads, no I/O; every function takes the instants it reasons about.

Rules, shared by the planner, the start guard, the missed-run check and
``sched preview`` (so they can never disagree):

1. **Zone.** A row is read in its own ``timezone`` when it has one, else in
   the node's: its windows, their keys, its blackouts and its messages
   (:func:`row_zone`). Every function here takes the node's zone and applies
   the row's itself.
2. **Windows are judged as they are.** ``paused``, ``not_before``,
   ``not_after`` and ``blackouts`` judge the window (the schedule's instant,
   its identity), read on the row's wall clock after any DST move
   (:func:`window_block`); they do not depend on when anything ran, so a
   window they block is blocked for good and is never recovered.
3. **min_interval** judges a window against the schedule's last fire: both
   read on the row's wall clock, so "7 days" is the same local time a week
   later across a DST change (:func:`interval_block`).
4. **Jitter** moves only when a window's run starts: ``window + offset``, the
   offset in ``[0, jitter)`` derived from the node and the schedule id (the
   same every day, like systemd's ``FixedRandomDelay``), and taken modulo the
   gap to the schedule's next window when it would reach it, so a run never
   starts at or after the next window (:func:`run_start`). Lateness is
   measured from the run's start; the window's identity and key do not move.
5. **catchup_window** replaces the fixed 24 h look-back of the miss policy for
   the row (:func:`catchup`).
6. **overlap** says what a job does about a running job of its schedule
   (:func:`overlap_verdict`; the node's jobs apply it, :mod:`sched_node.jobs` rule 3).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core.matcher import fire_times, zone
from sched_core.misses import LOOKBACK
from sched_core.model import DAY_NAMES, Blackout, LocalSchedule
from sched_core.values import TICK
from sched_core.values import local_text as model_local_text

__all__ = [
    "LOOKBACK",
    "blackout_text",
    "catchup",
    "describe_policies",
    "duration_text",
    "in_blackout",
    "interval_block",
    "jitter_offset",
    "latest_window",
    "local_text",
    "paused_text",
    "policy_block",
    "row_zone",
    "run_start",
    "window_block",
    "window_starts",
]

_SCAN_AHEAD = timedelta(days=8)
"""How far past a span :func:`window_starts` looks for the next window (the matcher's horizon)."""


def row_zone(row: LocalSchedule, default: ZoneInfo) -> ZoneInfo:
    """Return the zone the row is read in: its ``timezone``, else the node's (rule 1)."""
    return zone(row.timezone) if row.timezone else default


def catchup(row: LocalSchedule | None, default: timedelta = LOOKBACK) -> timedelta:
    """Return how far back the row's miss policy looks (rule 5)."""
    if row is None or row.catchup_window is None:
        return default
    return timedelta(seconds=row.catchup_window)


def jitter_offset(node: str, schedule_id: str, jitter: int) -> int:
    """Return the stable offset in seconds, in ``[0, jitter)``, of node's runs of the schedule."""
    if jitter <= 0:
        return 0
    digest = hashlib.sha256(f"{node}\x00{schedule_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % jitter


def _clamped(window: datetime, offset: int, following: datetime | None) -> datetime:
    if following is not None:
        gap = int((following - window).total_seconds())
        if 0 < gap <= offset:
            offset %= gap
    return window + timedelta(seconds=offset)


def window_starts(
    row: LocalSchedule, start: datetime, end: datetime, *, node: str, tz: ZoneInfo
) -> Iterator[tuple[datetime, datetime]]:
    """Yield (window, run start) for the row's windows in ``[start, end)``, in order (rule 4)."""
    z = row_zone(row, tz)
    offset = jitter_offset(node, row.id, row.jitter)
    if offset == 0:
        for window in fire_times(row.schedule, start, end, z):
            yield window, window
        return
    previous: datetime | None = None
    for window in fire_times(row.schedule, start, end + _SCAN_AHEAD, z):
        if previous is not None:
            yield previous, _clamped(previous, offset, window)
        if window >= end:
            return
        previous = window
    if previous is not None:
        yield previous, _clamped(previous, offset, None)


def run_start(row: LocalSchedule, window: datetime, *, node: str, tz: ZoneInfo) -> datetime:
    """Return when the run of the row's window starts: the window plus its jitter (rule 4)."""
    if row.jitter <= 0 or row.schedule.is_event:
        return window
    for found, start in window_starts(row, window, window + TICK,
                                      node=node, tz=tz):
        if found == window:
            return start
    return window + timedelta(seconds=jitter_offset(node, row.id, row.jitter))


def own_clock(row: LocalSchedule) -> bool:
    """Whether the row's windows are not the node zone's minutes: its own zone, or a jitter."""
    return bool(row.timezone) or row.jitter > 0


def local_text(instant: datetime, tz: ZoneInfo) -> str:
    """Return an instant as ``2026-11-30 02:30 EST`` in tz: the model's, without the weekday."""
    return model_local_text(instant, tz, "%Y-%m-%d %H:%M %Z")


def duration_text(delta: timedelta, parts: int = 2) -> str:
    """Return a duration for people: ``7 d``, ``2 d 3 h``, ``1 h 30 min``, ``45 s``.

    At most ``parts`` units, the largest first (``parts=1``: ``2 d``).
    """
    seconds = int(delta.total_seconds())
    sign = "-" if seconds < 0 else ""
    days, rest = divmod(abs(seconds), 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    units = [f"{value} {unit}" for value, unit in ((days, "d"), (hours, "h"), (minutes, "min"),
                                                  (seconds, "s")) if value]
    return sign + " ".join(units[:parts]) if units else "0 s"


def ago_text(instant: datetime | None, now: datetime, parts: int = 2) -> str:
    """Return how long ago instant was (``3 min``, ``2 d 3 h``), ``in 5 min`` when ahead.

    ``-`` when there is no instant. The CLI's tables show it as is; the fleet page
    with one unit and `` ago`` after it.
    """
    if instant is None:
        return "-"
    delta = now - instant
    if delta < timedelta(0):
        return f"in {duration_text(-delta, parts)}"
    return duration_text(delta, parts)


def blackout_text(blackout: Blackout) -> str:
    """Return a blackout for people: ``sat,sun 22:00-06:00 (to the next day)``."""
    days = ",".join(blackout.days)
    across = " (to the next day)" if blackout.end_minute <= blackout.start_minute else ""
    return f"{days} {blackout.start}-{blackout.to}{across}"


def in_blackout(blackout: Blackout, wall: datetime) -> bool:
    """Return whether a local wall time lies in the blackout ``[from, to)``.

    One crossing midnight belongs to the day it starts: ``sat 22:00-06:00``
    covers Saturday from 22:00 and Sunday until 06:00.
    """
    minute = wall.hour * 60 + wall.minute
    start, end = blackout.start_minute, blackout.end_minute
    today = DAY_NAMES[wall.weekday()]
    yesterday = DAY_NAMES[(wall.weekday() - 1) % 7]

    def on(day: str) -> bool:
        return "*" in blackout.days or day in blackout.days

    if start < end:
        return on(today) and start <= minute < end
    return (on(today) and minute >= start) or (on(yesterday) and minute < end)


def paused_text(row: LocalSchedule, tz: ZoneInfo) -> str:
    """Return the row's pause for people: ``paused: disk swap (until 2026-12-01 00:00 EST)``."""
    if row.paused is None:
        return ""
    note = f": {row.paused.note}" if row.paused.note else ""
    until = row.paused.until
    when = "until resumed" if until is None else f"until {local_text(until, row_zone(row, tz))}"
    return f"paused{note} ({when})"


def window_block(row: LocalSchedule, window: datetime, *, tz: ZoneInfo) -> str | None:
    """Return why the row's policies skip the window for good, or None (rule 2).

    ``paused`` (until ``until``, which fires), outside ``not_before`` ..
    ``not_after`` (both included), or in one of ``blackouts``.
    """
    z = row_zone(row, tz)
    if row.paused is not None and (row.paused.until is None or window < row.paused.until):
        return paused_text(row, tz)
    if row.not_before is not None and window < row.not_before:
        return f"before not_before ({local_text(row.not_before, z)})"
    if row.not_after is not None and window > row.not_after:
        return f"after not_after ({local_text(row.not_after, z)})"
    if row.blackouts:
        wall = window.astimezone(z)
        for blackout in row.blackouts:
            if in_blackout(blackout, wall):
                return f"in the blackout {blackout_text(blackout)}"
    return None


def interval_block(
    row: LocalSchedule, window: datetime, *, last_fired: datetime | None, tz: ZoneInfo
) -> str | None:
    """Return why min_interval holds the window back, or None (rule 3)."""
    if not row.min_interval or last_fired is None or window <= last_fired:
        return None  # a window at or before the last fire is the start guard's to refuse
    z = row_zone(row, tz)
    since = window.astimezone(z).replace(tzinfo=None) - last_fired.astimezone(z).replace(
        tzinfo=None
    )
    needed = timedelta(seconds=row.min_interval)
    if since >= needed:
        return None
    return (
        f"min_interval {duration_text(needed)}: the last fire "
        f"({local_text(last_fired, z)}) was {duration_text(since)} before"
    )


def policy_block(
    row: LocalSchedule,
    window: datetime,
    *,
    last_fired: datetime | None,
    tz: ZoneInfo,
    retry: bool = False,
) -> str | None:
    """Return why the row's policies skip the window, or None.

    The re-run of an interrupted job (``retry``) is its window's own second
    try: min_interval does not hold it back.
    """
    reason = window_block(row, window, tz=tz)
    if reason is None and not retry:
        reason = interval_block(row, window, last_fired=last_fired, tz=tz)
    return reason


def latest_window(
    row: LocalSchedule, now: datetime, *, since: datetime, node: str, tz: ZoneInfo
) -> tuple[datetime, datetime] | None:
    """Return the row's latest (window, run start) that started by now, from since on.

    Only windows :func:`window_block` lets fire count: a run coalesced into a
    later window is never coalesced into one that will not run.
    """
    found: tuple[datetime, datetime] | None = None
    for window, start in window_starts(row, since, now + TICK,
                                       node=node, tz=tz):
        if start <= now and window_block(row, window, tz=tz) is None:
            found = (window, start)
    return found


def describe_policies(row: LocalSchedule, *, node: str, tz: ZoneInfo) -> list[str]:
    """Return the row's policies for people, one short phrase each (artifact, preview).

    With a node name the jitter shows that node's offset.
    """
    z = row_zone(row, tz)
    parts: list[str] = []
    if row.timezone:
        parts.append(f"zone {row.timezone}")
    if row.paused is not None:
        parts.append(paused_text(row, tz))
    if row.not_before is not None:
        parts.append(f"not before {local_text(row.not_before, z)}")
    if row.not_after is not None:
        parts.append(f"not after {local_text(row.not_after, z)}")
    for blackout in row.blackouts or []:
        parts.append(f"blackout {blackout_text(blackout)}")
    if row.jitter and node:
        offset = jitter_offset(node, row.id, row.jitter)
        shown = duration_text(timedelta(seconds=offset))
        parts.append(f"jitter {row.jitter} s (this node: +{shown})")
    elif row.jitter:
        parts.append(f"jitter {row.jitter} s (each node its own offset)")
    if row.min_interval:
        parts.append(f"min_interval {duration_text(timedelta(seconds=row.min_interval))}")
    if row.catchup_window is not None:
        parts.append(f"catchup_window {duration_text(timedelta(seconds=row.catchup_window))}")
    if row.overlap is not None:
        parts.append(f"overlap {row.overlap.value}")
    if row.repo_lock:
        parts.append(f"repo_lock {row.repo_id}")
    return parts


@dataclass(frozen=True)
class Peer:
    """Another job of the same schedule, as the overlap rule sees it."""

    job_id: str
    run_name: str
    since: str
    running: bool
    waiting: bool


def overlap_verdict(mode: str, schedule_id: str, peers: list[Peer]) -> tuple[str, str]:
    """Return what a job does about the running jobs of its schedule (rule 6).

    ``("run", "")``, ``("skip", reason)``, ``("wait", reason)`` or
    ``("cancel", reason)`` (cancel the running ones, then wait).
    """
    running = [peer for peer in peers if peer.running]
    if mode == "allow" or not running:
        return "run", ""
    holder = running[0]
    busy = (f"a job of schedule {schedule_id} is still active on this node: run "
            f"{holder.run_name} (since {holder.since})")
    if mode == "skip":
        return "skip", f"{busy}; overlap skip"
    if any(peer.waiting for peer in peers):
        return "skip", f"{busy}, and another run already waits for it; overlap {mode}"
    if mode == "cancel-other":
        return "cancel", f"{busy}; overlap cancel-other: cancelling it"
    return "wait", f"{busy}; overlap buffer-one: waiting for it to end"
