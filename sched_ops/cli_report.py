"""``sched report`` and ``sched explain``: every window of a range and what became of it, and
why one window ran or not (registered on ``sched`` by :mod:`sched_ops.cli`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer

from sched_core.clock import utcnow
from sched_core.values import local_text as local
from sched_core.values import parse_api_time as parse_time
from sched_core.values import zone_or_utc
from sched_ops.cli_common import (
    RELATIVE,
    ControllerOpt,
    JsonOpt,
    TokenOpt,
    controller_client,
    echo_json,
    failing,
)
from sched_ops.client import Exit, OpsError
from sched_ops.render import NONE, cell, table

# ------------------------------------------------------------------ sched report

OUTCOME_WORDS = {"completed": "Completed", "failed": "FAILED", "missed": "MISSED",
                 "skipped": "Skipped", "running": "Running", "due": "due",
                 "cancelled": "Cancelled", "unreported": "unreported"}


def parse_since(text: str, now: datetime, flag: str) -> str:
    """Return ``--since``/``--until`` as RFC 3339 UTC: a time with its offset, or ``12h``
    (that long before now)."""
    match = RELATIVE.fullmatch(text.strip())
    if match:
        unit = {"m": 60, "min": 60, "h": 3600, "d": 86400}[match.group(2)]
        at = now - timedelta(seconds=int(match.group(1)) * unit)
    else:
        parsed = parse_time(text.strip())
        if parsed is None:
            raise OpsError(f"{flag} {text!r} is neither an RFC 3339 time with an offset "
                           "(2026-12-03T18:00:00-05:00) nor a duration back (90m, 12h, 2d)",
                           Exit.USAGE)
        at = parsed
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run_link(entry: dict[str, Any], link: Any) -> str:
    run_id = entry.get("flow_run_id")
    if not run_id:
        return NONE
    try:
        import uuid

        uuid.UUID(str(run_id))
    except ValueError:
        return cell(run_id)
    return link(run_id) if link is not None else cell(run_id)


def _duration(entry: dict[str, Any]) -> str:
    seconds = entry.get("duration_s")
    if not isinstance(seconds, int | float):
        return NONE
    from sched_core.policies import duration_text

    return duration_text(timedelta(seconds=seconds))


def report_text(report: dict[str, Any], link: Any = None) -> str:
    """Return ``GET /api/report`` for people: per node (worst first) every window, then the
    fleet's summary line. ``link(run_id)`` makes a run's URL (None: the id)."""
    lines: list[str] = []
    for node in report.get("nodes") or []:
        if not isinstance(node, dict):
            continue
        since = parse_time(node.get("since"))
        tz = zone_or_utc(node.get("timezone"))
        head = f"{cell(node.get('node'))}  (since {local(since, tz)})"
        if node.get("silent"):
            head += f"  SILENT: {cell(node.get('silence'), limit=200)}"
        lines.append(head)
        rows = []
        for entry in node.get("windows") or []:
            if not isinstance(entry, dict):
                continue
            status = str(entry.get("status"))
            what = OUTCOME_WORDS.get(status, cell(status))
            detail = entry.get("detail") or ""
            if status == "missed":
                text = "MISSED: no report from the node"
            elif status == "completed":
                text = what + (" (ran offline, recorded later)" if entry.get("offline") else "")
            elif status == "due":
                text = f"due (missed after {cell(entry.get('missed_after'))})"
            elif detail.lower().startswith(str(entry.get("state") or status).lower()):
                # "Failed: tar exited 2", "Running since ...": the detail says it already.
                text = what + detail[len(str(entry.get("state") or status)):]
            else:
                text = f"{what}: {detail}" if detail else what
            window = entry.get("local") or NONE
            if not entry.get("expected"):
                window = f"{entry.get('trigger_key') or 'run'} {window}"
            rows.append([cell(entry.get("schedule_id")), cell(window, limit=40),
                         cell(text, limit=120), _duration(entry), _run_link(entry, link)])
        if rows:
            lines += ["  " + line for line in table(
                ["SCHEDULE", "WINDOW", "OUTCOME", "DURATION", "RUN"], rows).splitlines()]
        else:
            lines.append("  no windows in the range")
        for held in node.get("held") or []:
            if isinstance(held, dict):
                lines.append(f"  ({cell(held.get('schedule_id'))}: {held.get('count')} windows "
                             f"held back by its policies: {cell(held.get('reason'), limit=120)})")
        lines.append("")
    summary = report.get("summary") or {}
    lines.append(cell(summary.get("text"), limit=2000))
    if report.get("truncated"):
        lines.append("(the list was cut: narrow --since/--until or --node)")
    return "\n".join(lines)


def report_exit(report: dict[str, Any]) -> Exit:
    """Return ``sched report``'s exit code: MISSED (6) when a window was missed or a node is
    silent, else FAILED (5) when a window failed, else OK."""
    summary = report.get("summary") or {}
    if summary.get("missed") or summary.get("silent"):
        return Exit.MISSED
    if summary.get("failed"):
        return Exit.FAILED
    return Exit.OK


def report_command(
    since: Annotated[str | None, typer.Option(
        help="From: RFC 3339 with its offset, or a duration back (12h, 2d). Default: "
        "yesterday 18:00 in each node's zone.")] = None,
    until: Annotated[str | None, typer.Option(help="Until (default: now).")] = None,
    node: Annotated[str | None, typer.Option("--node", "-n", help="Only this node.")] = None,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Did every node back up? Every window of the range per node, worst first, and one line.

    Exit 0 when every window ran (or is not due yet), 5 when one failed, 6 when one was
    missed (no report from the node) or a node is silent: it drops into cron or a monitor.
    """
    now = utcnow()
    with failing():
        since_text = parse_since(since, now, "--since") if since else None
        until_text = parse_since(until, now, "--until") if until else None
    with controller_client(controller, token) as client:
        found = client.report(since=since_text, until=until_text, node=node)
    if as_json:
        echo_json(found)
    else:
        from prefect.settings import PREFECT_API_URL

        from sched_ops.prefect import run_url

        typer.echo(report_text(found, run_url if PREFECT_API_URL.value() else None))
    raise typer.Exit(int(report_exit(found)))


# ------------------------------------------------------------------ sched explain


def explain_text(found: dict[str, Any]) -> str:
    """Return ``GET /api/nodes/{node}/explain`` for people: the verdict, then each fact."""
    lines = [f"{cell(found.get('verdict'))}: {cell(found.get('summary'), limit=400)}", ""]
    for fact in found.get("facts") or []:
        if isinstance(fact, dict):
            lines.append(f"- {cell(fact.get('topic'))}: {cell(fact.get('text'), limit=600)}")
    return "\n".join(lines)


def explain_command(
    node: Annotated[str, typer.Argument(metavar="NODE")],
    schedule_id: Annotated[str, typer.Argument(metavar="SCHEDULE")],
    window: Annotated[str, typer.Argument(
        metavar="WINDOW", help="The window: RFC 3339 with its offset, its key "
        "(s-1@2026-12-04T02:30-05:00), or the row's local time 2026-12-04T02:30.")],
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Why did that window run, or not: the row and its policies then, DST, the node's
    silence, the job's record (state, error, reason, offline) and the run."""
    with controller_client(controller, token) as client:
        found = client.explain(node, schedule_id, window)
    if as_json:
        echo_json(found)
        return
    typer.echo(explain_text(found))
