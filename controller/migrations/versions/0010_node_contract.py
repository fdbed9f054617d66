"""The action table each node publishes: what written rows of the node are checked against.

1. ``node_contract``: one row per node, its latest published table (JSON, never its ``env``),
   the table's hash and when it came.

Downgrade drops the table (rows are then accepted unchecked, with a warning).

Revision 0010 after 0009, 2026-12-07.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import NAME_TYPE, UtcDateTime

revision: str = "0010"
down_revision: str | None = "0009"


def upgrade() -> None:
    op.create_table(
        "node_contract",
        sa.Column("node", NAME_TYPE, primary_key=True),
        sa.Column("contract_hash", sa.String(64), nullable=False),
        sa.Column("contract", sa.JSON(), nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_contract")
