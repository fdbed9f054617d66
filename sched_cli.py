"""The ``sched`` command, composed at the top: the kit's ``preview``, ``sched controller``,
and the operator's commands (``nodes``, ``schedules``, ``upcoming``, ``run``, ``alerts``)
from :mod:`sched_ops`.

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


def build_app() -> typer.Typer:
    """Return the ``sched`` app: the kit's commands, ``controller``, and the operator's commands."""
    kit_app.add_typer(controller_app, name="controller")
    register_ops(kit_app)
    return kit_app


app = build_app()

if __name__ == "__main__":  # pragma: no cover - `python sched_cli.py ...`
    app()
