"""What the operator's commands share: their options, the controller client, JSON and errors."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from sched_ops.client import Controller, OpsError

ControllerOpt = Annotated[str | None, typer.Option(
    "--controller", envvar="SCHED_CONTROLLER_URL", show_envvar=True,
    help="The controller's base URL, e.g. http://127.0.0.1:8080.")]
TokenOpt = Annotated[str | None, typer.Option(
    "--token", envvar="SCHED_TOKEN", show_envvar=True, show_default=False,
    help="The controller's token (admin, or a node's for its own node).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
NodeOpt = Annotated[str, typer.Option("--node", "-n", help="The node.")]


RELATIVE = re.compile(r"(\d+)\s*(m|min|h|d)")
"""A duration back or ahead, as ``--since 12h`` and ``pause --until 2d`` take it."""


def echo_json(data: Any) -> None:
    """Print data as the API's JSON, indented (``--json``)."""
    typer.echo(json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False))


@contextmanager
def failing() -> Iterator[None]:
    """Turn an OpsError into its message on stderr and its exit code."""
    try:
        yield
    except OpsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(int(exc.code)) from None


@contextmanager
def controller_client(url: str | None, token: str | None) -> Iterator[Controller]:
    """Give a controller client; an OpsError inside becomes its message and exit code."""
    with failing(), Controller(url or "", token) as client:
        yield client
