"""The node's durable outbox: every job it decided, started and ended, on disk first.

One folder per job under ``<state_dir>/outbox/``, named so that listing the
folder gives the jobs in the order they were accepted:

- ``job.json``: what the job is (:class:`JobSpec`), written once, atomically,
  before anything runs;
- ``journal.jsonl``: what the node did with it, one JSON object a line, appended
  and fsynced before the node acts on it (a start is journalled before the
  process is spawned, so a kill in between is seen as an interrupted attempt);
- ``log.jsonl``: the node's own lines for the run (the start guard's answer, the
  command line, retries), ``{"t": time, "m": text}``;
- ``a<N>.spec.json``, ``a<N>.started``, ``a<N>.out``, ``a<N>.exit``: attempt N,
  as the job's keeper process (:mod:`sched_node.shim`) writes it;
- ``record.json`` and ``report.json``: how far the record in Prefect
  (:mod:`sched_node.recorder`) and the report to the controller have got.

Rule: what a job is now is a pure fold of its journal and its attempts' files
(:func:`fold`); nothing else is kept in memory that a restart would need.

A job's folder goes when its record is complete in Prefect and its end was
reported (or no controller takes reports). The outbox is bounded
(:meth:`Outbox.trim`): past ``max_bytes``, the oldest jobs' output is cut to its
last lines, oldest first; a job's identity, journal and outcome are never cut.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sched_core.statefile import write_atomic
from sched_node.job_view import (
    CANCELLED,
    COMPLETED,
    CRASHED,
    END_STATES,
    FAILED,
    KIND_JOB,
    KIND_RECONCILE,
    SKIPPED,
    Attempt,
    JobSpec,
    JobView,
    as_int,
    fold,
    parse_time,
    utc_text,
)

__all__ = ["CANCELLED", "COMPLETED", "CRASHED", "END_STATES", "EVENT_QUARANTINED", "FAILED",
           "KIND_EVENT", "KIND_JOB", "KIND_RECONCILE", "SKIPPED", "Attempt", "JobFolder",
           "JobSpec", "JobView", "Outbox", "fold", "job_id_for", "open_nofollow", "parse_time",
           "utc_text"]

log = logging.getLogger(__name__)

TRIM_KEEP_LINES = 100
"""Output lines an attempt keeps when the outbox is over its size (the last ones)."""

_SLUG = re.compile(r"[^a-z0-9]+")


KIND_EVENT = "event"
"""An outbox folder that only carries events to send (a folder put in quarantine, ...)."""
EVENT_QUARANTINED = "sched.outbox.quarantined"


def open_nofollow(path: Path, mode: str) -> Any:
    """Open a file of the state folder, never through a symlink (OSError ELOOP when it is one).

    ``mode`` is ``"a"`` (append text) or ``"rb"``.
    """
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT) if mode == "a" else os.O_RDONLY
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, mode, encoding="utf-8" if mode == "a" else None)


def job_id_for(accepted_at: datetime, key: str) -> str:
    """Return a job's folder name: accept time, a readable slug of key, and a hash of key."""
    stamp = accepted_at.astimezone(UTC).strftime("%Y%m%dT%H%M%S%f")
    digest = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    slug = _SLUG.sub("-", key.lower()).strip("-")[:60] or "job"
    return f"{stamp}-{slug}-{digest}"


class JobFolder:
    """One job's folder in the outbox (the module's files)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._spec: JobSpec | None = None

    @property
    def job_id(self) -> str:
        """The folder's name."""
        return self.path.name

    def spec(self) -> JobSpec:
        """Return the job's spec (read once); ValueError when ``job.json`` is unreadable."""
        if self._spec is None:
            try:
                with open_nofollow(self.path / "job.json", "rb") as handle:
                    data = json.loads(handle.read())
            except (OSError, ValueError) as exc:
                raise ValueError(f"{self.path}/job.json is unreadable: {exc}") from None
            if not isinstance(data, dict):
                raise ValueError(f"{self.path}/job.json is not an object")
            self._spec = JobSpec.from_json(data)
        return self._spec

    def append(self, entry: Mapping[str, Any], *, sync: bool = True) -> None:
        """Append one journal entry (with ``at`` set by the caller), fsynced unless told not."""
        line = json.dumps(dict(entry), separators=(",", ":")) + "\n"
        with self._lock, open_nofollow(self.path / "journal.jsonl", "a") as handle:
            handle.write(line)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())

    def entries(self) -> list[dict[str, Any]]:
        """Return the journal's entries; a torn last line (a kill mid-write) is left out."""
        try:
            with open_nofollow(self.path / "journal.jsonl", "rb") as handle:
                text = handle.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return []
        found: list[dict[str, Any]] = []
        for line in text.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
        return found

    def log(self, at: datetime, message: str) -> None:
        """Add one of the node's own lines to the run's log (not fsynced: a line, not a fact)."""
        line = json.dumps({"t": utc_text(at), "m": message}) + "\n"
        with self._lock, open_nofollow(self.path / "log.jsonl", "a") as handle:
            handle.write(line)

    def attempt_path(self, number: int, suffix: str) -> Path:
        """Return attempt number's file with suffix (``out``, ``started``, ``exit``, ...)."""
        return self.path / f"a{number}.{suffix}"

    def read_json(self, name: str) -> dict[str, Any] | None:
        """Return a JSON object file of the folder, None when missing or unreadable."""
        try:
            with open_nofollow(self.path / name, "rb") as handle:
                data = json.loads(handle.read())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_json(self, name: str, data: Mapping[str, Any]) -> None:
        """Replace a JSON file of the folder atomically."""
        write_atomic(self.path / name, json.dumps(dict(data), separators=(",", ":")).encode())

    def view(self) -> JobView:
        """Return what the job is now (:func:`fold` over its files); ValueError, naming the
        folder and what is wrong, when its files are not a job's."""
        try:
            return self._view()
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ValueError(f"outbox job {self.job_id}: {exc}") from None

    def _view(self) -> JobView:
        entries = self.entries()
        numbers = {as_int(entry.get("attempt"), f"journal entry {line}'s attempt")
                   for line, entry in enumerate(entries, start=1) if entry.get("e") == "launch"}
        exits: dict[int, dict[str, Any]] = {}
        started: dict[int, dict[str, Any]] = {}
        for number in numbers:
            found = self.read_json(f"a{number}.exit")
            if found is not None:
                exits[number] = found
            begun = self.read_json(f"a{number}.started")
            if begun is not None:
                started[number] = begun
        return fold(self.spec(), entries, exits, started)

    def size(self) -> int:
        """Return the bytes the folder's files take."""
        total = 0
        for item in self.path.iterdir():
            try:
                total += item.stat().st_size
            except OSError:
                continue
        return total

    def remove(self) -> None:
        """Delete the folder (its record and report are complete)."""
        shutil.rmtree(self.path, ignore_errors=True)


class Outbox:
    """The outbox folder: create, list (in accept order), trim, quarantine.

    A folder the node cannot read as a job (a journal line or ``job.json`` that is not
    one, a symlink where a folder should be) is moved to ``<state_dir>/quarantine/`` with
    one log line and a ``sched.outbox.quarantined`` event (an event folder of the outbox,
    sent as the records are), and the rest goes on: nothing in the outbox can stop the node,
    and nothing in it is followed through a symlink.
    """

    def __init__(self, root: Path, *, max_bytes: int, node: str = "") -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.node = node
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._folders: dict[str, JobFolder] = {}
        self._lock = threading.Lock()
        self.quarantined = 0

    def create(self, spec: JobSpec) -> JobFolder:
        """Write a new job's folder and its ``job.json`` (atomically, fsynced) and return it."""
        path = self.root / spec.job_id
        tmp = self.root / f".{spec.job_id}.new"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        try:
            write_atomic(tmp / "job.json", json.dumps(spec.to_json()).encode())
            os.replace(tmp, path)
        except OSError:  # a full or read-only disk: nothing half-made stays
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        folder = JobFolder(path)
        with self._lock:
            self._folders[spec.job_id] = folder
        return folder

    def folder(self, job_id: str) -> JobFolder:
        """Return the folder of job_id (one object per folder, so its journal lock is shared)."""
        with self._lock:
            found = self._folders.get(job_id)
            if found is None:
                found = self._folders[job_id] = JobFolder(self.root / job_id)
            return found

    def jobs(self) -> Iterator[JobFolder]:
        """Yield every job's folder, oldest accepted first (an unfinished create is skipped;
        a symlink is put in quarantine, never followed)."""
        try:
            items = sorted((item for item in self.root.iterdir()
                            if not item.name.startswith(".")), key=lambda item: item.name)
        except FileNotFoundError:
            return
        for item in items:
            if item.is_symlink():
                self.quarantine(item.name, "a symlink where a job's folder should be (not "
                                           "followed)")
            elif item.is_dir() and (item / "job.json").is_file():
                yield self.folder(item.name)

    def quarantine(self, name: str, reason: str) -> Path | None:
        """Move a folder the node cannot read as a job out of the outbox, saying why (a log
        line, an event); return where it went (None when it could not be moved)."""
        source = self.root / name
        target_dir = self.root.parent / "quarantine"
        now = datetime.now(UTC)
        target = target_dir / f"{name}.{now:%Y%m%dT%H%M%S%f}"
        try:
            target_dir.mkdir(mode=0o700, exist_ok=True)
            os.rename(source, target)  # a symlink is moved itself, not what it points at
        except OSError as exc:
            log.error("outbox entry %s cannot be read (%s) nor put in quarantine: %s", name,
                      reason, exc, extra={"node": self.node, "job_id": name})
            return None
        with self._lock:
            self._folders.pop(name, None)
        self.quarantined += 1
        log.error("outbox entry %s put in quarantine (%s): %s; the node goes on without it",
                  name, target, reason, extra={"node": self.node, "job_id": name})
        self.event(EVENT_QUARANTINED, {"node": self.node, "folder": name,
                                       "moved_to": str(target), "reason": reason}, now=now)
        return target

    def event(self, name: str, payload: dict[str, Any], *, now: datetime) -> None:
        """Queue one event about the node (an event folder, sent with the records)."""
        import uuid

        event = {"id": str(uuid.uuid4()), "occurred": utc_text(now), "event": name,
                 "resource": {"prefect.resource.id": f"sched.agent.{self.node}",
                              "prefect.resource.name": self.node},
                 "payload": payload}
        spec = JobSpec(job_id=job_id_for(now, f"{name}:{event['id']}"), kind=KIND_EVENT,
                       node=self.node, schedule_id="", action=name, trigger_key="event",
                       window=None, key=name, run_name=name, idempotency_key=None,
                       flow_run_id=None, planned_start=None, accepted_at=now, reason=name)
        try:
            folder = self.create(spec)
            folder.write_json("events.json", {"events": [event]})
            folder.append({"e": "end", "at": utc_text(now), "state": COMPLETED,
                           "message": name})
        except OSError as exc:
            log.error("could not queue the event %s (%s): %s", name, payload, exc,
                      extra={"node": self.node})

    def forget(self, folder: JobFolder) -> None:
        """Delete a job's folder and forget it."""
        folder.remove()
        with self._lock:
            self._folders.pop(folder.job_id, None)

    def size(self) -> int:
        """Return the bytes every job's folder takes."""
        return sum(folder.size() for folder in self.jobs())

    def trim(self, *, now: datetime, untouched: Callable[[JobFolder, int], bool]) -> int:
        """Cut the oldest jobs' output to its last lines until the outbox fits; return bytes freed.

        The policy when the outbox is full (a long outage of the Prefect
        server): identity, journal, outcome and the last
        :data:`TRIM_KEEP_LINES` lines of each attempt's output are kept; the
        rest of the output of the oldest jobs goes first, with a line saying
        how many lines were dropped. Nothing is trimmed while under ``max_bytes``.
        Only an attempt that has ended and of which nothing was sent yet
        (``untouched(folder, attempt)``) is cut, so a reader's place in it holds.
        """
        total = self.size()
        freed = 0
        if total <= self.max_bytes:
            return 0
        for folder in self.jobs():
            if total - freed <= self.max_bytes:
                break
            for out in sorted(folder.path.glob("a*.out")):
                number = int(out.name[1:].split(".", 1)[0])
                if folder.attempt_path(number, "exit").exists() and untouched(folder, number):
                    freed += _keep_tail(out, TRIM_KEEP_LINES, now)
        if freed:
            log.warning("outbox over its size: cut the output of its oldest jobs to their last "
                        "%d lines", TRIM_KEEP_LINES,
                        extra={"outbox": str(self.root), "bytes": total, "freed": freed,
                               "max_bytes": self.max_bytes})
        return freed


def _keep_tail(path: Path, keep: int, now: datetime) -> int:
    """Cut an output file to its last keep lines (with a line saying so); return bytes freed."""
    try:
        before = path.stat().st_size
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return 0
    if len(lines) <= keep + 1:
        return 0
    dropped = len(lines) - keep
    note = json.dumps({"t": utc_text(now),
                       "m": f"[{dropped} earlier output lines dropped: the node's outbox was "
                            f"full while the Prefect server was away]"})
    write_atomic(path, ("\n".join([note, *lines[-keep:]]) + "\n").encode())
    return max(before - path.stat().st_size, 0)
