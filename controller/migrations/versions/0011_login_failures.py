"""The fleet page's failed logins, shared by every controller instance.

1. ``login_failure``: one row per failed login: the client's key (its address, an
   IPv6 client's /64) and when; the login limit counts a client's rows within its
   window, and rows older than the window are pruned at each failure.

Downgrade drops the table (each instance then counts nothing: the limit is off).

Revision 0011 after 0010, 2026-12-07.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import UtcDateTime

revision: str = "0011"
down_revision: str | None = "0010"


# Alike in shape to 0007's and 0009's create_table calls: a revision is a frozen record and
# never shares code with another.
def upgrade() -> None:
    op.create_table(
        "login_failure",
        sa.Column("client", sa.String(100), primary_key=True),
        sa.Column("failed_at", UtcDateTime(), primary_key=True),
    )
    op.create_index("ix_login_failure_at", "login_failure", ["failed_at"])


def downgrade() -> None:
    op.drop_index("ix_login_failure_at", table_name="login_failure")
    op.drop_table("login_failure")
