"""Each agent schedule row keeps its wire JSON, so a pull splices stored strings.

Upgrade adds ``agent_schedule.wire`` and fills it for existing rows with
``LocalSchedule.model_dump_json()`` of the row as stored; downgrade drops it.
Every row is validated before the column is added: a row that no longer
validates stops the upgrade with its node and id named and nothing changed, so
the same upgrade succeeds once that row is fixed.

Revision 0002 after 0001, 2026-12-02.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from pydantic import ValidationError

from sched_core.model import LocalSchedule

revision: str = "0002"
down_revision: str | None = "0001"

_WIRE_FIELDS = (
    "id", "name", "repo_id", "action", "storage", "schedule", "miss_policy", "enabled",
    "params", "version",
)

# A frozen view of the table as this revision knows it (never the live model).
_rows = sa.table(
    "agent_schedule",
    sa.column("node", sa.String()),
    sa.column("id", sa.String()),
    sa.column("name", sa.Text()),
    sa.column("repo_id", sa.Text()),
    sa.column("action", sa.Text()),
    sa.column("storage", sa.Text()),
    sa.column("schedule", sa.JSON()),
    sa.column("miss_policy", sa.String()),
    sa.column("enabled", sa.Boolean()),
    sa.column("params", sa.JSON()),
    sa.column("version", sa.Integer()),
    sa.column("wire", sa.Text()),
)


def upgrade() -> None:
    # Validate every row before the first schema change: an invalid row then
    # stops the upgrade with nothing to undo, whichever engine runs it.
    connection = op.get_bind()
    found = connection.execute(
        sa.select(_rows.c.node, *(_rows.c[name] for name in _WIRE_FIELDS))
    ).all()
    filled = []
    for row in found:
        try:
            wire = LocalSchedule.model_validate(dict(zip(_WIRE_FIELDS, row[1:], strict=True)))
        except ValidationError as exc:
            raise ValueError(
                f"agent_schedule row node={row.node!r} id={row.id!r} is invalid: {exc}"
            ) from exc
        filled.append({"b_node": row.node, "b_id": row.id, "b_wire": wire.model_dump_json()})
    op.add_column("agent_schedule", sa.Column("wire", sa.Text(), nullable=True))
    if filled:
        connection.execute(
            sa.update(_rows)
            .where(_rows.c.node == sa.bindparam("b_node"), _rows.c.id == sa.bindparam("b_id"))
            .values(wire=sa.bindparam("b_wire")),
            filled,
        )
    with op.batch_alter_table("agent_schedule") as batch:
        batch.alter_column("wire", existing_type=sa.Text(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("agent_schedule") as batch:
        batch.drop_column("wire")
