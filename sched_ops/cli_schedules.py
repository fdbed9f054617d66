"""``sched schedules ...``: a node's schedules listed, described, put, removed, paused, resumed."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from sched_core.clock import utcnow
from sched_core.errors import WireError
from sched_core.jsonwire import MAX_DEPTH, decode
from sched_core.values import local_text as local
from sched_core.values import parse_api_time as parse_time
from sched_core.values import zone_or_utc
from sched_ops.cli_common import (  # as sched_ops/cli.py's (alike: `duplicates` pairs them)
    RELATIVE,
    ControllerOpt,
    JsonOpt,
    NodeOpt,
    TokenOpt,
    controller_client,
    echo_json,
    failing,
)
from sched_ops.client import Exit, OpsError
from sched_ops.render import NONE, cell, outcome, policy_summary, table

MAX_ROW_FILE = 1 << 20
"""The largest row file ``schedules put --file`` reads (bytes)."""

schedules_app = typer.Typer(help="A node's schedules: list, describe, put, rm, pause, resume.",
                            no_args_is_help=True)


# ------------------------------------------------------- sched schedules ls/describe


def _next_cell(schedule: dict[str, Any]) -> str:
    windows = schedule.get("next_windows") or []
    if not windows or not isinstance(windows[0], dict):
        return NONE
    first = windows[0]
    note = " (DST)" if first.get("note") else ""
    return f"{first.get('local') or first.get('at')}{note}"


def last_run_text(run: object, tz: Any) -> str:
    """Return one run's window (or its start, for a run without one) and outcome together."""
    if not isinstance(run, dict):
        return NONE
    window = parse_time(run.get("window"))
    if window is not None:
        when = local(window, tz)
    else:
        started = parse_time(run.get("started_at")) or parse_time(run.get("ended_at"))
        how = run.get("trigger_key") or "run"
        when = f"{how} {local(started, tz)}" if started is not None else str(how)
    text = f"{when} {outcome(run)}"
    why = run.get("error") or (run.get("reason") if run.get("state") == "Skipped" else None)
    if why:
        text += f": {why}"
    if run.get("offline"):
        text += " (offline)"
    return text


def _last_cell(schedule: dict[str, Any], tz: Any) -> str:
    # An older controller has no last_run: its latest job's own window and state (one run).
    run = schedule.get("last_run") or schedule.get("last_outcome")
    if isinstance(run, dict):
        return last_run_text(run, tz)
    fired = parse_time(schedule.get("last_fire"))
    return local(fired, tz) if fired is not None else NONE


def schedules_table(status: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """Return a node's schedules (its status, and its rows for the policies) as a table."""
    tz = zone_or_utc(status.get("timezone"))
    out = []
    for schedule in status.get("schedules") or []:
        if not isinstance(schedule, dict):
            continue
        row = rows.get(str(schedule.get("id")), {})
        merged = {**row, "paused": schedule.get("paused", row.get("paused")),
                  "miss_policy": schedule.get("miss_policy") or row.get("miss_policy")}
        out.append([
            cell(schedule.get("id")), cell(schedule.get("name"), limit=30),
            cell(schedule.get("action")), cell(schedule.get("when"), limit=40),
            cell(_next_cell(schedule), limit=40), cell(_last_cell(schedule, tz), limit=80),
            cell(policy_summary(merged), limit=60),
            "yes" if schedule.get("enabled") else "no",
        ])
    return table(["ID", "NAME", "ACTION", "WHEN", "NEXT", "LAST", "POLICY", "ENABLED"], out)


@schedules_app.command("ls")
def schedules_ls(node: NodeOpt, controller: ControllerOpt = None, token: TokenOpt = None,
                 as_json: JsonOpt = False) -> None:
    """List a node's schedules: when in words, next (node's local time), last, policy."""
    with controller_client(controller, token) as client:
        status = client.node_status(node)
        rows = {str(r.get("id")): r for r in client.rows(node)}
    if as_json:
        for schedule in status.get("schedules") or []:
            if isinstance(schedule, dict):
                schedule["row"] = rows.get(str(schedule.get("id")))
        echo_json(status)
        return
    typer.echo(schedules_table(status, rows))


def _find(status: dict[str, Any], schedule_id: str) -> dict[str, Any]:
    for schedule in status.get("schedules") or []:
        if isinstance(schedule, dict) and schedule.get("id") == schedule_id:
            return schedule
    return {}


def describe_text(row: dict[str, Any], schedule: dict[str, Any], status: dict[str, Any],
                  runs: list[dict[str, Any]] | None) -> str:
    """Return ``sched schedules describe``: the row, its next windows, recent fires and outcomes."""
    tz = zone_or_utc(row.get("timezone") or status.get("timezone"))
    lines = [
        f"Schedule:   {cell(row.get('id'))}  ({cell(row.get('name'), limit=80)})",
        f"Node:       {cell(status.get('node'))}  (zone {cell(status.get('timezone'))}, "
        f"status {cell(status.get('status'))})",
        f"Action:     {cell(row.get('action'))}",
        f"When:       {cell(schedule.get('when'), limit=80)}",
        f"Enabled:    {'yes' if row.get('enabled') else 'no'}",
        f"Policy:     {cell(policy_summary(row), limit=200)}",
    ]
    paused = row.get("paused")
    if isinstance(paused, dict):
        until = parse_time(paused.get("until"))
        lines.append(f"Paused:     {cell(paused.get('note'), limit=200)} "
                     f"({'until ' + local(until, tz) if until else 'until resumed'})")
    lines += ["", "Next windows:"]
    windows = [w for w in schedule.get("next_windows") or [] if isinstance(w, dict)]
    if windows:
        lines += ["  " + line for line in table(
            ["LOCAL", "UTC", "NOTE"],
            [[cell(w.get("local")), cell(w.get("at")), cell(w.get("note"), limit=80)]
             for w in windows]).splitlines()]
    else:
        lines.append("  none (disabled, paused, fired by the chain, or none within 8 days)")
    lines += ["", "Last fire and outcome (the node's report):"]
    fired = parse_time(schedule.get("last_fire"))
    job = schedule.get("last_outcome")
    run = schedule.get("last_run")
    lines.append(f"  last fire: {local(fired, tz)}")
    if isinstance(run, dict):
        ended = parse_time(run.get("ended_at"))
        name = run.get("flow_run_name") or run.get("flow_run_id")
        lines.append(f"  last run: {cell(last_run_text(run, tz), limit=200)}, ended "
                     f"{local(ended, tz)}, run {cell(name)}")
    if isinstance(job, dict):
        ended = parse_time(job.get("ended_at"))
        window = local(parse_time(job.get("window")), tz)
        lines.append(f"  latest job: {outcome(job)}, window {window}, ended {local(ended, tz)}"
                     f", run {cell(job.get('flow_run_name'))}")
    else:
        lines.append("  latest job: none reported")
    if runs is not None:
        lines += ["", "Recent runs (Prefect):"]
        if runs:
            lines += ["  " + line for line in table(
                ["RUN", "STATE", "START", "END", "URL"],
                [[cell(r["name"]), cell(r["state"]), local(parse_time(r["start"]), tz),
                  local(parse_time(r["end"]), tz), cell(r["url"], limit=120)] for r in runs],
            ).splitlines()]
        else:
            lines.append("  none")
    lines += ["", "Row:", json.dumps(row, indent=2, ensure_ascii=True)]
    return "\n".join(lines)


@schedules_app.command("describe")
def schedules_describe(
    schedule_id: Annotated[str, typer.Argument(metavar="ID", help="The schedule's id.")],
    node: NodeOpt, controller: ControllerOpt = None, token: TokenOpt = None,
    as_json: JsonOpt = False,
    runs: Annotated[int, typer.Option(
        min=0, max=100, help="Recent runs to read from Prefect when PREFECT_API_URL is set.")] = 10,
) -> None:
    """Show a schedule: the row, its next 10 windows with DST notes, recent fires and outcomes."""
    with controller_client(controller, token) as client:
        row = client.row(node, schedule_id)
        status = client.node_status(node)
    schedule = _find(status, schedule_id)
    recent = None
    if runs:
        from sched_ops import prefect

        with failing():
            recent = prefect.recent_runs(node, schedule_id, limit=runs)
    if as_json:
        echo_json({"row": row, "status": schedule, "node": {
            k: v for k, v in status.items() if k != "schedules"}, "recent_runs": recent})
        return
    typer.echo(describe_text(row, schedule, status, recent))


# ------------------------------------------------------- sched schedules put/rm/pause/resume


def read_row_file(path: str) -> dict[str, Any]:
    """Return the JSON object in path (``-`` for stdin), read with the wire's strict rules."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_ROW_FILE + 1)
        else:
            with Path(path).open("rb") as handle:
                raw = handle.read(MAX_ROW_FILE + 1)
    except OSError as exc:
        raise OpsError(f"--file {path}: {exc.strerror or exc}", Exit.USAGE) from None
    if len(raw) > MAX_ROW_FILE:
        raise OpsError(f"--file {path}: larger than {MAX_ROW_FILE} bytes", Exit.USAGE)
    try:
        data = decode(raw, max_depth=MAX_DEPTH, root="row")
    except (WireError, ValueError) as exc:
        raise OpsError(f"--file {path}: not valid JSON: {exc}", Exit.USAGE) from None
    if not isinstance(data, dict):
        raise OpsError(f"--file {path}: not a JSON object (one schedule row)", Exit.USAGE)
    return data


def _words(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise OpsError(f"--param {text!r} is not KEY=VALUE", Exit.USAGE)
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value  # a bare word is a string
    return key.strip(), parsed


def row_from_flags(base: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """Return base (a file's row, or {}) with the fields given as flags set on it."""
    row = dict(base)
    schedule = dict(row.get("schedule") or {}) if isinstance(row.get("schedule"), dict) else {}
    for key in ("name", "action", "repo_id", "storage", "miss_policy", "timezone"):
        if flags.get(key) is not None:
            row[key] = flags[key]
    if flags.get("days") is not None:
        schedule["days"] = _words(flags["days"])
    if flags.get("hours") is not None:
        schedule["hours"] = _words(flags["hours"])
    if flags.get("minute") is not None:
        schedule["minute"] = flags["minute"]
    if flags.get("interval") is not None:
        schedule = {"interval_minutes": flags["interval"]}
    if flags.get("on") is not None:
        schedule = {"on": flags["on"]}
    if schedule or "schedule" in row:
        row["schedule"] = schedule
    if flags.get("enabled") is not None:
        row["enabled"] = flags["enabled"]
    if flags.get("params"):
        params = dict(row.get("params") or {}) if isinstance(row.get("params"), dict) else {}
        params.update(dict(_param(p) for p in flags["params"]))
        row["params"] = params
    return row


def _propagation_lines(stored: dict[str, Any]) -> list[str]:
    info = stored.get("_propagation")
    if not isinstance(info, dict):
        return []
    at = info.get("next_window_local") or info.get("next_window") or "none"
    likely = "likely" if info.get("likely_in_time") else "NOT likely"
    event = "sent" if info.get("event_sent") else "not sent"
    reason = f": {cell(info.get('reason'), limit=1000)}" if info.get("reason") else ""
    lines = [f"next window {cell(at)}; the node is {likely} to have it by then "
             f"(change event {event}){reason}"]
    if info.get("check"):
        lines.append(cell(info.get("check"), limit=1000))
    return lines


@schedules_app.command("put")
def schedules_put(
    schedule_id: Annotated[str | None, typer.Argument(
        metavar="[ID]", help="The schedule's id (default: the file's `id`).")] = None,
    node: NodeOpt = "",
    file: Annotated[str | None, typer.Option(
        "--file", "-f", help="A JSON file with the row (`-`: stdin); flags override its fields.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="The row's name.")] = None,
    action: Annotated[str | None, typer.Option(help="backup, copy, prune, check, ...")] = None,
    days: Annotated[str | None, typer.Option(help="Days: mon,tue or *.")] = None,
    hours: Annotated[str | None, typer.Option(help="Hours: 2,14 or *.")] = None,
    minute: Annotated[str | None, typer.Option(help="The minute: 0..59.")] = None,
    interval: Annotated[int | None, typer.Option(
        help="Every N minutes since local midnight (instead of days/hours/minute).")] = None,
    on: Annotated[str | None, typer.Option(help="Fired by the chain, e.g. after_wave.")] = None,
    miss_policy: Annotated[str | None, typer.Option(
        help="skip, run-once-within-24h or run-all.")] = None,
    repo_id: Annotated[str | None, typer.Option(help="The repository id.")] = None,
    storage: Annotated[str | None, typer.Option(help="The storage.")] = None,
    timezone: Annotated[str | None, typer.Option(help="The row's own IANA zone.")] = None,
    param: Annotated[list[str] | None, typer.Option(
        help="A parameter KEY=VALUE (VALUE read as JSON when it is; repeatable).")] = None,
    enabled: Annotated[bool | None, typer.Option("--enabled/--disabled")] = None,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Create or replace a schedule row (a whole row: PUT), from a file and/or flags."""
    with failing():
        if not node:
            raise OpsError("--node is required", Exit.USAGE)
        base = read_row_file(file) if file else {}
        row = row_from_flags(base, {
            "name": name, "action": action, "days": days, "hours": hours, "minute": minute,
            "interval": interval, "on": on, "miss_policy": miss_policy, "repo_id": repo_id,
            "storage": storage, "timezone": timezone, "params": param, "enabled": enabled,
        })
        rid = schedule_id or row.get("id")
        if not isinstance(rid, str) or not rid:
            raise OpsError("no schedule id: give ID or an `id` in --file", Exit.USAGE)
        row["id"] = rid
        row.setdefault("enabled", True)
        row.setdefault("version", 0)
    with controller_client(controller, token) as client:
        stored = client.put(node, rid, row)
    if as_json:
        echo_json(stored)
        return
    typer.echo(f"stored {cell(rid)} on {cell(node)} (version {cell(stored.get('version'))})")
    for line in _propagation_lines(stored):
        typer.echo(line)


@schedules_app.command("rm")
def schedules_rm(
    schedule_id: Annotated[str, typer.Argument(metavar="ID")], node: NodeOpt,
    controller: ControllerOpt = None, token: TokenOpt = None,
) -> None:
    """Delete a schedule row."""
    with controller_client(controller, token) as client:
        client.delete(node, schedule_id)
    typer.echo(f"deleted {cell(schedule_id)} on {cell(node)}")




def parse_until(text: str, now: datetime) -> str:
    """Return ``--until`` as RFC 3339 UTC: an RFC 3339 time with an offset, or ``90m``, ``3d``..."""
    match = RELATIVE.fullmatch(text.strip())
    if match:
        unit = {"m": 60, "min": 60, "h": 3600, "d": 86400}[match.group(2)]
        at = now + timedelta(seconds=int(match.group(1)) * unit)
    else:
        at_parsed = parse_time(text.strip())
        if at_parsed is None:
            raise OpsError(
                f"--until {text!r} is neither an RFC 3339 time with an offset "
                "(2026-12-24T06:00:00Z) nor a duration (90m, 2h, 3d)", Exit.USAGE)
        at = at_parsed
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@schedules_app.command("pause")
def schedules_pause(
    schedule_id: Annotated[str, typer.Argument(metavar="ID")], node: NodeOpt,
    note: Annotated[str, typer.Option(help="Why (kept with the row and shown).")],
    until: Annotated[str | None, typer.Option(
        help="Resume by itself then: RFC 3339 (2026-12-24T06:00:00Z) or 90m, 2h, 3d.")] = None,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Pause a schedule with a note (a PATCH of `paused` only; the rest of the row is untouched)."""
    with failing():
        until_text = parse_until(until, utcnow()) if until else None
    with controller_client(controller, token) as client:
        stored = client.patch(node, schedule_id, {"paused": {"note": note, "until": until_text}})
    if as_json:
        echo_json(stored)
        return
    paused = stored.get("paused")
    if not isinstance(paused, dict):
        typer.echo(f"error: the controller stored {schedule_id!r} without its pause "
                   "(does it keep policy fields?)", err=True)
        raise typer.Exit(int(Exit.BAD_ANSWER))
    typer.echo(f"paused {cell(schedule_id)} on {cell(node)}: {cell(paused.get('note'), limit=200)}"
               f" ({'until ' + until_text if until_text else 'until resumed'})")
    for line in _propagation_lines(stored):
        typer.echo(line)


@schedules_app.command("resume")
def schedules_resume(
    schedule_id: Annotated[str, typer.Argument(metavar="ID")], node: NodeOpt,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Resume a paused schedule (a PATCH setting `paused` to null); says what the pause was."""
    with controller_client(controller, token) as client:
        before = client.row(node, schedule_id).get("paused")
        stored = client.patch(node, schedule_id, {"paused": None})
    if as_json:
        echo_json(stored)
        return
    was = (f" (it was paused: {cell(before.get('note'), limit=200)})"
           if isinstance(before, dict) else " (it was not paused)")
    typer.echo(f"resumed {cell(schedule_id)} on {cell(node)}{was}")
    for line in _propagation_lines(stored):
        typer.echo(line)
