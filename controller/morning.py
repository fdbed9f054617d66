"""The operator's morning: every window of a time range, per node, and what became of it.

Pure: no clock reads, no I/O; every function takes ``now`` and the stored facts
(row versions, job records, the node's liveness). ``GET /api/report``, the
fleet page, ``sched report`` and the controller's alerts all read it.

Rules:

1. **The windows a node was to run** are its rows' windows, each judged by the
   version of its row in force at the window's instant
   (:func:`controller.schedules.versions_between`), in the row's zone, else the
   node's (its report's, else the controller's default), with the kit's own
   functions: :func:`sched_core.policies.window_starts` (DST, jitter),
   :func:`sched_core.policies.window_block` (pause, dates, blackouts) and
   :func:`~sched_core.policies.interval_block` (min_interval, counted from the
   previous window that ran or was to run). A window before the row existed on
   the controller is not one; nor is a window whose run starts less than
   :data:`NEW_ROW_S` after the write that gave the row that window (the node
   could not have pulled it). Disabled rows and chain (``on``) rows have none.
2. **Its key** is :func:`sched_core.matcher.window_key` in the row's zone: the
   node's job record of the window carries the same key.
3. **What became of it**: its job record's state when there is one
   (``completed``, ``failed`` for Failed or Crashed, ``cancelled``,
   ``skipped``, ``running``); else, once its run's start (the window plus the
   row's jitter) plus the node's grace plus :data:`REPORT_SLACK_S` has passed,
   **missed: no report from the node**; before that it is ``due``. A node
   that never announced a heartbeat does not report its jobs: its windows
   without a record are ``unreported``, never missed; a node never seen at all
   ran nothing, and its windows are missed.
4. **Other jobs** (chain stages, ad hoc runs, windows no row version has, such
   as a recovery of an older window) are listed as the node reported them,
   not expected.
5. **Worst first**: nodes by their worst window (missed or silent, then failed,
   then the rest), then name; windows in time order.
6. **The summary** (:func:`summary`) judges each schedule by its latest window that
   ended, so a node whose backup failed at 02:30 and completed at 08:00 has backed up
   (its 02:30 failure is listed as recovered), and counts each node once, so the counts
   add up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from controller.jobs import FAILED_STATES, JobRecord
from controller.schedules import RowVersion
from sched_core.matcher import fire_times, window_key
from sched_core.model import LocalSchedule
from sched_core.policies import (
    duration_text,
    interval_block,
    local_text,
    row_zone,
    window_block,
    window_starts,
)
from sched_core.values import TICK, utc_text

REPORT_SLACK_S = 60.0
"""Seconds a node has, past a window's grace, for the report of its job's start to arrive."""
NEW_ROW_S = 60.0
"""A window whose run starts within this long after the write that gave the row that window
is not held against the node: it could not have pulled the row in time."""
MAX_RANGE = timedelta(days=31)
"""The longest time range one report covers."""
MAX_WINDOWS = 200_000
"""The most windows one report lists (``truncated`` says when cut)."""

SEVERITY = {"missed": 5, "failed": 4, "cancelled": 2, "unreported": 1, "running": 1, "due": 1,
            "skipped": 1, "completed": 0}
"""How bad a window's status is (worst first)."""
BAD = frozenset({"missed", "failed"})


def default_since(now: datetime, tz: ZoneInfo) -> datetime:
    """Return yesterday 18:00 in tz, as of now: where the operator's morning starts."""
    yesterday = now.astimezone(tz).date() - timedelta(days=1)
    return datetime.combine(yesterday, time(18, 0), tzinfo=tz).astimezone(now.tzinfo)


def status_of(state: str) -> str:
    """Return the report's status of a job record's state (rule 3)."""
    if state in FAILED_STATES:
        return "failed"
    return {"Completed": "completed", "Cancelled": "cancelled", "Skipped": "skipped",
            "Running": "running"}.get(state, "running")


@dataclass(frozen=True)
class NodeFacts:
    """What the controller knows of one node for a report."""

    node: str
    tz: ZoneInfo
    grace: timedelta
    versions: Mapping[str, Sequence[RowVersion]]
    """Per row id, its versions in force at some instant of the range, oldest first."""
    records: Sequence[JobRecord]
    """The node's job records filed in the range."""
    previous: Mapping[str, datetime]
    """Per row id, the latest window before the range that ran (min_interval's start)."""
    silence: str | None
    """Why the node is silent or never seen, in words; None when it is alive."""
    liveness: Mapping[str, Any]
    """:func:`controller.fleet.liveness` of the node."""
    reports_jobs: bool = True
    """False for a node seen but with no heartbeat announced (rule 3: an older agent)."""
    cannot_start: str | None = None
    """Why the node's agent cannot start, when it said so (:func:`controller.fleet.start_error`)."""


@dataclass(frozen=True)
class Expected:
    """One window a node was to run (rule 1)."""

    row: LocalSchedule
    window: datetime
    start: datetime
    key: str
    zone: ZoneInfo


def _new_window(versions: Sequence[RowVersion], index: int, window: datetime,
                start: datetime, tz: ZoneInfo) -> bool:
    """Return whether the window came with version index less than NEW_ROW_S before its run."""
    version = versions[index]
    if (start - version.valid_from).total_seconds() >= NEW_ROW_S:
        return False
    if index == 0:
        return True
    before = versions[index - 1]
    if before.valid_until is not None and before.valid_until < version.valid_from:
        return True  # deleted, then created again
    row = before.row
    if not row.enabled or row.schedule.is_event:
        return True
    z = row_zone(row, tz)
    had = any(True for _ in fire_times(row.schedule, window, window + TICK, z))
    return not had or window_block(row, window, tz=tz) is not None


def expected_windows(
    versions: Sequence[RowVersion], *, node: str, tz: ZoneInfo, since: datetime,
    until: datetime, previous: datetime | None,
) -> tuple[list[Expected], list[tuple[datetime, str]]]:
    """Return one row's windows in ``[since, until)`` the node was to run (rule 1), and the
    (window, reason) of those its policies held back."""
    found: list[Expected] = []
    held: list[tuple[datetime, str]] = []
    last = previous
    for index, version in enumerate(versions):
        row = version.row
        if not row.enabled or row.schedule.is_event:
            continue
        low = max(since, version.valid_from)
        high = min(until, version.valid_until) if version.valid_until else until
        if low >= high:
            continue
        z = row_zone(row, tz)
        for window, start in window_starts(row, low, high, node=node, tz=tz):
            reason = window_block(row, window, tz=tz) or interval_block(
                row, window, last_fired=last, tz=tz)
            if reason is not None:
                held.append((window, reason))
                continue
            if _new_window(versions, index, window, start, tz):
                continue
            last = window
            found.append(Expected(row, window, start, window_key(row.id, window, z), z))
    return found, held


def _entry(node: str, row: LocalSchedule | None, schedule_id: str, *, key: str,
           window: datetime | None, zone: ZoneInfo, start: datetime | None,
           record: JobRecord | None, status: str, detail: str, expected: bool,
           deadline: datetime | None = None) -> dict[str, Any]:
    at = window or (record.started_at if record else None) or (
        record.filed_at if record else None)
    data: dict[str, Any] = {
        "node": node, "schedule_id": schedule_id,
        "name": row.name if row else None, "action": row.action if row else None,
        "key": key, "window": utc_text(window),
        "local": local_text(at, zone) if at is not None else None,
        "start": utc_text(start), "missed_after": utc_text(deadline),
        "status": status, "detail": detail, "expected": expected,
        "state": None, "trigger_key": None, "started_at": None, "ended_at": None,
        "duration_s": None, "error": None, "reason": None, "offline": False,
        "flow_run_id": None,
        "_sort": at,
    }
    if record is not None:
        job = record.as_json()
        for name in ("state", "trigger_key", "started_at", "ended_at", "duration_s", "error",
                     "reason", "offline", "flow_run_id"):
            data[name] = job[name]
    return data


def record_detail(record: JobRecord) -> str:
    """Return what became of a job, in one line for people."""
    status = status_of(record.state)
    offline = " (ran offline, recorded later)" if record.offline else ""
    if status == "failed":
        return f"{record.state}: {record.error or 'no error given'}{offline}"
    if status == "skipped":
        return f"Skipped: {record.reason or 'no reason given'}"
    if status == "running":
        return f"Running since {utc_text(record.started_at) or '?'}{offline}"
    if status == "cancelled":
        return f"Cancelled{': ' + record.error if record.error else ''}{offline}"
    took = record.duration
    return f"Completed{' in ' + duration_text(took) if took is not None else ''}{offline}"


def node_windows(facts: NodeFacts, *, since: datetime, until: datetime,
                 now: datetime) -> dict[str, Any]:
    """Return one node's report for ``[since, until)`` as of now (rules 1 to 4)."""
    node, tz = facts.node, facts.tz
    upto = now + TICK if until >= now else until  # a window starting now is due
    by_key = {record.key: record for record in facts.records}
    used: set[str] = set()
    entries: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    names: dict[str, LocalSchedule] = {}
    for schedule_id, versions in sorted(facts.versions.items()):
        names[schedule_id] = versions[-1].row
        expected, blocked = expected_windows(
            versions, node=node, tz=tz, since=since, until=upto,
            previous=facts.previous.get(schedule_id))
        if blocked:
            held.append({"schedule_id": schedule_id, "count": len(blocked),
                         "first": utc_text(blocked[0][0]), "reason": blocked[0][1]})
        for item in expected:
            record = by_key.get(item.key)
            deadline = item.start + facts.grace + timedelta(seconds=REPORT_SLACK_S)
            if record is not None:
                used.add(item.key)
                status, detail = status_of(record.state), record_detail(record)
            else:
                status, detail = _unrecorded(item, deadline, facts, now)
            entries.append(_entry(node, item.row, schedule_id, key=item.key, window=item.window,
                                  zone=item.zone, start=item.start, record=record,
                                  status=status, detail=detail, expected=True,
                                  deadline=deadline))
    entries += _other_entries(facts, used, names)
    entries.sort(key=lambda e: (e["_sort"], e["schedule_id"], e["key"]))
    for entry in entries:
        del entry["_sort"]
    counts, worst = _severity(entries, facts.silence)
    return {
        "node": node, "timezone": str(tz.key), "since": utc_text(since),
        "until": utc_text(until), "grace_s": facts.grace.total_seconds(),
        "silent": facts.silence is not None, "silence": facts.silence,
        "cannot_start": facts.cannot_start,
        **{k: facts.liveness.get(k) for k in ("last_seen_at", "heartbeat_s",
                                                "silent_after_s")},
        "counts": counts, "held": held, "severity": worst, "windows": entries,
    }


def _unrecorded(item: Expected, deadline: datetime, facts: NodeFacts,
                now: datetime) -> tuple[str, str]:
    """Return the status and detail of an expected window with no job record (rule 3):
    due before its deadline, then missed (unreported when the node does not report jobs)."""
    if now >= deadline and not facts.reports_jobs:
        return ("unreported", "unreported: the node's agent does not report its jobs (it "
                "announced no heartbeat); see its latest job in sched schedules ls")
    if now >= deadline:
        return "missed", "missed: no report from the node" + (
            f" ({facts.silence})" if facts.silence else "")
    return "due", (f"due: its run starts {local_text(item.start, item.zone)}; missed if "
                   f"nothing is reported by {local_text(deadline, item.zone)}")


def _other_entries(facts: NodeFacts, used: set[str],
                   names: Mapping[str, LocalSchedule]) -> list[dict[str, Any]]:
    """Return the entries of the node's job records no expected window took (rule 4)."""
    entries = []
    for record in facts.records:
        if record.key in used:
            continue
        row = names.get(record.schedule_id)
        zone = row_zone(row, facts.tz) if row is not None else facts.tz
        entries.append(_entry(facts.node, row, record.schedule_id, key=record.key,
                              window=record.window, zone=zone, start=None, record=record,
                              status=status_of(record.state), detail=record_detail(record),
                              expected=False))
    return entries


def _severity(entries: list[dict[str, Any]], silence: str | None) -> tuple[dict[str, int], int]:
    """Return the count of entries per status and the node's worst severity (a silent node's
    is at least missed's)."""
    counts = {status: 0 for status in SEVERITY}
    for entry in entries:
        counts[entry["status"]] += 1
    worst = max((SEVERITY[e["status"]] for e in entries), default=0)
    if silence is not None:
        worst = max(worst, SEVERITY["missed"])
    return counts, worst


JUDGED = frozenset({"completed", "failed", "missed", "cancelled", "skipped"})
"""The statuses that say how a window ended (``due``, ``running`` and ``unreported`` do not)."""
BACKED_UP = ("each schedule's latest window that ended in the range completed (or was "
             "skipped by its own policy)")
"""What the summary's "backed up" means (rule 6); the text says it."""


def _latest(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return each schedule's latest window that ended (its windows are in time order)."""
    latest: dict[str, dict[str, Any]] = {}
    for entry in windows:
        if entry["status"] in JUDGED:
            latest[entry["schedule_id"]] = entry
    return latest


def _group(node: dict[str, Any], schedule_id: str, status: str) -> dict[str, Any]:
    """Return one schedule's windows of a status in the range as one item: how many, since
    when, and the last one's key, time and error."""
    found = [e for e in node["windows"]
             if e["schedule_id"] == schedule_id and e["status"] == status]
    first, last = found[0], found[-1]
    return {"node": node["node"], "schedule_id": schedule_id, "windows": len(found),
            "since": first["window"] or first["started_at"], "since_local": first["local"],
            "key": last["key"], "window": last["window"], "local": last["local"],
            "error": last["error"], "state": last["state"]}


def _group_text(item: dict[str, Any], verb: str) -> str:
    count = item["windows"]
    text = (f"{item['node']} {item['schedule_id']} {verb} {count} "
            f"window{'s' if count != 1 else ''} since {item['since_local'] or item['since']}")
    return text + (f", last: {item['error']}" if item.get("error") else "")


def summary(nodes: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Return the fleet's summary line and its parts (rule 6).

    Each node with a window in the range is counted once, by the first that holds:
    **silent**, **missed** (a schedule's latest window was missed), **failing** (a
    schedule's latest window that ended failed or was cancelled), **backed up** (every
    schedule's latest window that ended completed, or was skipped by its own policy),
    **pending** (no window has ended yet); so the counts add up to the nodes. A schedule
    failing window after window is one item ("node-b bk failed 3 windows since 02:30, last:
    ..."); one whose latest window completed after failures is **recovered**, and does not
    hold its node back.
    """
    nodes = list(nodes)
    # Linear in the nodes: the fleet watch sums up 10,000 nodes every pass.
    windowed = [any(e["expected"] or e["status"] in BAD for e in n["windows"]) or n["silent"]
                for n in nodes]
    with_windows = [n for n, w in zip(nodes, windowed, strict=True) if w]
    found = _classify(with_windows)
    found["no_windows"] = [n["node"] for n, w in zip(nodes, windowed, strict=True) if not w]
    return {"text": _summary_text(found, len(with_windows)), "nodes": len(with_windows),
            "means": BACKED_UP, **found}


def _classify(with_windows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each node in its one category, each schedule's latest trouble as a group."""
    found: dict[str, list[Any]] = {key: [] for key in (
        "backed_up", "failing", "missing", "pending", "failed", "missed", "recovered",
        "unreported")}
    found["silent"] = [n["node"] for n in with_windows if n["silent"]]
    found["cannot_start"] = [{"node": n["node"], "why": n["cannot_start"]}
                             for n in with_windows if n.get("cannot_start")]
    for n in with_windows:
        latest = _latest(n["windows"])
        node_missed = [_group(n, sid, "missed") for sid, e in latest.items()
                       if e["status"] == "missed"]
        node_failed = [_group(n, sid, e["status"]) for sid, e in latest.items()
                       if e["status"] in ("failed", "cancelled")]
        found["recovered"] += [_group(n, sid, "failed") for sid, e in latest.items()
                               if e["status"] in ("completed", "skipped") and any(
                                   w["schedule_id"] == sid and w["status"] == "failed"
                                   for w in n["windows"])]
        found["missed"] += node_missed
        found["failed"] += node_failed
        if n["silent"]:
            continue
        if node_missed:
            found["missing"].append(n["node"])
        elif node_failed:
            found["failing"].append(n["node"])
        elif latest:
            found["backed_up"].append(n["node"])
        elif any(e["status"] == "unreported" for e in n["windows"]):
            found["unreported"].append(n["node"])
        else:
            found["pending"].append(n["node"])
    return found


def _summary_text(found: dict[str, list[Any]], count: int) -> str:
    """The summary line: the categories that hold a node, the first few of each."""
    failed, missed, silent = found["failed"], found["missed"], found["silent"]
    parts = [f"{len(found['backed_up'])} of {count} nodes backed up (each schedule's latest "
             "window completed)"]
    shown = "; ".join(_group_text(item, "failed" if item["state"] != "Cancelled"
                                  else "cancelled") for item in failed[:5])
    more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
    parts.append(f"{len(found['failing'])} failing" + (f": {shown}{more}" if failed else ""))
    missing = set(found["missing"])
    shown_missed = [item for item in missed if item["node"] in missing]
    where = "; ".join(_group_text(item, "missed") for item in shown_missed[:5])
    parts.append(f"{len(missing)} missed" + (
        f": {where}{' ...' if len(shown_missed) > 5 else ''}" if shown_missed else ""))
    if silent:
        notes = {node: ", ".join(f"{item['schedule_id']} missed {item['windows']}"
                                 for item in missed if item["node"] == node)
                 for node in set(silent)}
        for item in found["cannot_start"]:
            notes[item["node"]] = "; ".join(filter(None, [item["why"], notes.get(item["node"])]))
        parts.append(f"{len(silent)} silent: " + ", ".join(
            f"{node} ({notes[node]})" if notes.get(node) else node for node in silent[:10]))
    if found["unreported"]:
        parts.append(f"{len(found['unreported'])} unreported (an agent that reports no jobs): "
                     f"{', '.join(found['unreported'][:10])}")
    if found["pending"]:
        parts.append(f"{len(found['pending'])} with nothing ended yet: "
                     f"{', '.join(found['pending'][:10])}")
    if found["recovered"]:
        parts.append(f"{len(found['recovered'])} recovered: " + "; ".join(
            f"{item['node']} {item['schedule_id']} (failed {item['windows']}, then "
            f"completed)" for item in found["recovered"][:5]))
    if found["no_windows"]:
        parts.append(f"{len(found['no_windows'])} with no window in the range")
    return "; ".join(parts)


def worst_first(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the nodes worst first, then by name (rule 5)."""
    return sorted(nodes, key=lambda n: (-n["severity"], n["node"]))
