"""The reconcile artifact: pure markdown over the kit's and the planner's reports.

Pure: no clock reads, no I/O; times are shown in each row's zone (the node's
unless the row sets ``timezone``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from sched_core import PullResult
from sched_core.matcher import matches
from sched_core.model import LocalSchedule
from sched_core.plan import upcoming
from sched_core.policies import describe_policies, row_zone
from sched_node.planner import PlanReport

NEXT_SHOWN = 3
"""How many next windows the artifact shows per schedule."""


def dst_note(row: LocalSchedule, window: datetime, tz: ZoneInfo) -> str:
    """Return why a window is not where its wall time says (DST), or ""."""
    local = window.astimezone(tz)
    if not matches(row.schedule, window, tz):
        return "moved here by DST (its wall time does not exist that day)"
    if local.fold == 1:
        return "second copy of a repeated hour (DST fall-back)"
    twin = (window + timedelta(hours=1)).astimezone(tz)
    if twin.replace(tzinfo=None) == local.replace(tzinfo=None):
        return "first copy of a repeated hour (DST fall-back)"
    return ""


def local(instant: datetime, tz: ZoneInfo) -> str:
    """Return an instant as the node's local time: ``Wed 2026-12-02 10:30 EST``."""
    return instant.astimezone(tz).strftime("%a %Y-%m-%d %H:%M %Z")


def cell(text: str) -> str:
    """Return text safe inside a markdown table cell (a row's note is anyone's text)."""
    flat = " ".join(text.split())
    for char in "\\|`*_[]<>#":
        flat = flat.replace(char, "\\" + char)
    return flat


def window_cell(window: datetime, start: datetime, tz: ZoneInfo) -> str:
    """Return a window, and its run's start when the row's jitter moves it."""
    if start == window:
        return local(window, tz)
    return f"{local(window, tz)} (starts {start.astimezone(tz):%H:%M:%S})"


def pull_lines(result: PullResult | None, error: str | None, names: dict[str, str]) -> list[str]:
    """Return the pull's part of the artifact: what changed, or why it failed."""
    if result is None:
        return [f"**Pull failed; the last good list is kept and keeps running.** {error}", ""]
    lines = [
        f"{len(names)} schedules; {len(result.added)} added, {len(result.removed)} removed, "
        f"{len(result.changed)} changed, {len(result.rejected)} rejected.",
        "",
    ]
    if result.added or result.removed or result.changed or result.rejected:
        lines += ["| change | schedule | name / reason |", "|---|---|---|"]
        lines += [f"| added | `{rid}` | {names.get(rid, '')} |" for rid in result.added]
        lines += [f"| removed | `{rid}` | |" for rid in result.removed]
        lines += [f"| changed | `{rid}` | {names.get(rid, '')} |" for rid in result.changed]
        lines += [
            f"| rejected{' (last good kept)' if rid in result.kept_last_good else ''} "
            f"| `{rid}` | {reason} |"
            for rid, reason in result.rejected
        ]
        lines.append("")
    return lines


def plan_lines(
    report: PlanReport | None,
    rows: Sequence[LocalSchedule],
    *,
    now: datetime,
    tz: ZoneInfo,
    node: str = "",
    last_fired: Mapping[str, datetime] | None = None,
    plan_error: str | None = None,
) -> list[str]:
    """Return the plan's part: each schedule's next windows and policies, then what it changed."""
    lines = ["#### Plan", "", *_plan_summary(report, plan_error)]
    clock_rows = [row for row in rows if not row.schedule.is_event]
    fired = last_fired or {}
    if clock_rows:
        lines += ["| schedule | name | action | next windows (local) | policies | notes |",
                  "|---|---|---|---|---|---|"]
        lines += [_schedule_line(row, now=now, tz=tz, node=node, last_fired=fired.get(row.id))
                  for row in sorted(clock_rows, key=lambda r: (r.name, r.id))]
        lines.append("")
    if report is None:
        return lines
    return lines + _change_lines(report, tz)


def _plan_summary(report: PlanReport | None, plan_error: str | None) -> list[str]:
    """Return the plan's first line: what it planned, or why Prefect's plan was not updated."""
    if report is None:
        return [f"The plan in Prefect was not updated: {plan_error or 'no server'}. The node "
                "fires its windows all the same; the Upcoming tab catches up at the next "
                "reconcile.", ""]
    return [f"{report.planned} windows planned ({len(report.created)} runs created now), "
            f"{len(report.deleted)} deleted, {len(report.moved)} moved"
            + (f", {report.held_back} held back by plan_max_runs" if report.held_back
               else "") + ".", ""]


def _schedule_line(row: LocalSchedule, *, now: datetime, tz: ZoneInfo, node: str,
                   last_fired: datetime | None) -> str:
    """Return a clock row's line of the table: its next windows, policies and notes."""
    name = cell(row.name)
    policies = "<br>".join(cell(part) for part in describe_policies(row, node=node, tz=tz))
    if not row.enabled:
        return f"| `{row.id}` | {name} | {row.action} | disabled | {policies} | |"
    z = row_zone(row, tz)
    coming = upcoming(row, now=now, last_fired=last_fired, count=NEXT_SHOWN, node=node, tz=tz)
    shown = "<br>".join(window_cell(w.window, w.start, z) for w in coming.windows)
    notes = [f"{local(w.window, z)}: {note}" for w in coming.windows
             if (note := dst_note(row, w.window, z))]
    notes += [f"{local(window, z)} skipped: {why}" for window, why in coming.skipped]
    return (f"| `{row.id}` | {name} | {row.action} | {shown or 'none within 8 days'} "
            f"| {policies} | {'<br>'.join(cell(note) for note in notes)} |")


def _change_lines(report: PlanReport, tz: ZoneInfo) -> list[str]:
    """Return what the plan changed: the runs created, deleted, moved, and failed."""
    lines: list[str] = []
    if report.created:
        lines += ["Created:", ""]
        lines += [f"- `{name}` at {local(start, tz)}" for name, start in report.created[:50]]
        if len(report.created) > 50:
            lines.append(f"- ... and {len(report.created) - 50} more")
        lines.append("")
    if report.deleted:
        lines += ["Deleted (no longer a window of its schedule, or skipped by its policies):", ""]
        lines += [f"- `{key}`: {cell(why)}" for key, why in report.deleted]
        lines.append("")
    if report.moved:
        lines += ["Moved (the schedule's jitter changed):", ""]
        lines += [f"- `{key}`: now starts {local(start, tz)}" for key, start in report.moved]
        lines.append("")
    if report.failed:
        lines += ["**Failed** (tried again at the next reconcile):", ""]
        lines += [f"- `{name}`: {cell(error)}" for name, error in report.failed]
        lines.append("")
    return lines
