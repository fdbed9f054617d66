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
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sched_core.statefile import write_atomic
from sched_core.values import format_go_time, parse_go_time

log = logging.getLogger(__name__)

KIND_JOB = "job"
KIND_RECONCILE = "reconcile"

COMPLETED = "Completed"
FAILED = "Failed"
CANCELLED = "Cancelled"
CRASHED = "Crashed"
SKIPPED = "Skipped"
END_STATES = frozenset({COMPLETED, FAILED, CANCELLED, CRASHED, SKIPPED})

TRIM_KEEP_LINES = 100
"""Output lines an attempt keeps when the outbox is over its size (the last ones)."""

_SLUG = re.compile(r"[^a-z0-9]+")


def utc_text(instant: datetime) -> str:
    """Return an instant as RFC 3339 in UTC with microseconds (``...T07:30:00.000123Z``)."""
    return instant.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_time(value: object) -> datetime | None:
    """Return an RFC 3339 text as an aware UTC datetime; None when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return parse_go_time(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class JobSpec:
    """What a job is: its identity in Prefect, what it runs and how (``job.json``)."""

    job_id: str
    kind: str
    node: str
    schedule_id: str
    action: str
    trigger_key: str
    window: datetime | None
    key: str
    run_name: str
    idempotency_key: str | None
    """``<node>:<key>`` for a job the node planned or fired; None for an ad hoc run."""
    flow_run_id: str | None
    """The run it records into when someone else created it (an ad hoc run)."""
    planned_start: datetime | None
    accepted_at: datetime
    reason: str
    argv: list[str] = field(default_factory=list)
    cwd: str | None = None
    timeout_s: float = 0.0
    retries: int = 0
    retry_delay_s: float = 0.0
    umask: int = 0o077
    tags: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    overlap: str = "skip"
    zone: str = ""
    """The row's own zone (its ``timezone``), empty for the node's: the command's ``TZ``."""
    repo_lock: str | None = None
    """The repository whose fleet-wide lock the job holds (``repo_lock`` rows)."""
    recorded_by: str = "node"
    """``node``: the node records the job in Prefect; ``engine``: the flow run that handed it
    the job records it (:mod:`sched_node.handoff`), the node only if that run goes away."""

    def to_json(self) -> dict[str, Any]:
        """Return the spec as ``job.json`` holds it."""
        data = asdict(self)
        data["window"] = None if self.window is None else format_go_time(self.window)
        data["planned_start"] = (None if self.planned_start is None
                                 else format_go_time(self.planned_start))
        data["accepted_at"] = utc_text(self.accepted_at)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """Read ``job.json``; raise ValueError (naming the field) when it is not one."""
        known = {name for name in cls.__dataclass_fields__}
        values = {key: value for key, value in data.items() if key in known}
        accepted = parse_time(values.get("accepted_at"))
        if accepted is None:
            raise ValueError("job.json has no accepted_at")
        values["accepted_at"] = accepted
        values["window"] = parse_time(values.get("window"))
        values["planned_start"] = parse_time(values.get("planned_start"))
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"job.json is incomplete: {exc}") from None


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job as its files and the journal tell it."""

    number: int
    launched_at: datetime
    shim_pid: int | None = None
    shim_start: int | None = None
    """The keeper's start time in clock ticks since boot (``/proc/<pid>/stat``), its identity."""
    started_at: datetime | None = None
    """When the command itself started (the keeper's ``started`` file)."""
    exit: dict[str, Any] | None = None
    """The keeper's ``exit`` file, once written."""
    interrupted: str | None = None
    """Why the attempt was given up as interrupted (its keeper is gone with no exit file)."""

    @property
    def ended(self) -> bool:
        """True once the attempt has an outcome."""
        return self.exit is not None or self.interrupted is not None

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit is not None and self.exit.get("exit_code") == 0

    @property
    def ended_at(self) -> datetime | None:
        """When the attempt ended (the exit file's time)."""
        return parse_time(self.exit.get("at")) if self.exit else None

    def failure(self, argv0: str, timeout_s: float) -> str:
        """Return the attempt's failure as one line (``tar exited with code 2``)."""
        if self.interrupted:
            return self.interrupted
        if self.exit is None:
            return "no outcome yet"
        if self.exit.get("error"):
            return str(self.exit["error"])
        if self.exit.get("cancelled"):
            return f"{argv0} was cancelled"
        if self.exit.get("timed_out"):
            return f"{argv0} timed out after {timeout_s:g} s and was killed"
        code = self.exit.get("exit_code")
        if isinstance(code, int) and code < 0:
            return f"{argv0} was killed by signal {-code}"
        return f"{argv0} exited with code {code}"


@dataclass(frozen=True)
class JobView:
    """What a job is now: the fold of its journal (:func:`fold`)."""

    spec: JobSpec
    phase: str
    """``queued`` (waiting for a slot or its turn), ``running`` (an attempt is live),
    ``retrying`` (between two attempts), ``ended``."""
    attempts: list[Attempt]
    end_state: str | None = None
    end_at: datetime | None = None
    message: str = ""
    error: str | None = None
    cancel: str | None = None
    """Why a cancel was asked (it ends the job Cancelled once its attempt is down)."""
    retry_at: datetime | None = None

    @property
    def started_at(self) -> datetime | None:
        """When the first attempt's command started."""
        for attempt in self.attempts:
            if attempt.started_at is not None:
                return attempt.started_at
        return self.attempts[0].launched_at if self.attempts else None

    @property
    def live(self) -> Attempt | None:
        """The attempt that is running (launched, no outcome), if any."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and not last.ended else None


def fold(spec: JobSpec, entries: list[dict[str, Any]],
         exits: Mapping[int, dict[str, Any]], started: Mapping[int, dict[str, Any]]) -> JobView:
    """Return what a job is now from its journal and its attempts' files (pure)."""
    attempts: dict[int, Attempt] = {}
    phase = "queued"
    end_state: str | None = None
    end_at: datetime | None = None
    message = ""
    error: str | None = None
    cancel: str | None = None
    retry_at: datetime | None = None
    for entry in entries:
        kind = entry.get("e")
        at = parse_time(entry.get("at")) or spec.accepted_at
        number = int(entry.get("attempt", 0) or 0)
        if kind == "launch":
            attempts[number] = Attempt(number=number, launched_at=at)
            phase, retry_at = "running", None
        elif kind == "spawned" and number in attempts:
            attempts[number] = _replace(attempts[number], shim_pid=entry.get("shim_pid"),
                                        shim_start=entry.get("shim_start"))
        elif kind == "interrupted" and number in attempts:
            attempts[number] = _replace(attempts[number],
                                        interrupted=str(entry.get("message", "interrupted")))
        elif kind == "retry":
            phase = "retrying"
            retry_at = parse_time(entry.get("until"))
        elif kind == "cancel":
            cancel = str(entry.get("message") or "cancelled")
        elif kind == "end":
            phase = "ended"
            end_state = str(entry.get("state") or FAILED)
            end_at = at
            message = str(entry.get("message") or "")
            error = entry.get("error") if isinstance(entry.get("error"), str) else None
    for number, attempt in list(attempts.items()):
        started_file = started.get(number)
        if started_file:
            attempt = _replace(attempt, started_at=parse_time(started_file.get("at")))
        if number in exits:
            attempt = _replace(attempt, exit=dict(exits[number]))
        attempts[number] = attempt
    ordered = [attempts[number] for number in sorted(attempts)]
    return JobView(spec=spec, phase=phase, attempts=ordered, end_state=end_state, end_at=end_at,
                   message=message, error=error, cancel=cancel, retry_at=retry_at)


def _replace(attempt: Attempt, **changes: Any) -> Attempt:
    return Attempt(**{**asdict(attempt), **changes})


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
                data = json.loads((self.path / "job.json").read_bytes())
            except (OSError, ValueError) as exc:
                raise ValueError(f"{self.path}/job.json is unreadable: {exc}") from None
            if not isinstance(data, dict):
                raise ValueError(f"{self.path}/job.json is not an object")
            self._spec = JobSpec.from_json(data)
        return self._spec

    def append(self, entry: Mapping[str, Any], *, sync: bool = True) -> None:
        """Append one journal entry (with ``at`` set by the caller), fsynced unless told not."""
        line = json.dumps(dict(entry), separators=(",", ":")) + "\n"
        with self._lock, open(self.path / "journal.jsonl", "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())

    def entries(self) -> list[dict[str, Any]]:
        """Return the journal's entries; a torn last line (a kill mid-write) is left out."""
        try:
            text = (self.path / "journal.jsonl").read_text(encoding="utf-8", errors="replace")
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
        with self._lock, open(self.path / "log.jsonl", "a", encoding="utf-8") as handle:
            handle.write(line)

    def attempt_path(self, number: int, suffix: str) -> Path:
        """Return attempt number's file with suffix (``out``, ``started``, ``exit``, ...)."""
        return self.path / f"a{number}.{suffix}"

    def read_json(self, name: str) -> dict[str, Any] | None:
        """Return a JSON object file of the folder, None when missing or unreadable."""
        try:
            data = json.loads((self.path / name).read_bytes())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_json(self, name: str, data: Mapping[str, Any]) -> None:
        """Replace a JSON file of the folder atomically."""
        write_atomic(self.path / name, json.dumps(dict(data), separators=(",", ":")).encode())

    def view(self) -> JobView:
        """Return what the job is now (:func:`fold` over its files)."""
        entries = self.entries()
        numbers = {int(entry.get("attempt", 0) or 0) for entry in entries
                   if entry.get("e") == "launch"}
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
    """The outbox folder: create, list (in accept order), trim."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._folders: dict[str, JobFolder] = {}
        self._lock = threading.Lock()

    def create(self, spec: JobSpec) -> JobFolder:
        """Write a new job's folder and its ``job.json`` (atomically, fsynced) and return it."""
        path = self.root / spec.job_id
        tmp = self.root / f".{spec.job_id}.new"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        write_atomic(tmp / "job.json", json.dumps(spec.to_json()).encode())
        os.replace(tmp, path)
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
        """Yield every job's folder, oldest accepted first (an unfinished create is skipped)."""
        try:
            names = sorted(item.name for item in self.root.iterdir()
                           if item.is_dir() and not item.name.startswith("."))
        except FileNotFoundError:
            return
        for name in names:
            if (self.root / name / "job.json").is_file():
                yield self.folder(name)

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
