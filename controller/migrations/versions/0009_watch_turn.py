"""The fleet watch's turn: one instance's pass per interval, however many instances run.

1. ``watch_turn``: one row per watched thing (``fleet``): when an instance last took
   its turn (the database's clock) and which instance it was.

Downgrade drops the table (every instance then runs its own pass again).

Revision 0009 after 0008, 2026-12-05.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import NAME_TYPE, UtcDateTime

revision: str = "0009"
down_revision: str | None = "0008"


# Alike in shape to 0006's and 0007's create_table calls: a revision is a frozen record and
# never shares code with another.
def upgrade() -> None:
    op.create_table(
        "watch_turn",
        sa.Column("name", sa.String(40), primary_key=True),
        sa.Column("taken_at", UtcDateTime(), nullable=False),
        sa.Column("holder", NAME_TYPE, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("watch_turn")
