"""The ``sched`` command, composed at the top: the kit's ``preview``, ``sched controller``,
``sched agent`` (the node, :mod:`sched_node.node`), and the operator's commands (``nodes``,
``schedules``, ``upcoming``, ``run``, ``alerts``) from :mod:`sched_ops`.

Rule: the layers below never name the ones above. ``sched_core.cli`` knows
nothing of the controller; this module, above both, adds the controller's
commands to the kit's app (httpx's optional ``_main`` import looks downward in
the same way).
"""

from __future__ import annotations

import typer

from controller.cli import app as controller_app
from sched_core.cli import app as kit_app
from sched_ops.cli import register as register_ops


def agent() -> None:
    """Run this node: fire its windows at their instants, record every job in Prefect.

    Settings from SCHED_CONFIG (a TOML file) and SCHED_* variables; Prefect from
    PREFECT_API_URL. Stops on Ctrl-C or SIGTERM; running jobs finish in their keepers.
    """
    from sched_node.process import main

    raise typer.Exit(main())


def build_app() -> typer.Typer:
    """Return the ``sched`` app: the kit's commands, ``controller``, ``agent``, the operator's."""
    kit_app.add_typer(controller_app, name="controller")
    kit_app.command("agent")(agent)
    register_ops(kit_app)
    return kit_app


app = build_app()

if __name__ == "__main__":  # pragma: no cover - `python sched_cli.py ...`
    app()
