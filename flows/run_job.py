"""``run-job``: one job of one schedule, on the node that owns the schedule.

Deployed once per node, as ``run-job/<node>``. Its one parameter is the schedule to run:
the node's own cache decides what the command is (the row and the node's action table),
never the run's parameters, and no parameter carries a time.

Two ways a run of it happens:

1. **At a window** the node starts the job itself, at the window's instant, and records it
   as the window's run of this flow (planned ahead: the Upcoming tab). Prefect's engine is
   not involved; the run shows the same steps as task runs.
2. **When Prefect runs it** (a Run from the UI taken by a worker, ``prefect flow-run
   execute``, ``run_deployment`` from another flow, ``run_job("s-1")`` in Python), the
   flow's tasks hand the job to the node on this host and follow it: ``check-inputs`` asks
   the node for the schedule, ``run-command`` has the node run it (its start guard, job
   slots, overlap rule and repository lock apply) and logs its output with the times it was
   written, ``write-artifact`` writes what happened. The run ends as the job did
   (Completed, Failed, Cancelled). With no node on the host, or another node's, it fails
   at ``check-inputs`` saying so.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled, Completed, Failed

from flows._node import NoNode, follow, open_node
from sched_node.local import NodeLink


@task(name="check-inputs")
def check_inputs(schedule_id: str) -> dict[str, Any]:
    """Return the node on this host and its cached row of schedule_id; NoNode when either
    is missing."""
    link, info = open_node(deployment.name)
    link.close()
    rows = {str(item.get("id")): item for item in info.get("schedules", [])}
    if schedule_id not in rows:
        known = ", ".join(sorted(rows)) or "none"
        raise NoNode(f"no schedule {schedule_id!r} in node {info.get('node')!r}'s cache "
                     f"(known: {known})")
    return {"node": info.get("node"), "row": rows[schedule_id]}


@task(name="run-command")
def run_command(schedule_id: str) -> dict[str, Any]:
    """Have the node run the schedule's job now and follow it to its end; return its outcome."""
    logger = get_run_logger()
    link, _info = open_node(deployment.name)
    try:
        job_id, why = link.submit(schedule_id, flow_run_id=_run_id(), flow_run_name=flow_run.name)
        if job_id is None:
            raise NoNode(why)
        ended = follow(link, job_id, logger)
        _recorded(link, job_id)
    finally:
        link.close()
    return {key: ended.get(key) for key in ("job_id", "run_name", "state", "message", "error",
                                            "tries", "started_at", "ended_at", "argv")}


@task(name="write-artifact")
def write_artifact(node: str, schedule_id: str, outcome: dict[str, Any]) -> None:
    """Write the job's outcome as the run's artifact."""
    tries = outcome.get("tries") or []
    lines = [f"### {outcome.get('run_name')} on {node}: {outcome.get('state')}", "",
             f"schedule `{schedule_id}`; {outcome.get('message') or ''}", "",
             "| try | started | ended | exit code |", "|---|---|---|---|"]
    lines += [f"| {item.get('number')} | {item.get('started_at') or '-'} | "
              f"{item.get('ended_at') or '-'} | {item.get('exit_code')} |" for item in tries]
    create_markdown_artifact(markdown="\n".join(lines), key=_key(f"job-{node}-{schedule_id}"),
                             description=f"{outcome.get('run_name')}: {outcome.get('state')}")


@flow(name="run-job", description="One job of one schedule on its node: fired by the node at "
      "its windows; when Prefect runs it, the node on this host runs the job.")
def run_job(schedule_id: str, voucher: str | None = None) -> State[Any]:
    """Run the cached schedule schedule_id once, now, on its node (the module's ways).

    ``voucher``: the controller's word for this run (``sched run`` brings one), which a
    node with ``ad_hoc_runs = "controller"`` needs before it takes the run.
    """
    found = check_inputs(schedule_id)
    outcome = run_command(schedule_id)
    write_artifact(str(found["node"]), schedule_id, outcome)
    state, message = outcome.get("state"), str(outcome.get("message") or "")
    if state == "Completed":
        return Completed(message=message, data=outcome)
    if state == "Skipped":
        return Completed(name="Skipped", message=message, data=outcome)
    if state == "Cancelled":
        return Cancelled(message=message, data=outcome)
    return Failed(message=message or f"the job ended {state}", data=outcome)


def _run_id() -> str | None:
    value = flow_run.id
    return str(value) if value else None


def _recorded(link: NodeLink, job_id: str) -> None:
    """Tell the node this run records the job's end (else the node records it itself)."""
    try:
        link.recorded(job_id)
    except ConnectionError:
        pass  # the node records the end itself when nobody said so


def _key(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:200] or "job"
