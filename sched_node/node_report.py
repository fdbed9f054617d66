"""The node's report to the controller (``POST /api/nodes/{node}/report``), from what it knows.

The node tells the controller what it sees, from its own state only (no
Prefect read): its version, zone, grace and heartbeat interval, its last pull,
per schedule the last fired window, the next one and the latest job, counts of
skipped and missed windows, and **every job it started or ended** since the
controller last accepted a report (``jobs``), each with a sequence number, so
a report lost on the way is sent again and one sent twice changes nothing.

Rules:

1. :func:`build_report` is pure: ``now`` and the facts are parameters.
2. It goes to the controller the node pulls from, with the token it pulls
   with: ``report_url`` when set, else the pull URL's ``.../api/`` prefix plus
   ``nodes/<node>/report``. A pull URL that is a file, or has no ``/api/``,
   sends no report (said once).
3. :class:`Reporter` sends one when a job starts or ends (after
   :data:`DEBOUNCE_S`, so a burst is one report), after a reconcile, and at
   least every ``heartbeat`` (the interval it announces; the controller calls a
   node silent after a few of them). While the controller's long poll is open it
   is the node's heartbeat, and a heartbeat report goes only every
   :data:`COVERED_EVERY`. A report that fails is sent again later (:data:`RETRY_S`;
   after a ``429`` or ``503``,
   the answer's ``Retry-After`` when it says more, up to :data:`MAX_RETRY_AFTER_S`),
   with what came meanwhile (the outbox keeps every job record until a report
   carrying it is accepted); it never holds up a job. The first report of a start
   waits for the start's reconcile (at most :data:`FIRST_WAIT_S`): one report, not two.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from sched_core.model import Cache
from sched_core.plan import NextPlanned
from sched_core.values import format_go_time, retry_after_seconds
from sched_core.worker import Worker
from sched_node.history import Ended
from sched_node.outbox import SKIPPED, JobFolder, JobView, Outbox, utc_text
from sched_node.settings import AgentSettings

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
"""This agent's version, as reports give it (pyproject's)."""
COUNT_WINDOW = timedelta(hours=24)
DEBOUNCE_S = 1.0
RETRY_S = 15.0
MAX_RETRY_AFTER_S = 900.0
"""The longest ``Retry-After`` a report waits for (a controller's busier answer is capped)."""
FIRST_WAIT_S = 15.0
"""How long the start's report waits for the start's reconcile (which pokes it when done):
one report at a start, with the pull's outcome, instead of one at once and one after the
reconcile (10,000 nodes restarting sent 20,000; bench/fleet_sim_findings.md item 9)."""
COVERED_EVERY = timedelta(minutes=15)
"""How often a node whose long poll is its heartbeat still sends a full report."""
MAX_JOBS = 1000
"""Job records per report (the controller's limit); more go in the next one."""


def agent_version() -> str:
    """Return the installed package's version (pyproject's), else :data:`AGENT_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sched-fleet")
    except PackageNotFoundError:
        return AGENT_VERSION


def controller_url(settings: AgentSettings, tail: str) -> str | None:
    """Return ``<the pull URL's /api/ prefix>/nodes/<node>/<tail>`` (rule 2), or None."""
    return controller_url_of(settings.pull_url, settings.node_name, tail)


def controller_url_of(pull_url: str, node: str, tail: str) -> str | None:
    """:func:`controller_url` of a pull URL and a node name."""
    parts = urlsplit(pull_url)
    if parts.scheme not in ("http", "https") or "/api/" not in parts.path + "/":
        return None
    prefix = parts.path[: (parts.path + "/").index("/api/")]
    path = f"{prefix}/api/nodes/{quote(node, safe='')}/{tail}"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def report_url(settings: AgentSettings) -> str | None:
    """Return where the node reports (rule 2), or None when it cannot."""
    return settings.report_url or controller_url(settings, "report")


def _time(value: datetime | None) -> str | None:
    return None if value is None else format_go_time(value)


def job_record(
    view: JobView, *, seq: int, offline: bool, flow_run_id: str | None
) -> dict[str, Any]:
    """Return one job as the report's ``jobs`` entry: its identity, state, times and error."""
    spec = view.spec
    state = view.end_state or "Running"
    started = view.started_at
    return {
        "key": spec.key, "schedule_id": spec.schedule_id,
        "window": _time(spec.window), "trigger_key": spec.trigger_key, "state": state,
        "started_at": None if state == SKIPPED or started is None else utc_text(started),
        "ended_at": _time(view.end_at) if view.phase == "ended" else None,
        "error": view.error, "reason": view.message if state == SKIPPED else None,
        "offline": offline, "flow_run_id": flow_run_id, "seq": seq,
    }


def build_report(
    settings: AgentSettings,
    cache: Cache,
    *,
    now: datetime,
    last_pull: Mapping[str, Any] | None,
    latest: Mapping[str, Ended],
    counts: Mapping[str, int],
    jobs: Sequence[Mapping[str, Any]],
    next_planned: NextPlanned | None = None,
) -> dict[str, Any]:
    """Return the report's JSON body (rule 1): every schedule of the cache, in its order.

    ``next_planned`` remembers each row's next window between reports (a new one if None)."""
    nxt = next_planned or NextPlanned(node=settings.node_name, tz=settings.tz)
    nxt.keep([row.id for row in cache.schedules])
    schedules = []
    for row in cache.schedules:
        fired = cache.last_fired_at.get(row.id)
        coming = nxt(row, now=now, last_fired=fired)
        job = latest.get(row.id)
        schedules.append({
            "id": row.id,
            "last_fired": _time(fired),
            "next_planned": _time(coming.window) if coming else None,
            "latest_job": None if job is None else {
                "state": job.state, "window": job.window, "ended_at": job.ended_at,
                "flow_run_id": None, "flow_run_name": job.run_name[:300]},
        })
    return {
        "agent_version": agent_version(),
        "timezone": settings.timezone,
        "grace_s": settings.grace.total_seconds(),
        "reported_at": format_go_time(now),
        "heartbeat_s": settings.heartbeat.total_seconds(),
        "last_pull": dict(last_pull) if last_pull is not None else None,
        "schedules": schedules,
        "counts": {"skipped": int(counts.get("skipped", 0)),
                   "missed": int(counts.get("missed", 0))},
        "jobs": list(jobs),
    }


def action_contract(settings: AgentSettings) -> dict[str, Any]:
    """Return the action table as the node publishes it to the controller, which checks
    written rows against it (:mod:`controller.contracts`): never an action's ``env``."""
    # Defaults left out: a rule's "pattern": null would read as a pattern set.
    return {"actions": {name: spec.model_dump(mode="json", exclude={"env"}, exclude_defaults=True)
                        for name, spec in sorted(settings.actions.items())}}


def contract_hash(contract: Mapping[str, Any]) -> str:
    """Return the published table's hash (every report carries it)."""
    text = json.dumps(contract, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class _Pending:
    folder: JobFolder
    state: str


class Reporter:
    """Send the node's reports (rule 3) in a thread; ``facts(now)`` gives the report's body parts.

    ``done(folder)`` is called once a job's final state was accepted by the controller.
    """

    def __init__(self, settings: AgentSettings, outbox: Outbox, *,
                 clock: Callable[[], datetime],
                 facts: Callable[[datetime], dict[str, Any]],
                 done: Callable[[JobFolder], None] = lambda folder: None,
                 covered: Callable[[], bool] = lambda: False) -> None:
        """``covered()`` says whether the node's long poll is its heartbeat now: reports are
        then sent on changes and every :data:`COVERED_EVERY` only."""
        self.settings = settings
        self.outbox = outbox
        self.url = report_url(settings)
        self._clock = clock
        self._facts = facts
        self._done = done
        self._covered = covered
        self._worker = Worker("reporter", self._main)
        self._sending = threading.Lock()  # one report at a time (the thread, the last one)
        self._coming = threading.Event()
        """Set by :meth:`expect` (a reconcile began) until the next report goes."""
        self._seq_path = settings.state_dir / "report-seq"
        self._contract = action_contract(settings)
        self._contract_hash: str | None = contract_hash(self._contract)
        self._contract_sent = False  # the table goes with the first report, and when wanted
        self.sent = 0
        self.failures = 0
        self.retry_s = RETRY_S
        """When the last report failed: how long until it is sent again (rule 3)."""
        if self.url is None:
            log.info("no report to a controller: the pull URL is not a controller's /api/ URL "
                     "(set report_url)", extra={"node": settings.node_name})

    @property
    def enabled(self) -> bool:
        """True when there is a controller to report to."""
        return self.url is not None

    def start(self) -> Reporter:
        """Start the thread (once) when there is a controller; return self."""
        if self.enabled:
            self._worker.start()
        return self

    def poke(self) -> None:
        """Send a report soon (a job started or ended, a reconcile ran)."""
        self._worker.woken.set()

    def expect(self) -> None:
        """Say a report is coming (a reconcile began; it pokes when it ends): a covered
        heartbeat report that comes due meanwhile waits for it, and the two are one."""
        self._coming.set()

    def stop(self) -> None:
        """Stop the thread; what is not reported yet is sent by the next start."""
        self._worker.stop(5.0)

    def _main(self) -> None:
        heartbeat = self.settings.heartbeat.total_seconds()
        wait = FIRST_WAIT_S
        ok = False
        accepted = 0.0  # time.monotonic() of the last report the controller accepted
        while not self._worker.stopping.is_set():
            woken = self._worker.woken.wait(wait)
            if self._worker.stopping.is_set():
                return
            if woken:
                self._worker.stopping.wait(DEBOUNCE_S)
            elif ok and self._covered():
                # A heartbeat is up, and the long poll is the node's heartbeat now: no report
                # before COVERED_EVERY, the poll looked at again each heartbeat (the start's
                # report goes before the poll's first answer, uncovered: its heartbeat later
                # the poll covers the node, and no second report follows it); nor while a
                # reconcile runs (its interval is the same 15 minutes by default): its
                # report, when it ends, is this one.
                left = COVERED_EVERY.total_seconds() - (time.monotonic() - accepted)
                if left > 0 or self._coming.is_set():
                    wait = min(left, heartbeat) if left > 0 else heartbeat
                    continue
            self._worker.woken.clear()
            ok = self.send_now()
            if ok:
                accepted = time.monotonic()
            wait = heartbeat if ok else self.retry_s

    def _next_seq(self) -> int:
        try:
            seq = int(self._seq_path.read_text(encoding="ascii").strip() or 0)
        except (OSError, ValueError):
            seq = 0
        return seq + 1

    def _pending(self) -> list[tuple[_Pending, dict[str, Any]]]:
        found: list[tuple[_Pending, dict[str, Any]]] = []
        seq = self._next_seq()
        for folder in self.outbox.jobs():
            try:
                view = folder.view()
            except (ValueError, OSError):  # unreadable, or forgotten just now
                continue
            if view.spec.kind != "job":
                continue
            state = view.end_state or ("Running" if view.attempts else "")
            if not state:
                continue  # waiting for a slot: nothing to say yet
            sent = folder.read_json("report.json") or {}
            if sent.get("state") == state:
                continue
            record = folder.read_json("record.json") or {}
            found.append((_Pending(folder, state), job_record(
                view, seq=seq, offline=bool(record.get("offline")),
                flow_run_id=record.get("flow_run_id") or view.spec.flow_run_id)))
            seq += 1
            if len(found) >= MAX_JOBS:
                break
        return found

    def send_now(self) -> bool:
        """Build and send one report; return whether the controller accepted it. Never raises."""
        if self.url is None:
            return False
        with self._sending:
            self._coming.clear()
            return self._send()

    def _send(self) -> bool:
        try:
            pending = self._pending()
            body = self._facts(self._clock())
            body["jobs"] = [record for _, record in pending]
            publish = self._contract_hash is not None and not self._contract_sent
            if self._contract_hash is not None:
                body["contract_hash"] = self._contract_hash
            if publish:
                body["contract"] = self._contract
            status = self._post(body)
            if status == 422 and pending:
                # The controller refused something in the job records: the rest of the
                # report (the node's heartbeat, its schedules) still goes; the records wait
                # for the next report instead of holding every report back.
                pending = []
                status = self._post({**body, "jobs": []})
            if status == 422 and self._contract_hash is not None:
                status = self._unpublished(body)
        except Exception as exc:
            log.warning("could not build the node report (tried again later)",
                        extra={"node": self.settings.node_name, "error": repr(exc)[:300]})
            return False
        if status != 204:
            self.failures += 1
            return False
        self.sent += 1
        self._contract_sent = self._contract_sent or publish
        if pending:
            self._seq_path.write_text(str(pending[-1][1]["seq"]), encoding="ascii")
        for item, record in pending:
            try:
                item.folder.write_json("report.json",
                                       {"state": item.state, "seq": record["seq"]})
            except FileNotFoundError:
                continue  # forgotten meanwhile (its record and report were complete)
            if record["ended_at"] is not None or item.state == SKIPPED:
                self._done(item.folder)
        return True

    def _unpublished(self, body: dict[str, Any]) -> int | None:
        """Send the report without the action table, which the controller refused (an
        older controller knows no such field): rows are then not checked when written."""
        body = {key: value for key, value in body.items()
                if key not in ("contract", "contract_hash")}
        status = self._post({**body, "jobs": []})
        if status == 204:
            self._contract_hash = None
            log.warning("the controller refuses the node's action table (an older controller?):"
                        " it cannot check rows of this node when they are written",
                        extra={"node": self.settings.node_name})
        return status

    def _post(self, body: dict[str, Any]) -> int | None:
        """POST the report; return the answer's status (None: no answer)."""
        assert self.url is not None
        node = self.settings.node_name
        self.retry_s = RETRY_S
        try:
            token = self.settings.bearer_token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            response = httpx.post(self.url, content=json.dumps(body), headers={
                **headers, "Content-Type": "application/json"},
                timeout=self.settings.report_timeout.total_seconds())
        except Exception as exc:
            log.warning("could not send the node report (sent again later)",
                        extra={"node": node, "report_url": self.url, "error": repr(exc)[:300]})
            return None
        if response.headers.get("sched-contract") == "wanted":
            self._contract_sent = False  # the controller lost it: it goes with the next report
            self.poke()
        self.retry_s = retry_after(response) if response.status_code in (429, 503) else RETRY_S
        if response.status_code != 204:
            log.warning("the controller refused the node report (%d; sent again in %g s): %s",
                        response.status_code, self.retry_s, response.text[:300],
                        extra={"node": node, "report_url": self.url,
                               "status": response.status_code})
        return response.status_code


def retry_after(response: httpx.Response) -> float:
    """Return a busy answer's ``Retry-After`` in seconds, between RETRY_S and
    MAX_RETRY_AFTER_S (RETRY_S when it has none, or a date, or anything else)."""
    seconds = retry_after_seconds(response.headers.get("retry-after"), most=MAX_RETRY_AFTER_S)
    return RETRY_S if seconds is None else max(seconds, RETRY_S)


def pull_outcome(
    at: datetime, *, ok: bool, error: str | None, status: str | None
) -> dict[str, Any]:
    """Return a report's ``last_pull``."""
    return {"at": format_go_time(at), "ok": ok, "error": (error or None) and error[:2000],
            "status": status}
