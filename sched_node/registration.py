"""The node's deployments: ``run-job/<node>``, ``reconcile/<node>`` and ``chain/<node>``.

They are the deployments ``prefect deploy --all`` makes from ``prefect.yaml`` (the flows of
``flows/``, named after the node, in the work pool ``work_pool``, in the node's own work
queue, no schedule), and the node makes them itself, from the same flows through Prefect's
deployment API (``flow.to_deployment(...)``, sent as its ``apply()`` would), when they are
missing. A deployment
that exists, whoever made it, is kept as it is while it is in the node's pool and queue and
not paused.

**The pool** (:func:`ensure_pool`; also ``prefect.yaml``'s build step) is a ``process``
pool with a paused queue, ``planned``: the node's planned runs wait there, where no worker,
the node's or anyone's, ever starts them (a paused queue is never polled). The node's own
queue holds what Prefect asks of it (a Run, a Retry), which the node takes as the pool's
worker (:mod:`sched_node.pool_worker`).

**A restart asks Prefect nothing** when nothing would change. The ids are kept in
``<state_dir>/deployments.json`` beside the registration's version (a hash of what the node
would register, so an agent whose flows or settings differ, or another node name, changes
it). A start whose version matches uses the kept ids at once, with no request; the node's
first periodic reconcile reads them back once (:meth:`Deployments.verify`). The node
registers again, and says why in its log, on a first start, when the version differs, when
that read finds a deployment gone, out of its pool or queue, or paused, and when a run's
creation or the plan finds its deployment gone (:meth:`Deployments.forget`). A first start
keeps the deployments it finds right (``prefect deploy``'s); a changed registration, or a
deployment the server changed, is made anew from the flows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sched_core.jsonwire import MAX_DEPTH
from sched_core.statefile import locked, read_json_file, write_atomic
from sched_node.prefect_api import PrefectApi

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.deployments.runner import RunnerDeployment

log = logging.getLogger(__name__)

RUN_JOB = "run-job"
RECONCILE = "reconcile"
CHAIN = "chain"
FLOWS = (RUN_JOB, RECONCILE, CHAIN)
DEFAULT_POOL = "sched-agent"
PLANNED_QUEUE = "planned"
"""The pool's paused queue of the node's planned runs (no worker polls a paused queue)."""
READY_TIMEOUT_S = 300
"""How long after a node's last poll its Prefect server may keep its deployments Ready: longer
than ``worker_poll`` (240 s by default), so they stay Ready while it runs, and they turn Not
Ready 1 to 5 minutes after its death (plus the foreman's loop, 15 s). Prefect's default is
60 s: set it on the server (:data:`SERVER_SETTINGS`; ``make run`` and the scaled layout do)."""
SERVER_SETTINGS = {
    "PREFECT_SERVER_SERVICES_FOREMAN_DEPLOYMENT_LAST_POLLED_TIMEOUT_SECONDS": str(READY_TIMEOUT_S),
    "PREFECT_SERVER_SERVICES_FOREMAN_WORK_QUEUE_LAST_POLLED_TIMEOUT_SECONDS": str(READY_TIMEOUT_S),
}
"""The Prefect server's settings the nodes need (its environment)."""
REGISTRATION_FORMAT = 2
"""Part of the registration's version: raise it when registering starts to do something its
deployments do not show, so every node registers once more."""


def flow_objects() -> dict[str, Any]:
    """Return the flows of ``flows/`` by name."""
    from flows.chain import chain
    from flows.reconcile import reconcile
    from flows.run_job import run_job

    return {RUN_JOB: run_job, RECONCILE: reconcile, CHAIN: chain}


def ensure_pool(work_pool: str = DEFAULT_POOL) -> dict[str, str]:
    """Create the work pool (``process``) and its paused ``planned`` queue unless they exist
    (``prefect.yaml``'s build step); return ``{"work_pool": name}``."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        pool_and_queue(client, work_pool)
    return {"work_pool": work_pool}


def pool_and_queue(client: SyncPrefectClient, work_pool: str) -> None:
    """Make sure the pool and its paused ``planned`` queue exist, the queue paused."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_work_pool(work_pool)
    except ObjectNotFound:
        try:
            client.create_work_pool(WorkPoolCreate(
                name=work_pool, type="process",
                description="The agent's nodes: each node is a worker of this pool, its runs "
                            "in a queue named after it; planned runs wait in the paused "
                            "queue 'planned'."))
            log.info("created the work pool %s", work_pool)
        except ObjectAlreadyExists:
            pass  # another node made it meanwhile
    try:
        queue = client.read_work_queue_by_name(PLANNED_QUEUE, work_pool_name=work_pool)
    except ObjectNotFound:
        try:
            queue = client.create_work_queue(
                name=PLANNED_QUEUE, work_pool_name=work_pool, is_paused=True,
                description="The nodes' planned runs: each node fires its own windows; no "
                            "worker may start these (keep this queue paused).")
        except ObjectAlreadyExists:
            queue = client.read_work_queue_by_name(PLANNED_QUEUE, work_pool_name=work_pool)
        client.update_work_queue(queue.id, is_paused=True)  # shown Paused, not Not Ready
        return
    if not queue.is_paused:
        log.warning("the work queue %s/%s was not paused: pausing it (a worker would start the "
                    "nodes' planned runs as well as the nodes)", work_pool, PLANNED_QUEUE)
        client.update_work_queue(queue.id, is_paused=True)


@dataclass
class Deployments:
    """The node's three deployments (the module's text): their ids, registered or kept."""

    api: PrefectApi
    node: str
    tags: list[str]
    work_pool: str = DEFAULT_POOL
    job_env: dict[str, str] = field(default_factory=dict)
    """What a flow run a worker starts needs to find the node (``SCHED_CONFIG``)."""
    ids: dict[str, str] | None = None
    cache_path: Path | None = None
    """``<state_dir>/deployments.json``; None: register at each process's first use."""
    how: str = ""
    """How the ids in use were found: ``""`` (not yet), ``"registered"``, ``"kept"`` (from
    ``cache_path``, not read yet) or ``"cached"`` (kept, and read back as registered)."""
    why: str = ""
    _forced: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wanted(self) -> dict[str, RunnerDeployment]:
        """Return the node's deployments as it would register them (from the flows)."""
        from prefect.types.entrypoint import EntrypointType

        return {name: flow.to_deployment(
            name=self.node, work_pool_name=self.work_pool, work_queue_name=self.node,
            tags=list(self.tags), description=flow.description, paused=False,
            job_variables={"env": dict(self.job_env)} if self.job_env else None,
            entrypoint_type=EntrypointType.MODULE_PATH)
            for name, flow in flow_objects().items()}

    def version(self) -> str:
        """Return the hash of what the registration would make (and its format)."""
        wanted = {name: {"name": item.name, "pool": self.work_pool, "queue": self.node,
                         "tags": sorted(self.tags), "env": self.job_env,
                         "entrypoint": item.entrypoint,
                         "schema": item._parameter_openapi_schema.model_dump()}
                  for name, item in self.wanted().items()}
        text = json.dumps({"format": REGISTRATION_FORMAT, "wanted": wanted}, sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def get(self) -> dict[str, str]:
        """Return ``{"run-job": id, "reconcile": id, "chain": id}``, registering on first use."""
        with self._lock:
            if self.ids is None:
                version = self.version()
                reason = "asked again (a deployment was deleted)" if self._forced else None
                refresh = False
                if reason is None:
                    kept, reason, refresh = self._kept(version)
                    if kept is not None:
                        self.ids, self.how, self.why = kept, "kept", reason
                        log.info("the node's deployments %s: not registered again (read back "
                                 "at the first periodic reconcile)", reason,
                                 extra={"node": self.node})
                        return self.ids
                self.ids = self._register(version, reason, refresh=refresh)
            return self.ids

    def verify(self) -> bool:
        """Read kept ids back once (the first periodic reconcile); return whether the node
        registered again because they no longer answer as it needs them.

        Does nothing (and sends nothing) unless the ids in use are ``kept``. Raises
        PrefectUnavailable when the server cannot be reached (tried at the next reconcile).
        """
        with self._lock:
            if self.how != "kept" or self.ids is None:
                return False
            found = {str(item.get("id")): item for item in self.api.read_deployments(
                self.ids.values())}
            wrong = next((f"{name}/{self.node} ({why})" for name, item_id in self.ids.items()
                          if (why := _wrong(found.get(item_id), self.work_pool, self.node))),
                         None)
            if wrong is None:
                self.how = "cached"
                self.why = f"{self.why}, read back as registered"
                return False
            log.warning("the node's kept deployment %s: registering again", wrong,
                        extra={"node": self.node})
            self.ids = self._register(self.version(), wrong, refresh=True)
            return True

    def _kept(self, version: str) -> tuple[dict[str, str] | None, str, bool]:
        """Return (the kept ids, why, False) when ``cache_path`` holds all of this version,
        else (None, why the node registers, whether its deployments are to be made anew: the
        registration changed). Sends nothing."""
        if self.cache_path is None:
            return None, "no state folder to keep the ids in", False
        data = read_json_file(self.cache_path, now=datetime.now(UTC), max_depth=MAX_DEPTH)
        if data is None:
            return None, f"first start ({self.cache_path.name} does not exist)", False
        entries = data.get("deployments") if isinstance(data, dict) else None
        if (not isinstance(entries, dict)
                or not all(isinstance(entries.get(name), str) for name in FLOWS)):
            return None, f"{self.cache_path.name} holds no ids of the three deployments", True
        if data.get("version") != version:
            return None, (f"the registration changed (version {data.get('version')} in "
                          f"{self.cache_path.name}, {version} now)"), True
        return ({name: str(entries[name]) for name in FLOWS},
                f"as registered (version {version}, ids kept in {self.cache_path.name})", False)

    def _register(self, version: str, reason: str, *, refresh: bool = False) -> dict[str, str]:
        """Make sure the pool and the three deployments are there (the module's rule); with
        refresh, make each anew from the flows (the registration changed, or the server's
        copy)."""
        self.api.call(lambda c: pool_and_queue(c, self.work_pool),
                      f"check the work pool {self.work_pool}")
        ids: dict[str, str] = {}
        made = []
        for name, deployment in self.wanted().items():
            found = None if refresh else self.api.deployment_by_name(name, self.node)
            if found is not None and not _wrong(found, self.work_pool, self.node):
                ids[name] = str(found["id"])
                continue
            ids[name] = self._apply(name, deployment)
            made.append(name)
        self.how, self.why, self._forced = "registered", reason, False
        log.info("the node's deployments %s in work pool %s: %s (%s)",
                 ", ".join(f"{name}/{self.node}" for name in FLOWS), self.work_pool,
                 f"registered {', '.join(made)}" if made else "all there", reason,
                 extra={"node": self.node})
        if self.cache_path is not None:
            text = json.dumps({"version": version, "deployments": ids}, sort_keys=True,
                              indent=1)
            try:
                with locked(self.cache_path):
                    write_atomic(self.cache_path, text.encode("utf-8") + b"\n")
            except OSError as exc:
                log.warning("could not keep the deployments' ids in %s (the next start "
                            "registers again): %s", self.cache_path, exc,
                            extra={"node": self.node})
        return ids

    def _apply(self, name: str, deployment: RunnerDeployment) -> str:
        """Create or update one deployment through Prefect's deployment API.

        What ``deployment.apply()`` sends for a deployment in a work pool (Prefect 3.9.1,
        ``RunnerDeployment._create_sync``), sent through the node's own client: ``apply``
        opens a client of its own, whose requests the node would neither see nor count.
        """
        def create(client: SyncPrefectClient) -> Any:
            return client.create_deployment(
                flow_id=client.create_flow_from_name(str(deployment.flow_name)),
                name=deployment.name, work_pool_name=self.work_pool,
                work_queue_name=deployment.work_queue_name, paused=deployment.paused,
                schedules=[], concurrency_limit=None, parameters=deployment.parameters,
                description=deployment.description, tags=deployment.tags, path=None,
                entrypoint=deployment.entrypoint,
                parameter_openapi_schema=deployment._parameter_openapi_schema.model_dump(
                    exclude_unset=True),
                enforce_parameter_schema=deployment.enforce_parameter_schema,
                job_variables=deployment.job_variables, pull_steps=[])

        return str(self.api.call(create, f"register {name}/{self.node}"))

    def forget(self) -> None:
        """Register again at the next use (a deployment was deleted on the server)."""
        self.ids = None
        self._forced = True


def _wrong(found: dict[str, Any] | None, pool: str, queue: str) -> str:
    """Return why a deployment read back will not do for the node, or "" when it will."""
    if found is None:
        return "gone (deleted, or another server or database)"
    if found.get("work_pool_name") != pool:
        return f"not in work pool {pool} (in {found.get('work_pool_name')})"
    if found.get("work_queue_name") != queue:
        return f"not in work queue {queue} (in {found.get('work_queue_name')})"
    if found.get("paused"):
        return "paused"
    if not found.get("entrypoint"):
        return "has no entrypoint"
    return ""

