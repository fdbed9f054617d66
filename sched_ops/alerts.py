"""The fleet's alerts as Prefect automations, kept in place by ``sched alerts install``.

Four automations, each named ``<prefix>: ...`` and found again by that name:

1. **wave overdue** (proactive, one bucket per node: ``for_each`` the node's
   resource ``sched.agent.<node>``): after a ``sched.job.completed`` of a wave
   action, none follows within ``wave_within`` (26 h). The wave's jobs are
   told apart by the job event's related resource ``sched.action.<action>``
   (role ``sched-action``, :func:`flows.runtime.action_related`): a trigger
   cannot match on the payload. A node that never completed a wave job has no
   bucket yet, so it is not watched until its first one.
2. **job failed** (reactive): every ``sched.job.failed`` (the agent sends one
   per failed, crashed or interrupted job, once per run).
3. **reconcile overdue** (proactive, one bucket per node: ``for_each`` the
   deployment name of the ``reconcile`` run, which is the node's name): no
   ``prefect.flow-run.Completed`` of the ``reconcile`` flow within
   ``reconcile_within`` (30 min) after the last one. Chosen over counting
   Failed runs because it also sees a node whose reconciles stopped running
   (worker down, runs stuck Late or Crashed), not only runs that fail; a
   failing reconcile cannot complete, so it is covered too.
4. **task gave up** (reactive): every ``sched.task.gave-up`` the controller's
   central scheduler emits when it stops retrying a (task, scheduled time).

Action: with ``block``, each sends a notification through that notification
block (``SendNotification`` needs the block document's id, looked up by name);
otherwise ``DoNothing``. Open-source Prefect 3.9.1 has no action that emits an
event, and needs none: every firing is recorded as a
``prefect.automation.triggered`` event (resource ``prefect.automation.<id>``,
``prefect.resource.name`` the automation's name), which the UI's event feed
shows and anything can watch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from sched_ops.client import Exit, OpsError

if TYPE_CHECKING:
    from prefect.automations import AutomationCore
    from prefect.client.orchestration import SyncPrefectClient

log = logging.getLogger(__name__)

JOB_COMPLETED = "sched.job.completed"
JOB_FAILED = "sched.job.failed"
TASK_GAVE_UP = "sched.task.gave-up"
RECONCILE_FLOW = "reconcile"
ACTION_ROLE = "sched-action"
"""The role of a job event's related ``sched.action.<action>`` (flows.runtime.ACTION_ROLE)."""
PROACTIVE_MIN = timedelta(seconds=10)
"""Prefect's shortest ``within`` for a proactive trigger."""

SUBJECT = "sched alert: {{ automation.name }}"
BODY = (
    "{{ automation.name }}\n\n{{ automation.description }}\n\n"
    "{% if event %}Event: {{ event.event }} on {{ event.resource.id }} at {{ event.occurred }}\n"
    "Payload: {{ event.payload }}{% else %}No event came in time.{% endif %}"
)


@dataclass(frozen=True)
class AlertSettings:
    """What ``sched alerts install`` creates; checked when made (OpsError naming the field)."""

    prefix: str = "sched-fleet"
    wave_actions: tuple[str, ...] = ("backup", "copy")
    wave_within: timedelta = timedelta(hours=26)
    reconcile_within: timedelta = timedelta(minutes=30)
    block: str | None = None
    """A notification block's name (``NAME`` or ``BLOCK-TYPE-SLUG/NAME``); None: DoNothing."""

    def __post_init__(self) -> None:
        if not self.prefix.strip() or len(self.prefix) > 60:
            raise OpsError("--prefix must be 1 to 60 characters", Exit.USAGE)
        if not self.wave_actions:
            raise OpsError("--wave-actions names no action", Exit.USAGE)
        for action in self.wave_actions:
            if not action.replace("-", "").replace("_", "").replace(".", "").isalnum():
                raise OpsError(f"--wave-actions: {action!r} is not an action name", Exit.USAGE)
        for name, value in (("--wave-within", self.wave_within),
                            ("--reconcile-within", self.reconcile_within)):
            if value < PROACTIVE_MIN:
                raise OpsError(f"{name} must be at least {PROACTIVE_MIN.seconds} s "
                               "(Prefect's minimum for a proactive trigger)", Exit.USAGE)

    def name(self, what: str) -> str:
        """Return the name of one of the automations."""
        return f"{self.prefix}: {what}"


def _hours(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"


def specs(settings: AlertSettings, actions: list[Any]) -> list[AutomationCore]:
    """Return the four automations for settings, each running actions."""
    from prefect.automations import AutomationCore
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    agents = ResourceSpecification({"prefect.resource.id": "sched.agent.*"})
    wave_related = ResourceSpecification({
        "prefect.resource.role": ACTION_ROLE,
        "prefect.resource.id": [f"sched.action.{a}" for a in settings.wave_actions],
    })
    wave = ", ".join(settings.wave_actions)
    return [
        AutomationCore(
            name=settings.name(
                f"no completed wave job on a node for {_hours(settings.wave_within)}"),
            description=(f"A node completed a wave job ({wave}) and then none for "
                         f"{_hours(settings.wave_within)}: its backups stopped. Watched per node "
                         f"from its first completed wave job."),
            enabled=True,
            trigger=EventTrigger(
                after={JOB_COMPLETED}, expect={JOB_COMPLETED}, match=agents,
                match_related=wave_related, for_each={"prefect.resource.id"},
                posture=Posture.Proactive, threshold=1, within=settings.wave_within,
            ),
            actions=list(actions),
        ),
        AutomationCore(
            name=settings.name("a job failed or crashed"),
            description=("A job of the agent failed, crashed or was interrupted "
                         f"({JOB_FAILED}); its payload names node, schedule, window and run."),
            enabled=True,
            trigger=EventTrigger(
                expect={JOB_FAILED}, match=agents, for_each={"prefect.resource.id"},
                posture=Posture.Reactive, threshold=1, within=timedelta(0),
            ),
            actions=list(actions),
        ),
        AutomationCore(
            name=settings.name(
                f"no completed reconcile on a node for {_hours(settings.reconcile_within)}"),
            description=("A node's reconcile (pull and plan) has not completed for "
                         f"{_hours(settings.reconcile_within)}: its runs fail, crash or do not "
                         "run, so schedule changes do not reach it and no runs are planned. "
                         "Watched per node (its reconcile deployment) from its first completed "
                         "reconcile."),
            enabled=True,
            trigger=EventTrigger(
                after={"prefect.flow-run.Completed"}, expect={"prefect.flow-run.Completed"},
                match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
                match_related=ResourceSpecification({
                    "prefect.resource.role": "flow", "prefect.resource.name": RECONCILE_FLOW}),
                for_each={"related:deployment:prefect.resource.name"},
                posture=Posture.Proactive, threshold=1, within=settings.reconcile_within,
            ),
            actions=list(actions),
        ),
        AutomationCore(
            name=settings.name("a central task gave up"),
            description=("The controller's central scheduler gave up on a (task, scheduled "
                         f"time) after its last failed dispatch ({TASK_GAVE_UP}); the payload "
                         "names the task, the time, the attempts and the error."),
            enabled=True,
            trigger=EventTrigger(
                expect={TASK_GAVE_UP},
                match=ResourceSpecification({"prefect.resource.id": "sched.task.*"}),
                for_each={"prefect.resource.id"},
                posture=Posture.Reactive, threshold=1, within=timedelta(0),
            ),
            actions=list(actions),
        ),
    ]


def find_notification_block(client: SyncPrefectClient, name: str) -> UUID:
    """Return the id of the notification block called name (``NAME`` or ``SLUG/NAME``).

    REFUSED when there is none, or several of that name (then name its type).
    """
    slug, _, plain = name.rpartition("/")
    body: dict[str, Any] = {
        "block_documents": {"name": {"any_": [plain]}, "is_anonymous": {"eq_": False}},
        "include_secrets": False,
    }
    if slug:
        body["block_types"] = {"slug": {"any_": [slug]}}
    found = client.request("POST", "/block_documents/filter", json=body).json()
    notifiers = [doc for doc in found
                 if "notify" in ((doc.get("block_schema") or {}).get("capabilities") or [])]
    if not notifiers:
        kinds = sorted({(d.get("block_type") or {}).get("slug", "?") for d in found})
        also = f" (found {', '.join(kinds)}, which cannot notify)" if found else ""
        raise OpsError(f"--block {name!r}: no notification block of that name{also}",
                       Exit.REFUSED)
    if len(notifiers) > 1:
        kinds = sorted((d.get("block_type") or {}).get("slug", "?") for d in notifiers)
        raise OpsError(f"--block {name!r}: several notification blocks have that name "
                       f"({', '.join(kinds)}): give TYPE/NAME", Exit.REFUSED)
    return UUID(str(notifiers[0]["id"]))


def actions_for(client: SyncPrefectClient, settings: AlertSettings) -> list[Any]:
    """Return the action every alert runs: a notification through the block, or nothing."""
    from prefect.events.actions import DoNothing, SendNotification

    if settings.block is None:
        return [DoNothing()]
    block_id = find_notification_block(client, settings.block)
    return [SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)]


def _shape(automation: Any) -> dict[str, Any]:
    shape: dict[str, Any] = automation.model_dump(
        mode="json", include={"description", "enabled", "trigger", "actions"})
    return shape


def install(client: SyncPrefectClient, settings: AlertSettings) -> list[dict[str, str]]:
    """Create or update each alert by name; delete duplicates; return what was done to each.

    Idempotent: an automation already as specified is kept as it is. An older
    alert of the same prefix whose name changed (another ``--wave-within``) is
    deleted, so one install leaves exactly these four.
    """
    wanted = specs(settings, actions_for(client, settings))
    names = {spec.name for spec in wanted}
    done: list[dict[str, str]] = []
    existing = client.read_automations()
    for automation in existing:
        if automation.name.startswith(f"{settings.prefix}: ") and automation.name not in names:
            client.delete_automation(automation.id)
            done.append({"name": automation.name, "id": str(automation.id), "done": "deleted"})
    for spec in wanted:
        found = sorted((a for a in existing if a.name == spec.name), key=lambda a: str(a.id))
        if not found:
            new_id = client.create_automation(spec)
            done.append({"name": spec.name, "id": str(new_id), "done": "created"})
            continue
        keep, *extra = found
        for item in extra:
            client.delete_automation(item.id)
            done.append({"name": item.name, "id": str(item.id), "done": "deleted"})
        if _shape(keep) != _shape(spec):
            client.update_automation(keep.id, spec)
            done.append({"name": spec.name, "id": str(keep.id), "done": "updated"})
        else:
            done.append({"name": spec.name, "id": str(keep.id), "done": "kept"})
    log.info("alerts installed", extra={"alerts": done})
    return done
