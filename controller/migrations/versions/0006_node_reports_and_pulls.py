"""The fleet's view of its nodes: their reports, and the pulls the controller answered.

1. ``node_report``: each node's latest report (``POST /api/nodes/{node}/report``),
   one row per node, with when the controller received it.
2. ``node_report_history``: the reports themselves, newest kept (the API keeps
   a bounded number per node; ``(node, id)`` indexed for that pruning).
3. ``node_pull``: each node's latest pull answer: when, ``200`` or ``304``,
   and the list version (ETag) served.

Downgrade drops the three tables.

Revision 0006 after 0005, 2026-12-03.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import NAME_TYPE, UtcDateTime

revision: str = "0006"
down_revision: str | None = "0005"


def upgrade() -> None:
    op.create_table(
        "node_report",
        sa.Column("node", NAME_TYPE, primary_key=True),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
    )
    op.create_table(
        "node_report_history",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("node", NAME_TYPE, nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
    )
    op.create_index(
        "ix_node_report_history_node_id", "node_report_history", ["node", "id"]
    )
    op.create_table(
        "node_pull",
        sa.Column("node", NAME_TYPE, primary_key=True),
        sa.Column("pulled_at", UtcDateTime(), nullable=False),
        sa.Column("status", sa.String(3), nullable=False),
        sa.Column("list_version", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_pull")
    op.drop_index("ix_node_report_history_node_id", table_name="node_report_history")
    op.drop_table("node_report_history")
    op.drop_table("node_report")
