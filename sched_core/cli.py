"""The ``sched`` command: ``sched preview`` here; other packages add sub-commands."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated
from zoneinfo import ZoneInfo

import typer

from sched_core.cache import validate_rows
from sched_core.clock import utcnow
from sched_core.errors import WireError
from sched_core.explain import describe, gap_notes, repeat_notes, window_notes
from sched_core.jsonwire import MAX_LIST_DEPTH, decode
from sched_core.matcher import DEFAULT_TZ, fire_times, zone
from sched_core.model import LocalSchedule
from sched_core.policies import describe_policies, row_zone, window_starts

app = typer.Typer(help="Schedules defined centrally, fired locally.", no_args_is_help=True)


def _zone(name: str) -> ZoneInfo:
    try:
        return zone(name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _parse_at(text: str | None, tz: ZoneInfo) -> datetime:
    if text is None:
        return utcnow()
    try:
        at = datetime.fromisoformat(text)
    except ValueError as exc:
        raise typer.BadParameter(f"--at {text!r} is not an ISO 8601 time") from exc
    return at.replace(tzinfo=tz) if at.tzinfo is None else at


def preview_lines(
    rows: list[LocalSchedule],
    *,
    at: datetime,
    days: int,
    tz: ZoneInfo,
    limit: int,
    node: str = "",
) -> list[str]:
    """Return each schedule's next fires, with DST moves, suppressions and policies marked.

    Each row is read in its own zone when it sets ``timezone`` (else tz).
    Windows its policies skip are marked with why (min_interval counted from
    the last shown window that fires); with a node name, a jittered window
    shows when that node's run starts.
    """
    at = at.astimezone(UTC)  # step in UTC: aware arithmetic in a local zone is wall-clock
    end = at + timedelta(days=days)
    lines: list[str] = []
    for row in sorted(rows, key=lambda r: (r.name, r.id)):
        z = row_zone(row, tz)
        state = "" if row.enabled else " [disabled]"
        lines.append(f"{row.id}  {row.name}  ({row.action}; {describe(row.schedule)}){state}")
        policies = describe_policies(row, node=node, tz=tz)
        if policies:
            lines.append(f"  policies: {'; '.join(policies)}")
        if row.schedule.is_event:
            lines.append("  fired by the chain, not the clock")
            continue
        shown = 0
        previous: datetime | None = None
        for fire, start in window_starts(row, at, end, node=node, tz=tz):
            notes, fires = window_notes(row, fire, start, previous=previous, node=node, tz=tz)
            if fires:
                previous = fire
            local = fire.astimezone(z)
            note = f"  <- {'; '.join(notes)}" if notes else ""
            lines.append(
                f"  {local:%a %Y-%m-%d %H:%M %Z}  ({fire.astimezone(UTC):%Y-%m-%dT%H:%MZ}){note}"
            )
            shown += 1
            if shown >= limit:
                break
        fires_set = set(fire_times(row.schedule, at, end, z))
        lines.extend(f"  {note}" for note in repeat_notes(row.schedule, at, end, z, fires_set))
        lines.extend(f"  {note}" for note in gap_notes(row.schedule, at, end, z))
        if shown == 0:
            lines.append(f"  no fires in the next {days} days")
    return lines


@app.command()
def preview(
    schedules: Annotated[Path, typer.Option(help="A JSON schedule list (object or array).")],
    at: Annotated[str | None, typer.Option(help="Start time, ISO 8601 (default now).")] = None,
    days: Annotated[int, typer.Option(min=1, max=366, help="How many days ahead.")] = 7,
    tz: Annotated[str, typer.Option(help="Timezone schedules are matched in.")] = DEFAULT_TZ.key,
    limit: Annotated[int, typer.Option(min=1, help="Fires to show per schedule.")] = 10,
    node: Annotated[str, typer.Option(help="Show this node's jittered starts.")] = "",
) -> None:
    """Print each schedule's next fire times, marking DST moves, suppressions and policies."""
    zone = _zone(tz)
    try:
        data = decode(schedules.read_bytes(), max_depth=MAX_LIST_DEPTH, root=schedules.name)
    except (OSError, WireError) as exc:
        raise typer.BadParameter(f"cannot read {schedules}: {exc}") from exc
    rows = data.get("schedules") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise typer.BadParameter(f"{schedules} holds no schedule list")
    good, bad = validate_rows(rows, source=str(schedules), warn=False)  # echoed below
    for row_id, reason in bad:
        typer.echo(f"invalid schedule {row_id}: {reason}", err=True)
    for line in preview_lines(good, at=_parse_at(at, zone), days=days, tz=zone, limit=limit,
                              node=node):
        typer.echo(line)


@app.callback()
def main() -> None:
    """Schedules defined centrally, fired locally (`sched preview`, and what packages add)."""
    # A callback keeps `sched` a group of commands even with `preview` alone, as the
    # kit's own app is when no package above has added its commands (see sched_cli.py).
