"""The ``sched`` command, composed at the top: the kit's ``preview``, ``sched controller``,
``sched agent`` (the node, :mod:`sched_node.node`), and the operator's commands (``nodes``,
``schedules``, ``upcoming``, ``run``, ``alerts``) from :mod:`sched_ops`.

Rule: the layers below never name the ones above. ``sched_core.cli`` knows
nothing of the controller; this module, above both, adds the controller's
commands to the kit's app (httpx's optional ``_main`` import looks downward in
the same way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controller.cli import app as controller_app
from sched_core.cli import app as kit_app
from sched_ops.cli import register as register_ops

agent_app = typer.Typer(no_args_is_help=False, invoke_without_command=True,
                        help="Run this node (no subcommand), or check a config first.")


@agent_app.callback()
def agent(ctx: typer.Context) -> None:
    """Run this node: fire its windows at their instants, record every job in Prefect.

    Settings from SCHED_CONFIG (a TOML file) and SCHED_* variables; Prefect from
    PREFECT_API_URL. Stops on Ctrl-C or SIGTERM; running jobs finish in their keepers.
    """
    if ctx.invoked_subcommand is not None:
        return
    from sched_node.process import main

    raise typer.Exit(main())


@agent_app.command("check")
def agent_check(config: Annotated[Path, typer.Argument(help="the agent.toml to check")]) -> None:
    """Read an agent config as the node would (writing nothing): 0 it starts on it, 1 it
    starts but some cached schedules would fail, 2 it would not start."""
    from sched_node.check import check_config

    status, lines = check_config(config)
    for line in lines:
        typer.echo(line, err=status == 2)
    raise typer.Exit(status)


def build_app() -> typer.Typer:
    """Return the ``sched`` app: the kit's commands, ``controller``, ``agent``, the operator's."""
    kit_app.add_typer(controller_app, name="controller")
    kit_app.add_typer(agent_app, name="agent")
    register_ops(kit_app)
    return kit_app


app = build_app()

if __name__ == "__main__":  # pragma: no cover - `python sched_cli.py ...`
    app()
