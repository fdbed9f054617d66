"""The fleet page's HTML: pure rendering of the fleet's status into one self-contained page.

Pure: no clock reads, no I/O beyond reading the package's templates; ``now`` is
an argument. The page loads nothing from anywhere (inline CSS, inline SVG, no
script), so it works offline.

The markup is in ``controller/templates/`` (Jinja2, shipped in the package):
this module only works out what the page says (texts, times, positions) and
hands the templates plain values. Every value comes from rows and reports that
anyone with a token wrote: the environment escapes each where it lands
(``autoescape``), a name a template does not get is an error
(``StrictUndefined``), and a link to Prefect is built only from a flow run id
that is a UUID.

The templates' line breaks and the indentation after them are layout, not
output (:class:`_LayoutLines`): the page is served on one line.

The data are the API's shapes (FLEET-CONTRACT.md): the rows of ``GET
/api/status``, each node's ``schedules`` from ``GET /api/nodes/{node}/status``,
and the windows of ``GET /api/upcoming``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from jinja2 import Environment, PackageLoader, StrictUndefined
from jinja2.ext import Extension

from sched_core.policies import ago_text
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


class _LayoutLines(Extension):
    """Drop each line break of an HTML template and the indentation after it.

    The templates are written one element a line for people; the page they make
    is one line, as it was when it was built in Python. Where a space is meant
    between two lines, the template says so: ``{{ " " }}``. The stylesheet
    (``fleet.css``) keeps its lines.
    """

    def preprocess(self, source: str, name: str | None, filename: str | None = None) -> str:
        if name is None or not name.endswith(".html"):
            return source
        return re.sub(r"\n[ \t]*", "", source)


TEMPLATES = Environment(
    loader=PackageLoader("controller", "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    keep_trailing_newline=True,
    extensions=[_LayoutLines],
    auto_reload=False,
)
"""The fleet page's templates (``controller/templates/``): every value escaped where it lands.
Loaded once (``auto_reload`` off): a rendering asks the disk nothing, so a flood of login
pages costs no ``stat`` per answer (the templates ship with the package)."""
TEMPLATES.filters["f1"] = lambda value: f"{value:.1f}"


def _text(value: object) -> str:
    """Return a value as the page writes it: None as nothing."""
    return "" if value is None else str(value)


def _ago(instant: datetime | None, now: datetime) -> str:
    """The page's "how long ago": the largest unit only (``2 min ago``), ``in 5 min`` ahead."""
    text = ago_text(instant, now, parts=1)
    return text if text == "-" or text.startswith("in ") else f"{text} ago"


def run_href(prefect_ui: str | None, job: object) -> str | None:
    """Return the job's run in the Prefect UI, or None (no UI, or no flow run id that is a UUID)."""
    if not prefect_ui or not isinstance(job, dict):
        return None
    try:
        run_id = uuid.UUID(str(job.get("flow_run_id")))
    except ValueError:
        return None
    return f"{prefect_ui}/runs/flow-run/{run_id}"


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


@dataclass(frozen=True)
class _Axis:
    """The timeline's time axis: [start, end] drawn from x = label_w to width - 10."""

    start: datetime
    end: datetime
    label_w: int = 150
    width: int = 1100

    def x(self, instant: datetime) -> float:
        span = (self.end - self.start).total_seconds()
        return (self.label_w + (self.width - self.label_w - 10)
                * (instant - self.start).total_seconds() / span)

    def shows(self, instant: datetime | None) -> bool:
        return instant is not None and self.start <= instant <= self.end


LANE_H, TOP = 34, 28
"""The timeline's lane height and the height above the first lane (pixels)."""


def _lane_runs(view: FleetView, axis: _Axis, name: str, tz: ZoneInfo) -> list[dict[str, Any]]:
    """Return the node's latest runs within the timeline: where, how they ended, their link."""
    runs = []
    for schedule in view.schedules.get(name, []):
        job = schedule.get("last_outcome")
        state, css = _outcome(job)
        ran: datetime | None = None
        if isinstance(job, dict):
            ran = _time(job.get("window")) or _time(job.get("ended_at"))
        if ran is None or not axis.shows(ran):
            continue
        title = (f"{name} {schedule.get('id')} ({schedule.get('action')}): {state} "
                 f"{local_text(ran, tz, SHORT)}")
        runs.append({"x": axis.x(ran), "css": css, "title": title,
                     "href": run_href(view.prefect_ui, job)})
    return runs


def _timeline_windows(
    view: FleetView, axis: _Axis, lane_of: dict[str, int]
) -> list[dict[str, Any]]:
    """Return the next windows within the timeline, each on its node's lane."""
    marks = []
    for window in view.windows:
        name = str(window.get("node"))
        when = _time(window.get("at"))
        if name not in lane_of or when is None or not axis.shows(when):
            continue
        note = str(window.get("note") or "")
        paused = bool(window.get("paused"))
        title = (f"{name} {window.get('schedule_id')} {window.get('name') or ''} "
                 f"({window.get('action')}) {window.get('local') or ''}"
                 f"{' PAUSED' if paused else ''}{': ' + note if note else ''}")
        moved = "DST" in note  # the note may also say a jitter or a pause
        css = "window" + (" paused" if paused else "") + (" dst-moved" if moved else "")
        marks.append({"x": axis.x(when), "y": TOP + LANE_H * lane_of[name] + LANE_H / 2,
                      "css": css, "moved": moved, "title": title})
    return marks


def timeline(view: FleetView) -> dict[str, Any]:
    """Return what timeline.html draws: one lane per node, -6 h .. +24 h, windows, runs, DST."""
    now = view.now.astimezone(UTC)
    axis = _Axis(now - PAST, now + AHEAD)
    nodes = [str(n.get("node")) for n in view.nodes]
    height = TOP + LANE_H * max(len(nodes), 1) + 10
    ticks = []
    tick = axis.start.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    while tick < axis.end:
        if tick.hour % 3 == 0:
            ticks.append({"x": axis.x(tick), "label": f"{tick:%H:%M}"})
        tick += timedelta(hours=1)
    # By name: of two nodes of one name (never from the API), the last one's zone.
    zones = {str(n.get("node")): zone_or_utc(n.get("timezone")) for n in view.nodes}
    lanes = []
    for index, node in enumerate(view.nodes):
        name = str(node.get("node"))
        tz = zones[name]
        shifts = offset_changes(tz, axis.start, axis.end)
        lanes.append({"name": name, "label": name[:20], "failing": node.get("status") == "failing",
                      "y": TOP + LANE_H * index + LANE_H / 2,
                      "dst": [{"x": axis.x(at), "text": text} for at, text in shifts],
                      "runs": _lane_runs(view, axis, name, tz)})
    return {"width": axis.width, "height": height, "top": TOP, "label_w": axis.label_w,
            "ticks": ticks, "now_x": axis.x(now), "now": f"{now:%Y-%m-%d %H:%M}",
            "lanes": lanes,
            "windows": _timeline_windows(view, axis, {name: i for i, name in enumerate(nodes)})}


# ---------------------------------------------------------------- the tables


def _status(status: object) -> dict[str, str]:
    """Return a node's status label: its text and its css class (the text's own letters)."""
    text = str(status or "unknown")
    return {"text": text,
            "css": "st-" + "".join(c if c.isalnum() or c == "-" else "-" for c in text)}


def _seen(node: dict[str, Any], now: datetime) -> str:
    """Return when the node last made a request of its own, and its heartbeat."""
    seen = _time(node.get("last_seen_at"))
    if seen is None:
        return "never"
    heartbeat = node.get("heartbeat_s")
    every = f" (heartbeat {heartbeat:g} s)" if isinstance(heartbeat, int | float) else ""
    return _ago(seen, now) + every


def node_row(view: FleetView, node: dict[str, Any]) -> dict[str, Any]:
    """Return one node's line of the nodes table, and its schedules for its own section."""
    tz = zone_or_utc(node.get("timezone"))
    pulled = _time(node.get("last_pull_at"))
    served, current = node.get("list_version_served"), node.get("list_version_current")
    return {
        "name": _text(node.get("node")), "key": str(node.get("node")),
        "schedules": _text(node.get("schedules")),
        "pulled": local_text(pulled, tz, SHORT),
        "pull_status": _text(node.get("last_pull_status") or ""),
        "behind": served is not None and current is not None and served != current,
        "pulled_ago": _ago(pulled, view.now), "seen": _seen(node, view.now),
        "status": _status(node.get("status")),
        "zone": _text(node.get("timezone") or "-"),
        "zone_default": bool(node.get("timezone_default")),
        "agent": _text(node.get("agent_version") or "-"),
        "rows": schedule_rows(view, node),
    }


def _pause(paused: object, tz: ZoneInfo) -> dict[str, str] | None:
    """Return a schedule's pause (its note, until when), or None when it is not paused."""
    if not isinstance(paused, dict):
        return None
    until = _time(paused.get("until"))
    until_text = "until " + local_text(until, tz, SHORT) if until else "until resumed"
    return {"note": _text(paused.get("note") or ""), "until": until_text}


def schedule_rows(view: FleetView, node: dict[str, Any]) -> list[dict[str, Any]]:
    """Return one node's schedules: when, next window, last fire and outcome, pause."""
    tz = zone_or_utc(node.get("timezone"))
    rows = []
    for schedule in view.schedules.get(str(node.get("node")), []):
        windows = [w for w in schedule.get("next_windows") or [] if isinstance(w, dict)]
        first = windows[0] if windows else {}
        job = schedule.get("last_outcome")
        state, css = _outcome(job)
        rows.append({
            "id": _text(schedule.get("id")), "name": _text(schedule.get("name")),
            "action": _text(schedule.get("action")), "when": _text(schedule.get("when")),
            "next": _text(first.get("local") or "-"), "next_note": _text(first.get("note") or ""),
            "last_fire": local_text(_time(schedule.get("last_fire")), tz, SHORT),
            "state": state, "css": css, "href": run_href(view.prefect_ui, job),
            "policy": _text(schedule.get("miss_policy")),
            "paused": _pause(schedule.get("paused"), tz),
            "enabled": bool(schedule.get("enabled")),
        })
    return rows


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


def _report_entry(view: FleetView, name: object, entry: dict[str, Any]) -> dict[str, Any]:
    """Return one window's line of the report: its outcome in words, how long, its run."""
    status = str(entry.get("status") or "")
    detail = str(entry.get("detail") or "")
    text = _OUTCOME.get(status, status)
    if status == "missed":
        text = "MISSED: no report from the node"
    elif status in ("failed", "skipped", "cancelled") and detail:
        text = f"{text}: {detail.split(': ', 1)[-1]}"
    elif status == "completed" and entry.get("offline"):
        text += " (ran offline, recorded later)"
    css = "bad" if status in ("missed", "failed") else ("good" if status == "completed" else "")
    window = entry.get("local") or "-"
    if not entry.get("expected"):
        window = f"{entry.get('trigger_key') or 'run'} {window}"
    linked = bool(entry.get("flow_run_id"))
    return {"silent": False, "node": _text(name), "status": status,
            "schedule_id": _text(entry.get("schedule_id")), "window": _text(window),
            "css": css, "text": text, "duration": _duration(entry.get("duration_s")),
            "run": "run" if linked else "-",
            "href": run_href(view.prefect_ui, entry) if linked else None}


def report_rows(view: FleetView) -> dict[str, Any] | None:
    """Return the morning report: the summary line, then every window, worst node first."""
    report = view.report
    if not isinstance(report, dict):
        return None
    found = report.get("summary")
    summary: dict[str, Any] = found if isinstance(found, dict) else {}
    rows = []
    shown = 0
    for node in report.get("nodes") or []:
        if not isinstance(node, dict):
            continue
        name = node.get("node")
        if node.get("silent"):
            rows.append({"silent": True, "node": _text(name),
                         "silence": _text(node.get("silence"))})
        for entry in node.get("windows") or []:
            if not isinstance(entry, dict) or shown >= REPORT_ROWS:
                continue
            shown += 1
            rows.append(_report_entry(view, name, entry))
    return {"summary": _text(summary.get("text")),
            "bad": bool(summary.get("failed") or summary.get("missed") or summary.get("silent")),
            "rows": rows, "cut": REPORT_ROWS if shown >= REPORT_ROWS else 0}


# ---------------------------------------------------------------- the pages


def render_page(view: FleetView, *, logout: bool = True) -> str:
    """Return the whole fleet page."""
    return TEMPLATES.get_template("page.html").render(
        now=f"{view.now.astimezone(UTC):%Y-%m-%d %H:%M:%S}", node_count=len(view.nodes),
        prefect_ui=view.prefect_ui or "", logout=logout, notice=_text(view.notice),
        nodes=[node_row(view, node) for node in view.nodes],
        report_shown=view.report is not None, report=report_rows(view),
        timeline=timeline(view))


def render_login(message: str = "") -> str:
    """Return the login form (the admin token goes in a POST body, never in a URL)."""
    return TEMPLATES.get_template("login.html").render(message=message)


def render_forbidden() -> str:
    """Return what a token that is not the admin's sees at ``/``."""
    return TEMPLATES.get_template("forbidden.html").render()
