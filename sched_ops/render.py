"""Pure helpers for the operator's tables: safe cells, times and durations for people.

Pure: no clock reads, no I/O; ``now`` is an argument. Every value shown comes
from the controller and so from whoever wrote a row: :func:`cell` makes it one
printable line (no terminal escapes, no line breaks) before it reaches a terminal.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence
from datetime import timedelta

from sched_core.policies import ago_text, duration_text

NONE = "-"
"""What an empty cell shows."""


def cell(value: object, *, limit: int = 60) -> str:
    """Return value as one printable line: control and format characters escaped, cut at limit."""
    if value is None or value == "":
        return NONE
    text = str(value)
    out = []
    for char in text:
        if char in "\t\n\r":
            out.append(" ")
        elif unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Co", "Cs"):
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    flat = " ".join("".join(out).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Return a plain text table: columns padded to their widest cell, two spaces apart."""
    body = [list(headers), *[[cell(c, limit=200) if c != NONE else c for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in body) for i in range(len(headers))]
    lines = []
    for r in body:
        padded = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)








ago = ago_text


def outcome(job: object) -> str:
    """Return a latest-job object (``{"state", "window", "ended_at", ...}``) in a word or two."""
    if not isinstance(job, dict):
        return NONE
    return cell(job.get("state") or "unknown", limit=20)


def policy_summary(row: dict[str, object]) -> str:
    """Return a row's miss policy and the policy fields it sets, short, for a table cell."""
    parts = [str(row.get("miss_policy") or "")]
    paused = row.get("paused")
    if isinstance(paused, dict):
        note = paused.get("note") or ""
        until = paused.get("until")
        parts.append(f"PAUSED{': ' + str(note) if note else ''}"
                     f"{' until ' + str(until) if until else ''}")
    for key in ("overlap", "jitter", "catchup_window", "min_interval", "blackouts",
                "not_before", "not_after", "repo_lock", "timezone"):
        value = row.get(key)
        if value in (None, "", 0, False, []):
            continue
        if key == "blackouts" and isinstance(value, list):
            parts.append(f"blackouts {len(value)}")
        elif key in ("jitter", "catchup_window", "min_interval") and isinstance(value, int):
            parts.append(f"{key} {duration_text(timedelta(seconds=value))}")
        elif value is True:
            parts.append(key)
        else:
            parts.append(f"{key} {value}")
    return ", ".join(p for p in parts if p) or NONE
