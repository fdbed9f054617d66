"""The agents' schedule rows, per node: the store behind ``GET /api/schedules?node=N``.

Rules:

- every change to a node's list (add, update, delete) bumps that node's
  ``node_revision`` row in the same transaction, so the ETag of the list changes
  exactly when the list does;
- a row is stored in one column per Go field, plus its set policy fields
  (:data:`POLICY_FIELDS`) in one JSON column, so a row without policies is
  stored (and served) exactly as the Go kit's;
- every write also keeps the row's version history (``schedule_version``) in
  the same transaction: the version written is in force from the write's
  ``now`` until the next write or the delete, so the controller can tell which
  row (and policies) a node was to run at any past instant; closed versions
  older than :data:`VERSION_RETENTION` go with the next write of that node;
- a row is validated on the way in, and stored with its wire JSON
  (``LocalSchedule.model_dump_json()`` of the row as stored, version included),
  so the pull answer is the stored strings spliced together: reading trusts
  what was written and validates nothing.

Every write commits its own transaction; reads do not commit.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import Table, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlmodel import Session

from controller import sql
from controller.db import transaction
from controller.models import AgentSchedule, NodeRevision, ScheduleVersion, utc_now
from sched_core.model import LocalSchedule
from sched_core.values import STORED_BEFORE_RULES

_SCHEDULE_TABLE: Table = AgentSchedule.__table__  # type: ignore[attr-defined]
_REVISION_TABLE: Table = NodeRevision.__table__  # type: ignore[attr-defined]
_VERSION_TABLE: Table = ScheduleVersion.__table__  # type: ignore[attr-defined]
_COLUMNS = _SCHEDULE_TABLE.c
_REVISIONS = _REVISION_TABLE.c
_VERSIONS = _VERSION_TABLE.c
VERSION_RETENTION = timedelta(days=35)
"""How long a replaced or deleted row version is kept (longer than any report's range)."""


def _insert(session: Session, table: Any) -> Any:
    """Return a dialect insert (both dialects have ON CONFLICT) for table."""
    if session.get_bind().dialect.name == "postgresql":
        return pg_insert(table)
    return sqlite_insert(table)


_GO_FIELDS = (
    "id", "name", "repo_id", "action", "storage", "schedule", "miss_policy", "enabled",
    "params", "version",
)
"""The Go kit's fields: one column each."""
POLICY_FIELDS = tuple(name for name in LocalSchedule.model_fields if name not in _GO_FIELDS)
"""The row's policy fields: stored together, the set ones only, in ``policies``."""
_WIRE_FIELDS = (*_GO_FIELDS, "policies")
_WIRE_COLUMNS = tuple(_COLUMNS[name] for name in _WIRE_FIELDS)
_WIRE_LIST: TypeAdapter[list[LocalSchedule]] = TypeAdapter(list[LocalSchedule])


def _wire_data(row: Any) -> dict[str, Any]:
    """Return a stored row's columns (``_WIRE_COLUMNS`` order) as the row's JSON object."""
    data = dict(zip(_WIRE_FIELDS, row, strict=True))
    policies = data.pop("policies") or {}
    return {**data, **policies}


def _to_wire(row: Any) -> LocalSchedule:
    # A row stored before the identifier rule stays readable (and so deletable).
    return LocalSchedule.model_validate(_wire_data(row), context={STORED_BEFORE_RULES: True})


def policies_of(row: LocalSchedule) -> dict[str, Any] | None:
    """Return the row's set policy fields as JSON data (None when it has none).

    Exactly what the row's JSON holds for them (unset, empty, zero and false
    ones are left out, as ``model_dump_json`` leaves them out), so the row
    read back from its columns dumps to the same bytes.
    """
    data: dict[str, Any] = row.model_dump(mode="json", include=set(POLICY_FIELDS))
    return data or None


def _etag(epoch: str, revision: int) -> str:
    return f'"{epoch}-{revision}"'


def _bump_revision(session: Session, node: str) -> None:
    """Bump node's list revision (creating it with a fresh epoch) in the open transaction."""
    stmt = _insert(session, _REVISION_TABLE).values(
        node=node, epoch=uuid.uuid4().hex[:16], revision=1
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[_REVISIONS.node],
        set_={"revision": _REVISIONS.revision + 1},
    )
    session.execute(stmt)


def node_etag(session: Session, node: str) -> str:
    """Return node's list ETag from its revision row alone (one key lookup, no rows read).

    Always equal to the ETag :func:`list_schedules` and :func:`list_wire` return
    for the same state; the API's pull reads it first, to answer a 304 or a
    cached body without reading any row.
    """
    return node_etags(session, [node])[node]


def node_etags(connection: Session | Connection, nodes: Iterable[str]) -> dict[str, str]:
    """Return each node's list ETag as :func:`node_etag` would, in one statement.

    Every node asked for is in the answer (``'"empty"'`` for a node without a
    revision row). Takes a session or a bare connection (the nodes' waits read
    it on a connection: no ORM session to set up for one key lookup).
    """
    wanted = list(dict.fromkeys(nodes))
    found = {node: '"empty"' for node in wanted}
    if wanted:
        rows = connection.execute(
            select(_REVISIONS.node, _REVISIONS.epoch, _REVISIONS.revision)
            .where(_REVISIONS.node.in_(wanted))
        ).all()
        for row in rows:
            found[row.node] = _etag(row.epoch, row.revision)
    return found


def list_schedules(session: Session, node: str) -> tuple[list[LocalSchedule], str]:
    """Return node's rows sorted by id, and the list's ETag (a quoted string).

    The ETag (e.g. ``'"3f2a9c0b1d4e5f60-12"'``, ready for an ``ETag`` header)
    changes on any add, update or delete for that node and is stable
    otherwise; a node that never had rows gets ``'"empty"'``. Rows and ETag
    are read in one statement, so they agree. Reads do not commit.
    """
    # One statement is one snapshot, so the rows and the revision agree.
    rows = session.execute(
        select(_REVISIONS.epoch, _REVISIONS.revision, *_WIRE_COLUMNS)
        .select_from(_REVISION_TABLE)
        .outerjoin(_SCHEDULE_TABLE, _COLUMNS.node == _REVISIONS.node)
        .where(_REVISIONS.node == node)
        .order_by(_COLUMNS.id)
    ).all()
    if not rows:
        return [], '"empty"'
    etag = _etag(rows[0].epoch, rows[0].revision)
    # One validation call for the whole list: rows were validated on the way in,
    # this keeps a hand-edited bad row from ever reaching an agent (identifiers
    # excepted: rows stored before that rule stay listable; an agent's pull drops them).
    wire = [_wire_data(row[2:]) for row in rows if row.id is not None]
    return _WIRE_LIST.validate_python(wire, context={STORED_BEFORE_RULES: True}), etag


def list_wire(session: Session, node: str) -> tuple[list[str], str]:
    """Return node's rows as their stored wire JSON strings sorted by id, and the list's ETag.

    The strings are what ``model_dump_json()`` of :func:`list_schedules`'s rows
    gives, so ``",".join`` of them is the rows' part of the pull answer; nothing
    is decoded or validated. Rows and ETag come from one statement, as in
    :func:`list_schedules`.
    """
    connection = session.connection()
    driver = connection.connection.driver_connection
    assert driver is not None
    # Straight to the driver: for 10,000 rows SQLAlchemy's result layer costs
    # more than the query (about 50 ms against 40 ms on Postgres).
    cursor = driver.cursor()
    try:
        cursor.execute(sql.render("list_wire", connection.dialect.name), {"node": node})
        columns = [column[0] for column in cursor.description or ()]
        rows = cursor.fetchall()
    finally:
        cursor.close()
    if not rows:
        return [], '"empty"'
    i_epoch, i_revision, i_wire = (columns.index(n) for n in ("epoch", "revision", "wire"))
    first = rows[0]
    wires = [row[i_wire] for row in rows if row[i_wire] is not None]
    return wires, _etag(first[i_epoch], first[i_revision])


def get_schedule(session: Session, node: str, schedule_id: str) -> LocalSchedule | None:
    """Return node's row schedule_id, or None."""
    row = session.execute(
        select(*_WIRE_COLUMNS).where(
            _COLUMNS.node == node, _COLUMNS.id == schedule_id
        )
    ).first()
    return _to_wire(row) if row else None


def _record_version(session: Session, node: str, row: LocalSchedule | None, schedule_id: str,
                    *, now: datetime) -> None:
    """Close the row's version in force and open row's (None: deleted), in the open
    transaction; prune the node's closed versions older than the retention."""
    session.execute(
        update(_VERSION_TABLE)
        .where(_VERSIONS.node == node, _VERSIONS.id == schedule_id,
               _VERSIONS.valid_until.is_(None))
        .values(valid_until=now)
    )
    if row is not None:
        session.execute(_VERSION_TABLE.insert().values(
            node=node, id=row.id, version=row.version, wire=row.model_dump_json(),
            valid_from=now, valid_until=None))
    session.execute(delete(_VERSION_TABLE).where(
        _VERSIONS.node == node, _VERSIONS.valid_until < now - VERSION_RETENTION))


@dataclass(frozen=True)
class RowVersion:
    """One version of a node's row and the span it was in force: ``[valid_from, valid_until)``."""

    node: str
    row: LocalSchedule
    valid_from: datetime
    valid_until: datetime | None


VERSION_CACHE = 131_072
"""Stored versions' rows kept parsed, by their text (:func:`stored_row`): 10,000 nodes of 13
rows each, ~2 KB a row (up to ~260 MB). A fleet with more distinct rows than that parses
the rest at each pass (a cycle longer than the cache misses every time), as before."""


@functools.lru_cache(maxsize=VERSION_CACHE)
def stored_row(wire: str) -> LocalSchedule:
    """Return a stored version's row, parsed once per text in this process.

    A version's text never changes, and the fleet watch reads every node's every row at each
    pass (10,000 nodes with ten rows: 100,000 parses, half of a pass's CPU); nodes given the
    same row by the same template share one text. The row returned is shared by every
    caller: read it, never change it (``model_copy`` it to change it).
    """
    return LocalSchedule.model_validate_json(wire, context={STORED_BEFORE_RULES: True})


def versions_between(
    session: Session, since: datetime, until: datetime, *, node: str | None = None,
    schedule_id: str | None = None,
) -> dict[str, dict[str, list[RowVersion]]]:
    """Return, per node and row id, the versions in force at some instant of
    ``[since, until)``, oldest first (only node's, or one row's, when given).

    The rows are shared (:func:`stored_row`): read only."""
    query = select(_VERSIONS.node, _VERSIONS.valid_from, _VERSIONS.valid_until,
                   _VERSIONS.wire).where(
        _VERSIONS.valid_from < until,
        (_VERSIONS.valid_until.is_(None)) | (_VERSIONS.valid_until > since))
    if node is not None:
        query = query.where(_VERSIONS.node == node)
    if schedule_id is not None:
        query = query.where(_VERSIONS.id == schedule_id)
    rows = session.execute(query.order_by(_VERSIONS.node, _VERSIONS.id, _VERSIONS.valid_from,
                                          _VERSIONS.seq)).all()
    found: dict[str, dict[str, list[RowVersion]]] = {}
    for name, valid_from, valid_until, wire in rows:
        row = stored_row(wire)
        found.setdefault(name, {}).setdefault(row.id, []).append(
            RowVersion(name, row, valid_from, valid_until))
    return found


def schedule_nodes(session: Session, node: str | None = None) -> list[str]:
    """Return the nodes that have a row now or a version in the history (only node, if given)."""
    query = select(_VERSIONS.node).group_by(_VERSIONS.node)
    if node is not None:
        query = query.where(_VERSIONS.node == node)
    found = set(session.execute(query).scalars().all())
    current = select(_COLUMNS.node).group_by(_COLUMNS.node)
    if node is not None:
        current = current.where(_COLUMNS.node == node)
    found |= set(session.execute(current).scalars().all())
    return sorted(found)


def prune_versions(session: Session, *, now: datetime) -> int:
    """Delete every closed version older than the retention (rows no longer written); commits."""
    with transaction(session):
        result = session.execute(delete(_VERSION_TABLE).where(
            _VERSIONS.valid_until < now - VERSION_RETENTION))
    return int(getattr(result, "rowcount", 0) or 0)


def stored_values(node: str, row: LocalSchedule, *, version: int) -> dict[str, Any]:
    """Return the ``agent_schedule`` columns that store row as node's at version.

    ``wire`` is the row's wire JSON at that version. Bulk loaders (the
    benchmark) insert these; the API writes through :func:`put_schedule`.
    """
    return {
        "node": node,
        "id": row.id,
        "name": row.name,
        "repo_id": row.repo_id,
        "action": row.action,
        "storage": row.storage,
        "schedule": row.schedule.model_dump(mode="json"),
        "miss_policy": row.miss_policy.value,
        "enabled": row.enabled,
        "params": row.params or None,
        "policies": policies_of(row),
        "version": version,
        "wire": row.model_copy(update={"version": version}).model_dump_json(),
        "updated_at": utc_now(),
    }


class VersionConflict(Exception):
    """The row changed (or went) since it was read: a conditional write did nothing."""


def put_schedule(
    session: Session, node: str, row: LocalSchedule, *, if_version: int | None = None,
    now: datetime | None = None,
) -> LocalSchedule:
    """Insert or replace node's row ``row.id`` and return the stored row; commits.

    The stored version is the previous one plus 1 (1 for a new row), whatever
    ``row.version`` says. The stored wire JSON is that of the row as read back
    from its columns at that version. The node's ETag changes in the same
    transaction.

    ``if_version`` (a PATCH's read-modify-write) replaces the row only while
    its stored version is still that one: else :class:`VersionConflict` and
    nothing changes (a row deleted since is not recreated).

    The stored version is in force from ``now`` (default: the wall clock) in
    the row's version history.
    """
    now = now or utc_now()
    values = stored_values(node, row, version=1)
    values["updated_at"] = now
    if if_version is not None:
        stmt: Any = (
            update(_SCHEDULE_TABLE)
            .where(_COLUMNS.node == node, _COLUMNS.id == row.id,
                   _COLUMNS.version == if_version)
            .values(**{k: v for k, v in values.items() if k not in ("node", "id", "version")},
                    version=_COLUMNS.version + 1)
            .returning(*_WIRE_COLUMNS)
        )
    else:
        stmt = _insert(session, _SCHEDULE_TABLE).values(**values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[_COLUMNS.node, _COLUMNS.id],
            set_={
                **{k: stmt.excluded[k] for k in values if k not in ("node", "id", "version")},
                "version": _COLUMNS.version + 1,
            },
        ).returning(*_WIRE_COLUMNS)
    with transaction(session):
        found = session.execute(stmt).first()
        if found is None:
            raise VersionConflict(f"row {row.id!r} of node {node!r} is no longer at "
                                  f"version {if_version}")
        stored = _to_wire(found)
        wire = stored.model_dump_json()
        # The database picked the version; an update (or a column's round trip)
        # changes the JSON, and the row is locked until the commit.
        if wire != values["wire"]:
            session.execute(
                update(_SCHEDULE_TABLE)
                .where(_COLUMNS.node == node, _COLUMNS.id == row.id)
                .values(wire=wire)
            )
        _bump_revision(session, node)
        _record_version(session, node, stored, stored.id, now=now)
    return stored


def delete_schedule(session: Session, node: str, schedule_id: str, *,
                    now: datetime | None = None) -> bool:
    """Delete node's row schedule_id; return False when there was none. Commits.

    Its version in force ends at ``now`` (default: the wall clock).
    """
    now = now or utc_now()
    with transaction(session):
        result = session.execute(
            delete(_SCHEDULE_TABLE)
            .where(_COLUMNS.node == node, _COLUMNS.id == schedule_id)
            .returning(_COLUMNS.id)
        ).first()
        if result is not None:
            _bump_revision(session, node)
            _record_version(session, node, None, schedule_id, now=now)
    return result is not None


def list_nodes(session: Session) -> list[str]:
    """Return the nodes that have at least one schedule row, sorted."""
    nodes = session.execute(
        select(_COLUMNS.node).group_by(_COLUMNS.node).order_by(_COLUMNS.node)
    ).scalars().all()
    return list(nodes)



def all_schedules(session: Session) -> dict[str, list[LocalSchedule]]:
    """Return every node's rows sorted by id (one statement): the fleet's status and upcoming."""
    rows = session.execute(
        select(_COLUMNS.node, *_WIRE_COLUMNS).order_by(_COLUMNS.node, _COLUMNS.id)
    ).all()
    found: dict[str, list[LocalSchedule]] = {}
    for row in rows:
        found.setdefault(row[0], []).append(_to_wire(row[1:]))
    return found
