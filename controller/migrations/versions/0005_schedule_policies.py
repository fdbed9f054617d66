"""A schedule row keeps its policy fields: ``agent_schedule.policies``.

Until now the store kept one column per Go field and dropped the row's policy
fields (``timezone``, ``overlap``, ``jitter``, ``catchup_window``,
``paused``, ``not_before``, ``not_after``, ``blackouts``, ``min_interval``,
``repo_lock``) when it stored a row. Upgrade adds one nullable JSON column for
the set ones; every existing row has none (they were dropped), so its stored
wire JSON stays as it is, byte for byte.

Downgrade drops the column, and first rewrites the wire JSON of each row that
has policies to the row without them: what revision 0004's code serves and
stores for it. That code cannot keep policies, so a downgrade loses them.

Revision 0005 after 0004, 2026-12-03.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from sched_core.model import LocalSchedule
from sched_core.values import STORED_BEFORE_RULES

revision: str = "0005"
down_revision: str | None = "0004"

# The fields and the frozen view below repeat 0002's on purpose (a pair `duplicates` lists):
# a revision never imports another's code, which a later edit could change.
_GO_FIELDS = (
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
    sa.column("policies", sa.JSON()),
)


def upgrade() -> None:
    with op.batch_alter_table("agent_schedule") as batch:
        batch.add_column(sa.Column("policies", sa.JSON(), nullable=True))


def downgrade() -> None:
    connection = op.get_bind()
    found = connection.execute(
        sa.select(_rows.c.node, *(_rows.c[name] for name in _GO_FIELDS))
        .where(_rows.c.policies.is_not(None))
    ).all()
    rewritten = [
        {"b_node": row.node, "b_id": row.id,
         "b_wire": LocalSchedule.model_validate(
             dict(zip(_GO_FIELDS, row[1:], strict=True)), context={STORED_BEFORE_RULES: True}
         ).model_dump_json()}
        for row in found
    ]
    if rewritten:
        connection.execute(
            sa.update(_rows)
            .where(_rows.c.node == sa.bindparam("b_node"), _rows.c.id == sa.bindparam("b_id"))
            .values(wire=sa.bindparam("b_wire")),
            rewritten,
        )
    with op.batch_alter_table("agent_schedule") as batch:
        batch.drop_column("policies")
