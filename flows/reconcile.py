"""``reconcile``: the node pulls its schedule list and plans its coming windows.

Deployed once per node, as ``reconcile/<node>``. The node reconciles by itself (every
``reconcile_interval``, and at once when its controller says the list changed) and records a
run of this flow when something changed. When Prefect runs it (a Run from the UI taken by a
worker, ``run_deployment``, a call in Python), ``pull-and-plan`` asks the node on this host
to reconcile now and the run ends with what it found, its summary as the artifact.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.runtime import deployment, flow_run
from prefect.states import Completed, Failed

from flows._node import open_node
from flows.run_job import _key


@task(name="pull-and-plan")
def pull_and_plan() -> dict[str, Any]:
    """Have the node on this host pull and plan now; return its summary."""
    link, _info = open_node(deployment.name)
    try:
        run_id = str(flow_run.id) if flow_run.id else None
        return link.reconcile(run_id)
    finally:
        link.close()


@flow(name="reconcile", description="The node's pull of its schedule list and its plan: done "
      "by the node itself; when Prefect runs it, the node on this host reconciles now.")
def reconcile() -> State[Any]:
    """Reconcile the node on this host now (the module's text)."""
    found = pull_and_plan()
    get_run_logger().info("%s", found.get("summary", ""))
    if found.get("markdown"):
        create_markdown_artifact(markdown=str(found["markdown"]),
                                 key=_key(f"reconcile-{found.get('node', 'node')}"))
    if found.get("ok"):
        return Completed(message=str(found.get("summary", "")), data=found)
    return Failed(message=str(found.get("summary") or found.get("error") or "failed"),
                  data=found)
