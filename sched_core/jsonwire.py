"""Strict JSON for everything that arrives from outside: pulls, cache files, request bodies.

Rule: a document from outside is decoded here, and only here, and every rule
below is decided before any of it is used or stored, so whatever passes can be
written back (by pydantic, by ``json``, by Go) and read again unchanged:

1. Numbers: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON, and a number
   beyond a float64 (``1e400``, or an integer of 310 digits or more) is
   refused, as Go's ``encoding/json`` refuses them. So no integer ever reaches
   Python's 4,300-digit conversion limit, and no ``inf`` is stored as ``null``.
2. Text: no string or key holds an unpaired UTF-16 surrogate (a JSON
   ``"\\ud800"``): it is not UTF-8, and writing it back would fail.
3. Depth: nothing nests deeper than ``max_depth`` levels (the document itself
   is level 1). Any depth is a refusal naming where, never a ``RecursionError``.

Two readers share the rules. :func:`parse_strict` raises at the first bad
number (the controller's request bodies: Go's order of errors). :func:`loads`
marks a bad number where it stands and says whether the document needs a
look; :func:`find_problem` then names the first problem and its location, so a
pull can say where, and a cache file can drop only the part that holds it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from sched_core.errors import WireError

MAX_DEPTH = 100
"""The deepest nesting of one request body or schedule row (the row being level 1).

Pydantic serializes about 250 levels at most; a pull answer or a cache file,
whose rows sit at level 3, allows ``MAX_DEPTH + 2``.
"""

MAX_LIST_DEPTH = MAX_DEPTH + 2
"""The deepest nesting of a schedule list: a pull answer or a cache file, rows at level 3."""

NUL_TEXT = "contains a NUL character, which PostgreSQL text cannot hold"
SURROGATE_TEXT = "contains an unpaired UTF-16 surrogate, which is not UTF-8 text"

_GO_REFUSES = "(Go's encoding/json refuses it too)"


def is_utf8(text: str) -> bool:
    """Return whether text encodes as UTF-8 (a JSON ``\\ud800`` decodes to one that does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _constant_reason(name: str) -> str:
    return f"{name} is not JSON {_GO_REFUSES}"


def _number_reason(text: str) -> str:
    shown = text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"
    return f"number {shown} is beyond a float64 {_GO_REFUSES}"


# -- the strict reader: raise at the first bad number ---------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(_constant_reason(name))


def _finite_float(text: str) -> float:
    """Return the JSON number text as a float; one beyond a float64 is a ValueError."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(_number_reason(text))
    return value


def _float64_int(text: str) -> int:
    """Return the JSON integer text as an int; one beyond a float64 (Go's) is a ValueError."""
    # float() first: it rounds as Go does, and never hits int()'s 4,300-digit limit.
    if not math.isfinite(float(text)):
        raise ValueError(_number_reason(text))
    return int(text)


def parse_strict(raw: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Return the parsed document, or raise :class:`WireError` at its first bad number.

    Text and depth are not checked here: call :func:`find_problem` on the result.
    """
    try:
        return json.loads(raw, parse_constant=_reject_constant,
                          parse_float=_finite_float, parse_int=_float64_int)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"invalid JSON: {exc}", rule="syntax") from None
    except RecursionError:
        raise WireError(f"JSON nested deeper than {max_depth} levels", rule="depth") from None


# -- the marking reader: a bad number becomes an Invalid where it stands --------------


class Invalid:
    """A value that breaks a rule, kept in place so :func:`find_problem` can say where."""

    __slots__ = ("reason", "rule")

    def __init__(self, rule: str, reason: str) -> None:
        self.rule = rule
        self.reason = reason

    def __repr__(self) -> str:
        return f"Invalid({self.reason!r})"


class _Marker:
    """json.loads hooks that count and mark bad numbers instead of raising."""

    def __init__(self) -> None:
        self.marked = 0

    def constant(self, name: str) -> Any:
        self.marked += 1
        return Invalid("constant", _constant_reason(name))

    def float(self, text: str) -> Any:
        value = float(text)
        if math.isfinite(value):
            return value
        self.marked += 1
        return Invalid("number", _number_reason(text))

    def int(self, text: str) -> Any:
        if len(text) < 300:  # below 1e299: always a finite float64
            return int(text)
        if math.isfinite(float(text)):
            return int(text)
        self.marked += 1
        return Invalid("number", _number_reason(text))


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STRING = re.compile(rb'"[^"]*"')
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
# An escaped high surrogate not followed by a low one, or a low one not after a high one
# (an escaped backslash before "ud800" matches too: that only costs a look).
_LONE_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"
)


def _has_lone_surrogate_escape(raw: bytes) -> bool:
    # A find per case first: the regex (with its look-behind) costs far more per byte.
    if raw.find(b"\\ud") < 0 and raw.find(b"\\uD") < 0:
        return False
    return _LONE_SURROGATE_ESCAPE.search(raw) is not None


def _brackets(raw: bytes) -> bytes:
    """Return the brackets of the valid JSON document raw that are outside strings, in order."""
    structure = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    # Most strings hold no bracket: they are "" here. If removing those pairs in one
    # pass leaves no quote at all, each pair was a real string (the first quote can
    # only pair with the next, and so on), and what is left is the brackets.
    brackets = structure.replace(b'""', b"")
    return brackets if b'"' not in brackets else _STRING.sub(b"", structure)


def _within_depth(raw: bytes, max_depth: int) -> bool:
    """Return whether the valid UTF-8 JSON document raw nests at most max_depth levels.

    A pass of two plain replaces removes one or two levels, so after p passes
    the depth is between p and 2p: decide from that when it can, else count exactly.
    """
    brackets = _brackets(raw)
    passes = 0
    while brackets and passes <= max_depth:
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
        passes += 1
    if 2 * passes <= max_depth:
        return True
    if passes > max_depth:
        return False
    return nesting_depth(raw, stop_after=max_depth) <= max_depth


def nesting_depth(raw: bytes, *, stop_after: int) -> int:
    """Return how deep the valid UTF-8 JSON document raw nests, or stop_after + 1 if deeper.

    Escaped backslashes and quotes are dropped (so every quote left opens or
    closes a string), everything but quotes and brackets is dropped, strings
    are cut out; then each pass removes every innermost empty pair, so the
    number of passes is the depth: a few passes of C-speed work over a fraction
    of the bytes, instead of visiting every value.
    """
    brackets = _brackets(raw)
    depth = 0
    while brackets and depth <= stop_after:
        brackets = _EMPTY_PAIR.sub(b"", brackets)
        depth += 1
    return depth


def loads(raw: bytes, *, max_depth: int) -> tuple[Any, bool]:
    """Return (document, clean): clean means every rule holds and nothing need be checked.

    A bad number or constant is an :class:`Invalid` in the document. Invalid
    JSON, or nesting deep enough to exhaust the parser, is a :class:`WireError`.
    When clean is False, :func:`find_problem` names the problems.
    """
    marker = _Marker()
    try:
        data = json.loads(raw, parse_constant=marker.constant,
                          parse_float=marker.float, parse_int=marker.int)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"invalid JSON: {exc}", rule="syntax") from None
    except RecursionError:
        raise WireError(f"JSON nested deeper than {max_depth} levels", rule="depth") from None
    clean = (
        marker.marked == 0
        and json.detect_encoding(raw) in ("utf-8", "utf-8-sig")
        and not _has_lone_surrogate_escape(raw)
        and _within_depth(raw, max_depth)
    )
    return data, clean


def decode(raw: bytes, *, max_depth: int, root: str = "document") -> Any:
    """Return the document raw holds if it keeps every rule; else raise :class:`WireError`."""
    data, clean = loads(raw, max_depth=max_depth)
    if not clean:
        problem = find_problem(data, max_depth=max_depth, root=root)
        if problem is not None:
            raise problem
    return data


# -- the rules, over a parsed document ------------------------------------------------


def _dotted(loc: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in loc)


def find_problem(
    data: Any,
    *,
    max_depth: int = MAX_DEPTH,
    root: str = "document",
    base: tuple[str | int, ...] = (),
    nul_free_top_level: bool = False,
) -> WireError | None:
    """Return the first part of a parsed document that breaks a rule, or None.

    ``base`` is where data sits in its document (``("schedules", 3)`` for a
    row), so levels and locations count from the document. With
    ``nul_free_top_level`` a string directly in the top object must hold no NUL
    (the controller's text columns; JSON columns escape it).
    """
    if nul_free_top_level and isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, str) and "\x00" in value and is_utf8(key):
                return WireError(f"{key} {NUL_TEXT}", loc=(*base, key), kind="string_nul",
                                 rule="nul")
    # Iterative, so that any depth is an answer here and never a RecursionError.
    stack: list[tuple[tuple[str | int, ...], Any]] = [(base, data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if not is_utf8(value):
                return WireError(f"{_dotted(loc) or root} {SURROGATE_TEXT}", loc=loc,
                                 kind="string_unicode", rule="surrogate")
            continue
        if isinstance(value, Invalid):
            return WireError(value.reason, loc=loc, rule=value.rule)
        if isinstance(value, dict | list) and len(loc) + 1 > max_depth:
            return WireError(f"JSON nested deeper than {max_depth} levels", loc=loc,
                             rule="depth")
        if isinstance(value, dict):
            for key in value:
                if not is_utf8(key):
                    shown = key.encode("utf-8", "backslashreplace").decode()
                    return WireError(f"key {shown!r} {SURROGATE_TEXT}", loc=(*loc, shown),
                                     kind="string_unicode", rule="surrogate")
            stack.extend(((*loc, key), item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend(((*loc, index), item) for index, item in enumerate(value))
    return None
