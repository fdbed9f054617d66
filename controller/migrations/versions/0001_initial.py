"""Agent schedules, node revisions, scheduled tasks and their dispatch records.

Revision 0001, 2026-12-02.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import UtcDateTime

revision: str = "0001"
down_revision: str | None = None


def upgrade() -> None:
    op.create_table(
        "agent_schedule",
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("repo_id", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("storage", sa.Text(), nullable=False),
        sa.Column("schedule", sa.JSON(), nullable=False),
        sa.Column("miss_policy", sa.String(40), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
    )
    op.create_table(
        "node_revision",
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("epoch", sa.String(40), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
    )
    op.create_table(
        "scheduled_task",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("cron", sa.Text(), nullable=True),
        sa.Column("schedule", sa.JSON(), nullable=True),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("run_at", UtcDateTime(), nullable=True),
        sa.Column("event", sa.Text(), nullable=True),
        sa.Column("deployment", sa.Text(), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("next_run_at", UtcDateTime(), nullable=True),
        sa.Column("locked_by", sa.String(200), nullable=True),
        sa.Column("locked_until", UtcDateTime(), nullable=True),
        sa.Column("last_run_at", UtcDateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_scheduled_task_due", "scheduled_task", ["status", "next_run_at"])
    op.create_table(
        "task_dispatch",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("task_name", sa.String(200), nullable=False),
        sa.Column("scheduled_at", UtcDateTime(), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=False),
        sa.Column("finished_at", UtcDateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("task_name", "scheduled_at", name="uq_task_dispatch_task_time"),
    )


def downgrade() -> None:
    op.drop_table("task_dispatch")
    op.drop_index("ix_scheduled_task_due", table_name="scheduled_task")
    op.drop_table("scheduled_task")
    op.drop_table("node_revision")
    op.drop_table("agent_schedule")
