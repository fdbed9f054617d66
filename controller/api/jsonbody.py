"""Request bodies read as Go's ``encoding/json`` reads them, and the 422 entries that refuse them.

Rule: a body is JSON as the Go controller's is: no ``NaN``/``Infinity`` and no
number beyond a float64, nested at most 100 deep, its text fields hold no NUL
(Postgres text cannot) and nothing but UTF-8; a node name, schedule id or task
name that no database column holds (over 200 characters, or with a NUL) is
refused on every path that takes one, so SQLite and Postgres answer alike.
A node name being stored is also an identifier (the kit's rule). Every
refusal is an :class:`controller.errors.InvalidInput` (422) naming the field,
or a :class:`controller.errors.BodyTooLarge` (413); a client that leaves before
its body is in is a :class:`controller.errors.ClientGone`; the app maps them.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from starlette.requests import ClientDisconnect, Request

from controller.errors import BodyTooLarge, ClientGone, InvalidInput
from sched_core.errors import ScheduleError, WireError
from sched_core.jsonwire import (
    MAX_DEPTH,
    NUL_TEXT,
    SURROGATE_TEXT,
    find_problem,
    is_utf8,
    parse_strict,
)
from sched_core.values import check_identifier

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 1 << 20
"""A schedule or task body larger than this is refused with 413."""

MAX_NAME_LENGTH = 200
"""The longest node name, schedule id or task name: their columns are ``varchar(200)``."""

MAX_JSON_DEPTH = MAX_DEPTH
"""The deepest nesting of a body (``params`` is level 2); pydantic serializes ~250 at most."""

_DRAIN_LIMIT = 16 * MAX_BODY_BYTES

_LOCATIONS = ("body", "query", "path", "header", "cookie")


def _field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """Return the dotted field name of a validation error location, without its source."""
    parts = [str(part) for part in loc]
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    return ".".join(parts)


def _error_entry(
    loc: tuple[Any, ...] | list[Any], msg: str, kind: str, value: Any = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "field": _field_name(loc),
        "loc": list(loc),
        "msg": msg.removeprefix("Value error, "),
        "type": kind,
    }
    # Echo a bad scalar so the answer names the value too; never a whole object.
    if isinstance(value, str | int | float | bool) and len(str(value)) <= 200:
        entry["input"] = value
    return entry


def _body_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Return a pydantic error as 422 entries located in the body (no input echoed)."""
    return [
        _error_entry(("body", *err["loc"]), err["msg"], err["type"], err.get("input"))
        for err in exc.errors(include_url=False, include_context=False)
    ]


def _unprocessable(loc: tuple[str, ...], msg: str, kind: str = "value_error") -> InvalidInput:
    return InvalidInput([_error_entry(loc, msg, kind)])


_NUL = NUL_TEXT
_SURROGATE = SURROGATE_TEXT
_is_utf8 = is_utf8


def _name_problem(name: str, *, storing: bool) -> tuple[str, str] | None:
    """Return (message, type) if name cannot be a node name, schedule id or task name.

    The length limit applies to names being stored (a PUT): reading or deleting
    by a longer name is just not found, and a row stored on SQLite before the
    limit existed stays readable and deletable.
    """
    if storing and len(name) > MAX_NAME_LENGTH:
        return f"is {len(name)} characters long; the most is {MAX_NAME_LENGTH}", "string_too_long"
    if "\x00" in name:
        return _NUL, "string_nul"
    if not _is_utf8(name):
        return _SURROGATE, "string_unicode"
    return None


def check_name(loc: tuple[str, str], name: str, *, storing: bool = False) -> None:
    """Raise InvalidInput (422) naming loc's field if name cannot be used (see _name_problem)."""
    problem = _name_problem(name, storing=storing)
    if problem is not None:
        message, kind = problem
        raise InvalidInput([_error_entry(loc, f"{loc[-1]} {message}", kind)])


def check_node(loc: tuple[str, str], node: str, *, storing: bool = False) -> None:
    """Raise InvalidInput (422) naming loc's field if node cannot be used as a node name.

    Every name is held to :func:`check_name`; a node name being stored (a
    write) must also be an identifier (:func:`sched_core.values.check_identifier`,
    the kit's rule, which the agents' pull also applies). Reading or deleting a
    node stored before the rule stays possible, as the length rule allows.
    """
    check_name(loc, node, storing=storing)
    if storing:
        try:
            check_identifier(node, loc[-1])
        except ScheduleError as exc:
            raise InvalidInput([_error_entry(loc, str(exc), "value_error")]) from None


def _body_problem(data: dict[str, Any]) -> tuple[tuple[Any, ...], str, str] | None:
    """Return (loc, message, type) of the first part of a parsed body no database can store.

    The rules are :mod:`sched_core.jsonwire`'s (UTF-8 text, at most
    MAX_JSON_DEPTH levels, the body itself being level 1), plus no NUL in a
    top-level string (a text column; JSON columns escape it).
    """
    problem = find_problem(data, max_depth=MAX_JSON_DEPTH, root="body", nul_free_top_level=True)
    if problem is None:
        return None
    loc = problem.loc[:1] if problem.rule == "depth" else problem.loc
    return ("body", *loc), problem.reason, problem.kind


def validation_entries(errors: list[Any]) -> list[dict[str, Any]]:
    """Return FastAPI's request-validation errors as 422 entries (loc kept as given)."""
    return [
        _error_entry(tuple(err.get("loc", ())), str(err.get("msg", "")), str(err.get("type")))
        for err in errors
    ]


async def read_object(request: Request, key: str, value: str) -> dict[str, Any]:
    """Return the JSON object body with key defaulted to value.

    Raises BodyTooLarge past ``MAX_BODY_BYTES`` and InvalidInput for a body
    that is not JSON Go would read, not an object, holds what no database can
    store, or whose key differs from the path's value.
    """
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                chunks.append(chunk)
            elif size > _DRAIN_LIMIT:
                break
            # Past the limit the rest is read and dropped (never buffered), so the
            # client gets its 413 instead of a reset connection.
    except ClientDisconnect:
        # Gone, or cut off by the connection guard's body deadline: nothing to answer.
        raise ClientGone("the client left before its request body was in") from None
    if size > MAX_BODY_BYTES:
        raise BodyTooLarge(f"body over {MAX_BODY_BYTES} bytes")
    raw = b"".join(chunks)
    try:
        # Go reads UTF-8 only; Python's json would also guess UTF-16 and UTF-32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _unprocessable(
            ("body",), f"the body is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start}): send JSON encoded as UTF-8", "utf8") from None
    try:
        data = parse_strict(text, max_depth=MAX_JSON_DEPTH)
    except WireError as exc:
        raise _unprocessable(("body",), exc.reason, exc.kind) from None
    if not isinstance(data, dict):
        raise _unprocessable(("body",), "expected a JSON object", "model_type")
    problem = _body_problem(data)
    if problem is not None:
        raise _unprocessable(*problem)
    data.setdefault(key, value)
    if data[key] != value:
        raise _unprocessable(
            ("body", key), f"{key} {data[key]!r} differs from the path's {value!r}"
        )
    return data


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """Return (the model a field holds, whether it is a list of them), or (None, False)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = get_origin(annotation)
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    if origin is list and len(args) == 1:
        found, _ = _model_of(args[0])
        return found, found is not None
    if len(args) == 1 and origin is not dict:  # Optional[X], X | None
        return _model_of(args[0])
    return None, False


def unknown_keys(model: type[BaseModel], data: Any,
                 loc: tuple[Any, ...] = ("body",)) -> list[dict[str, Any]]:
    """Return a 422 entry for each key of data, at any depth, that no field of model has.

    The wire models ignore unknown keys (an agent reads a newer controller's
    rows), so a write checks them itself: a misspelt ``interval_minute`` would
    turn "every 2 minutes" into the row's days and hours. Nested models (a row's
    ``schedule``, a blackout) are checked the same way.
    """
    if not isinstance(data, dict):
        return []
    fields: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        for alias in (name, info.alias, info.validation_alias):
            if isinstance(alias, str):
                fields[alias] = info
    entries = [
        _error_entry((*loc, key), f"unknown field {key!r}", "extra_forbidden")
        for key in sorted(data) if key not in fields
    ]
    for key, value in data.items():
        found = fields.get(key)
        if found is None:
            continue
        inner, is_list = _model_of(found.annotation)
        if inner is None:
            continue
        if is_list and isinstance(value, list):
            for index, item in enumerate(value):
                entries.extend(unknown_keys(inner, item, (*loc, key, index)))
        elif not is_list:
            entries.extend(unknown_keys(inner, value, (*loc, key)))
    return entries


def validate_as_go(model: type[M], data: dict[str, Any]) -> M:
    """Return data as model, its JSON types read as Go reads them; else InvalidInput (422).

    One rule for every field: a bool is a JSON ``true``/``false`` (``"false"``
    and ``0`` are refused), a number a JSON number (``"15"`` is refused), as Go's
    ``encoding/json`` refuses them; unknown keys at any depth are refused
    (:func:`unknown_keys`). The model's own checks then apply.
    """
    unknown = unknown_keys(model, data)
    if unknown:
        raise InvalidInput(unknown)
    try:
        return model.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        entries = _body_errors(exc)
        for entry, err in zip(entries, exc.errors(include_url=False), strict=True):
            if err["type"] in _JSON_TYPE_ERRORS:
                entry["msg"] += f", not a JSON {_json_type(err.get('input'))} (no conversion)"
        raise InvalidInput(entries) from None


_JSON_TYPE_ERRORS = frozenset({"bool_type", "int_type", "float_type", "string_type"})


def _json_type(value: Any) -> str:
    """Return the JSON type of a parsed value: string, number, boolean, null, array, object."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


async def read_model(request: Request, model: type[M], key: str, value: str) -> M:
    """Return the body as model, with key defaulted to (and checked against) the path's value.

    The body is read by :func:`read_object` and validated by
    :func:`validate_as_go`; a model's validation errors are an InvalidInput
    whose entries are located in the body.
    """
    return validate_as_go(model, await read_object(request, key, value))
