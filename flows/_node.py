"""What the flows share: find the node on this host, and follow a job it runs for them."""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sched_node.local import SOCKET_NAME, NodeLink, NodeUnreachable

SOCKET_ENV = "SCHED_NODE_SOCKET"
"""Names the node's door directly (else it is found from ``SCHED_CONFIG``'s state folder)."""
RECONNECT_S = 600.0
"""How long a follower waits for a node that stopped answering (a restart) before it gives up."""
POLL_WAIT_S = 20.0
"""How long each look at the job waits for news."""


class NoNode(RuntimeError):
    """No node runs on this host for this flow (or it is another node's run)."""


def door_path() -> Path:
    """Return where the node on this host listens: ``SCHED_NODE_SOCKET``, else the state
    folder of the agent config ``SCHED_CONFIG`` names (as the node reads it)."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return Path(explicit)
    from sched_core import ConfigError
    from sched_node.settings import CONFIG_ENV, load_settings

    if not os.environ.get(CONFIG_ENV):
        raise NoNode(
            f"no node on this host for this flow: set {CONFIG_ENV} (the node's agent.toml) or "
            f"{SOCKET_ENV} in the environment of the process that runs it (for a worker: the "
            "deployment's job_variables, as prefect.yaml sets them)")
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise NoNode(f"the node's config cannot be read here: {exc}") from None
    return Path(settings.state_dir) / SOCKET_NAME


def open_node(expected: str | None) -> tuple[NodeLink, dict[str, Any]]:
    """Return a link to the node on this host and what it says of itself; NoNode when none
    answers, or when it is not the node ``expected`` (the deployment's name)."""
    path = door_path()
    link = NodeLink(path)
    try:
        info = link.node()
    except NodeUnreachable as exc:
        link.close()
        raise NoNode(f"no node answers on this host ({exc}): start it (`sched agent`), or run "
                     "this flow where the node runs") from None
    if expected and info.get("node") != expected:
        link.close()
        raise NoNode(f"this run is node {expected!r}'s, but the node on this host is "
                     f"{info.get('node')!r}: run it on {expected!r}'s host")
    return link, info


def log_line(logger: logging.Logger | logging.LoggerAdapter[Any], line: dict[str, Any]) -> None:
    """Log one of the job's lines at the time it was written (the node's record of it)."""
    base = logger.logger if isinstance(logger, logging.LoggerAdapter) else logger
    extra = dict(logger.extra or {}) if isinstance(logger, logging.LoggerAdapter) else {}
    record = base.makeRecord(base.name, logging.INFO, __file__, 0, str(line.get("m", "")),
                             (), None, extra=extra)
    stamp = line.get("t")
    if isinstance(stamp, str):
        try:
            record.created = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    base.handle(record)


def follow(link: NodeLink, job_id: str,
           logger: logging.Logger | logging.LoggerAdapter[Any]) -> dict[str, Any]:
    """Follow a job to its end, logging its lines; return its last answer (phase ``ended``).

    A node that stops answering (it restarts; the job goes on in its keeper) is waited for
    up to :data:`RECONNECT_S`; a node that forgot the job is a NoNode.
    """
    cursor = ""
    lost_since: float | None = None
    while True:
        try:
            found = link.job(job_id, cursor, POLL_WAIT_S)
        except NodeUnreachable as exc:
            now = time.monotonic()
            if lost_since is None:
                lost_since = now
                logger.warning("the node stopped answering (%s); waiting for it", exc)
            if now - lost_since > RECONNECT_S:
                raise NoNode(f"the node did not answer for {RECONNECT_S:g} s: the job may "
                             "still run in its keeper; the node records its end") from None
            time.sleep(2.0)
            continue
        if lost_since is not None:
            logger.info("the node answers again; following the job")
            lost_since = None
        if found is None:
            raise NoNode(f"the node has no job {job_id!r} any more")
        for line in found.get("lines", []):
            log_line(logger, line)
        cursor = str(found.get("after", cursor))
        if found.get("phase") == "ended" and not found.get("more"):
            return found
