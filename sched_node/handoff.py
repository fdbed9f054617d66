"""Jobs the node runs for Prefect's engine: what the local door's requests do on the node.

A flow of ``flows/`` that Prefect's engine runs on this host hands its job to the node
(:mod:`sched_node.local`); this module is the node's side:

1. ``submit``: the cached row it names becomes a job now (trigger ``manual``, through the
   same start, slots, overlap and repository lock as any job), whose run is the engine's
   flow run: the node records nothing into it while the engine follows. A second hand-off
   of the same flow run (the flow asked again after the node restarted) is the same job.
2. ``job``: what the job is now and its lines after a cursor (each file's byte offset),
   waiting a while for news, so the flow can log them and end as the job did.
3. ``recorded``: the flow recorded the job's end. A job whose end nobody acknowledges
   within :data:`ENGINE_GRACE_S` (the flow's process died) is recorded by the node itself
   (:mod:`sched_node.recorder`), so its run never stays Running.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sched_core.model import LocalSchedule
from sched_node.local import MAX_LINES, wait_for
from sched_node.outbox import JobFolder, JobSpec, JobView, Outbox, utc_text
from sched_node.record_steps import read_lines
from sched_node.vouch import HOW_TO

log = logging.getLogger(__name__)

ENGINE_GRACE_S = 60.0
"""How long after its end an engine's job waits for the engine's word before the node
records the end itself."""
RECORDED_BY_ENGINE = "engine"


def engine_recorded(folder: JobFolder) -> bool:
    """Return whether the engine said it recorded the job's end."""
    return bool((folder.read_json("record.json") or {}).get("engine_recorded"))


def _cursor(text: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for part in text.split(";"):
        name, _, offset = part.partition(":")
        if name and offset.isdigit():
            found[name] = int(offset)
    return found


def _files(view: JobView) -> list[tuple[str, str]]:
    """Return (mark, file name) of the job's line files: the node's, then each try's."""
    return [("node", "log.jsonl"), *((f"a{item.number}", f"a{item.number}.out")
                                     for item in view.attempts)]


def job_answer(folder: JobFolder, cursor: str) -> dict[str, Any]:
    """Return a job now and its lines after cursor, oldest first (the door's ``GET``)."""
    view = folder.view()
    offsets = _cursor(cursor)
    lines: list[dict[str, Any]] = []
    more = False
    for mark, name in _files(view):
        start = offsets.get(mark, 0)
        found, end = read_lines(folder, name, start, MAX_LINES)
        if len(found) >= MAX_LINES:
            more = True
        lines += found
        offsets[mark] = end
    lines.sort(key=lambda item: str(item.get("t") or ""))
    tries = [{"number": item.number,
              "started_at": utc_text(item.started_at) if item.started_at else None,
              "ended_at": utc_text(item.ended_at) if item.ended_at else None,
              "exit_code": (item.exit or {}).get("exit_code")} for item in view.attempts]
    return {"job_id": folder.job_id, "run_name": view.spec.run_name, "phase": view.phase,
            "state": view.end_state, "message": view.message, "error": view.error,
            "argv": view.spec.argv, "tries": tries,
            "started_at": utc_text(view.started_at) if view.started_at else None,
            "ended_at": utc_text(view.end_at) if view.end_at else None,
            "lines": lines, "more": more,
            "after": ";".join(f"{mark}:{offset}" for mark, offset in offsets.items())}


class Handoff:
    """The node's side of the door (the module's rules), given the node's hands."""

    def __init__(self, *, node: str, outbox: Outbox, clock: Callable[[], datetime],
                 row: Callable[[str], LocalSchedule | None],
                 known: Callable[[], list[str]],
                 spec: Callable[..., JobSpec],
                 start: Callable[[LocalSchedule, JobSpec, list[str]], JobFolder],
                 wake: Callable[[], None], door_key: str | None = None) -> None:
        """door_key: with one, only callers that bring it hand over jobs (the node's own
        engine processes, :func:`sched_node.vouch.door_key`)."""
        self.node = node
        self.door_key = door_key
        self.outbox = outbox
        self._clock = clock
        self._row = row
        self._known = known
        self._spec = spec
        self._start = start
        self._wake = wake

    def submit(self, schedule_id: str, flow_run_id: str | None,
               flow_run_name: str | None, key: str | None = None) -> tuple[str | None, str]:
        """Rule 1: start the row's job for the engine's run; (job id, "") or (None, why)."""
        if self.door_key and not (key and hmac.compare_digest(key, self.door_key)):
            return None, f"refused: a flow run the node's own engine does not run; {HOW_TO}"
        if flow_run_id is not None:
            for folder in self.outbox.jobs():
                try:
                    if folder.spec().flow_run_id == flow_run_id:
                        return folder.job_id, ""
                except ValueError:
                    continue
        row = self._row(schedule_id)
        if row is None:
            known = ", ".join(sorted(self._known())) or "none"
            return None, f"no schedule {schedule_id!r} in node {self.node!r}'s cache " \
                         f"(known: {known})"
        now = self._clock()
        run_id = flow_run_id or str(uuid.uuid4())
        name = flow_run_name or run_id
        spec = self._spec(row, trigger="manual", window=None, key=f"{row.id}@manual@{run_id}",
                          start=None, reason=f"run by Prefect's engine ({name})", now=now,
                          flow_run_id=run_id, run_name=name, recorded_by=RECORDED_BY_ENGINE)
        folder = self._start(row, spec, [f"flow run {name} ({run_id}) handed this job to the "
                                         f"node (Prefect's engine follows it)"])
        log.info("took a job from Prefect's engine: schedule %s for flow run %s", row.id, name,
                 extra={"node": self.node, "flow_run_id": run_id})
        return folder.job_id, ""

    def job(self, job_id: str, cursor: str, wait_s: float) -> dict[str, Any] | None:
        """Rule 2: the job now and its lines after cursor, waiting up to wait_s for news."""
        folder = self.outbox.folder(job_id)
        if not (folder.path / "job.json").is_file():
            return None
        first = job_answer(folder, cursor)
        if first["lines"] or first["phase"] == "ended" or wait_s <= 0:
            return first
        found = [first]

        def news() -> bool:
            if not (folder.path / "job.json").is_file():
                return True
            found[0] = job_answer(folder, cursor)
            return bool(found[0]["lines"]) or found[0]["phase"] != first["phase"]

        wait_for(news, wait_s)
        return found[0]

    def recorded(self, job_id: str) -> bool:
        """Rule 3: the engine recorded the end (the recorder may let the job's folder go)."""
        folder = self.outbox.folder(job_id)
        if not (folder.path / "job.json").is_file():
            return False
        progress = folder.read_json("record.json") or {}
        folder.write_json("record.json", {**progress, "engine_recorded": True})
        self._wake()
        return True


def engine_overdue(view: JobView, now: datetime) -> bool:
    """Return whether an engine's job ended more than ENGINE_GRACE_S ago (its engine is
    presumed gone: the node records the end)."""
    return view.end_at is not None and now - view.end_at > timedelta(seconds=ENGINE_GRACE_S)
