"""A node that cannot start on its settings says so to its controller, when it can.

Rule: the settings failed, so nothing of them is trusted but the few fields that name the
controller (``node_name``, ``pull_url``, ``report_url``, ``token``), read from the
environment (``SCHED_*``) or, raw, from the config file; when they name a controller, one
report goes there with ``start_error`` (the refusal's text), so the controller's view
shows the node cannot start, and why, instead of waiting for it to turn silent. It never
counts as a sign of life. Best effort: any failure here is one log line, and the node
exits 2. ``sched agent check CONFIG`` says the same before a restart.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from sched_core.values import check_identifier, format_go_time
from sched_node.node_report import agent_version, controller_url_of
from sched_node.settings import CONFIG_ENV

log = logging.getLogger("sched_node.node")

TIMEOUT_S = 10.0


def _raw(config: str | None) -> dict[str, Any]:
    path = config or os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    return data


def where(config: str | None = None) -> tuple[str, str, str | None] | None:
    """Return (node, report URL, token) from what names the controller, or None."""
    raw = _raw(config)

    def get(name: str) -> str | None:
        value = os.environ.get(f"SCHED_{name.upper()}") or raw.get(name)
        return value if isinstance(value, str) and value else None

    node = get("node_name") or socket.gethostname()
    try:
        check_identifier(node, "node_name")
    except ValueError:
        return None
    url = get("report_url") or controller_url_of(get("pull_url") or "", node, "report")
    if url is None or not url.startswith(("http://", "https://")):
        return None
    return node, url, get("token")


def report(error: str, *, config: str | None = None, now: datetime | None = None) -> bool:
    """Tell the controller the node cannot start, and why; return whether it took it."""
    found = where(config)
    if found is None:
        return False
    node, url, token = found
    body = {"node": node, "agent_version": agent_version(), "timezone": "UTC",
            "grace_s": 0.0, "reported_at": format_go_time(now or datetime.now(UTC)),
            "start_error": error[:2000]}
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        answer = httpx.post(url, content=json.dumps(body), headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        log.warning("could not tell the controller the node cannot start: %s", exc)
        return False
    if answer.status_code != 204:
        log.warning("the controller refused the node's start failure (%d): %s",
                    answer.status_code, answer.text[:300])
        return False
    return True
