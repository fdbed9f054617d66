"""The operator's commands: ``sched nodes``, ``schedules ...``, ``upcoming``, ``report``,
``explain``, ``run``, ``alerts``.

Each command talks to the controller named by ``--controller`` or
``SCHED_CONTROLLER_URL`` with the token from ``--token`` or ``SCHED_TOKEN``
(the admin's for anything but reading one node), prints a table for people or,
with ``--json``, the API's JSON for scripts, and exits with the codes of
:class:`sched_ops.client.Exit` (0 ok, 1 refused or not found, 2 usage,
3 unreachable, 4 a bad answer). ``sched run`` and ``sched alerts`` talk to
Prefect (``PREFECT_API_URL``).

Here: ``nodes``, ``upcoming``, ``run``, ``alerts`` and :func:`register`; ``schedules ...``
are :mod:`sched_ops.cli_schedules`', ``report`` and ``explain``
:mod:`sched_ops.cli_report`'s; what they share is :mod:`sched_ops.cli_common`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer

from sched_core.clock import utcnow
from sched_core.values import local_text as local
from sched_core.values import parse_api_time as parse_time
from sched_core.values import zone_or_utc
from sched_ops.cli_common import (
    ControllerOpt,
    JsonOpt,
    NodeOpt,
    TokenOpt,
    controller_client,
    echo_json,
    failing,
)
from sched_ops.cli_report import explain_command, report_command
from sched_ops.cli_schedules import schedules_app
from sched_ops.render import NONE, ago, cell, table

# cli_schedules imports most of the options from cli_common too (a pair `duplicates` lists): each
# command module names what it uses.

app = typer.Typer(no_args_is_help=True)
alerts_app = typer.Typer(help="Prefect automations that alert on the fleet.",
                         no_args_is_help=True)


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
    why = [f"{cell(node.get('node'))} {cell(node.get('start_error'), limit=300)}"
           for node in status.get("nodes") or []
           if isinstance(node, dict) and node.get("start_error")]
    return "\n".join([table(["NODE", "SCHEDULES", "LAST PULL", "AGO", "LAST SEEN", "STATUS",
                              "TZ", "VERSION"], rows), *why])


@app.command("nodes")
def nodes_command(controller: ControllerOpt = None, token: TokenOpt = None,
                  as_json: JsonOpt = False) -> None:
    """List the nodes: last pull, how long ago, status (ok, failing, silent, never-seen,
    cannot-start: its agent said it cannot start on its settings, and why)."""
    with controller_client(controller, token) as client:
        status = client.status()
    if as_json:
        echo_json(status)
        return
    typer.echo(nodes_table(status, utcnow()))


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
    with controller_client(controller, token) as client:
        windows = client.upcoming(hours, node)
    if as_json:
        echo_json({"windows": windows})
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
    none), the run is tagged with its action as planned runs are, and it carries the
    controller's voucher (a node with `ad_hoc_runs = "controller"` takes no run without).
    """
    from sched_ops import prefect

    action = None
    warning = None
    voucher = None
    if controller:
        with controller_client(controller, token) as client:
            action = client.row(node, schedule_id).get("action")
            warning = silent_warning(client.node_status(node), utcnow())
            voucher = client.voucher(node, "run", schedule_id)
    if warning:
        typer.echo(f"warning: {warning}", err=True)
    with failing():
        run = prefect.run_job(node, schedule_id, action=action if isinstance(action, str) else None,
                              voucher=voucher)
    if as_json:
        echo_json({**run, "node_warning": warning})
        return
    typer.echo(f"created run {run['name']} of {run['deployment']} ({run['state']})")
    typer.echo(run["url"])


@app.command("cancel")
def cancel_command(
    flow_run_id: Annotated[str, typer.Argument(metavar="RUN_ID")], node: NodeOpt,
    controller: ControllerOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
) -> None:
    """Cancel a run of a node's job (as the UI's Cancel does), with the controller's voucher
    when there is a controller (a node with `ad_hoc_runs = "controller"` needs it)."""
    from sched_ops import prefect

    voucher = None
    if controller:
        with controller_client(controller, token) as client:
            voucher = client.voucher(node, "cancel", flow_run_id)
    with failing():
        run = prefect.cancel_run(flow_run_id, voucher=voucher)
    if as_json:
        echo_json(run)
        return
    typer.echo(f"asked to cancel run {run['name']} ({run['status']}; it was {run['state']})")
    typer.echo(run["url"])


app.command("report")(report_command)
app.command("explain")(explain_command)


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

    with failing():
        settings = alerts.AlertSettings(prefix=prefix, block=block)
        done = prefect.with_client(lambda client: alerts.install(client, settings))
    if as_json:
        echo_json({"automations": done})
        return
    for item in done:
        typer.echo(f"{item['done']:8} {item['name']}  ({item['id']})")


def register(parent: typer.Typer) -> None:
    """Add the operator's commands to parent (``sched``)."""
    for command in app.registered_commands:
        parent.registered_commands.append(command)
    parent.add_typer(schedules_app, name="schedules")
    parent.add_typer(alerts_app, name="alerts")
