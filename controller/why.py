"""``sched explain``: why one window of one node's schedule ran, or did not, in words.

Pure: no clock reads, no I/O; :func:`explain` takes ``now`` and everything the
controller knows (the row's versions, the job records, the node's liveness and
the alerts raised about it), and returns a verdict and the facts behind it:

1. **Which window.** The text names an instant (RFC 3339 with an offset), a
   window key (``s-1@2026-12-04T02:30-05:00``), or a wall time in the row's zone
   (``2026-12-04T02:30``): a wall time a spring-forward gap skips is followed to
   where DST moved the window, one a fall-back repeats is its first copy (the
   second is named). A time that is no window of the row says so, with the
   windows before and after it.
2. **The row then**: the version in force at the window (or that the row did
   not exist yet, or was deleted), in words, with its policies; what DST did to
   the window (:func:`sched_core.explain.dst_note`); whether a policy held it
   back (:func:`sched_core.policies.window_block`, ``interval_block``); whether it
   came with a write too close to it for the node to have it.
3. **What happened**: the node's job record of the window's key (state, times,
   error, the start guard's reason, offline, the run), else missed or not due
   yet (:mod:`controller.morning` rule 3); the node's silence around it (the
   alerts raised, and its latest request); the alerts about the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from controller.alert_rules import AlertFact
from controller.jobs import JobRecord
from controller.morning import NEW_ROW_S, REPORT_SLACK_S, record_detail, status_of
from controller.schedules import RowVersion
from sched_core.explain import dst_note, schedule_words
from sched_core.matcher import fire_times, window_key
from sched_core.model import LocalSchedule
from sched_core.policies import (
    describe_policies,
    duration_text,
    interval_block,
    local_text,
    row_zone,
    run_start,
    window_block,
)
from sched_core.values import TICK, utc_text

_SCAN = timedelta(hours=3)


def _wall(text: str) -> datetime | None:
    """Return a wall time without an offset (``2026-12-04T02:30``), or None."""
    try:
        parsed = datetime.fromisoformat(text.replace(" ", "T"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is None else None


def parse_window_text(text: str, schedule_id: str) -> tuple[datetime | None, datetime | None]:
    """Return (instant, wall time) the text names (rule 1): one of them is set; ValueError else."""
    text = text.strip()
    if "@" in text:
        owner, _, rest = text.partition("@")
        if owner != schedule_id:
            raise ValueError(f"the key {text[:80]!r} is not one of schedule {schedule_id!r}")
        text = rest
    wall = _wall(text)
    if wall is not None:
        return None, wall
    from controller.report_in import parse_instant

    try:
        return parse_instant(text), None
    except ValueError:
        raise ValueError(f"{text[:80]!r} is neither an RFC 3339 time with its offset, a window "
                         "key, nor a local time like 2026-12-04T02:30") from None


def version_at(versions: Sequence[RowVersion], instant: datetime) -> RowVersion | None:
    """Return the version in force at instant, or None."""
    for version in versions:
        if version.valid_from <= instant and (version.valid_until is None
                                              or instant < version.valid_until):
            return version
    return None


def _windows(row: LocalSchedule, start: datetime, end: datetime, z: ZoneInfo) -> list[datetime]:
    if not row.enabled or row.schedule.is_event:
        return []
    return list(fire_times(row.schedule, start, end, z))


def resolve(row: LocalSchedule, z: ZoneInfo, *, instant: datetime | None,
            wall: datetime | None) -> tuple[datetime | None, list[str]]:
    """Return the row's window the text names (rule 1) and what to say about finding it."""
    said: list[str] = []
    if instant is not None:
        if instant in _windows(row, instant, instant + TICK, z):
            return instant, said
        return None, said
    assert wall is not None
    guess = wall.replace(tzinfo=z)
    near = _windows(row, guess - _SCAN, guess + _SCAN, z)
    same = [w for w in near if w.astimezone(z).replace(tzinfo=None) == wall]
    if same:
        if len(same) > 1:
            said.append(f"{wall:%Y-%m-%d %H:%M} happens twice (DST fall-back): this is the first "
                        f"({local_text(same[0], z)}); the second is {local_text(same[1], z)}")
        return same[0], said
    # Through UTC: a wall time a gap skips does not come back the same.
    exists = any(guess.replace(fold=fold).astimezone(UTC).astimezone(z).replace(tzinfo=None)
                 == wall for fold in (0, 1))
    if not exists:
        for window in near:
            note = dst_note(row.schedule, window, z)
            if note.startswith(f"{wall:%H:%M} does not exist on {wall:%Y-%m-%d}"):
                said.append(note)
                return window, said
        said.append(f"{wall:%Y-%m-%d %H:%M} does not exist in {z.key} (a DST gap)")
    return None, said


def explain(
    *, node: str, schedule_id: str, text: str, versions: Sequence[RowVersion],
    records: dict[str, JobRecord], tz: ZoneInfo, grace: timedelta,
    previous: datetime | None, liveness: dict[str, Any], silence: str | None,
    alerts: Sequence[AlertFact], now: datetime, run_url: str | None,
) -> dict[str, Any]:
    """Return the verdict on one window and its facts (rules 1 to 3).

    ``records`` are the node's job records of the schedule by key; ``previous``
    the last window of the schedule that ran before the one asked about (for
    min_interval); ``run_url`` the Prefect UI base for the run's link.
    """
    facts: list[dict[str, str]] = []

    def fact(topic: str, said: str) -> None:
        facts.append({"topic": topic, "text": said})

    instant, wall = parse_window_text(text, schedule_id)
    probe = instant or (wall.replace(tzinfo=row_zone(versions[-1].row, tz)) if wall else None)
    assert probe is not None
    version = version_at(versions, probe) or version_at(versions, probe - timedelta(hours=1))
    answer: dict[str, Any] = {"node": node, "schedule_id": schedule_id, "key": None,
                              "window": None, "local": None, "record": None, "row": None,
                              "version": None, "run_url": None}

    def verdict(word: str, summary: str) -> dict[str, Any]:
        return {**answer, "verdict": word, "summary": summary, "facts": facts}

    if version is None:
        return verdict("NOT A WINDOW", _row_absent(versions, probe, schedule_id))
    row = version.row
    z = row_zone(row, tz)
    answer.update(row=row.model_dump(mode="json"), version=row.version)
    fact("row", _row_text(version, node=node, tz=tz, z=z))
    window, found = resolve(row, z, instant=instant, wall=wall)
    for said in found:
        fact("DST", said)
    if window is None:
        return verdict("NOT A WINDOW", _not_a_window(row, schedule_id, probe, z))
    key = window_key(row.id, window, z)
    answer.update(key=key, window=utc_text(window), local=local_text(window, z))
    note = dst_note(row.schedule, window, z)
    if note and not any(f["topic"] == "DST" for f in facts):
        fact("DST", note)
    start = run_start(row, window, node=node, tz=tz)
    deadline = start + grace + timedelta(seconds=REPORT_SLACK_S)
    fact("start", _start_text(window, start, deadline, grace, z))
    held = window_block(row, window, tz=tz) or interval_block(row, window, last_fired=previous,
                                                              tz=tz)
    record = records.get(key)
    answer.update(_record_fields(record, run_url))
    for said in _alert_texts(alerts, key):
        fact("alert", said)
    _silence_facts(fact, node, window, deadline, liveness, silence, alerts, now)
    if record is not None:
        fact("job", _record_text(record))
    return verdict(*_outcome(
        window=window, start=start, deadline=deadline, z=z, held=held, record=record,
        written=version.valid_from, first=version is versions[0], silence=silence, now=now))


def _row_absent(versions: Sequence[RowVersion], probe: datetime, schedule_id: str) -> str:
    """Say why no version of the row was in force at probe: not written yet, or deleted."""
    first, last = versions[0], versions[-1]
    if probe < first.valid_from:
        return (f"the row {schedule_id} did not exist on the controller yet: it was written "
                f"at {utc_text(first.valid_from)}")
    return f"the row {schedule_id} was deleted at {utc_text(last.valid_until)}"


def _row_text(version: RowVersion, *, node: str, tz: ZoneInfo, z: ZoneInfo) -> str:
    """Describe the version in force (rule 2): when written, the schedule, its policies."""
    row = version.row
    until = (f", replaced {utc_text(version.valid_until)}" if version.valid_until else
             ", in force now")
    policies = describe_policies(row, node=node, tz=tz)
    return (f"version {row.version} (written {utc_text(version.valid_from)}{until}): "
            f"{schedule_words(row.schedule)} in {z.key}, miss policy "
            f"{row.miss_policy.value}" + (f"; {', '.join(policies)}" if policies else "")
            + ("" if row.enabled else "; DISABLED"))


def _not_a_window(row: LocalSchedule, schedule_id: str, probe: datetime, z: ZoneInfo) -> str:
    """Say why probe is no window of the row: disabled, event-fired, or the windows around it."""
    if not row.enabled:
        return f"the row {schedule_id} was disabled then"
    if row.schedule.is_event:
        return (f"the row {schedule_id} is fired by the chain "
                f"({schedule_words(row.schedule)}), never on the clock")
    before = [w for w in _windows(row, probe - timedelta(days=8), probe, z)][-1:]
    after = _windows(row, probe + TICK, probe + timedelta(days=8), z)[:1]
    near = "; ".join(f"{what} {local_text(w, z)}" for what, ws in
                     (("the window before is", before), ("the one after is", after))
                     for w in ws)
    return (f"{local_text(probe, z)} is not a window of "
            f"{schedule_id} ({schedule_words(row.schedule)})" + (f": {near}" if near else ""))


def _start_text(window: datetime, start: datetime, deadline: datetime, grace: timedelta,
                z: ZoneInfo) -> str:
    """Say when the window's run starts (its jitter) and from when it counts as missed."""
    jitter = f" (its jitter: +{duration_text(start - window)})" if start != window else ""
    return (f"its run starts {local_text(start, z)}{jitter}; the node's grace is "
            f"{duration_text(grace)}, so with {REPORT_SLACK_S:g} s for its report it "
            f"counts as missed from {local_text(deadline, z)}")


def _record_fields(record: JobRecord | None, run_url: str | None) -> dict[str, Any]:
    """Return the answer's fields from the window's job record: the record, its run's link."""
    if record is None:
        return {}
    fields: dict[str, Any] = {"record": record.as_json()}
    if record.flow_run_id and run_url:
        fields["run_url"] = f"{run_url}/runs/flow-run/{record.flow_run_id}"
    return fields


def _alert_texts(alerts: Sequence[AlertFact], key: str) -> list[str]:
    """Describe the alerts raised about the window (its key, or its report)."""
    texts = []
    for alert in alerts:
        if alert.subject == key or alert.subject == f"reported@{key}":
            sent = f", sent {utc_text(alert.sent_at)}" if alert.sent_at else ", not sent yet"
            done = f", resolved {utc_text(alert.resolved_at)}" if alert.resolved_at else ""
            texts.append(f"{alert.kind} raised {utc_text(alert.detected_at)}{sent}{done}")
    return texts


def _outcome(*, window: datetime, start: datetime, deadline: datetime, z: ZoneInfo,
             held: str | None, record: JobRecord | None, written: datetime, first: bool,
             silence: str | None, now: datetime) -> tuple[str, str]:
    """Decide a found window's verdict (rule 3): held, too new, its record's, or the clock's."""
    if held is not None and record is None:
        return ("HELD", f"{local_text(window, z)} was held back by the row's policies: "
                f"{held}; it was never to run")
    if record is None and (start - written).total_seconds() < NEW_ROW_S and first:
        return ("NOT EXPECTED", f"the row was written {utc_text(written)}, "
                f"{duration_text(start - written)} before this window's run: "
                "the node could not have had it")
    if record is not None:
        status = status_of(record.state)
        word = {"completed": "RAN", "failed": "FAILED", "skipped": "SKIPPED",
                "running": "RUNNING", "cancelled": "CANCELLED"}[status]
        return word, record_detail(record).removeprefix(f"{record.state}: ")
    if now < start:
        return "NOT YET", f"its run starts {local_text(start, z)}"
    if now < deadline:
        return "DUE", f"no report yet; missed from {local_text(deadline, z)}"
    why = "no report from the node"
    if silence:
        why += f" ({silence})"
    return "MISSED", why


# Alike in shape to sched_core.policies.describe_policies (a list of parts, one per set field):
# other fields, other words.
def _record_text(record: JobRecord) -> str:
    parts = [f"state {record.state} ({record.trigger_key})"]
    if record.started_at:
        parts.append(f"started {utc_text(record.started_at)}")
    if record.ended_at:
        parts.append(f"ended {utc_text(record.ended_at)}")
    if record.duration is not None:
        parts.append(f"took {duration_text(record.duration)}")
    if record.error:
        parts.append(f"error: {record.error}")
    if record.reason:
        parts.append(f"the start guard: {record.reason}")
    if record.offline:
        parts.append("ran while the Prefect server was unreachable, recorded later")
    if record.flow_run_id:
        parts.append(f"Prefect run {record.flow_run_id}")
    parts.append(f"reported {utc_text(record.received_at)} (seq {record.seq})")
    return "; ".join(parts)


def _silence_facts(fact: Any, node: str, window: datetime, deadline: datetime,
                   liveness: dict[str, Any], silence: str | None,
                   alerts: Sequence[AlertFact], now: datetime) -> None:
    """Say whether the node was silent around the window: the alerts, then its last request."""
    for alert in alerts:
        if alert.kind != "node-silent":
            continue
        since = alert.subject.removeprefix("silent@")
        end = alert.resolved_at
        if end is not None and end < window - timedelta(hours=1):
            continue
        if alert.detected_at > deadline + timedelta(hours=1):
            continue
        back = f"back {utc_text(end)}" if end else "not back since"
        fact("node", f"node {node} went silent (last request {since}; alert raised "
                     f"{utc_text(alert.detected_at)}), {back}")
    if silence:
        fact("node", f"now: {silence}")
    elif liveness.get("last_seen_at"):
        heartbeat = liveness.get("heartbeat_s")
        every = f"{heartbeat:g} s" if isinstance(heartbeat, int | float) else "not announced"
        fact("node", f"now: alive, last request of its own {liveness['last_seen_at']} "
                     f"(heartbeat {every})")
