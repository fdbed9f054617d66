"""The controller's named SQL queries, loaded once from ``queries.sql``.

Each query in the file starts at a ``-- name: <name>`` line; the comment lines
that follow describe it and are stripped (procrastinate's ``sql/queries.sql``
and its loader). Placeholders are psycopg's ``%(name)s``; :func:`render` turns
them into sqlite3's ``:name`` for a SQLite connection.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(?P<name>[a-z_]+)\s*$")
_PYFORMAT = re.compile(r"%\((?P<name>[a-z_]+)\)s")


def parse_queries(text: str) -> dict[str, str]:
    """Return each ``-- name:`` query of text, without its comment lines; ValueError on a repeat."""
    queries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        found = _NAME.match(line.strip())
        if found:
            name = found["name"]
            if name in queries:
                raise ValueError(f"query {name!r} is defined twice in queries.sql")
            current = queries[name] = []
        elif current is not None and not line.lstrip().startswith("--"):
            current.append(line)
    return {name: "\n".join(lines).strip() for name, lines in queries.items()}


@cache
def queries() -> dict[str, str]:
    """Return the named queries of ``controller/sql/queries.sql`` (read once per process)."""
    text = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    return parse_queries(text)


def query(name: str) -> str:
    """Return the query called name (psycopg placeholders); KeyError naming it if unknown."""
    try:
        return queries()[name]
    except KeyError:
        raise KeyError(f"no query {name!r} in controller/sql/queries.sql") from None


def render(name: str, dialect: str) -> str:
    """Return the query called name for a dialect's driver: psycopg's or sqlite3's placeholders."""
    sql = query(name)
    if dialect == "postgresql":
        return sql
    if dialect == "sqlite":
        return _PYFORMAT.sub(r":\g<name>", sql)
    raise ValueError(f"no rendering of query {name!r} for the {dialect!r} dialect")
