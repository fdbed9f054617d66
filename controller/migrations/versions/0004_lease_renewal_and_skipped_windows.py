"""Fast failover and counted catch-up: a renewed dispatch record, and skipped windows.

1. ``task_dispatch.renewed_at``: when the worker dispatching a record last
   said it is alive (its lease renewal). A record left "dispatching" is taken
   over once neither its start nor its last renewal is within ``stale_after``,
   so a killed instance's dispatch is taken over within seconds, while a live
   one's, however slow, never is.
2. ``scheduled_task.skipped_windows``: how many windows of a recurring task
   were skipped under the catch-up rule (never dispatched), counted for the API.

Downgrade drops both columns.

Revision 0004 after 0003, 2026-12-03.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import UtcDateTime

revision: str = "0004"
down_revision: str | None = "0003"


def upgrade() -> None:
    with op.batch_alter_table("task_dispatch") as batch:
        batch.add_column(sa.Column("renewed_at", UtcDateTime(), nullable=True))
    with op.batch_alter_table("scheduled_task") as batch:
        batch.add_column(
            sa.Column("skipped_windows", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("scheduled_task") as batch:
        batch.drop_column("skipped_windows")
    with op.batch_alter_table("task_dispatch") as batch:
        batch.drop_column("renewed_at")
