"""What the controller knows of its fleet over a time range, read in one session.

The imperative half of :mod:`controller.morning`: it reads the row versions,
job records, liveness and reports a range needs, then calls the pure
functions. ``GET /api/report``, the fleet page and the controller's alerts
(:mod:`controller.watch`) all go through :func:`fleet_report`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session

from controller import fleet, jobs, morning, nodes, schedules
from controller.fleet import FleetSettings
from sched_core.values import utc_text


def node_grace(report: nodes.StoredReport | None, settings: FleetSettings) -> timedelta:
    """Return the node's grace: its latest report's, else the fleet's default."""
    value = report.report.get("grace_s") if report is not None else None
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 86_400:
        return timedelta(seconds=value)
    return timedelta(seconds=settings.default_grace)


def fleet_report(
    session: Session, *, settings: FleetSettings, now: datetime,
    since: datetime | None = None, until: datetime | None = None, node: str | None = None,
    reports: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the report of ``[since, until)`` (default: until now, since the day before
    until's at 18:00 in each node's zone) for every node (or one): worst first, with the
    fleet's summary. ``reports``: the nodes' latest reports, when the caller read them already
    (``nodes.latest_reports`` of the same node or fleet)."""
    until = until or now
    seen = nodes.latest_seen(session, node)
    if reports is None:  # else the caller's read of them (the fleet watch's, for every node)
        reports = nodes.latest_reports(session, node)
    zones = {}
    earliest = since
    names = set(seen) | set(reports) | set(schedules.schedule_nodes(session, node))
    for name in names:
        zones[name] = fleet.node_zone(reports.get(name), settings)
        start = since or morning.default_since(until, zones[name])
        earliest = start if earliest is None else min(earliest, start)
    if earliest is None:  # no node at all
        earliest = since or now - timedelta(days=1)
    versions = schedules.versions_between(session, earliest, until, node=node)
    records = jobs.jobs_between(session, earliest, until,
                                nodes=None if node is None else [node])
    previous = jobs.last_windows_before(session, earliest,
                                        nodes=None if node is None else [node])
    names |= set(versions) | set(records)
    found = []
    for name in sorted(names):
        tz = zones.get(name) or fleet.node_zone(reports.get(name), settings)
        start = since or morning.default_since(until, tz)
        mine = [r for r in records.get(name, []) if r.filed_at >= start]
        last = seen.get(name)
        cannot_start = fleet.start_error(reports.get(name), last)
        facts = morning.NodeFacts(
            node=name, tz=tz, grace=node_grace(reports.get(name), settings),
            versions=versions.get(name, {}), records=mine, previous=previous.get(name, {}),
            silence=fleet.silence_text(name, last, now=now, settings=settings,
                                       cannot_start=cannot_start),
            cannot_start=cannot_start,
            liveness=fleet.liveness(last, now=now, settings=settings),
            reports_jobs=last is None or last.heartbeat_s is not None or bool(mine),
        )
        found.append(morning.node_windows(facts, since=start, until=until, now=now))
    ordered = morning.worst_first(found)
    total = sum(len(n["windows"]) for n in ordered)
    truncated = total > morning.MAX_WINDOWS
    if truncated:
        budget = morning.MAX_WINDOWS
        for item in ordered:
            item["windows"] = item["windows"][:max(budget, 0)]
            budget -= len(item["windows"])
    return {
        "now": utc_text(now), "since": utc_text(since),
        "until": utc_text(until), "summary": morning.summary(ordered),
        "nodes": ordered, "truncated": truncated,
    }
