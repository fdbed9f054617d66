"""Fill an action's argv template from a schedule row, every value checked where it lands.

Rule: :func:`render_argv` checks everything before anything runs, so a template
naming a missing parameter, or a value that breaks a rule, fails with a clear
error naming the schedule, the field and the rule. The node renders each job's
command with it; the controller renders each written row with it against the
node's published action table (``lexical``), so a row the node would refuse is
refused when it is written.

Rule: a value is data, never an option, a path out of bounds, or a pattern.
Every value a row, a run parameter or the node puts into an argv element is
checked where it lands (docs/agent-reference.md, "What a row may put into a command"):

1. Any value: at most MAX_VALUE_BYTES bytes, no control character (NUL,
   newline, ...); ``repo_id``, ``id``, ``action``, ``node`` and
   ``trigger_key`` are identifiers (letters, digits, ``._-``, not starting
   with ``.`` or ``-``, at most 200 characters); a declared param or field
   meets its ParamSpec (type, pattern, bounds, roots).
2. A value that starts an argv element may not start with ``-`` (it would be
   an option), unless its declaration says ``allow_dash``; a value that is a
   whole element may not be empty nor one of find's operators (``! ( ) , ; +``).
3. A value inside a ``{state_dir}`` element may not hold ``/``, ``..``, glob
   characters, nor be empty or ``.``: it never leaves the state folder.
4. A value in a pattern (an element with a literal ``*?[``, or the argument
   of ``-name``, ``--exclude``, ...) may not hold glob characters; after
   ``-regex`` no regex characters.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sched_core.action_specs import MAX_VALUE_BYTES, ActionSpec, ParamSpec, template_pieces
from sched_core.errors import ConfigError
from sched_core.model import LocalSchedule

IDENTIFIER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
"""An identifier: letters, digits, ``._-``, not starting with ``.`` or ``-``, 1-200 long."""

IDENTIFIER_FIELDS = frozenset({"repo_id", "schedule_id", "action", "node", "trigger_key"})

FIND_OPERATORS = frozenset({"!", "(", ")", ",", ";", "+", "{}"})
"""Words that change a find expression (or end its -exec) when they are a whole element."""

GLOB_CHARS = "*?[]\\"
REGEX_CHARS = ".^$*+?()[]{}|\\"
PATTERN_OPTIONS = frozenset({
    "-name", "-iname", "-path", "-ipath", "-wholename", "-iwholename", "-lname", "-ilname",
    "--exclude", "--iexclude", "--include", "--iinclude", "--glob", "--exclude-dir",
    "--include-dir", "--filter",
})
"""Options whose argument is a glob: the value after them (or after ``--opt=``) is one."""
REGEX_OPTIONS = frozenset({"-regex", "-iregex"})
_CONTROL_RE = re.compile("[\x00-\x1f\x7f]")
_CONTROL_NAMES = {"\x00": "a NUL character", "\n": "a newline", "\r": "a carriage return"}


def window_stamp(window: datetime | None, *, now: datetime | None = None) -> str:
    """Return a window as a compact UTC stamp for names and file names: 20261202T0730Z.

    A window without a UTC offset is a ConfigError: reading it in the machine's
    local time would name (and write) a different window on every host. No
    window (an ad hoc or chain job) is named after ``now``.
    """
    if window is not None and (window.tzinfo is None or window.utcoffset() is None):
        raise ConfigError(
            f"window {window.isoformat()} has no UTC offset; give one, "
            f"such as {window.isoformat()}Z or {window.isoformat()}-05:00"
        )
    instant = window or now
    if instant is None:
        raise ConfigError("a job without a window is named after the time it starts: give now")
    return instant.astimezone(UTC).strftime("%Y%m%dT%H%MZ")


class ValueRefused(ConfigError):
    """A value of the schedule breaks a rule of the action table; nothing was run."""


def _show(text: object) -> str:
    """Return a value for an error message: its repr, cut short when long."""
    shown = repr(text)
    if len(shown) > 200:
        size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else None
        shown = f"{shown[:160]}..." + (f" ({size} bytes)" if size is not None else "")
    return shown


@dataclass(frozen=True)
class _Slot:
    """One placeholder of one argv element, and where the schedule's value came from."""

    where: str  # "schedule 's-1' (backup)"
    label: str  # "params.path", "repo_id", "node", ...
    field: str  # "param", "repo_id", ...
    rule: ParamSpec | None
    program: str

    def refuse(self, value: object, rule: str) -> ValueRefused:
        return ValueRefused(f"{self.where}: {self.label} = {_show(value)} refused: {rule}")


def _plain_text(slot: _Slot, value: object) -> str:
    """Return an undeclared value as text: a string, a number or a bool."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (str, int, float)):
        return str(value)
    raise slot.refuse(value, f"it is a {type(value).__name__}, not a string, number or bool")


def _check_text(slot: _Slot, text: str) -> None:
    """Refuse a value too long, with a control character, or a bad identifier."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_VALUE_BYTES:
        raise slot.refuse(text, f"it is {size} bytes long, more than the {MAX_VALUE_BYTES} allowed")
    bad = _CONTROL_RE.search(text)
    if bad:
        char = bad.group(0)
        name = _CONTROL_NAMES.get(char, f"the control character U+{ord(char):04X}")
        raise slot.refuse(text, f"it holds {name}")
    if slot.field in IDENTIFIER_FIELDS and not IDENTIFIER_RE.fullmatch(text):
        raise slot.refuse(
            text,
            "an identifier is letters, digits, '.', '_' or '-', not starting with '.' or "
            "'-', at most 200 characters",
        )


def _declared_text(slot: _Slot, rule: ParamSpec, value: object, cwd: Path | None,
                   lexical: bool = False) -> str:
    """Return value as text once it meets its declared rule."""
    if rule.type == "int":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise slot.refuse(value, f"declared int, it is a {type(value).__name__}")
        if rule.min is not None and value < rule.min:
            raise slot.refuse(value, f"it is below the minimum {rule.min}")
        if rule.max is not None and value > rule.max:
            raise slot.refuse(value, f"it is above the maximum {rule.max}")
        return str(value)
    if rule.type == "bool":
        if not isinstance(value, bool):
            raise slot.refuse(value, f"declared bool, it is a {type(value).__name__}")
        return "true" if value else "false"
    if not isinstance(value, str):
        raise slot.refuse(value, f"declared {rule.type}, it is a {type(value).__name__}")
    _check_text(slot, value)
    if rule.type == "path":
        return _checked_path(slot, rule, value, cwd, lexical)
    if rule.max_length is not None and len(value) > rule.max_length:
        raise slot.refuse(value, f"it is longer than max_length {rule.max_length}")
    if rule.choices is not None and value not in rule.choices:
        raise slot.refuse(value, f"it is not one of {', '.join(map(repr, rule.choices))}")
    # lexical: a node's regex never runs on the controller (one hostile node could stall it
    # with a catastrophic pattern); the node checks it at the window.
    if rule.pattern is not None and not lexical and not re.fullmatch(rule.pattern, value):
        raise slot.refuse(value, f"it does not match the pattern {rule.pattern!r}")
    return value


def _checked_path(slot: _Slot, rule: ParamSpec, value: str, cwd: Path | None,
                  lexical: bool = False) -> str:
    """Return the resolved path of value once it stays under one of the rule's roots."""
    if not value or value.startswith("-"):
        raise slot.refuse(value, "a path may not be empty or start with '-'")
    path = value
    if not os.path.isabs(path):
        if cwd is None:
            raise slot.refuse(
                value, "it is not an absolute path (a relative one needs the action's cwd)"
            )
        path = os.path.join(cwd, path)
    # lexical: the symlinks are the node's, not on this disk; the node resolves them.
    real = os.path.normpath if lexical else os.path.realpath
    resolved = real(os.path.normpath(path))
    roots = [real(str(root)) for root in rule.under or ()]
    for root in roots:
        if resolved == root or resolved.startswith(root.rstrip("/") + "/"):
            return resolved
    raise slot.refuse(
        value,
        f"it is not under {' or '.join(roots)} (it resolves to {resolved}"
        + ("" if lexical else "; symlinks are followed") + ")",
    )


def _slot_value(
    spec: ActionSpec,
    schedule: LocalSchedule,
    field: str,
    name: str,
    *,
    where: str,
    node: str,
    trigger_key: str,
) -> tuple[_Slot, object]:
    """Return the slot of one placeholder and its raw value; ConfigError if it has none."""
    program = spec.argv[0]
    if field == "param":
        params: Mapping[str, Any] = schedule.params or {}
        if name not in params or params[name] is None:
            raise ConfigError(
                f"schedule {schedule.id!r} ({schedule.action}) has no parameter {name!r} "
                f"that its argv template names as {{param:{name}}}"
            )
        slot = _Slot(where, f"params.{_name(name)}", field, spec.params.get(name), program)
        if slot.rule is None and spec.strict_params is not False:
            raise slot.refuse(params[name], _undeclared(schedule.action, name))
        return slot, params[name]
    raw: dict[str, str] = {
        "repo_id": schedule.repo_id,
        "storage": schedule.storage,
        "schedule_id": schedule.id,
        "action": schedule.action,
        "node": node,
        "trigger_key": trigger_key,
    }
    if field in ("repo_id", "storage") and not raw[field]:
        raise ConfigError(
            f"schedule {schedule.id!r} ({schedule.action}) has no {field} "
            f"but its argv template names {{{field}}}"
        )
    label = {"schedule_id": "id", "node": "node (node_name)",
             "trigger_key": "trigger_key (run parameter)"}.get(field, field)
    return _Slot(where, label, field, spec.fields.get(field), program), raw[field]


def _undeclared(action: str, name: str) -> str:
    return (
        f"action {action!r} declares no param {name!r} (strict_params): declare it as "
        f"[actions.{action}.params.{name}] with a type, or set strict_params = false"
    )


def _check_declared(spec: ActionSpec, schedule: LocalSchedule, where: str) -> None:
    """Refuse a param the action does not declare (unless its params are not strict)."""
    if spec.strict_params is False:
        return
    for name in sorted(schedule.params or {}):
        if name not in spec.params:
            raise ValueRefused(
                f"{where}: params.{_name(name)} refused: "
                f"{_undeclared(schedule.action, _name(name))}"
            )


def render_argv(
    spec: ActionSpec,
    schedule: LocalSchedule,
    *,
    state_dir: Path,
    node: str,
    window: datetime | None,
    trigger_key: str,
    now: datetime | None = None,
    lexical: bool = False,
) -> list[str]:
    """Return the argv of spec filled from schedule, every value checked (module rules).

    ``{window}`` is the window's UTC stamp, or ``now``'s for a job without a window (a
    chain stage's, an ad hoc run's): a template that names it needs one of them.

    ``lexical`` checks as the controller can, away from the node's disk: a path is
    normalised but not resolved (symlinks are the node's), and a ``pattern`` rule is left
    to the node.

    Raises ConfigError naming a missing value, ValueRefused (a ConfigError)
    naming the schedule, the field and the rule a value broke.
    """
    where = f"schedule {_show(schedule.id)} ({schedule.action})"
    _check_declared(spec, schedule, where)
    fixed = {"state_dir": lambda: str(state_dir), "window": lambda: window_stamp(window, now=now)}
    argv: list[str] = []
    for index, template in enumerate(spec.argv):
        pieces = template_pieces(template)
        place = _Place.of(spec.argv, index, pieces)
        out: list[str] = []
        first: tuple[_Slot, str] | None = None  # the value the element starts with
        last: _Slot | None = None
        for literal, field, name, _conv in pieces:
            out.append(literal)
            if field is None:
                continue
            if field in fixed:
                out.append(fixed[field]())
                continue
            slot, value = _slot_value(spec, schedule, field, name, where=where, node=node,
                                      trigger_key=trigger_key)
            if slot.rule is not None:
                text = _declared_text(slot, slot.rule, value, spec.cwd, lexical)
            else:
                text = _plain_text(slot, value)
                _check_text(slot, text)
            place.check(slot, text)
            if first is None and text and not "".join(out):
                first = (slot, text)
            last = slot
            out.append(text)
        element = "".join(out)
        if first is not None:
            _check_element_start(first[0], first[1], whole=place.single)
        elif not element and last is not None:
            raise last.refuse(element, "an argv element may not be empty")
        argv.append(element)
    return argv


@dataclass(frozen=True)
class _Place:
    """Where in the argv an element's values land: a {state_dir} path, a pattern, a regex."""

    template: str
    in_state: bool
    in_glob: bool
    in_regex: bool
    single: bool  # the element is one placeholder and nothing else

    @classmethod
    def of(cls, argv: list[str], index: int,
           pieces: list[tuple[str, str | None, str, str | None]]) -> _Place:
        literals = "".join(literal for literal, *_ in pieces)
        fields = [field for _, field, _, _ in pieces if field is not None]
        before = argv[index - 1] if index else ""
        head = pieces[0][0] if pieces else ""
        option = head.split("=", 1)[0] if "=" in head else ""  # --exclude={param:x}
        return cls(
            template=argv[index],
            in_state="state_dir" in fields,
            in_glob=(any(c in literals for c in "*?[")
                     or before in PATTERN_OPTIONS or option in PATTERN_OPTIONS),
            in_regex=before in REGEX_OPTIONS or option in REGEX_OPTIONS,
            single=not literals and len(fields) == 1,
        )

    def check(self, slot: _Slot, text: str) -> None:
        """Refuse a value that would leave the state folder or widen a pattern."""
        if self.in_state and ("/" in text or ".." in text or text in ("", ".")
                              or any(c in GLOB_CHARS for c in text)):
            raise slot.refuse(
                text,
                "inside a {state_dir} path a value may not be empty or '.', nor hold "
                "'/', '..' or any of *?[]\\ (it must not leave the state folder or "
                "match other files)",
            )
        if self.in_glob and any(c in GLOB_CHARS for c in text):
            raise slot.refuse(
                text, f"it lands in a pattern ({self.template!r}), where *?[]\\ are not allowed"
            )
        if self.in_regex and any(c in REGEX_CHARS for c in text):
            raise slot.refuse(
                text,
                f"it lands in a regex ({self.template!r}), where {REGEX_CHARS} are not allowed",
            )


def _name(name: str) -> str:
    """Return a param name for a message: as is when plain, else its repr, cut short."""
    return name if IDENTIFIER_RE.fullmatch(name) else _show(name)


def _check_element_start(slot: _Slot, text: str, *, whole: bool) -> None:
    """Refuse a value that would be read as an option or an operator at an element's start."""
    allowed = slot.rule is not None and slot.rule.allow_dash
    if text.startswith("-") and not allowed:
        raise slot.refuse(
            text,
            f"it starts with '-' at the start of an argv element, so {slot.program} would "
            "read it as an option (values are data: declare the param with allow_dash and "
            "a pattern if it is meant to be one)",
        )
    if whole and text in FIND_OPERATORS:
        words = " ".join(sorted(FIND_OPERATORS))
        raise slot.refuse(text, f"a whole argv element may not be one of {words}")
