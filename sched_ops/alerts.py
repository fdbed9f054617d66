"""The fleet's alerts as Prefect automations, kept in place by ``sched alerts install``.

The controller's fleet watch (``controller/watch.py``) raises each alert once, as a Prefect
event on the node's resource ``sched.node.<node>`` (the schedule as a related resource),
for every node from its first row on. Five automations, each named ``<prefix>: ...`` and
found again by that name, each reactive (for every node, including nodes added later):

1. **a node went silent**: ``sched.node.silent``;
2. **a window was missed**: ``sched.node.window-missed``;
3. **a window failed**: ``sched.node.window-failed``;
4. **resolved**: ``sched.node.recovered`` and ``sched.node.window-recovered``;
5. **task gave up**: ``sched.task.gave-up`` from the central scheduler.

Any other automation of the prefix is deleted. Action: with ``block``, a notification through
that block (``SendNotification`` needs the block document's id, looked up by name);
otherwise ``DoNothing``: every firing is recorded as a ``prefect.automation.triggered``
event anyway, which the UI's event feed shows.
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

NODE_SILENT = "sched.node.silent"
NODE_RECOVERED = "sched.node.recovered"
WINDOW_MISSED = "sched.node.window-missed"
WINDOW_FAILED = "sched.node.window-failed"
WINDOW_RECOVERED = "sched.node.window-recovered"
TASK_GAVE_UP = "sched.task.gave-up"
"""The events, named as the controller names them (controller.alert_rules, controller.central)."""

SUBJECT = "sched alert: {{ automation.name }}"
BODY = (
    "{{ automation.name }}\n\n{{ automation.description }}\n\n"
    "{% if event %}{{ event.payload.reason }}\n\n"
    "Event: {{ event.event }} on {{ event.resource.id }} at {{ event.occurred }}\n"
    "Payload: {{ event.payload }}{% else %}No event came in time.{% endif %}"
)


@dataclass(frozen=True)
class AlertSettings:
    """What ``sched alerts install`` creates; checked when made (OpsError naming the field)."""

    prefix: str = "sched-fleet"
    block: str | None = None
    """A notification block's name (``NAME`` or ``BLOCK-TYPE-SLUG/NAME``); None: DoNothing."""

    def __post_init__(self) -> None:
        if not self.prefix.strip() or len(self.prefix) > 60:
            raise OpsError("--prefix must be 1 to 60 characters", Exit.USAGE)

    def name(self, what: str) -> str:
        """Return the name of one of the automations."""
        return f"{self.prefix}: {what}"


KINDS = (
    ("a node went silent", {NODE_SILENT}, "sched.node.*",
     "A node made no request of its own (a pull or a report) for 3 of the heartbeats it "
     "announced, or was never seen and missed a window: it may be down. The payload names "
     "the node, its last request and its heartbeat."),
    ("a window was missed", {WINDOW_MISSED}, "sched.node.*",
     "A window passed its grace with no report from the node: nothing ran, or nothing "
     "was reported. The payload names node, schedule, window and reason."),
    ("a window failed", {WINDOW_FAILED}, "sched.node.*",
     "A window's job ended Failed or Crashed (online or offline). The payload names node, "
     "schedule, window, the error's first line and the run."),
    ("resolved", {NODE_RECOVERED, WINDOW_RECOVERED}, "sched.node.*",
     "A silent node is back, or a later window of a schedule that had a missed or failed "
     "window completed: the payload names what it resolves."),
    ("a central task gave up", {TASK_GAVE_UP}, "sched.task.*",
     "The controller's central scheduler gave up on a (task, scheduled time) after its "
     f"last failed dispatch ({TASK_GAVE_UP}); the payload names the task, the time, the "
     "attempts and the error."),
)
"""(name, events, resource pattern, description) of each automation."""


def specs(settings: AlertSettings, actions: list[Any]) -> list[AutomationCore]:
    """Return the five automations for settings, each running actions."""
    from prefect.automations import AutomationCore
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return [
        AutomationCore(
            name=settings.name(what), description=description, enabled=True,
            trigger=EventTrigger(
                expect=set(events), match=ResourceSpecification({"prefect.resource.id": pattern}),
                for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1,
                within=timedelta(0),
            ),
            actions=list(actions),
        )
        for what, events, pattern, description in KINDS
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
    """Return what install compares: sets (a trigger's events) in a stable order."""
    shape: dict[str, Any] = automation.model_dump(
        mode="json", include={"description", "enabled", "trigger", "actions"})
    trigger = shape.get("trigger") or {}
    for key in ("expect", "after", "for_each"):
        if isinstance(trigger.get(key), list):
            trigger[key] = sorted(trigger[key])
    return shape


def install(client: SyncPrefectClient, settings: AlertSettings) -> list[dict[str, str]]:
    """Create or update each alert by name; delete duplicates; return what was done to each.

    Idempotent: an automation already as specified is kept as it is. Any other
    automation of the same prefix (an earlier install's) is deleted, so one
    install leaves exactly these five.
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
