"""The fleet page's HTML: pure rendering of the fleet's status into one self-contained page.

Pure: no clock reads, no I/O; ``now`` is an argument. The page loads nothing
from anywhere (inline CSS, inline SVG, no script), so it works offline. Every
value comes from rows and reports that anyone with a token wrote: each is
escaped where it lands (``html.escape``), and a link to Prefect is built only
from a flow run id that is a UUID.

The data are the API's shapes (FLEET-CONTRACT.md): the rows of ``GET
/api/status``, each node's ``schedules`` from ``GET /api/nodes/{node}/status``,
and the windows of ``GET /api/upcoming``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from html import escape
from typing import Any
from zoneinfo import ZoneInfo

from sched_core.values import local_text, zone_or_utc
from sched_core.values import parse_api_time as _time

PAST = timedelta(hours=6)
"""How far back the timeline shows the latest runs."""
AHEAD = timedelta(hours=24)
"""How far ahead the timeline shows windows."""
FAILED_STATES = frozenset({"Failed", "Crashed", "TimedOut"})


@dataclass(frozen=True)
class FleetView:
    """What the page shows."""

    now: datetime
    nodes: list[dict[str, Any]]
    """``GET /api/status`` rows."""
    schedules: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Per node, its ``GET /api/nodes/{node}/status`` schedules."""
    windows: list[dict[str, Any]] = field(default_factory=list)
    """``GET /api/upcoming`` windows for the next 24 hours."""
    prefect_ui: str | None = None
    """The Prefect UI's base URL (``http://host:4200``), for links to runs."""
    notice: str = ""
    """A line about what the page cannot show (e.g. no reports yet)."""
    report: dict[str, Any] | None = None
    """``GET /api/report`` for the default range: every window since yesterday 18:00."""

SHORT = "%a %m-%d %H:%M %Z"
"""How the page writes a local time (the year is the reader's)."""


def _e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)








def _ago(instant: datetime | None, now: datetime) -> str:
    if instant is None:
        return "-"
    seconds = int((now - instant).total_seconds())
    if seconds < 0:
        return "in the future"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def run_link(prefect_ui: str | None, job: object, text: str) -> str:
    """Return text linked to the job's run in the Prefect UI (escaped; plain if no valid id)."""
    if not prefect_ui or not isinstance(job, dict):
        return _e(text)
    try:
        run_id = uuid.UUID(str(job.get("flow_run_id")))
    except ValueError:
        return _e(text)
    return f'<a href="{_e(prefect_ui)}/runs/flow-run/{run_id}">{_e(text)}</a>'


def _outcome(job: object) -> tuple[str, str]:
    """Return (state, css class) of a latest-job object."""
    if not isinstance(job, dict):
        return "", ""
    state = str(job.get("state") or "unknown")
    return state, "bad" if state in FAILED_STATES else "good" if state == "Completed" else ""


# ---------------------------------------------------------------- the timeline


def offset_changes(tz: ZoneInfo, start: datetime, end: datetime) -> list[tuple[datetime, str]]:
    """Return each instant in [start, end) where tz's UTC offset changes, and the change."""
    changes = []
    step = timedelta(minutes=15)
    at = start
    before = at.astimezone(tz).utcoffset()
    while at < end:
        after = (at + step).astimezone(tz).utcoffset()
        if after != before and before is not None and after is not None:
            low, high = at, at + step
            while high - low > timedelta(minutes=1):
                mid = low + (high - low) / 2
                if mid.astimezone(tz).utcoffset() == before:
                    low = mid
                else:
                    high = mid
            shift = int((after - before).total_seconds() // 60)
            sign = "+" if shift > 0 else "-"
            hours, minutes = divmod(abs(shift), 60)
            text = f"{sign}{hours}h" + (f"{minutes:02d}" if minutes else "")
            name = f"{high.astimezone(tz):%Z}"
            changes.append((high, f"clocks {text} ({name} from {high.astimezone(tz):%H:%M})"))
            before = after
        at += step
    return changes


def timeline_svg(view: FleetView) -> str:
    """Return the inline SVG: one lane per node, -6 h .. +24 h, windows, runs and DST shifts."""
    now = view.now.astimezone(UTC)
    start, end = now - PAST, now + AHEAD
    label_w, width, lane_h, top = 150, 1100, 34, 28
    nodes = [str(n.get("node")) for n in view.nodes]
    height = top + lane_h * max(len(nodes), 1) + 10
    span = (end - start).total_seconds()

    def x(instant: datetime) -> float:
        return label_w + (width - label_w - 10) * (instant - start).total_seconds() / span

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline" role="img" '
             f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             f'aria-label="The next 24 hours of the fleet, one lane per node">']
    tick = start.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    while tick < end:
        if tick.hour % 3 == 0:
            parts.append(f'<line class="grid" x1="{x(tick):.1f}" y1="{top - 6}" '
                         f'x2="{x(tick):.1f}" y2="{height - 8}"/>')
            parts.append(f'<text class="tick" x="{x(tick):.1f}" y="{top - 10}" '
                         f'text-anchor="middle">{tick:%H:%M}Z</text>')
        tick += timedelta(hours=1)
    parts.append(f'<line class="now" x1="{x(now):.1f}" y1="{top - 6}" x2="{x(now):.1f}" '
                 f'y2="{height - 8}"><title>now {now:%Y-%m-%d %H:%M}Z</title></line>')
    lane_of = {name: i for i, name in enumerate(nodes)}
    zones = {str(n.get("node")): zone_or_utc(n.get("timezone")) for n in view.nodes}
    for index, node in enumerate(view.nodes):
        name = str(node.get("node"))
        y = top + lane_h * index + lane_h / 2
        failing = node.get("status") == "failing"
        parts.append(f'<line class="lane" x1="{label_w}" y1="{y}" x2="{width - 10}" y2="{y}"/>')
        parts.append(f'<text class="lane-label{" bad" if failing else ""}" x="6" y="{y + 4}">'
                     f'{_e(name[:20])}</text>')
        for at, text in offset_changes(zones[name], start, end):
            parts.append(f'<g class="dst"><line x1="{x(at):.1f}" y1="{y - 14}" x2="{x(at):.1f}" '
                         f'y2="{y + 14}"/><text x="{x(at) + 3:.1f}" y="{y - 6}">DST</text>'
                         f'<title>{_e(name)}: {_e(text)}</title></g>')
        for schedule in view.schedules.get(name, []):
            job = schedule.get("last_outcome")
            state, css = _outcome(job)
            ran: datetime | None = None
            if isinstance(job, dict):
                ran = _time(job.get("window")) or _time(job.get("ended_at"))
            if ran is None or not start <= ran <= end:
                continue
            title = (f"{name} {schedule.get('id')} ({schedule.get('action')}): {state} "
                     f"{local_text(ran, zones[name], SHORT)}")
            mark = (f'<rect class="run {css}" x="{x(ran) - 5:.1f}" y="{y - 5}" width="10" '
                    f'height="10"><title>{_e(title)}</title></rect>')
            parts.append(run_link_svg(view.prefect_ui, job, mark))
    for window in view.windows:
        name = str(window.get("node"))
        when = _time(window.get("at"))
        if name not in lane_of or when is None or not start <= when <= end:
            continue
        at = when
        y = top + lane_h * lane_of[name] + lane_h / 2
        note = str(window.get("note") or "")
        paused = bool(window.get("paused"))
        title = (f"{name} {window.get('schedule_id')} {window.get('name') or ''} "
                 f"({window.get('action')}) {window.get('local') or ''}"
                 f"{' PAUSED' if paused else ''}{': ' + note if note else ''}")
        moved = "DST" in note  # the note may also say a jitter or a pause
        css = "window" + (" paused" if paused else "") + (" dst-moved" if moved else "")
        if moved:
            parts.append(f'<path class="{css}" d="M{x(at):.1f},{y - 7} l6,7 l-6,7 l-6,-7 z">'
                         f'<title>{_e(title)}</title></path>')
        else:
            parts.append(f'<circle class="{css}" cx="{x(at):.1f}" cy="{y}" r="5">'
                         f'<title>{_e(title)}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def run_link_svg(prefect_ui: str | None, job: object, mark: str) -> str:
    """Return an SVG mark wrapped in a link to the job's run, when there is a valid run id."""
    if not prefect_ui or not isinstance(job, dict):
        return mark
    try:
        run_id = uuid.UUID(str(job.get("flow_run_id")))
    except ValueError:
        return mark
    return f'<a href="{_e(prefect_ui)}/runs/flow-run/{run_id}">{mark}</a>'


# ---------------------------------------------------------------- the page

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#1b1f24;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 6px}
.meta{color:#57606a;margin-bottom:12px}
table{border-collapse:collapse;margin:4px 0 8px}
th,td{border-bottom:1px solid #d0d7de;padding:3px 10px;text-align:left;vertical-align:top;
  overflow-wrap:anywhere}
th{background:#f6f8fa;font-weight:600}
.status{font-weight:600;border-radius:8px;padding:0 6px}
.st-ok{background:#dafbe1;color:#116329}.st-stale{background:#fff8c5;color:#7d4e00}
.st-failing{background:#ffebe9;color:#a40e26}.st-never-seen{background:#eaeef2;color:#57606a}
.st-silent{background:#ffebe9;color:#a40e26}
.summary{font-weight:600;margin:6px 0}.summary.bad{color:#cf222e}
tr.missed td,tr.failed td{background:#fff5f5}
.bad{color:#cf222e;font-weight:600}.good{color:#116329}
.note{color:#7d4e00}.paused{color:#57606a}
svg{border:1px solid #d0d7de;background:#fbfcfd}
svg .grid{stroke:#e1e4e8}svg .tick{font-size:11px;fill:#57606a}
svg .now{stroke:#0969da;stroke-width:2}svg .lane{stroke:#d0d7de}
svg .lane-label{font-size:12px;fill:#1b1f24}svg .lane-label.bad{fill:#cf222e}
svg .window{fill:#0969da}svg .window.paused{fill:#fff;stroke:#8c959f;stroke-width:1.5}
svg .window.dst-moved{fill:#bf8700}
svg .dst line{stroke:#bf8700;stroke-dasharray:3 2;stroke-width:1.5}
svg .dst text{font-size:10px;fill:#bf8700}
svg .run{fill:#2da44e}svg .run.bad{fill:#cf222e}
.legend span{margin-right:14px}.legend i{display:inline-block;width:10px;height:10px;
margin-right:4px;vertical-align:-1px}
form.inline{display:inline}button{font:inherit}
"""


def _status_cell(status: object) -> str:
    text = str(status or "unknown")
    css = "st-" + "".join(c if c.isalnum() or c == "-" else "-" for c in text)
    return f'<span class="status {_e(css)}">{_e(text)}</span>'


def _seen(node: dict[str, Any], now: datetime) -> str:
    """Return when the node last made a request of its own, and its heartbeat."""
    seen = _time(node.get("last_seen_at"))
    if seen is None:
        return "never"
    heartbeat = node.get("heartbeat_s")
    every = f" (heartbeat {heartbeat:g} s)" if isinstance(heartbeat, int | float) else ""
    return _ago(seen, now) + every


def nodes_table(view: FleetView) -> str:
    """Return the nodes table."""
    rows = []
    for node in view.nodes:
        tz = zone_or_utc(node.get("timezone"))
        pulled = _time(node.get("last_pull_at"))
        served, current = node.get("list_version_served"), node.get("list_version_current")
        behind = (' <span class="note">(behind)</span>'
                  if served is not None and current is not None and served != current else "")
        name = _e(node.get("node"))
        rows.append(
            f'<tr><td><a href="#node-{name}">{name}</a></td><td>{_e(node.get("schedules"))}</td>'
            f"<td>{_e(local_text(pulled, tz, SHORT))} "
            f"{_e(node.get('last_pull_status') or '')}{behind}</td>"
            f"<td>{_e(_ago(pulled, view.now))}</td>"
            f"<td>{_e(_seen(node, view.now))}</td><td>{_status_cell(node.get('status'))}</td>"
            f"<td>{_e(node.get('timezone') or '-')}"
            f"{' (default)' if node.get('timezone_default') else ''}</td>"
            f"<td>{_e(node.get('agent_version') or '-')}"
            "</td></tr>")
    head = ("<tr><th>Node</th><th>Schedules</th><th>Last pull</th><th>Ago</th>"
            "<th>Last seen</th><th>Status</th><th>Zone</th><th>Agent</th></tr>")
    body = "".join(rows) or '<tr><td colspan="8">no nodes yet</td></tr>'
    return f'<table id="nodes">{head}{body}</table>'


def schedules_table(view: FleetView, node: dict[str, Any]) -> str:
    """Return one node's schedules: when, next window, last fire and outcome, pause."""
    name = str(node.get("node"))
    tz = zone_or_utc(node.get("timezone"))
    rows = []
    for schedule in view.schedules.get(name, []):
        windows = [w for w in schedule.get("next_windows") or [] if isinstance(w, dict)]
        first = windows[0] if windows else {}
        note = first.get("note") or ""
        next_cell = _e(first.get("local") or "-") + (
            f' <span class="note">({_e(note)})</span>' if note else "")
        job = schedule.get("last_outcome")
        state, css = _outcome(job)
        last = _e(local_text(_time(schedule.get("last_fire")), tz, SHORT))
        if state:
            last += f' <span class="{css}">{run_link(view.prefect_ui, job, state)}</span>'
        paused = schedule.get("paused")
        pause = ""
        if isinstance(paused, dict):
            until = _time(paused.get("until"))
            until_text = "until " + local_text(until, tz, SHORT) if until else "until resumed"
            pause = (f'<span class="paused">paused: {_e(paused.get("note") or "")}'
                     f' ({_e(until_text)})</span>')
        rows.append(
            f"<tr><td>{_e(schedule.get('id'))}</td><td>{_e(schedule.get('name'))}</td>"
            f"<td>{_e(schedule.get('action'))}</td><td>{_e(schedule.get('when'))}</td>"
            f"<td>{next_cell}</td><td>{last}</td>"
            f"<td>{_e(schedule.get('miss_policy'))} {pause}</td>"
            f"<td>{'yes' if schedule.get('enabled') else 'no'}</td></tr>")
    head = ("<tr><th>ID</th><th>Name</th><th>Action</th><th>When</th><th>Next</th>"
            "<th>Last fire</th><th>Policy</th><th>Enabled</th></tr>")
    body = "".join(rows) or '<tr><td colspan="8">no schedules</td></tr>'
    return f'<table class="schedules" data-node="{_e(name)}">{head}{body}</table>'


REPORT_ROWS = 1000
"""The most windows the page's report table lists (the CLI and the API list all)."""
_OUTCOME = {"completed": "Completed", "failed": "FAILED", "missed": "MISSED",
            "skipped": "Skipped", "running": "Running", "due": "due", "cancelled": "Cancelled",
            "unreported": "unreported"}


def _duration(seconds: object) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    total = int(seconds)
    minutes, rest = divmod(total, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _run_cell(prefect_ui: str | None, entry: dict[str, Any]) -> str:
    return run_link(prefect_ui, entry, "run") if entry.get("flow_run_id") else "-"


def report_table(view: FleetView) -> str:
    """Return the morning report: the summary line, then every window, worst node first."""
    report = view.report
    if not isinstance(report, dict):
        return ""
    found = report.get("summary")
    summary: dict[str, Any] = found if isinstance(found, dict) else {}
    bad = bool(summary.get("failed") or summary.get("missed") or summary.get("silent"))
    rows = []
    shown = 0
    for node in report.get("nodes") or []:
        if not isinstance(node, dict):
            continue
        name = node.get("node")
        if node.get("silent"):
            rows.append(f'<tr class="missed"><td>{_e(name)}</td><td colspan="5" class="bad">'
                        f"SILENT: {_e(node.get('silence'))}</td></tr>")
        for entry in node.get("windows") or []:
            if not isinstance(entry, dict) or shown >= REPORT_ROWS:
                continue
            shown += 1
            status = str(entry.get("status") or "")
            detail = str(entry.get("detail") or "")
            text = _OUTCOME.get(status, status)
            if status == "missed":
                text = "MISSED: no report from the node"
            elif status in ("failed", "skipped", "cancelled") and detail:
                text = f"{text}: {detail.split(': ', 1)[-1]}"
            elif status == "completed" and entry.get("offline"):
                text += " (ran offline, recorded later)"
            css = "bad" if status in ("missed", "failed") else (
                "good" if status == "completed" else "")
            window = entry.get("local") or "-"
            if not entry.get("expected"):
                window = f"{entry.get('trigger_key') or 'run'} {window}"
            rows.append(
                f'<tr class="{_e(status)}"><td>{_e(name)}</td><td>{_e(entry.get("schedule_id"))}'
                f"</td><td>{_e(window)}</td><td class=\"{css}\">{_e(text)}</td>"
                f"<td>{_e(_duration(entry.get('duration_s')))}</td>"
                f"<td>{_run_cell(view.prefect_ui, entry)}</td></tr>")
    head = ("<tr><th>Node</th><th>Schedule</th><th>Window</th><th>Outcome</th>"
            "<th>Duration</th><th>Run</th></tr>")
    body = "".join(rows) or '<tr><td colspan="6">no windows in the range</td></tr>'
    cut = (f'<p class="note">The first {REPORT_ROWS} windows are shown: sched report lists '
           "them all.</p>" if shown >= REPORT_ROWS else "")
    return (f'<p class="summary{" bad" if bad else ""}" id="summary">'
            f"{_e(summary.get('text'))}</p>"
            f'<table id="report">{head}{body}</table>{cut}')


def render_page(view: FleetView, *, logout: bool = True) -> str:
    """Return the whole fleet page."""
    now = view.now.astimezone(UTC)
    sections = "".join(
        f'<h2 id="node-{_e(n.get("node"))}">{_e(n.get("node"))} '
        f'{_status_cell(n.get("status"))}</h2>{schedules_table(view, n)}'
        for n in view.nodes)
    prefect = (f'Runs link to the Prefect UI at <a href="{_e(view.prefect_ui)}">'
               f"{_e(view.prefect_ui)}</a>." if view.prefect_ui
               else "No Prefect API is configured on the controller: runs are not linked.")
    notice = f'<p class="note">{_e(view.notice)}</p>' if view.notice else ""
    out = ('<form class="inline" method="post" action="/logout">'
           '<button type="submit">Log out</button></form>') if logout else ""
    legend = ('<p class="legend"><span><i style="background:#0969da;border-radius:5px"></i>'
              'window</span><span><i style="background:#bf8700"></i>'
              'DST moves or repeats it (hover for why)</span>'
              '<span><i style="border:1.5px solid #8c959f"></i>paused</span>'
              '<span><i style="background:#2da44e"></i>last run completed</span>'
              '<span><i style="background:#cf222e"></i>last run failed</span>'
              '<span style="color:#bf8700">- - DST: the zone\'s clocks change</span></p>')
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>sched fleet</title><style>{STYLE}</style></head><body>"
        f"<h1>sched fleet</h1><div class=\"meta\">{len(view.nodes)} nodes, at "
        f"{now:%Y-%m-%d %H:%M:%S}Z. {prefect} {out}</div>{notice}"
        f'<h2>Nodes</h2>{nodes_table(view)}'
        + (f"<h2>Since yesterday 18:00 (each node's zone), worst first</h2>{report_table(view)}"
           if view.report is not None else "") +
        f"<h2>Next 24 hours</h2>{timeline_svg(view)}{legend}"
        f"{sections}</body></html>"
    )


def render_login(message: str = "") -> str:
    """Return the login form (the admin token goes in a POST body, never in a URL)."""
    error = f'<p class="bad" id="login-error">{_e(message)}</p>' if message else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>sched fleet: log in</title><style>{STYLE}</style></head><body>"
        "<h1>sched fleet</h1><p>The fleet page needs the controller's admin token.</p>"
        f'{error}<form method="post" action="/login">'
        '<label>Admin token <input type="password" name="token" id="token" '
        'autocomplete="current-password" required></label> '
        '<button type="submit" id="login">Log in</button></form></body></html>'
    )
