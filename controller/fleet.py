"""The fleet as an operator sees it: node status rows, schedules in words, next windows.

Pure: no clock reads, no I/O; every function takes ``now`` and the stored
facts (:mod:`controller.nodes`' reports and pulls, the rows). The API
(:mod:`controller.api.fleet`) reads those, calls these, and answers.

Rules:

1. A node's zone is the one its latest report names, else the controller's
   default (America/New_York); a row with its own ``timezone`` is read in
   that (:func:`sched_core.policies.row_zone`). Windows are the kit's: the
   planner's rules (:func:`sched_core.plan.upcoming`: policies, jitter,
   min_interval from the last fire the node reported) and its DST notes
   (:func:`sched_core.explain.dst_note`).
2. Liveness comes only from the node's own requests (a pull or a report made with its
   own token; an admin's read of its list never counts). A node is **silent** when its
   latest own request is older than :data:`SILENT_HEARTBEATS` times the heartbeat it
   announced (``heartbeat_s`` in its report); a node that announced none gets the longer
   of 3 x 300 s and ``stale_after`` (3 pull intervals). It is **never-seen** when it never
   made one, and **failing** when the latest job that ended of one of its current schedules failed,
   crashed or timed out (its latest job record, else, while that one runs, its report's
   latest job): a job's start changes no status. Its ``status`` is the first that holds
   of cannot-start (its agent said so since its last own request, :func:`start_error`),
   never-seen, silent, failing, else ok: a node silent for that long may be failing too,
   but that is old news. (``stale`` in the answers means silent.)
3. A write's ``_propagation`` says when the row's next window is and whether the node is
   likely to have the row by then: it must have pulled the row by the end of the
   window's minute (a node never fires a window earlier than the minute it first saw the
   row). With its long poll here answered by the write, or the event accepted by Prefect,
   the node pulls within :data:`EVENT_PULL_S`; else at its next periodic pull. A node
   silent or never seen is not counted on, and the answer says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from controller.events import Announced
from controller.jobs import JobKeep, JobRecord
from controller.models import DEFAULT_TIMEZONE
from controller.nodes import Pull, Seen, StoredReport
from controller.report_in import DEFAULT_HEARTBEAT_S, FAILING_STATES
from sched_core.clock import floor_minute
from sched_core.errors import ConfigError
from sched_core.explain import dst_note, schedule_words
from sched_core.matcher import zone
from sched_core.model import LocalSchedule
from sched_core.plan import upcoming
from sched_core.policies import (
    duration_text,
    interval_block,
    jitter_offset,
    paused_text,
    row_zone,
    window_block,
    window_starts,
)
from sched_core.values import local_text, parse_go_time, utc_text

DEFAULT_PULL_INTERVAL = 900.0
"""Seconds between a node's periodic pulls unless told otherwise: the agents' default
``reconcile_interval``."""
STALE_PULLS = 3
"""A node is stale after this many pull intervals without a pull."""
EVENT_PULL_S = 10.0
"""How soon a node pulls after the controller's event reached Prefect (the benchmark's
p95 target, ``bench/bench_propagation.py``)."""
SILENT_HEARTBEATS = 3
"""A node is silent after this many of its announced heartbeats without a request."""
NEXT_WINDOWS = 10
"""How many next windows a node's status shows per schedule."""
NEXT_WINDOWS_AHEAD = timedelta(days=400)
"""How far a node's status looks for them (a weekly row's 10 windows are 10 weeks out)."""


@dataclass(frozen=True)
class FleetSettings:
    """The controller's view of its nodes.

    :param pull_interval: seconds between a node's periodic pulls (the agents'
        ``reconcile_interval``, 900 s by default).
    :param stale_after: seconds without a pull before a node is stale
        (default: 3 pull intervals).
    :param report_history: reports kept per node (the newest).
    :param default_timezone: the zone of a node that never reported its own.
    :param default_grace: the grace (seconds) of a node that never reported its own.
    :param job_retention_days: job records are kept this long after they arrive.
    :param job_history: job records kept per node at most (the newest).
    """

    pull_interval: float = DEFAULT_PULL_INTERVAL
    stale_after: float | None = None
    report_history: int = 50
    default_timezone: str = DEFAULT_TIMEZONE
    default_grace: float = 300.0
    job_retention_days: float = 14.0
    job_history: int = 50_000

    def __post_init__(self) -> None:
        if not self.pull_interval > 0:
            raise ConfigError(f"pull_interval {self.pull_interval!r} must be above 0 seconds")
        if self.stale_after is not None and not self.stale_after > 0:
            raise ConfigError(f"stale_after {self.stale_after!r} must be above 0 seconds")
        if self.report_history < 1:
            raise ConfigError(f"report_history {self.report_history!r} must be at least 1")
        try:
            zone(self.default_timezone)
        except ValueError as exc:
            raise ConfigError(f"default_timezone: {exc}") from None
        if not 0 <= self.default_grace <= 86_400:
            raise ConfigError(f"default_grace {self.default_grace!r} must be 0 to 86400 seconds")
        if not self.job_retention_days > 0:
            raise ConfigError(
                f"job_retention_days {self.job_retention_days!r} must be above 0 days")
        if self.job_history < 1:
            raise ConfigError(f"job_history {self.job_history!r} must be at least 1")

    @property
    def job_keep(self) -> JobKeep:
        """How many job records are kept (:class:`controller.jobs.JobKeep`)."""
        return JobKeep(days=self.job_retention_days, count=self.job_history)

    @property
    def stale_after_s(self) -> float:
        """Seconds without a pull after which a node is stale."""
        if self.stale_after is not None:
            return self.stale_after
        return STALE_PULLS * self.pull_interval


def node_zone(report: StoredReport | None, settings: FleetSettings) -> ZoneInfo:
    """Return the node's zone: its latest report's, else the controller's default (rule 1)."""
    name = report.report.get("timezone") if report is not None else None
    if isinstance(name, str) and name:
        try:
            return zone(name)
        except ValueError:
            pass  # validated when stored; a zone this machine lost falls back
    return zone(settings.default_timezone)


def _reported(report: StoredReport | None) -> dict[str, dict[str, Any]]:
    """Return the report's schedules by id."""
    if report is None:
        return {}
    return {item["id"]: item for item in report.report.get("schedules") or []
            if isinstance(item, dict) and isinstance(item.get("id"), str)}


def _time(value: object) -> datetime | None:
    try:
        return parse_go_time(value) if isinstance(value, str) else None
    except ValueError:
        return None


def silent_after_s(seen: Seen | None, settings: FleetSettings) -> float:
    """Return how long node may go without a request of its own before it is silent (rule 2)."""
    if seen is not None and seen.heartbeat_s:
        return SILENT_HEARTBEATS * seen.heartbeat_s
    return max(SILENT_HEARTBEATS * DEFAULT_HEARTBEAT_S, settings.stale_after_s)


def liveness(seen: Seen | None, *, now: datetime, settings: FleetSettings) -> dict[str, Any]:
    """Return a node's liveness (rule 2): its last own request, its heartbeat, silent or not."""
    after = silent_after_s(seen, settings)
    silent_for = None if seen is None else (now - seen.at).total_seconds()
    return {
        "last_seen_at": utc_text(seen.at) if seen else None,
        "last_seen_via": seen.via if seen else None,
        "heartbeat_s": seen.heartbeat_s if seen else None,
        "silent_after_s": after,
        "silent": silent_for is not None and silent_for > after,
        "quiet_for_s": silent_for,
    }


def start_error(report: StoredReport | None, seen: Seen | None) -> str | None:
    """Return why node's agent cannot start (its last word since its last sign of life),
    in words; None when it said nothing of the kind."""
    data = report.report if report is not None else {}
    error, at = data.get("start_error"), data.get("start_error_at")
    try:
        when = parse_go_time(at)
    except ValueError:
        return None
    if not isinstance(error, str) or when is None or (seen is not None and when < seen.at):
        return None
    return f"its agent cannot start on its settings (at {utc_text(when)}): {error}"


def silence_text(node: str, seen: Seen | None, *, now: datetime,
                 settings: FleetSettings, cannot_start: str | None = None) -> str | None:
    """Return why node is silent or never seen, in words (None when it is alive); a node
    whose agent cannot start (``cannot_start``, :func:`start_error`) is silent at once."""
    if cannot_start is not None:
        return f"node {node}: {cannot_start}"
    if seen is None:
        return f"node {node} has never made a request to this controller with its own token"
    quiet = now - seen.at
    after = silent_after_s(seen, settings)
    if quiet.total_seconds() <= after:
        return None
    promise = (f"it promised one every {duration_text(timedelta(seconds=seen.heartbeat_s))}"
               if seen.heartbeat_s else
               f"it announced no heartbeat: silent after {duration_text(timedelta(seconds=after))}")
    return (f"node {node} is silent: no request of its own for {duration_text(quiet)} "
            f"(last {seen.via} {utc_text(seen.at)}; {promise})")


def failing_ids(report: StoredReport | None, records: Mapping[str, JobRecord] | None,
                current: set[str] | None) -> list[str]:
    """Return the current schedules whose latest job that ended failed: its latest job
    record's state, else (no record, or one still Running) the report's latest job, which is
    the latest that ended (rule 2). A job that starts changes nothing: a schedule failing on
    every retry stays failing, and the status changes only when a job ends."""
    records = records or {}
    ended = {sid: record for sid, record in records.items() if record.state != "Running"}
    found = {sid for sid, record in ended.items() if record.state in FAILING_STATES}
    for sid, item in _reported(report).items():
        job = item.get("latest_job")
        if sid not in ended and isinstance(job, dict) and job.get("state") in FAILING_STATES:
            found.add(sid)
    return sorted(sid for sid in found if current is None or sid in current)


def node_row(
    node: str,
    *,
    schedules: int,
    schedule_ids: Iterable[str] | None,
    pull: Pull | None,
    report: StoredReport | None,
    version: str | None,
    now: datetime,
    settings: FleetSettings,
    seen: Seen | None = None,
    records: Mapping[str, JobRecord] | None = None,
) -> dict[str, Any]:
    """Return a node's status row (the contract's point 3), per rule 2.

    ``schedule_ids`` are the node's current rows: a failed job of a schedule
    since deleted does not make the node failing (None: count every one).
    ``seen`` is its latest own request, ``records`` its latest job record per schedule.
    """
    current = None if schedule_ids is None else set(schedule_ids)
    failing = failing_ids(report, records, current)
    alive = liveness(seen, now=now, settings=settings)
    cannot_start = start_error(report, seen)
    if cannot_start is not None:
        status = "cannot-start"
    elif seen is None:
        status = "never-seen"
    elif alive["silent"]:
        status = "silent"
    elif failing:
        status = "failing"
    else:
        status = "ok"
    data = report.report if report is not None else {}
    return {
        "node": node,
        "schedules": schedules,
        "last_pull_at": utc_text(pull.at) if pull else None,
        "last_pull_status": pull.status if pull else None,
        "list_version_served": pull.list_version if pull else None,
        "list_version_current": version,
        "last_report_at": utc_text(report.received_at) if report else None,
        "timezone": data.get("timezone"),
        "agent_version": data.get("agent_version"),
        **alive,
        "stale": alive["silent"],
        "failing": bool(failing),
        "failing_schedules": failing,
        "status": status,
        "start_error": cannot_start,
    }


def window_entry(
    row: LocalSchedule, window: datetime, start: datetime, *, node: str, tz: ZoneInfo
) -> dict[str, Any]:
    """Return one window for people: its UTC instant, local time in the row's zone, notes."""
    z = row_zone(row, tz)
    notes = [dst_note(row.schedule, window, z)]
    if start != window:
        offset = duration_text(timedelta(seconds=jitter_offset(node, row.id, row.jitter)))
        notes.append(f"starts {start.astimezone(z):%H:%M:%S} on {node} (jitter +{offset})")
    return {"at": utc_text(window), "local": local_text(window, z),
            "note": "; ".join(note for note in notes if note)}


def next_windows(
    row: LocalSchedule, *, node: str, tz: ZoneInfo, now: datetime,
    last_fired: datetime | None, count: int = NEXT_WINDOWS,
) -> list[dict[str, Any]]:
    """Return the row's next count windows that will run on node (rule 1), for people."""
    found = upcoming(row, now=now, last_fired=last_fired, count=count, node=node, tz=tz,
                     ahead=NEXT_WINDOWS_AHEAD)
    return [window_entry(row, item.window, item.start, node=node, tz=tz)
            for item in found.windows]


def schedule_view(
    row: LocalSchedule,
    *,
    node: str,
    tz: ZoneInfo,
    reported: Mapping[str, Any] | None,
    recent: list[dict[str, Any]],
    now: datetime,
    record: JobRecord | None = None,
) -> dict[str, Any]:
    """Return one schedule of a node's status (the contract's point 4).

    ``last_run`` is one run, its window and its outcome together: the newest
    job record, else the report's latest job (``last_fire`` may be another
    window than ``last_outcome``'s: an ad hoc run has none).
    """
    reported = reported or {}
    last_fire = _time(reported.get("last_fired"))
    latest = reported.get("latest_job")
    return {
        "id": row.id,
        "name": row.name,
        "action": row.action,
        "enabled": row.enabled,
        "paused": row.paused.model_dump(mode="json") if row.paused is not None else None,
        "when": schedule_words(row.schedule),
        "timezone": row.timezone or None,
        "miss_policy": row.miss_policy.value,
        "last_fire": utc_text(last_fire),
        "last_outcome": latest if isinstance(latest, dict) else None,
        "last_run": last_run(record, latest),
        "recent_outcomes": recent,
        "next_windows": next_windows(row, node=node, tz=tz, now=now, last_fired=last_fire),
    }


def last_run(record: JobRecord | None, latest: object) -> dict[str, Any] | None:
    """Return a schedule's last run, its window and outcome from one run (see schedule_view)."""
    if record is not None:
        return {**record.as_json(), "source": "job record"}
    if not isinstance(latest, dict):
        return None
    return {"key": None, "schedule_id": None, "window": latest.get("window"),
            "trigger_key": None, "state": latest.get("state"), "started_at": None,
            "ended_at": latest.get("ended_at"), "duration_s": None, "error": None,
            "reason": None, "offline": False, "flow_run_id": latest.get("flow_run_id"),
            "flow_run_name": latest.get("flow_run_name"), "source": "report"}


def recent_outcomes(
    history: Iterable[StoredReport], schedule_id: str, *, limit: int = 10
) -> list[dict[str, Any]]:
    """Return the schedule's distinct latest jobs found in a node's reports, newest first."""
    seen: set[object] = set()
    found: list[dict[str, Any]] = []
    for stored in history:
        job = _reported(stored).get(schedule_id, {}).get("latest_job")
        if not isinstance(job, dict):
            continue
        key = job.get("flow_run_id") or (job.get("window"), job.get("ended_at"))
        if key in seen:
            continue
        seen.add(key)
        found.append(job)
        if len(found) >= limit:
            break
    return found


def last_fires(report: StoredReport | None) -> dict[str, datetime]:
    """Return the last fire the node reported for each schedule."""
    fires = {}
    for schedule_id, item in _reported(report).items():
        at = _time(item.get("last_fired"))
        if at is not None:
            fires[schedule_id] = at
    return fires


def upcoming_windows(
    rows: Iterable[LocalSchedule],
    *,
    node: str,
    tz: ZoneInfo,
    now: datetime,
    until: datetime,
    last_fired: Mapping[str, datetime],
) -> list[dict[str, Any]]:
    """Return node's windows whose runs start in ``[now, until)``, for the fleet's upcoming list.

    Windows a pause holds back are listed with ``paused`` true; those the
    row's dates, blackouts or min_interval skip are left out, as are
    disabled and event rows.
    """
    found: list[dict[str, Any]] = []
    for row in rows:
        if not row.enabled or row.schedule.is_event:
            continue
        z = row_zone(row, tz)
        previous = last_fired.get(row.id)
        scan = now - timedelta(seconds=row.jitter)
        for window, start in window_starts(row, scan, until, node=node, tz=tz):
            if start < now or start >= until:
                continue
            blocked = window_block(row, window, tz=tz)
            paused = blocked is not None and blocked == paused_text(row, tz)
            if blocked is not None and not paused:
                continue
            if not paused and interval_block(row, window, last_fired=previous, tz=tz):
                continue
            entry = window_entry(row, window, start, node=node, tz=tz)
            if paused:
                entry["note"] = "; ".join(n for n in (entry["note"], blocked) if n)
            else:
                previous = window
            found.append({
                "node": node, "schedule_id": row.id, "name": row.name, "action": row.action,
                "at": entry["at"], "local": entry["local"], "timezone": str(z.key),
                "note": entry["note"], "paused": paused,
                "_sort": (start, node, row.id),
            })
    return found


def sort_windows(windows: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], bool]:
    """Return the windows in time order (then node, schedule), at most limit; and if cut."""
    windows.sort(key=lambda item: item["_sort"])
    for item in windows:
        del item["_sort"]
    return windows[:limit], len(windows) > limit


def propagation(
    row: LocalSchedule,
    *,
    node: str,
    tz: ZoneInfo,
    now: datetime,
    pull: Pull | None,
    announced: Announced,
    settings: FleetSettings,
    last_fired: datetime | None = None,
    seen: Seen | None = None,
    woken: bool = False,
) -> dict[str, Any]:
    """Return a write's ``_propagation`` (the contract's point 6), per rule 3.

    ``seen`` is the node's latest own request: a node silent or never seen is not counted
    on, and the answer names the silence. ``woken``: the write answered the node's long poll.
    """
    found = upcoming(row, now=now, last_fired=last_fired, count=1, node=node, tz=tz,
                     ahead=NEXT_WINDOWS_AHEAD).windows
    window = found[0].window if found else None
    z = row_zone(row, tz)
    answer: dict[str, Any] = {
        "next_window": utc_text(window),
        "next_window_local": local_text(window, z) if window is not None else None,
        "event_sent": announced.sent,
    }
    silence = silence_text(node, seen, now=now, settings=settings)
    answer["node_silent"] = silence is not None
    said = announced.reason
    if window is None:
        if not row.enabled:
            why = "disabled"
        elif row.schedule.is_event:
            why = "fired by the chain, never on the clock"
        elif row.paused is not None and row.paused.until is None:
            why = f"paused until resumed ({row.paused.note or 'no note'})"
        else:
            why = "without a window in the next 400 days (its policies or dates)"
        return {**answer, "likely_in_time": True,
                "reason": f"the row is {why}: nothing to be late for; {said}"}
    deadline = floor_minute(window) + timedelta(minutes=1)
    left = duration_text(window - now)
    if silence is not None:
        back = "" if seen is None else "; it gets the change when it is back"
        return {**answer, "likely_in_time": False,
                "reason": f"{silence}{back}; {said}"}
    if woken or announced.sent:
        expected = now + timedelta(seconds=EVENT_PULL_S)
        soon = f"node {node} pulls within about {EVENT_PULL_S:g} s"
        how = (f"node {node}'s long poll on this controller was answered: {soon}; {said}"
               if woken else f"{said}: {soon}")
    else:
        last = pull.at if pull is not None else seen.at if seen is not None else now
        expected = max(now, last + timedelta(seconds=settings.pull_interval))
        how = (f"{said}; node {node} pulls every {settings.pull_interval:g} s, next by about "
               f"{utc_text(expected)}")
    likely = expected < deadline
    verdict = "before" if likely else "probably after"
    return {**answer, "likely_in_time": likely,
            "reason": f"{how}, {verdict} the next window ({local_text(window, z)}, in {left})"}
