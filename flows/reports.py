"""The reconcile artifact: pure markdown over the kit's and the planner's reports.

Pure: no clock reads, no I/O; times are shown in each row's zone (the node's
unless the row sets ``timezone``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from flows.planner import PlanReport
from sched_core import PullResult
from sched_core.matcher import matches
from sched_core.model import LocalSchedule
from sched_core.plan import upcoming
from sched_core.policies import describe_policies, row_zone

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
    report: PlanReport,
    rows: Sequence[LocalSchedule],
    *,
    now: datetime,
    tz: ZoneInfo,
    node: str = "",
    last_fired: Mapping[str, datetime] | None = None,
) -> list[str]:
    """Return the plan's part: each schedule's next windows and policies, then what it did."""
    lines = ["#### Plan", "",
             f"{report.planned} windows planned ({len(report.created)} runs created now, "
             f"{report.existing} already there), {len(report.deleted)} deleted"
             + (f", {report.held_back} held back by plan_max_runs" if report.held_back else "")
             + ".", ""]
    clock_rows = [row for row in rows if not row.schedule.is_event]
    fired = last_fired or {}
    if clock_rows:
        lines += ["| schedule | name | action | next windows (local) | policies | notes |",
                  "|---|---|---|---|---|---|"]
        for row in sorted(clock_rows, key=lambda r: (r.name, r.id)):
            name = cell(row.name)
            policies = "<br>".join(cell(part) for part in describe_policies(row, node=node, tz=tz))
            if not row.enabled:
                lines.append(f"| `{row.id}` | {name} | {row.action} | disabled | {policies} | |")
                continue
            z = row_zone(row, tz)
            coming = upcoming(row, now=now, last_fired=fired.get(row.id), count=NEXT_SHOWN,
                              node=node, tz=tz)
            shown = "<br>".join(window_cell(w.window, w.start, z) for w in coming.windows)
            notes = [f"{local(w.window, z)}: {note}" for w in coming.windows
                     if (note := dst_note(row, w.window, z))]
            notes += [f"{local(window, z)} skipped: {why}" for window, why in coming.skipped]
            lines.append(
                f"| `{row.id}` | {name} | {row.action} | {shown or 'none within 8 days'} "
                f"| {policies} | {'<br>'.join(cell(note) for note in notes)} |"
            )
        lines.append("")
    if report.created:
        lines += ["Created:", ""]
        lines += [f"- `{ref.name}` at {local(start, tz)}" for ref, start, _ in report.created[:50]]
        if len(report.created) > 50:
            lines.append(f"- ... and {len(report.created) - 50} more")
        lines.append("")
    if report.deleted:
        lines += ["Deleted (no longer a window of its schedule, or skipped by its policies):", ""]
        lines += [f"- `{run.schedule_id}` {local(run.window, tz)}: {cell(why)}"
                  for run, why in report.deleted]
        lines.append("")
    if report.moved:
        lines += ["Moved (the schedule's jitter changed):", ""]
        lines += [f"- `{run.schedule_id}` {local(run.window, tz)}: now starts "
                  f"{start.astimezone(tz):%H:%M:%S}" for run, start in report.moved]
        lines.append("")
    if report.skipped:
        lines += ["Late runs ended Skipped (their start guard's answer, given without starting "
                  "them):", ""]
        lines += [f"- `{run.schedule_id}` {local(run.window, tz)}: {cell(why)}"
                  for run, why in report.skipped[:50]]
        if len(report.skipped) > 50:
            lines.append(f"- ... and {len(report.skipped) - 50} more")
        lines.append("")
    if report.missed:
        lines += ["**Missed** (windows that never had a run: the node or Prefect was down "
                  "for longer than the plan horizon):", ""]
        for item in report.missed:
            shown = ", ".join(local(w, tz) for w in item.windows)
            hidden = item.count - len(item.windows)
            more = f" and {hidden} more" if hidden else ""
            fate = (f"recovered {local(item.recover.window, tz)}" if item.recover else
                    "not recovered (miss policy)")
            if item.truncated:
                fate += f", {item.truncated} older dropped (run-all)"
            lines.append(f"- `{item.schedule_id}`: {item.count} missed ({shown}{more}); {fate}")
        lines.append("")
    if report.recovered:
        lines += [f"- recovery run `{ref.name}`" for ref, _ in report.recovered] + [""]
    if report.retried:
        lines += ["Interrupted jobs run again:", ""]
        lines += [f"- `{ref.name}` (re-run of `{ref.retry_of}`)" for ref, _ in report.retried]
        lines.append("")
    if report.not_retried:
        lines += ["Interrupted jobs not run again:", ""]
        lines += [f"- `{item.run_name}`: {why}" for item, why in report.not_retried]
        lines.append("")
    if report.failed:
        lines += ["**Failed** (retried at the next reconcile):", ""]
        lines += [f"- `{name}`: {error}" for name, error in report.failed]
        lines.append("")
    return lines
