"""What a job is: its spec (``job.json``) and the pure fold of its journal and tries' files.

Pure: no I/O (:mod:`sched_node.outbox` reads the files and hands them here). What a job is
now is :func:`fold` of its journal entries and its attempts' ``started`` and ``exit`` files;
an entry whose fields are not what they must be is a ValueError naming it (the outbox then
puts the folder in quarantine).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from sched_core.values import format_go_time, parse_go_time

KIND_JOB = "job"
KIND_RECONCILE = "reconcile"

COMPLETED = "Completed"
FAILED = "Failed"
CANCELLED = "Cancelled"
CRASHED = "Crashed"
SKIPPED = "Skipped"
END_STATES = frozenset({COMPLETED, FAILED, CANCELLED, CRASHED, SKIPPED})


CAUSE_LINES = 3
"""The last lines of a failed command's output its failure message carries."""
CAUSE_MAX = 600


def _escaped(char: str) -> str:
    """Return a character as text may show it: a control or format character escaped."""
    if char.isprintable() or char == " ":
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def as_int(value: object, field: str) -> int:
    """Return a journal field as an int; ValueError naming it when it is not one."""
    if value is None or value == "":
        return 0
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{field} is not an integer: {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{field} is not an integer: {value!r}") from None


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

    def cause(self, secrets: Iterable[str] = ()) -> str:
        """Return the last lines the command wrote to stderr (else to stdout), joined with
        `` | ``: a failure's why (its keeper's exit file); each secret replaced, control
        characters escaped, at most :data:`CAUSE_MAX` characters ("" when none)."""
        exit_file = self.exit or {}
        lines = exit_file.get("err_tail") or exit_file.get("out_tail") or []
        if not isinstance(lines, list):
            return ""
        text = " | ".join(str(line).strip() for line in lines[-CAUSE_LINES:]
                          if str(line).strip())
        for secret in secrets:
            if secret:
                text = text.replace(secret, "[redacted]")
        text = "".join(_escaped(char) for char in text)
        return text if len(text) <= CAUSE_MAX else "\u2026" + text[-(CAUSE_MAX - 1):]

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
    for line, entry in enumerate(entries, start=1):
        kind = entry.get("e")
        at = parse_time(entry.get("at")) or spec.accepted_at
        number = as_int(entry.get("attempt"), f"journal entry {line}'s attempt")
        if kind == "launch":
            attempts[number] = Attempt(number=number, launched_at=at)
            phase, retry_at = "running", None
        elif kind == "spawned" and number in attempts:
            attempts[number] = _replace(
                attempts[number],
                shim_pid=as_int(entry.get("shim_pid"), f"journal entry {line}'s shim_pid") or None,
                shim_start=as_int(entry.get("shim_start"),
                                f"journal entry {line}'s shim_start") or None)
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
