"""The fleet watch's rules: which alerts a fleet report raises and resolves, and their events.

Pure: :func:`plan_alerts` reads a report (``GET /api/report``'s shape) and the
open alerts and returns what to raise; :func:`prefect_event` turns a stored
alert into its Prefect event, with an id (:func:`event_id`) that is the same
for every instance and every resend. :mod:`controller.watch` runs them (the
kinds and the exactly-once steps are in its docstring).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

_NAMESPACE = uuid.UUID("5d1f3a2e-8c4b-4f6a-9e21-7b0c3d9a4e11")

EVENTS = {
    "node-silent": "sched.node.silent",
    "node-recovered": "sched.node.recovered",
    "window-missed": "sched.node.window-missed",
    "window-failed": "sched.node.window-failed",
    "window-recovered": "sched.node.window-recovered",
}
"""The Prefect event each kind of alert sends."""
PROBLEMS = frozenset({"node-silent", "window-missed", "window-failed"})


@dataclass(frozen=True)
class Alert:
    """One alert to raise: what, about what, why; and the open alerts it resolves."""

    node: str
    kind: str
    subject: str
    reason: str
    schedule_id: str | None = None
    window: datetime | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    resolves: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpenAlert:
    """A problem alert not yet resolved."""

    id: int
    node: str
    kind: str
    subject: str
    schedule_id: str | None
    window: datetime | None


@dataclass(frozen=True)
class AlertFact:
    """An alert as it was raised, sent and resolved (``fleet_alert``), to explain a window."""

    kind: str
    subject: str
    detected_at: datetime
    sent_at: datetime | None
    resolved_at: datetime | None


def event_id(node: str, kind: str, subject: str) -> uuid.UUID:
    """Return the Prefect event id of an alert: the same for every instance and every resend."""
    return uuid.uuid5(_NAMESPACE, f"{node}\x00{kind}\x00{subject}")


def _payload(node: str, kind: str, reason: str, entry: Mapping[str, Any] | None = None,
             **more: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"node": node, "kind": kind, "reason": reason}
    if entry is not None:
        for name in ("schedule_id", "key", "window", "local", "state", "error", "flow_run_id",
                     "started_at", "ended_at"):
            data[name] = entry.get(name)
    data.update(more)
    return data


def plan_alerts(report: Mapping[str, Any], open_alerts: Iterable[OpenAlert]) -> list[Alert]:
    """Return the alerts a fleet report calls for (see the module docstring).

    Pure: the report carries its own ``now``; alerts already raised are left
    to the database's uniqueness (step 1), so a pass may propose them again.
    """
    found: list[Alert] = []
    open_by_node: dict[str, list[OpenAlert]] = {}
    for item in open_alerts:
        open_by_node.setdefault(item.node, []).append(item)
    for node in report["nodes"]:
        name = node["node"]
        mine = open_by_node.get(name, [])
        found += _silence_alerts(node, mine)
        found += _window_alerts(name, node["windows"], mine)
        found += _recovery_alerts(name, node["windows"], mine)
    return found


def _silence_alerts(node: Mapping[str, Any], mine: list[OpenAlert]) -> list[Alert]:
    """Decide node-silent (a silent node seen once, or with a missed window) and
    node-recovered (a node back while its silence is open)."""
    found: list[Alert] = []
    name = node["node"]
    missed = [e for e in node["windows"] if e["status"] == "missed"]
    if node["silent"] and (node["last_seen_at"] is not None or missed):
        subject = (f"silent@{node['last_seen_at']}" if node["last_seen_at"]
                   else "never-seen")
        found.append(Alert(name, "node-silent", subject, node["silence"] or "silent",
                           payload=_payload(name, "node-silent", node["silence"] or "",
                                            last_seen_at=node["last_seen_at"],
                                            heartbeat_s=node["heartbeat_s"],
                                            silent_after_s=node["silent_after_s"])))
    if not node["silent"]:
        for item in mine:
            if item.kind == "node-silent":
                reason = (f"node {name} is back: its last request of its own was at "
                          f"{node['last_seen_at']}")
                found.append(Alert(name, "node-recovered", f"recovered@{item.subject}",
                                   reason, resolves=(item.id,),
                                   payload=_payload(name, "node-recovered", reason,
                                                    last_seen_at=node["last_seen_at"],
                                                    resolves=[item.subject])))
    return found


def _window_alerts(name: str, windows: list[dict[str, Any]],
                   mine: list[OpenAlert]) -> list[Alert]:
    """Decide window-missed and window-failed: the first of each schedule and kind while
    none of them is open."""
    found: list[Alert] = []
    already = {(i.schedule_id, i.kind) for i in mine}
    for entry in windows:
        kind = {"missed": "window-missed", "failed": "window-failed"}.get(entry["status"])
        if kind is None or (entry["schedule_id"], kind) in already:
            continue
        already.add((entry["schedule_id"], kind))
        reason = f"{entry['schedule_id']} window {entry['local']}: {entry['detail']}"
        found.append(Alert(name, kind, entry["key"], reason,
                           schedule_id=entry["schedule_id"],
                           window=_time(entry["window"]),
                           payload=_payload(name, kind, reason, entry)))
    return found


def _recovery_alerts(name: str, windows: list[dict[str, Any]],
                     mine: list[OpenAlert]) -> list[Alert]:
    """Decide window-recovered, schedule by schedule: a later window that completed resolves
    the schedule's earlier open alerts; a missed window reported after all resolves its own."""
    found: list[Alert] = []
    by_key = {e["key"]: e for e in windows}
    for schedule_id in sorted({i.schedule_id for i in mine if i.schedule_id}):
        problems = [i for i in mine if i.schedule_id == schedule_id
                    and i.kind in ("window-missed", "window-failed")]
        if not problems:
            continue
        oldest = min((i.window for i in problems if i.window is not None), default=None)
        done = [e for e in windows if e["schedule_id"] == schedule_id
                and e["status"] == "completed" and e["expected"]
                and oldest is not None and (_time(e["window"]) or oldest) > oldest]
        # A missed window whose job was reported after all is resolved by that report.
        late = [i for i in problems if i.kind == "window-missed"
                and by_key.get(i.subject, {}).get("status") not in (None, "missed")]
        if done:
            found.append(_completed_recovery(name, schedule_id, done[0], problems))
        for item in late:
            entry = by_key[item.subject]
            reason = (f"{schedule_id} window {entry['local']}: the node reported its job "
                      f"after all ({entry['detail']})")
            found.append(Alert(name, "window-recovered", f"reported@{item.subject}",
                               reason, schedule_id=schedule_id,
                               window=_time(entry["window"]), resolves=(item.id,),
                               payload=_payload(name, "window-recovered", reason, entry,
                                                resolves=[item.subject])))
    return found


def _completed_recovery(name: str, schedule_id: str, first: Mapping[str, Any],
                        problems: list[OpenAlert]) -> Alert:
    """Return the window-recovered alert of a completed window: it resolves the schedule's
    open alerts about earlier windows."""
    resolved = tuple(i.id for i in problems if i.window is None
                     or i.window < (_time(first["window"]) or i.window))
    reason = (f"{schedule_id} window {first['local']} completed: resolves "
              f"{len(resolved)} earlier alert(s)")
    return Alert(name, "window-recovered", first["key"], reason,
                 schedule_id=schedule_id, window=_time(first["window"]),
                 resolves=resolved,
                 payload=_payload(name, "window-recovered", reason, first,
                                  resolves=[i.subject for i in problems if i.id in resolved]))


def _time(value: object) -> datetime | None:
    from sched_core.values import parse_api_time

    return parse_api_time(value)


def prefect_event(alert: Mapping[str, Any], *, occurred: datetime) -> dict[str, Any]:
    """Return a stored alert's Prefect event as JSON data (rule 3: a stable id)."""
    from prefect.events import Event

    node, kind, subject = alert["node"], alert["kind"], alert["subject"]
    related = []
    if alert.get("schedule_id"):
        related.append({"prefect.resource.id": f"sched.schedule.{node}.{alert['schedule_id']}",
                        "prefect.resource.role": "sched-schedule",
                        "prefect.resource.name": alert["schedule_id"]})
    event = Event(
        event=EVENTS[kind],
        resource={"prefect.resource.id": f"sched.node.{node}", "prefect.resource.name": node},
        related=related, occurred=occurred, payload=dict(alert["payload"]),
        id=event_id(node, kind, subject),
    )
    data: dict[str, Any] = event.model_dump(mode="json")
    return data
