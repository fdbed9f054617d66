"""The operator's commands: ``sched nodes``, ``schedules ...``, ``upcoming``, ``report``,
``explain``, ``run``, ``alerts``.

Each command talks to the controller named by ``--controller`` or
``SCHED_CONTROLLER_URL`` with the token from ``--token`` or ``SCHED_TOKEN``
(the admin's for anything but reading one node), prints a table for people or,
with ``--json``, the API's JSON for scripts, and exits with the codes of
:class:`sched_ops.client.Exit` (0 ok, 1 refused or not found, 2 usage,
3 unreachable, 4 a bad answer). ``sched run`` and ``sched alerts`` talk to
Prefect (``PREFECT_API_URL``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from sched_core.clock import utcnow
from sched_core.errors import WireError
from sched_core.jsonwire import MAX_DEPTH, decode
from sched_core.model import local_text as local
from sched_core.model import parse_api_time as parse_time
from sched_core.model import zone_or_utc
from sched_ops.client import Controller, Exit, OpsError
from sched_ops.render import NONE, ago, cell, outcome, policy_summary, table

MAX_ROW_FILE = 1 << 20
"""The largest row file ``schedules put --file`` reads (bytes)."""

ControllerOpt = Annotated[str | None, typer.Option(
    "--controller", envvar="SCHED_CONTROLLER_URL", show_envvar=True,
    help="The controller's base URL, e.g. http://127.0.0.1:8080.")]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", envvar="SCHED_TOKEN", show_envvar=True, show_default=False,
    help="The controller's token (admin, or a node's for its own node).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
NodeOpt = Annotated[str, typer.Option("--node", "-n", help="The node.")]

app = typer.Typer(no_args_is_help=True)
schedules_app = typer.Typer(help="A node's schedules: list, describe, put, rm, pause, resume.",
                            no_args_is_help=True)
alerts_app = typer.Typer(help="Prefect automations that alert on the fleet.",
                         no_args_is_help=True)


def _echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False))


@contextmanager
def _failing() -> Iterator[None]:
    """Turn an OpsError into its message on stderr and its exit code."""
    try:
        yield
    except OpsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(int(exc.code)) from None


@contextmanager
def _controller(url: str | None, token: str | None) -> Iterator[Controller]:
    with _failing(), Controller(url or "", token) as client:
        yield client


# ------------------------------------------------------------------ sched nodes


def nodes_table(status: dict[str, Any], now: datetime) -> str:
    """Return ``GET /api/status`` as the nodes table."""
    rows = []
    for node in status.get("nodes") or []:
        if not isinstance(node, dict):
            continue
        tz = zone_or_utc(node.get("timezone"))
        pulled = parse_time(node.get("last_pull_at"))
        served, current = node.get("list_version_served"), node.get("list_version_current")
        pull = local(pulled, tz)
        if pulled is not None and node.get("last_pull_status"):
            pull += f" ({node['last_pull_status']})"
        if served is not None and current is not None and served != current:
            pull += " behind"
        seen = parse_time(node.get("last_seen_at"))
        heartbeat = node.get("heartbeat_s")
        seen_text = ago(seen, now) + (
            f" (heartbeat {heartbeat:g} s)" if isinstance(heartbeat, int | float) else "")
        rows.append([
            cell(node.get("node")), cell(node.get("schedules", 0)), cell(pull, limit=80),
            ago(pulled, now), cell(seen_text if seen else NONE, limit=40),
            cell(node.get("status")), cell(node.get("timezone")),
            cell(node.get("agent_version")),
        ])
    return table(["NODE", "SCHEDULES", "LAST PULL", "AGO", "LAST SEEN", "STATUS", "TZ",
                  "VERSION"], rows)


@app.command("nodes")
def nodes_command(controller: ControllerOpt = None, token: TokenOpt = None,
                  as_json: JsonOpt = False) -> None:
    """List the nodes: last pull, how long ago, status (ok, stale, failing, never-seen)."""
    with _controller(controller, token) as client:
        status = client.status()
    if as_json:
        _echo_json(status)
        return
    typer.echo(nodes_table(status, utcnow()))


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
    with _controller(controller, token) as client:
        status = client.node_status(node)
        rows = {str(r.get("id")): r for r in client.rows(node)}
    if as_json:
        for schedule in status.get("schedules") or []:
            if isinstance(schedule, dict):
                schedule["row"] = rows.get(str(schedule.get("id")))
        _echo_json(status)
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
    with _controller(controller, token) as client:
        row = client.row(node, schedule_id)
        status = client.node_status(node)
    schedule = _find(status, schedule_id)
    recent = None
    if runs:
        from sched_ops import prefect

        with _failing():
            recent = prefect.recent_runs(node, schedule_id, limit=runs)
    if as_json:
        _echo_json({"row": row, "status": schedule, "node": {
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
    return [f"next window {cell(at)}; the node is {likely} to have it by then "
            f"(change event {event}){reason}"]


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
    with _failing():
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
    with _controller(controller, token) as client:
        stored = client.put(node, rid, row)
    if as_json:
        _echo_json(stored)
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
    with _controller(controller, token) as client:
        client.delete(node, schedule_id)
    typer.echo(f"deleted {cell(schedule_id)} on {cell(node)}")


_RELATIVE = re.compile(r"(\d+)\s*(m|min|h|d)")


def parse_until(text: str, now: datetime) -> str:
    """Return ``--until`` as RFC 3339 UTC: an RFC 3339 time with an offset, or ``90m``, ``3d``..."""
    match = _RELATIVE.fullmatch(text.strip())
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
    with _failing():
        until_text = parse_until(until, utcnow()) if until else None
    with _controller(controller, token) as client:
        stored = client.patch(node, schedule_id, {"paused": {"note": note, "until": until_text}})
    if as_json:
        _echo_json(stored)
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
    with _controller(controller, token) as client:
        before = client.row(node, schedule_id).get("paused")
        stored = client.patch(node, schedule_id, {"paused": None})
    if as_json:
        _echo_json(stored)
        return
    was = (f" (it was paused: {cell(before.get('note'), limit=200)})"
           if isinstance(before, dict) else " (it was not paused)")
    typer.echo(f"resumed {cell(schedule_id)} on {cell(node)}{was}")
    for line in _propagation_lines(stored):
        typer.echo(line)


# ------------------------------------------------------------------ sched upcoming


def upcoming_table(windows: list[dict[str, Any]]) -> str:
    """Return ``GET /api/upcoming``'s windows as a table, in their order (time order)."""
    rows = []
    for w in windows:
        at = parse_time(w.get("at"))
        note = "; ".join(x for x in (
            "PAUSED" if w.get("paused") else "", str(w.get("note") or "")) if x)
        rows.append([
            at.strftime("%Y-%m-%d %H:%MZ") if at else NONE, cell(w.get("local")),
            cell(w.get("node")), cell(w.get("schedule_id")), cell(w.get("name"), limit=30),
            cell(w.get("action")), cell(note, limit=80),
        ])
    return table(["UTC", "LOCAL", "NODE", "SCHEDULE", "NAME", "ACTION", "NOTE"], rows)


@app.command("upcoming")
def upcoming_command(
    hours: Annotated[float, typer.Option(min=0, max=24 * 8, help="How far ahead.")] = 24,
    node: Annotated[str | None, typer.Option("--node", "-n", help="Only this node.")] = None,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """List every window across the fleet in the next hours, in order, with local times."""
    with _controller(controller, token) as client:
        windows = client.upcoming(hours, node)
    if as_json:
        _echo_json({"windows": windows})
        return
    typer.echo(upcoming_table(windows) if windows else "no windows in the next "
               f"{hours:g} h")


# ------------------------------------------------------------------ sched run


def silent_warning(status: dict[str, Any], now: datetime) -> str | None:
    """Return what to tell before a run on a node that is silent or never seen (else None)."""
    state = status.get("status")
    node = cell(status.get("node"))
    if state == "never-seen":
        return (f"node {node} has never made a request to the controller with its own token: "
                "the run waits in Prefect until an agent serves it")
    if state == "silent":
        seen = parse_time(status.get("last_seen_at"))
        heartbeat = status.get("heartbeat_s")
        promise = (f"it promised one every {heartbeat:g} s"
                   if isinstance(heartbeat, int | float) else "it announced no heartbeat")
        return (f"node {node} is silent: no request of its own for {ago(seen, now)} "
                f"({promise}); the run waits in Prefect until its agent is back")
    return None


@app.command("run")
def run_command(
    schedule_id: Annotated[str, typer.Argument(metavar="ID")], node: NodeOpt,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Run a schedule's job now on its node, through Prefect (`run-job/<node>`); print its URL.

    With a controller, the schedule is looked up there first (exit 1 if it has
    none) and the run is tagged with its action as planned runs are.
    """
    from sched_ops import prefect

    action = None
    warning = None
    if controller:
        with _controller(controller, token) as client:
            action = client.row(node, schedule_id).get("action")
            warning = silent_warning(client.node_status(node), utcnow())
    if warning:
        typer.echo(f"warning: {warning}", err=True)
    with _failing():
        run = prefect.run_job(node, schedule_id, action=action if isinstance(action, str) else None)
    if as_json:
        _echo_json({**run, "node_warning": warning})
        return
    typer.echo(f"created run {run['name']} of {run['deployment']} ({run['state']})")
    typer.echo(run["url"])


# ------------------------------------------------------------------ sched report

OUTCOME_WORDS = {"completed": "Completed", "failed": "FAILED", "missed": "MISSED",
                 "skipped": "Skipped", "running": "Running", "due": "due",
                 "cancelled": "Cancelled", "unreported": "unreported"}


def parse_since(text: str, now: datetime, flag: str) -> str:
    """Return ``--since``/``--until`` as RFC 3339 UTC: a time with its offset, or ``12h``
    (that long before now)."""
    match = _RELATIVE.fullmatch(text.strip())
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


@app.command("report")
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
    with _failing():
        since_text = parse_since(since, now, "--since") if since else None
        until_text = parse_since(until, now, "--until") if until else None
    with _controller(controller, token) as client:
        found = client.report(since=since_text, until=until_text, node=node)
    if as_json:
        _echo_json(found)
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


@app.command("explain")
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
    with _controller(controller, token) as client:
        found = client.explain(node, schedule_id, window)
    if as_json:
        _echo_json(found)
        return
    typer.echo(explain_text(found))


# ------------------------------------------------------------------ sched alerts


@alerts_app.command("install")
def alerts_install(
    block: Annotated[str | None, typer.Option(
        help="A notification block's name (e.g. a Slack webhook block): each alert sends a "
        "notification through it. Default: no action; the automation's own "
        "prefect.automation.triggered event is the alert.")] = None,
    prefix: Annotated[str, typer.Option(help="The automations' name prefix.")] = "sched-fleet",
    as_json: JsonOpt = False,
) -> None:
    """Create or update the fleet's Prefect automations (idempotent; others of the prefix go).

    They fire on the controller's alerts (a silent node, a missed or failed window, and
    their resolution) for every node, from its first row on.
    """
    from sched_ops import alerts, prefect

    with _failing():
        settings = alerts.AlertSettings(prefix=prefix, block=block)
        done = prefect.with_client(lambda client: alerts.install(client, settings))
    if as_json:
        _echo_json({"automations": done})
        return
    for item in done:
        typer.echo(f"{item['done']:8} {item['name']}  ({item['id']})")


def register(parent: typer.Typer) -> None:
    """Add the operator's commands to parent (``sched``)."""
    for command in app.registered_commands:
        parent.registered_commands.append(command)
    parent.add_typer(schedules_app, name="schedules")
    parent.add_typer(alerts_app, name="alerts")
