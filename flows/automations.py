"""Prefect automations the agent ships with: no run is left stranded.

A run whose process is gone (the node was killed, serve got Ctrl-C, a worker
was stopped) stays Running, or Pending/"Submitting", for good in Prefect 3.9.1,
and holds its deployment's concurrency slot. Two automations, matched to the
agent's runs by their ``sched-agent`` tag, mark such runs Crashed, which frees
their slots; the next reconcile then runs an interrupted window job once more
(:mod:`flows.planner`).

1. Running, and no heartbeat (``prefect.flow-run.heartbeat``, sent every
   :data:`HEARTBEAT_S` seconds from inside the flow's process) and no terminal
   state for :data:`RUNNING_SILENT_S` seconds: Crashed.
2. Pending (the runner took it; "Submitting" is a Pending state), and neither
   Running nor any other state for :data:`PENDING_STUCK_S` seconds: Crashed.
   A run in Pending has no heartbeat yet, so 1 cannot see it.

Both are created or updated by name, idempotently, whenever a node starts
serving and at every reconcile (:func:`ensure_automations`), on whichever
server the node talks to.

Caveat, measured: right after a Prefect server outage, heartbeats sent during
the outage are lost and rule 1 can mark a live run Crashed; a Crashed run may
still end Completed. A re-run therefore first checks that the interrupted run
is not alive after all (:func:`flows.registry.alive_after`).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from prefect.automations import AutomationCore
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

log = logging.getLogger(__name__)

AGENT_TAG = "sched-agent"
"""The tag every deployment of the agent carries (and so every run of it)."""
HEARTBEAT_S = 30
"""Seconds between a run's heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``; Prefect's minimum)."""
RUNNING_SILENT_S = 75
"""A Running run silent this long (two heartbeats missed and then some) is Crashed."""
PENDING_STUCK_S = 120
"""A run Pending this long never got its process: Crashed.

Not the 90 s first shipped: a run is Pending from when the runner takes it (after
its concurrency slot) until its own process says Running, and on a busy node
that restarted with a backlog of late runs (each a fresh Python process
importing Prefect) this was measured at 92 s: the automation crashed live runs,
whose leases it revoked, so they were killed at their next lease renewal ("410
Gone"). The reconcile at start now ends such late runs without a process
(:func:`sched_core.plan.late_skips`), which removes that backlog; 120 s keeps a
margin and still frees the slot of a run killed while Pending within about
two minutes."""
CRASHED_BY_AGENT = "Flow run marked as crashed by the sched-agent automation:"
"""How the automations' Crashed states start: the re-run logic tells them apart."""

TERMINAL = {
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
}
_OURS = ResourceSpecification({"prefect.resource.id": f"prefect.tag.{AGENT_TAG}",
                               "prefect.resource.role": "tag"})
_FLOW_RUNS = ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"})


def running_silent() -> AutomationCore:
    """Return rule 1: a Running agent run without heartbeats becomes Crashed."""
    return AutomationCore(
        name="sched-agent: crash runs whose heartbeats stopped",
        description=(f"An agent run (tag {AGENT_TAG}) with no heartbeat and no terminal state "
                     f"for {RUNNING_SILENT_S} s has lost its process: mark it Crashed, which "
                     "frees its job slot; the next reconcile runs its window once more."),
        enabled=True,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat", "prefect.flow-run.Running"},
            expect={"prefect.flow-run.heartbeat", *TERMINAL},
            match=_FLOW_RUNS,
            match_related=_OURS,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=RUNNING_SILENT_S),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"{CRASHED_BY_AGENT} no heartbeat for {RUNNING_SILENT_S} s",
        )],
    )


def pending_stuck() -> AutomationCore:
    """Return rule 2: an agent run stuck in Pending (Submitting) becomes Crashed."""
    return AutomationCore(
        name="sched-agent: crash runs stuck in Pending",
        description=(f"An agent run (tag {AGENT_TAG}) still Pending after {PENDING_STUCK_S} s "
                     "never got its process: mark it Crashed, which frees its job slot."),
        enabled=True,
        trigger=EventTrigger(
            after={"prefect.flow-run.Pending"},
            expect={
                "prefect.flow-run.Running", "prefect.flow-run.Scheduled",
                "prefect.flow-run.AwaitingConcurrencySlot", "prefect.flow-run.AwaitingRetry",
                "prefect.flow-run.Cancelling", "prefect.flow-run.Paused", *TERMINAL,
            },
            match=_FLOW_RUNS,
            match_related=_OURS,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=PENDING_STUCK_S),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"{CRASHED_BY_AGENT} still Pending after {PENDING_STUCK_S} s",
        )],
    )


def _shape(automation: Any) -> dict[str, Any]:
    """Return what an automation does, comparable between the spec and the server's copy."""
    shape: dict[str, Any] = automation.model_dump(
        mode="json", include={"description", "enabled", "trigger", "actions"})
    return shape


def ensure_automations(client: SyncPrefectClient) -> list[str]:
    """Create or update the agent's automations by name; return what was done to each.

    Idempotent: an automation already as specified is left alone; duplicates
    of one name (two nodes creating it at once) are deleted.
    """
    done: list[str] = []
    for spec in (running_silent(), pending_stuck()):
        found = sorted(client.read_automations_by_name(spec.name), key=lambda a: str(a.id))
        if not found:
            client.create_automation(spec)
            done.append(f"created {spec.name!r}")
            continue
        keep, *extra = found
        for item in extra:
            client.delete_automation(item.id)
        if _shape(keep) != _shape(spec):
            client.update_automation(keep.id, spec)
            done.append(f"updated {spec.name!r}")
        else:
            done.append(f"kept {spec.name!r}")
    if any(not item.startswith("kept") for item in done):
        log.info("automations: %s", "; ".join(done), extra={"automations": done})
    return done
