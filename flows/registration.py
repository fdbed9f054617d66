"""The node's two deployments in Prefect: ``run-job/<node>`` and ``reconcile/<node>``.

Registered through the REST API the first time the server answers (and again when one
was deleted): no work pool, no schedule, tags ``sched-agent``; nothing but the node
starts their runs. A Run of either from the UI reaches the node as an ad hoc job or an
on-demand reconcile (:mod:`flows.control`). The old agent's heartbeat automations,
which would crash the runs the node records (they send no heartbeats), are deleted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from flows.prefect_api import PrefectApi
from sched_core import SchedError

log = logging.getLogger(__name__)

RUN_JOB = "run-job"
RECONCILE = "reconcile"

JOB_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "title": "Parameters",
    "properties": {
        "schedule_id": {"type": "string", "title": "schedule_id", "position": 0,
                        "description": "The node's cached schedule to run now."},
    },
    "required": ["schedule_id"],
}
LEGACY_AUTOMATIONS = frozenset({
    "sched-agent: crash runs whose heartbeats stopped",
    "sched-agent: crash runs stuck in Pending",
})
"""What the runner-driven agent (before the node fired its windows itself) installed."""
RECONCILE_PARAMETERS: dict[str, Any] = {"type": "object", "title": "Parameters",
                                        "properties": {}}


@dataclass
class Deployments:
    """The node's two deployments in Prefect, registered once per process (lazily)."""

    api: PrefectApi
    node: str
    tags: list[str]
    ids: dict[str, str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self) -> dict[str, str]:
        """Return ``{"run-job": id, "reconcile": id}``, registering them on first use."""
        with self._lock:
            return self._get()

    def _get(self) -> dict[str, str]:
        if self.ids is None:
            ids: dict[str, str] = {}
            for flow, description, schema in (
                (RUN_JOB, "One job of one schedule, fired by the node at its window (the node "
                          "records it here; a Run here runs the schedule now).", JOB_PARAMETERS),
                (RECONCILE, "The node's pull of its schedule list and its plan (recorded when "
                            "something changed; a Run here reconciles now).",
                 RECONCILE_PARAMETERS),
            ):
                flow_id = self.api.ensure_flow(flow)
                ids[flow] = self.api.ensure_deployment(
                    flow_id, self.node, tags=self.tags, description=description,
                    parameter_openapi_schema=schema, enforce_parameter_schema=False,
                    entrypoint=f"flows/node.py:{flow.replace('-', '_')}", paused=False,
                    schedules=[],
                )
            self.ids = ids
            log.info("registered the node's deployments %s/%s and %s/%s", RUN_JOB, self.node,
                     RECONCILE, self.node, extra={"node": self.node})
            self._remove_legacy_automations()
        return self.ids

    def _remove_legacy_automations(self) -> None:
        """Delete the automations the runner-driven agent made (they would crash the runs the
        node records: those send no heartbeats). Best effort."""
        try:
            found = self.api.call("POST", "/automations/filter", json={"limit": 200}).json()
            for automation in found:
                if automation.get("name") in LEGACY_AUTOMATIONS:
                    self.api.call("DELETE", f"/automations/{automation['id']}")
                    log.warning("deleted the old agent's automation %r: the node records its "
                                "runs itself, with no heartbeats", automation.get("name"),
                                extra={"node": self.node})
        except SchedError as exc:
            log.info("could not look for the old agent's automations: %s", exc)

    def forget(self) -> None:
        """Register again at the next use (a deployment was deleted on the server)."""
        self.ids = None
