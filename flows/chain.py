"""``chain``: the day's chain of a node, its stages (prune, then check) in order.

Deployed once per node, as ``chain/<node>``. The node runs the chain itself after its
nightly wave (each stage once per day) and records it as one run of this flow: one task run
per stage, each stage's jobs as ``run-job`` runs under it. When Prefect runs it (a Run from
the UI taken by a worker, ``run_deployment``, a call in Python), it runs the stages now, in
order: each stage a task whose jobs are ``run-job`` subflow runs handed to the node on this
host. A run from Prefect never counts as the day's chain: the node's own still comes after
its wave.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.client.schemas.objects import State
from prefect.runtime import deployment
from prefect.states import Completed, Failed

from flows._node import open_node
from flows.run_job import run_job


@task(name="stage")
def stage(name: str, schedule_ids: list[str]) -> dict[str, str]:
    """Run one stage: each of its schedules' jobs, one after another; return each's state."""
    outcome: dict[str, str] = {}
    for schedule_id in schedule_ids:
        state = run_job(schedule_id, return_state=True)
        outcome[schedule_id] = state.name or state.type.value
    return outcome


@flow(name="chain", description="The day's chain of a node (prune, then check): run by the "
      "node after its wave; when Prefect runs it, its stages run now on the node on this host.")
def chain(voucher: str | None = None) -> State[Any]:
    """Run the node's chain stages now, in order (the module's text); ``voucher`` as
    :func:`flows.run_job.run_job`'s."""
    link, info = open_node(deployment.name)
    link.close()
    rows = info.get("schedules", [])
    results: dict[str, dict[str, str]] = {}
    for spec in info.get("stages", []):
        ids = [str(row["id"]) for row in rows
               if row.get("on") == spec.get("on") and row.get("action") == spec.get("action")]
        results[str(spec["name"])] = stage.with_options(name=str(spec["name"]))(
            str(spec["name"]), ids)
    failed = [f"{name}: {sid} {state}" for name, found in results.items()
              for sid, state in found.items() if state not in ("Completed", "Skipped")]
    if failed:
        return Failed(message="; ".join(failed), data=results)
    return Completed(message=", ".join(f"{name}: {len(found)} job(s)"
                                       for name, found in results.items()), data=results)
