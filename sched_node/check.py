"""``sched agent check CONFIG``: read an agent config as the node would, before a restart on it.

Nothing is written: the config is read as the node reads it (the TOML file, then the
``SCHED_*`` variables), its state folder is looked at but not created, and each schedule the
node has cached (``<state_dir>/cache.json``, when there is one) is rendered through the
action table as its job would be. The answer is one line per finding and an exit status:

- 0: the node starts on it, and every cached schedule renders a command;
- 1: the node starts on it, but some cached schedules would fail (each named, with why);
- 2: the node would not start on it (the error names the setting).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from sched_core import ConfigError
from sched_core.model import LocalSchedule
from sched_core.render import render_argv
from sched_node.settings import AgentSettings, load_settings

OK, ROWS_REFUSED, WILL_NOT_START = 0, 1, 2


def check_config(config: Path, *, now: datetime | None = None) -> tuple[int, list[str]]:
    """Return the exit status and the lines of ``sched agent check`` for config."""
    now = now or datetime.now(UTC)
    try:
        settings = load_settings(config, create_state=False)
    except ConfigError as exc:
        return WILL_NOT_START, [f"the node would not start on {config}: {exc}"]
    lines = [
        f"{config}: node {settings.node_name}, pulls {settings.pull_url}, "
        f"state in {settings.state_dir}, zone {settings.timezone}",
        f"actions: {', '.join(sorted(settings.actions)) or 'none'}; chain: "
        + (" -> ".join(f"{stage.name} ({stage.action})" for stage in settings.stages)
           or "none"),
        f"Prefect: work pool {settings.work_pool}; its deployments run-job/"
        f"{settings.node_name}, reconcile/{settings.node_name}, chain/{settings.node_name}",
    ]
    refused = _refused_rows(settings, now)
    if refused is None:
        lines.append("no cached schedules yet (the node pulls them at its start)")
        return OK, lines
    checked, problems = refused
    lines.append(f"{checked} cached schedule(s): {checked - len(problems)} render a command, "
                 f"{len(problems)} would fail")
    lines += [f"  {problem}" for problem in problems]
    return (ROWS_REFUSED if problems else OK), lines


def _refused_rows(settings: AgentSettings,
                  now: datetime) -> tuple[int, list[str]] | None:
    """Return how many cached rows there are and why each refused one fails; None with no
    cache."""
    path = Path(settings.state_dir) / "cache.json"
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return 0, [f"{path} cannot be read ({exc}): the node sets it aside and pulls afresh"]
    rows = data.get("schedules") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        return 0, [f"{path} holds no list of schedules: the node pulls afresh"]
    problems = []
    for raw in rows:
        try:
            row = LocalSchedule.model_validate(raw)
        except ValidationError as exc:
            problems.append(f"a cached row is not a schedule: {exc.errors()[0]['msg']}")
            continue
        try:
            render_argv(settings.action(row.action), row, state_dir=Path(settings.state_dir),
                        node=settings.node_name, window=None, trigger_key="manual", now=now)
        except ConfigError as exc:
            problems.append(f"{row.id} ({row.name}): {exc}")
    return len(rows), problems
