"""The node's two deployments in Prefect: ``run-job/<node>`` and ``reconcile/<node>``.

Registered through the REST API the first time the server answers: no work pool, no
schedule, tags ``sched-agent``; nothing but the node starts their runs. A Run of either
from the UI reaches the node as an ad hoc job or an on-demand reconcile
(:mod:`sched_node.control`). The old agent's heartbeat automations, which would crash the runs
the node records (they send no heartbeats), are deleted when the node registers.

**A restart asks Prefect nothing about them** when nothing would change. The ids of the
last registration are kept in ``<state_dir>/deployments.json`` beside the registration's
version (:func:`registration_version`: a hash of everything the registration sends, so a
new agent whose registration differs, or another node name, changes it). A start whose
version matches uses the kept ids at once, with no request (a fleet-wide restart is
10,000 of them in a minute); the node's first periodic reconcile then reads both
deployments by id once (``POST /deployments/filter``, :meth:`Deployments.verify`) to check
that they still answer and still hold what the registration would set
(:func:`differences`). The node registers again (two flow upserts, two deployment upserts,
the automations' read), and says why in its log, on a first start (no file), when the
version differs, when that read finds a deployment gone (deleted, or the server or its
database is another one) or changed on the server (paused, other tags, another schema),
and when a run's creation or the plan finds its deployment gone
(:meth:`Deployments.forget`). So a deployment deleted or changed while the node was down
is put back within one ``reconcile_interval`` of its start, or at once when the node
creates a run on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sched_core import SchedError
from sched_core.jsonwire import MAX_DEPTH
from sched_core.statefile import locked, read_json_file, write_atomic
from sched_node.prefect_api import PrefectApi, PrefectRefused

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
REGISTRATION_FORMAT = 1
"""Part of the registration's version: raise it when registering starts to do something its
payload does not show (another clean-up), so every node registers once more."""
DESCRIPTIONS = {
    RUN_JOB: "One job of one schedule, fired by the node at its window (the node records it "
             "here; a Run here runs the schedule now).",
    RECONCILE: "The node's pull of its schedule list and its plan (recorded when something "
               "changed; a Run here reconciles now).",
}


def deployment_bodies(node: str, tags: list[str]) -> dict[str, dict[str, Any]]:
    """Return what the registration sends for each flow (the deployment's body but its
    ``flow_id``, which is the flow upsert's answer)."""
    schemas = {RUN_JOB: JOB_PARAMETERS, RECONCILE: RECONCILE_PARAMETERS}
    return {flow: {"name": node, "tags": list(tags), "description": DESCRIPTIONS[flow],
                   "parameter_openapi_schema": schemas[flow],
                   "enforce_parameter_schema": False,
                   "entrypoint": f"sched_node/node.py:{flow.replace('-', '_')}", "paused": False,
                   "schedules": []}
            for flow in (RUN_JOB, RECONCILE)}


def registration_version(bodies: dict[str, dict[str, Any]]) -> str:
    """Return the hash of everything the registration would send (and its format)."""
    text = json.dumps({"format": REGISTRATION_FORMAT, "bodies": bodies}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def differences(body: dict[str, Any], flow_id: str, found: dict[str, Any]) -> list[str]:
    """Return the fields the server's deployment ``found`` holds otherwise than the
    registration would set them (``body`` and ``flow_id``); empty when it is as registered."""
    wanted = {**body, "flow_id": flow_id}
    out = []
    for key, value in wanted.items():
        have = found.get(key)
        if key == "tags":
            same = isinstance(have, list) and sorted(have) == sorted(value)
        else:
            same = have == value
        if not same:
            out.append(key)
    return out


@dataclass
class Deployments:
    """The node's two deployments in Prefect, registered once per process (lazily), or
    taken from ``cache_path`` when they still answer as registered (the module's text)."""

    api: PrefectApi
    node: str
    tags: list[str]
    ids: dict[str, str] | None = None
    cache_path: Path | None = None
    """``<state_dir>/deployments.json``; None: register at each process's first use."""
    how: str = ""
    """How the ids in use were found: ``""`` (not yet), ``"registered"``, ``"kept"`` (from
    ``cache_path``, not read yet) or ``"cached"`` (kept, and read back as registered)."""
    why: str = ""
    """Why the last resolution registered, or why it did not (the log line says it too)."""
    _forced: bool = False
    _kept_flow_ids: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self) -> dict[str, str]:
        """Return ``{"run-job": id, "reconcile": id}``, registering them on first use."""
        with self._lock:
            return self._get()

    def _get(self) -> dict[str, str]:
        if self.ids is None:
            bodies = deployment_bodies(self.node, self.tags)
            version = registration_version(bodies)
            reason = "asked again (a deployment was deleted)" if self._forced else None
            if reason is None:
                kept, reason = self._kept(bodies, version)
                if kept is not None:
                    self.ids, self.how, self.why = kept, "kept", reason
                    log.info("the node's deployments %s/%s and %s/%s %s: not registered "
                             "again (read back at the first periodic reconcile)", RUN_JOB,
                             self.node, RECONCILE, self.node, reason, extra={"node": self.node})
                    return self.ids
            self.ids = self._register(bodies, version, reason)
        return self.ids

    def verify(self) -> bool:
        """Read kept ids back once (the first periodic reconcile); return whether the node
        registered again because they no longer answer as registered.

        Does nothing (and sends nothing) unless the ids in use are ``kept``. Raises
        PrefectUnavailable when the server cannot be reached (tried at the next reconcile).
        """
        with self._lock:
            if self.how != "kept" or self.ids is None:
                return False
            bodies = deployment_bodies(self.node, self.tags)
            wrong = self._read(bodies, self._kept_flow_ids)
            if wrong is None:
                self.how = "cached"
                self.why = f"{self.why}, read back as registered"
                return False
            log.warning("the node's kept deployments %s: registering again", wrong,
                        extra={"node": self.node})
            self.ids = self._register(bodies, registration_version(bodies), wrong)
            return True

    def _kept(self, bodies: dict[str, dict[str, Any]],
              version: str) -> tuple[dict[str, str] | None, str]:
        """Return (the kept ids, why) when ``cache_path`` holds both of this version, else
        (None, why the node registers). Sends nothing."""
        if self.cache_path is None:
            return None, "no state folder to keep the ids in"
        data = read_json_file(self.cache_path, now=datetime.now(UTC), max_depth=MAX_DEPTH)
        if data is None:
            return None, f"first start ({self.cache_path.name} does not exist)"
        entries = data.get("deployments") if isinstance(data, dict) else None
        if (not isinstance(entries, dict)
                or not all(isinstance(entries.get(flow), dict)
                           and isinstance(entries[flow].get("id"), str)
                           and isinstance(entries[flow].get("flow_id"), str)
                           for flow in bodies)):
            return None, f"{self.cache_path.name} holds no ids of both deployments"
        if data.get("version") != version:
            return None, (f"the registration changed (version {data.get('version')} in "
                          f"{self.cache_path.name}, {version} now)")
        self._kept_flow_ids = {flow: str(entries[flow]["flow_id"]) for flow in bodies}
        return ({flow: str(entries[flow]["id"]) for flow in bodies},
                f"as registered (version {version}, ids kept in {self.cache_path.name})")

    def _read(self, bodies: dict[str, dict[str, Any]], flow_ids: dict[str, str]) -> str | None:
        """Read the ids in use by id; return None when both answer as registered, else why
        not. Raises PrefectUnavailable."""
        assert self.ids is not None
        ids = self.ids
        try:
            found = self.api.call("POST", "/deployments/filter", json={
                "deployments": {"id": {"any_": list(ids.values())}},
                "limit": len(ids)}).json()
        except PrefectRefused as exc:
            return f"could not be read ({exc})"
        by_id = {str(item.get("id")): item for item in found if isinstance(item, dict)}
        for flow, body in bodies.items():
            item = by_id.get(ids[flow])
            if item is None:
                return (f"{flow}/{self.node} ({ids[flow]}) no longer answers (deleted, or "
                        "another server or database)")
            changed = differences(body, flow_ids[flow], item)
            if changed:
                return f"{flow}/{self.node} was changed on the server ({', '.join(changed)})"
        return None

    def _register(self, bodies: dict[str, dict[str, Any]], version: str,
                  reason: str) -> dict[str, str]:
        ids: dict[str, str] = {}
        entries: dict[str, dict[str, str]] = {}
        for flow, body in bodies.items():
            flow_id = self.api.ensure_flow(flow)
            ids[flow] = self.api.ensure_deployment(flow_id, **body)
            entries[flow] = {"id": ids[flow], "flow_id": flow_id}
        self.how, self.why, self._forced = "registered", reason, False
        log.info("registered the node's deployments %s/%s and %s/%s: %s", RUN_JOB, self.node,
                 RECONCILE, self.node, reason, extra={"node": self.node})
        self._remove_legacy_automations()
        if self.cache_path is not None:
            text = json.dumps({"version": version, "deployments": entries}, sort_keys=True,
                              indent=1)
            try:
                with locked(self.cache_path):
                    write_atomic(self.cache_path, text.encode("utf-8") + b"\n")
            except OSError as exc:
                log.warning("could not keep the deployments' ids in %s (the next start "
                            "registers again): %s", self.cache_path, exc,
                            extra={"node": self.node})
        return ids

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
        self._forced = True
