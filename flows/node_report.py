"""The node's report to the controller (``POST /api/nodes/{node}/report``), best effort.

After each reconcile and each job the agent tells the controller what it
sees (the fleet contract, point 1): its version, zone and grace, its last
pull, per schedule the last fired window, the next planned one and the latest
job outcome, and how many windows it skipped or missed in the last 24 hours.

Rules:

1. Best effort: :func:`send_report` never raises. A report that cannot be
   built in part (Prefect down) is sent without that part; one that cannot be
   sent is logged (WARNING, with node, URL and error) and dropped: the next
   reconcile or job sends a fresh one. A report never fails a job or a pull.
2. It goes to the controller the node pulls from, with the token it pulls
   with: ``report_url`` when set, else the pull URL's ``.../api/`` prefix plus
   ``nodes/<node>/report``. A pull URL that is a file, or has no ``/api/``,
   sends no report (said once per process).
3. A short timeout (``report_timeout``, 5 s by default): a slow controller
   delays the end of a reconcile or a job by at most that.
4. The report is built by :func:`build_report` (pure: ``now`` and the facts
   are parameters).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from flows.settings import AgentSettings
from sched_core.model import Cache, format_go_time
from sched_core.plan import upcoming

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
"""This agent's version, as reports give it (pyproject's)."""
COUNT_WINDOW = timedelta(hours=24)
"""Skipped and missed windows are counted over this long."""
LATEST_RUNS = 200
"""How many of the newest finished runs are read to find each schedule's latest job
(Prefect's page limit): a schedule whose latest job is older is reported without one."""
MISSED_EVENTS = 50
"""How many ``sched.window.missed`` events are read (Prefect's page limit); each
counts its windows."""

_said_no_url: set[str] = set()


def agent_version() -> str:
    """Return the installed package's version (pyproject's), else :data:`AGENT_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sched-fleet")
    except PackageNotFoundError:
        return AGENT_VERSION


def report_url(settings: AgentSettings) -> str | None:
    """Return where the node reports (rule 2), or None when it cannot."""
    if settings.report_url:
        return settings.report_url
    parts = urlsplit(settings.pull_url)
    if parts.scheme not in ("http", "https") or "/api/" not in parts.path + "/":
        return None
    prefix = parts.path[: (parts.path + "/").index("/api/")]
    path = f"{prefix}/api/nodes/{quote(settings.node_name, safe='')}/report"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _time(value: datetime | None) -> str | None:
    return None if value is None else format_go_time(value)


def build_report(
    settings: AgentSettings,
    cache: Cache,
    *,
    now: datetime,
    last_pull: Mapping[str, Any] | None,
    latest_jobs: Mapping[str, Mapping[str, Any]],
    counts: Mapping[str, int],
) -> dict[str, Any]:
    """Return the report's JSON body (rule 4): every schedule of the cache, in its order."""
    schedules = []
    for row in cache.schedules:
        fired = cache.last_fired_at.get(row.id)
        nxt = upcoming(row, now=now, last_fired=fired, count=1, node=settings.node_name,
                       tz=settings.tz).windows
        schedules.append({
            "id": row.id,
            "last_fired": _time(fired),
            "next_planned": _time(nxt[0].window) if nxt else None,
            "latest_job": dict(latest_jobs[row.id]) if row.id in latest_jobs else None,
        })
    return {
        "agent_version": agent_version(),
        "timezone": settings.timezone,
        "grace_s": settings.grace.total_seconds(),
        "reported_at": format_go_time(now),
        "last_pull": dict(last_pull) if last_pull is not None else None,
        "schedules": schedules,
        "counts": {"skipped": int(counts.get("skipped", 0)),
                   "missed": int(counts.get("missed", 0))},
    }


def job_entry(run: Any) -> dict[str, Any]:
    """Return a finished run-job run as a report's ``latest_job``."""
    params = dict(run.parameters or {})
    window = params.get("window")
    return {
        "state": (run.state.name if run.state is not None else None) or "Unknown",
        "window": window if isinstance(window, str) and window else None,
        "ended_at": _time(run.end_time),
        "flow_run_id": str(run.id),
        "flow_run_name": run.name,
    }


def latest_jobs(
    client: Any, deployment: str, node: str, *, now: datetime
) -> tuple[dict[str, dict[str, Any]], int]:
    """Return each schedule's latest finished job, and how many runs ended Skipped lately.

    The node's run-job runs are those tagged ``node:<node>`` and ``schedule:<id>``
    (whichever deployment ran them: a planned run, or ``sched run``'s ad hoc one).
    """
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.registry import tag_values

    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"node:{node}"]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[
                StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED,
            ])),
        ),
        sort=FlowRunSort.END_TIME_DESC,
        limit=LATEST_RUNS,
    )
    latest: dict[str, dict[str, Any]] = {}
    skipped = 0
    since = now - COUNT_WINDOW
    for run in runs:
        if not any(tag.startswith("schedule:") for tag in run.tags):
            continue  # not a run-job run
        schedule_id = str((run.parameters or {}).get("schedule_id")
                          or tag_values(run).get("schedule", ""))
        if run.state is not None and run.state.name == "Skipped" and (
                run.end_time is not None and run.end_time >= since):
            skipped += 1
        if schedule_id and schedule_id not in latest:
            latest[schedule_id] = job_entry(run)
    return latest, skipped


def missed_windows(client: Any, node: str, *, now: datetime) -> int:
    """Return how many windows the node reported missed (``sched.window.missed``) lately."""
    from flows.runtime import EVENT_WINDOW_MISSED

    response = client.request("POST", "/events/filter", json={
        "filter": {
            "event": {"name": [EVENT_WINDOW_MISSED]},
            "resource": {"id": [f"sched.agent.{node}"]},
            "occurred": {"since": format_go_time(now - COUNT_WINDOW),
                         "until": format_go_time(now)},
            "any_resource": None,
        },
        "limit": MISSED_EVENTS,
    })
    return sum(int(event.get("payload", {}).get("count") or 1)
               for event in response.json().get("events", []))


def prefect_facts(
    client: Any, deployment: str, node: str, *, now: datetime
) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """Return the latest jobs and the counts; a part Prefect cannot give is left out (logged)."""
    latest: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    try:
        latest, counts["skipped"] = latest_jobs(client, deployment, node, now=now)
    except Exception as exc:
        log.warning("node report without job outcomes: could not read them from Prefect: %s",
                    repr(exc)[:300], extra={"node": node})
    try:
        counts["missed"] = missed_windows(client, node, now=now)
    except Exception as exc:
        log.warning("node report without missed windows: could not read them from Prefect: %s",
                    repr(exc)[:300], extra={"node": node})
    return latest, counts


def send_report(settings: AgentSettings, report: dict[str, Any]) -> bool:
    """POST report to the controller (rules 1-3); return whether it was accepted. Never raises."""
    url = report_url(settings)
    node = settings.node_name
    if url is None:
        if node not in _said_no_url:
            _said_no_url.add(node)
            log.info("no report sent: the pull URL is not a controller's /api/ URL "
                     "(set report_url)", extra={"node": node, "pull_url": settings.pull_url})
        return False
    try:
        import httpx

        token = settings.bearer_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.post(url, json=report, headers=headers,
                              timeout=settings.report_timeout.total_seconds())
    except Exception as exc:
        log.warning("could not send the node report (best effort; the next one retries)",
                    extra={"node": node, "report_url": url, "error": repr(exc)[:300]})
        return False
    if response.status_code != 204:
        log.warning("the controller refused the node report",
                    extra={"node": node, "report_url": url, "status": response.status_code,
                           "answer": response.text[:500]})
        return False
    log.debug("node report sent", extra={"node": node, "report_url": url})
    return True


def report_after(
    settings: AgentSettings,
    *,
    now: datetime,
    deployment: str,
    last_pull: Mapping[str, Any] | None = None,
    client: Any = None,
    cache: Cache | None = None,
) -> bool:
    """Build and send a report now (after a reconcile or a job); never raises (rule 1)."""
    try:
        from sched_core.cache import load_cache

        if report_url(settings) is None:
            return send_report(settings, {})
        if cache is None:
            cache = load_cache(settings.cache_path, now=now)
        latest: dict[str, dict[str, Any]] = {}
        counts: dict[str, int] = {}
        try:
            if client is None:
                from prefect.client.orchestration import get_client

                with get_client(sync_client=True) as own:
                    latest, counts = prefect_facts(own, deployment, settings.node_name, now=now)
            else:
                latest, counts = prefect_facts(client, deployment, settings.node_name, now=now)
        except Exception as exc:  # no client at all
            log.warning("node report without job outcomes: no Prefect client: %s",
                        repr(exc)[:300], extra={"node": settings.node_name})
        report = build_report(settings, cache, now=now, last_pull=last_pull,
                              latest_jobs=latest, counts=counts)
        return send_report(settings, report)
    except Exception as exc:
        log.warning("could not build the node report (best effort)",
                    extra={"node": settings.node_name, "error": repr(exc)[:300]})
        return False


def pull_outcome(
    at: datetime, *, ok: bool, error: str | None, status: str | None
) -> dict[str, Any]:
    """Return a report's ``last_pull``."""
    return {"at": format_go_time(at), "ok": ok, "error": (error or None) and error[:2000],
            "status": status}
