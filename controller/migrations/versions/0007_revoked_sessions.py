"""Fleet page sessions that ended before their time (Log out), for every instance to refuse.

1. ``revoked_session``: one row per logged-out session cookie: the SHA-256 of
   its signature (never the cookie) and when the cookie would have expired;
   rows past that time are pruned at the next log out.

Downgrade drops the table (logged-out cookies then work again until they expire).

Revision 0007 after 0006, 2026-12-04.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import UtcDateTime

revision: str = "0007"
down_revision: str | None = "0006"


# Alike in shape to 0006's create_table calls: a revision is a frozen record and never
# shares code with another.
def upgrade() -> None:
    op.create_table(
        "revoked_session",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("expires_at", UtcDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("revoked_session")
