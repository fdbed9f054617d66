"""The strict JSON reader shared by pulls, cache files and the controller's bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sched_core.errors import SchedError, WireError, format_loc
from sched_core.jsonwire import (
    Invalid,
    decode,
    find_problem,
    loads,
    nesting_depth,
    parse_strict,
)


def nested(depth: int, inner: str = "1") -> bytes:
    return ('{"a":' * depth + inner + "}" * depth).encode()


@pytest.mark.parametrize(
    ("raw", "rule", "loc", "words"),
    [
        (b'{"p": {"x": NaN}}', "constant", ("p", "x"), "NaN is not JSON"),
        (b'[1, -Infinity]', "constant", (1,), "-Infinity is not JSON"),
        (b'{"p": 1e400}', "number", ("p",), "number 1e400 is beyond a float64"),
        (b'{"v": -1e400}', "number", ("v",), "beyond a float64"),
        (b'{"v": ' + b"1" * 5000 + b"}", "number", ("v",), "beyond a float64"),
        (b'[' + b"9" * 310 + b"]", "number", (0,), "beyond a float64"),
        (b'{"name": "\\ud800"}', "surrogate", ("name",), "name contains an unpaired"),
        (b'{"p": ["ok", "\\udc00"]}', "surrogate", ("p", 1), "p.1 contains an unpaired"),
        (b'{"p": {"\\ud83d": 1}}', "surrogate", ("p", "\\ud83d"), "key '\\\\ud83d'"),
        (nested(11), "depth", ("a",) * 10, "nested deeper than 10 levels"),
        (b"[" * 11 + b"]" * 11, "depth", (0,) * 10, "nested deeper than 10 levels"),
    ],
)
def test_each_rule_is_refused_naming_where(
    raw: bytes, rule: str, loc: tuple[Any, ...], words: str
) -> None:
    with pytest.raises(WireError) as info:
        decode(raw, max_depth=10)
    assert (info.value.rule, info.value.loc) == (rule, loc)
    assert words in info.value.reason
    assert isinstance(info.value, SchedError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # far past the interpreter's recursion limit
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    ],
)
def test_any_depth_is_a_wire_error_never_a_recursion_error(raw: bytes) -> None:
    with pytest.raises(WireError, match="nested deeper than 102 levels"):
        decode(raw, max_depth=102)
    with pytest.raises(WireError, match="nested deeper than 102 levels"):
        parse_strict(raw, max_depth=102)


def test_good_documents_pass_and_keep_their_values() -> None:
    doc = {"a": [1, 2.5, -0.0, 10**40, 2**63, 5e-324, 1.7976931348623157e308, True, None],
           "t": "\u00e9\U0001f600\u2028<&>", "n": "\u0000", "d": json.loads(nested(9))}
    raw = json.dumps(doc).encode()
    assert decode(raw, max_depth=11) == doc
    assert loads(raw, max_depth=11)[1] is True
    assert decode(b'{"x": 1e-400}', max_depth=3) == {"x": 0.0}  # underflow is exact enough
    # A paired escape is a real character, not a problem.
    assert decode(b'["\\ud83d\\ude00"]', max_depth=3) == ["\U0001f600"]


def test_nesting_depth_counts_containers_not_brackets_in_strings() -> None:
    assert nesting_depth(b'{"a": "[[[[{{{{", "b": [[]], "c": "\\"]]"}', stop_after=50) == 3
    assert nesting_depth(b"1", stop_after=5) == 0
    assert nesting_depth(b"[" * 30 + b"]" * 30, stop_after=5) == 6  # stops early


def test_utf16_document_with_a_lone_surrogate_is_found() -> None:
    raw = '["\ud800"]'.encode("utf-16-le", "surrogatepass")
    with pytest.raises(WireError) as info:
        decode(raw, max_depth=5)
    assert info.value.rule == "surrogate"


def test_loads_marks_bad_numbers_where_they_stand() -> None:
    data, clean = loads(b'{"ok": [1, 2], "bad": [NaN, 1e999]}', max_depth=5)
    assert not clean and data["ok"] == [1, 2]
    assert all(isinstance(item, Invalid) for item in data["bad"])
    # Per part: the good part has no problem, the bad one does.
    assert find_problem(data["ok"], base=("ok",)) is None
    problem = find_problem(data["bad"], base=("bad",))
    assert problem is not None and problem.loc in {("bad", 0), ("bad", 1)}


def test_parse_strict_is_the_controllers_reader() -> None:
    with pytest.raises(WireError, match=r"^invalid JSON: NaN is not JSON"):
        parse_strict(b'{"x": NaN}')
    with pytest.raises(WireError, match=r"^invalid JSON: Expecting"):
        parse_strict(b"{not json")
    assert parse_strict(b'{"x": "\\ud800"}') == {"x": "\ud800"}  # text is find_problem's
    problem = find_problem({"name": "a\u0000b"}, root="body", nul_free_top_level=True)
    assert problem is not None and (problem.kind, problem.loc) == ("string_nul", ("name",))


def test_format_loc() -> None:
    assert format_loc(("schedules", 3, "params", "x")) == "schedules[3].params.x"
    assert format_loc((0, 1)) == "[0][1]"
    assert str(WireError("bad", loc=("a", 2))) == "a[2]: bad"
