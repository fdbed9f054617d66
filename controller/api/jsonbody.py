"""Request bodies read as Go's ``encoding/json`` reads them, and the 422 entries that refuse them.

Rule: a body is JSON as the Go controller's is: no ``NaN``/``Infinity`` and no
number beyond a float64, nested at most 100 deep, its text fields hold no NUL
(Postgres text cannot) and nothing but UTF-8; a node name, schedule id or task
name that no database column holds (over 200 characters, or with a NUL) is
refused on every path that takes one, so SQLite and Postgres answer alike.
Every refusal is an :class:`controller.errors.InvalidInput` (422) naming the
field, or a :class:`controller.errors.BodyTooLarge` (413); the app maps them.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from controller.errors import BodyTooLarge, InvalidInput

M = TypeVar("M", bound=BaseModel)

MAX_BODY_BYTES = 1 << 20
"""A schedule or task body larger than this is refused with 413."""

MAX_NAME_LENGTH = 200
"""The longest node name, schedule id or task name: their columns are ``varchar(200)``."""

MAX_JSON_DEPTH = 100
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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (Go's encoding/json refuses it too)")


def _out_of_range(text: str) -> ValueError:
    shown = text if len(text) <= 40 else f"{text[:20]}...{text[-10:]}"
    return ValueError(f"number {shown} is beyond a float64 (Go's encoding/json refuses it too)")


def _finite_float(text: str) -> float:
    """Return the JSON number text as a float; one beyond a float64 is a ValueError."""
    value = float(text)
    if not math.isfinite(value):
        raise _out_of_range(text)
    return value


def _float64_int(text: str) -> int:
    """Return the JSON integer text as an int; one beyond a float64 (Go's) is a ValueError."""
    # float() first: it rounds as Go does, and never hits int()'s 4,300-digit limit.
    if not math.isfinite(float(text)):
        raise _out_of_range(text)
    return int(text)


def _is_utf8(text: str) -> bool:
    """Return whether text encodes as UTF-8 (a JSON ``\\ud800`` decodes to one that does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_NUL = "contains a NUL character, which PostgreSQL text cannot hold"
_SURROGATE = "contains an unpaired UTF-16 surrogate, which is not UTF-8 text"


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


def _body_problem(data: dict[str, Any]) -> tuple[tuple[Any, ...], str, str] | None:
    """Return (loc, message, type) of the first part of a parsed body no database can store.

    Every string, key or value, must be UTF-8; a top-level string (a text
    column) must hold no NUL (JSON columns escape it); no object or array may
    nest deeper than MAX_JSON_DEPTH, the body itself being level 1.
    """
    for key, value in data.items():
        if isinstance(value, str) and "\x00" in value and _is_utf8(key):
            return ("body", key), f"{key} {_NUL}", "string_nul"
    # Iterative, so that any depth is a 422 here and never a RecursionError.
    stack: list[tuple[tuple[Any, ...], Any]] = [(("body",), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return loc, f"{_field_name(loc) or 'body'} {_SURROGATE}", "string_unicode"
            continue
        if isinstance(value, dict | list) and len(loc) > MAX_JSON_DEPTH:
            return loc[:2], f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_invalid"
        if isinstance(value, dict):
            for key in value:
                if not _is_utf8(key):
                    shown = key.encode("utf-8", "backslashreplace").decode()
                    return (*loc, shown), f"key {shown!r} {_SURROGATE}", "string_unicode"
            stack.extend(((*loc, key), item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend(((*loc, index), item) for index, item in enumerate(value))
    return None


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
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
        elif size > _DRAIN_LIMIT:
            break
        # Past the limit the rest is read and dropped (never buffered), so the
        # client gets its 413 instead of a reset connection.
    if size > MAX_BODY_BYTES:
        raise BodyTooLarge(f"body over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(b"".join(chunks), parse_constant=_reject_constant,
                          parse_float=_finite_float, parse_int=_float64_int)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _unprocessable(("body",), f"invalid JSON: {exc}", "json_invalid") from None
    except RecursionError:
        raise _unprocessable(
            ("body",), f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "json_invalid"
        ) from None
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


async def read_model(request: Request, model: type[M], key: str, value: str) -> M:
    """Return the body as model, with key defaulted to (and checked against) the path's value.

    The body is read by :func:`read_object`; a model's validation errors are
    an InvalidInput whose entries are located in the body.
    """
    data = await read_object(request, key, value)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput(_body_errors(exc)) from None
