"""A hand-written fuzzer of the controller's HTTP API, driven by its OpenAPI document.

Every operation the document lists is called with hostile path and query
values, and every declared request body is sent as a known-good example with
one part replaced by a hostile value (wrong types, numbers past a float64,
huge and deep values, control characters, zone-database folders, instants out
of range), with a field dropped or added, or as raw bytes broken in ways JSON
readers disagree on. The contract: no answer is a 5xx, every error answer is
JSON, and the controller stays healthy.

Used by tests/test_controller_fuzz.py (bounded, on SQLite and Postgres) and by
hand for a longer hunt::

    .venv/bin/python -m tests.api_fuzzer --url http://127.0.0.1:8080 --token ADMIN \\
        --requests 20000 --seed 7
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

WAIT_TIMEOUTS = ["1", "0", "-5", "301", "1e9", "nan", "abc", "", "0.5", "1" * 400]
"""A node's long poll: every timeout the fuzzer sends is refused or answered within 1 s."""
GOOD_SCHEDULE: dict[str, Any] = {
    "name": "nightly", "repo_id": "r-9", "action": "backup", "storage": "b2",
    "schedule": {"days": ["mon", "tue"], "hours": ["2"], "minute": "30"},
    "miss_policy": "run-once-within-24h", "enabled": True, "params": {"threads": 4},
}
GOOD_REPORT: dict[str, Any] = {
    "agent_version": "0.1.0", "timezone": "America/New_York", "grace_s": 300,
    "reported_at": "2026-12-03T07:31:02Z",
    "last_pull": {"at": "2026-12-03T07:31:00Z", "ok": True, "error": None, "status": "200"},
    "schedules": [{"id": "s-1", "last_fired": "2026-12-03T07:30:00Z",
                   "next_planned": "2026-12-04T07:30:00Z", "latest_job": None}],
    "counts": {"skipped": 0, "missed": 0},
}
PATCHES: list[dict[str, Any]] = [
    {"paused": {"note": "disk swap", "until": None}}, {"paused": None},
    {"name": "renamed", "jitter": 60}, {"schedule": {"days": ["*"], "hours": ["3"], "minute": "0"}},
]
"""Merge patches of a row (PATCH): their paths are a row's, so they are fuzzed as one."""
GOOD_TASKS: list[dict[str, Any]] = [
    {"cron": "30 2 * * *", "event": "backup.nightly", "payload": {"repo": "r-9"}},
    {"schedule": {"interval_minutes": 15}, "timezone": "Europe/Paris", "event": "x"},
    {"run_at": "2031-03-30T02:30:00+02:00", "deployment": "flow/dep", "payload": {}},
    {"cron": "*/5 1 * * 0", "timezone": "America/New_York", "deployment": "a/b",
     "status": "disabled"},
]

NAMES = [
    "node-a", "n1", "s-1", "a" * 128, "a" * 129, "n" * 200, "n" * 201, "n" * 5000, ".", "..",
    ".hidden", "-rf", "--help", "a b", "a*b", "a?b", "[x]", "~root", "été", "名前", "\U0001f600",
    "x\x1b[2Jy", "a\nb", "a\rb", "a\tb", "a\x00b", "\x7f", "\u202e", "\ud800", "%00", "%2F",
    "%252F", "'", '"', "\\", ";id", "$(id)", "`id`", "<script>", "null", "0", "-1", "1e400",
    "NaN", " ", "",
]
ZONES = [
    "Europe", "America/", "Europe/Paris", "UTC", "Etc/GMT+14", "Etc/GMT-14", "", " ", "Z" * 256,
    "../../../../etc/passwd", "/etc/localtime", "Europe/Paris\x00", "posixrules", "Factory",
    "EST5EDT", "zoneinfo/UTC", "right/UTC", "Europe/Paris/x", "e" * 65, "\ud800",
]
INSTANTS = [
    "0001-01-01T00:00:00+01:00", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59-14:00",
    "9999-12-31T23:59:59Z", "2031-02-29T00:00:00Z", "2031-03-30T02:30:00", "yesterday",
    "2031-03-30T02:30:00+24:00", "2031-03-30T02:30:00.9999999999Z", "1970-01-01T00:00:00Z",
    "+275760-09-13T00:00:00Z", "2031-13-01T00:00:00Z", 0, -1, 1e20, None,
]
CRONS = [
    "* * * * *", "0 0 30 2 *", "61 * * * *", "*/0 * * * *", "* * * * * *", "@daily", "@reboot",
    "0 0 * * 8", "0-59/1 0-23 1-31 1-12 0-7", "1,2,3,4,5,6,7,8,9,10 * * * *" * 50, "L W # ?",
    "0 0 31 4,6 *", "0 2 * * sun#5", "",
]
SCALARS: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400 // 10**380, 1.5,
    -0.0, 1e308, 5e-324, "", " ", "x" * 10_000, "\x00", "\x1b[31m", "\ud800", "é", [], {},
    [[[[[]]]]], {"a": {"b": {"c": {}}}}, ["mon"], ["*"], ["2"], "mon", "*", "2", "30", "60",
    "-1", "99",
]
RAW_BODIES = [
    b"", b"{", b"[]", b"null", b"0", b'"x"', b"\xff\xfe", b'{"a": NaN}', b'{"a": 1e400}',
    b'{"name": "\\ud800"}', b'{"name": "a\\u0000b"}', b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 200 + b"1" + b"}" * 200, b'{"schedule": {"days": ["mon"]}} trailing',
    b'{"name": "x", "name": "y"}', b"\xef\xbb\xbf{}", b'{"params": ' + b"1" * 500 + b"}",
]
LIMITS = ["1", "0", "-1", "1000", "1001", "abc", "1e3", "99999999999999999999", "", "1.5"]
ETAGS = ['"x"', "*", 'W/"x"', '"', '"' * 300, "x" * 9000, '"a", "b"', "null"]


@dataclass
class Result:
    """What a fuzzing run saw: answers by status, and every 5xx or non-JSON error."""

    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    requests: int = 0

    def summary(self) -> str:
        """Return one line: the request count and the answers by status."""
        by_status = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return f"{self.requests} requests; {by_status}; {len(self.failures)} failures"


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = document["components"]["schemas"][name]
    return schema


def _paths_in(document: dict[str, Any], schema: dict[str, Any],
              prefix: tuple[str, ...] = (), depth: int = 0) -> Iterator[tuple[str, ...]]:
    """Yield the path of every property a body of schema may hold, nested ones included."""
    schema = _resolve(document, schema)
    for branch in schema.get("anyOf", []):
        yield from _paths_in(document, branch, prefix, depth)
    for name, sub in schema.get("properties", {}).items():
        yield (*prefix, name)
        if depth < 3:
            yield from _paths_in(document, sub, (*prefix, name), depth + 1)


def _hostile_for(name: str, rng: random.Random) -> Any:
    pools: list[list[Any]] = [SCALARS, NAMES]
    if name == "timezone":
        pools = [ZONES, ZONES, SCALARS]
    elif name == "run_at":
        pools = [INSTANTS, INSTANTS, SCALARS]
    elif name == "cron":
        pools = [CRONS, CRONS, SCALARS]
    elif name in ("id", "name", "repo_id", "action", "event", "deployment", "storage", "on"):
        pools = [NAMES, NAMES, SCALARS]
    return rng.choice(rng.choice(pools))


def _set(body: dict[str, Any], path: tuple[str, ...], value: Any, *, delete: bool) -> None:
    target: Any = body
    for part in path[:-1]:
        if not isinstance(target, dict):
            return
        target = target.setdefault(part, {})
    if isinstance(target, dict):
        if delete:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value


def _body(document: dict[str, Any], schema: dict[str, Any], examples: list[dict[str, Any]],
          rng: random.Random) -> tuple[bytes, str]:
    """Return a body (and what was done to it) for an operation taking schema."""
    roll = rng.random()
    if roll < 0.08:
        return rng.choice(RAW_BODIES), "raw"
    body = copy.deepcopy(rng.choice(examples))
    paths = list(dict.fromkeys(_paths_in(document, schema)))
    what = "good"
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        if roll < 0.15:
            break  # a good example as it is
        path = rng.choice(paths)
        if rng.random() < 0.15:
            _set(body, path, None, delete=True)
            what = f"drop {'.'.join(path)}"
        else:
            _set(body, path, _hostile_for(path[-1], rng), delete=False)
            what = f"set {'.'.join(path)}"
    if rng.random() < 0.05:
        body[rng.choice(NAMES) or "extra"] = rng.choice(SCALARS)
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True)
    if rng.random() < 0.05:
        text = text[: rng.randrange(len(text) + 1)]
        what += " truncated"
    try:
        return text.encode("utf-8"), what
    except UnicodeEncodeError:  # a lone surrogate: sent escaped instead
        return json.dumps(body, ensure_ascii=True, allow_nan=True).encode(), what


def operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Return (method, path template, operation) for every operation of the document."""
    found = []
    for path, item in sorted(document["paths"].items()):
        for method, operation in sorted(item.items()):
            if method in ("get", "put", "post", "patch", "delete"):
                found.append((method.upper(), path, operation))
    return found


def fuzz(client: httpx.Client, document: dict[str, Any], *, requests: int, seed: int,
         tokens: list[str | None]) -> Result:
    """Send requests generated from document through client; return what came back."""
    rng = random.Random(seed)
    result = Result()
    ops = operations(document)
    writes = [op for op in ops if "requestBody" in op[2]]
    examples_by_model = {"LocalSchedule": [GOOD_SCHEDULE], "TaskIn": GOOD_TASKS,
                         "NodeReportIn": [GOOD_REPORT],
                         "VoucherRequest": [{"purpose": "run", "subject": "s-1"},
                                            {"purpose": "cancel", "subject": "0" * 32}]}
    for _ in range(requests):
        # Half the requests carry a body: that is where the validation is.
        method, template, operation = rng.choice(writes if rng.random() < 0.5 else ops)
        url = template
        hostile_path = rng.random() < (0.3 if "requestBody" in operation else 0.7)
        for parameter in operation.get("parameters", []):
            if parameter["in"] == "path":
                value = rng.choice(NAMES) if hostile_path else "node-a"
                encoded = quote(value, safe="", errors="surrogatepass")
                url = url.replace("{" + parameter["name"] + "}", encoded or "%20")
        params: dict[str, str] = {}
        if template == "/api/schedules" or rng.random() < 0.1:
            params["node"] = rng.choice(NAMES[:20])
        if template.endswith("/dispatches"):
            params["limit"] = rng.choice(LIMITS)
        if template.endswith("/wait"):  # a long poll: hostile bounds, or at most a second
            params["timeout"] = rng.choice(WAIT_TIMEOUTS)
            params["etag"] = rng.choice(ETAGS)
        headers: dict[str, str] = {}
        token = rng.choice(tokens)
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        if method == "GET" and rng.random() < 0.3:
            headers["if-none-match"] = rng.choice(ETAGS)
        content: bytes | None = None
        what = ""
        body = operation.get("requestBody")
        if body is not None:
            schema = body["content"]["application/json"]["schema"]
            if "$ref" in schema:
                examples = examples_by_model[schema["$ref"].rsplit("/", 1)[-1]]
            else:  # a merge patch of a row: any of a row's fields
                schema, examples = {"$ref": "#/components/schemas/LocalSchedule"}, PATCHES
            content, what = _body(document, schema, examples, rng)
            headers["content-type"] = "application/json"
        try:
            response = client.request(method, url, params=params, content=content,
                                      headers=headers)
        except httpx.TransportError as exc:
            result.failures.append(f"{method} {url} ({what}): {type(exc).__name__}: {exc}")
            continue
        result.requests += 1
        result.statuses[response.status_code] += 1
        if response.status_code >= 500:
            result.failures.append(
                f"{method} {url} ({what}) -> {response.status_code}: {response.text[:300]}"
            )
        elif response.status_code >= 400 and response.status_code != 404:
            try:
                response.json()
            except ValueError:
                result.failures.append(f"{method} {url} -> {response.status_code} not JSON")
    return result


def main(argv: list[str] | None = None) -> int:
    """Fuzz a running controller; exit 1 if any answer was a 5xx."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True, help="the admin token")
    parser.add_argument("--node-token", default=None)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=60) as client:
        document = client.get("/openapi.json").json()
        tokens = [args.token, args.token, args.token, args.node_token, None, "wrong"]
        result = fuzz(client, document, requests=args.requests, seed=args.seed, tokens=tokens)
    print(result.summary())
    for failure in result.failures[:50]:
        print(failure)
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
