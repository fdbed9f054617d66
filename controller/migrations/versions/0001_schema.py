"""The controller's tables, as the first release ships them (:mod:`controller.models`).

One row per table: ``agent_schedule`` (the agents' wire-format rows), ``node_revision`` (each
node's list revision, its ETag), ``scheduled_task`` and ``task_dispatch`` (the central
scheduler), ``node_report``/``node_report_history``/``node_pull``/``node_seen``/``node_job``
(what nodes say and do), ``node_contract`` (each node's published action table),
``schedule_version`` (every row's versions), ``fleet_alert`` and ``watch_turn`` (the fleet
watch), ``revoked_session`` and ``login_failure`` (the fleet page). Name columns sort by code
point on every database (``COLLATE "C"`` on Postgres, SQLite's ``BINARY``).

Revision 0001.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import UtcDateTime

revision: str = "0001"
down_revision: str | None = None


def _name(length: int = 200) -> sa.types.TypeEngine[str]:
    """A name column: sorted by code point on Postgres as on SQLite."""
    return sa.String(length).with_variant(sa.String(length, collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "agent_schedule",
        sa.Column("node", _name(), nullable=False),
        sa.Column("id", _name(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("repo_id", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("storage", sa.Text(), nullable=False),
        sa.Column("schedule", sa.JSON(), nullable=False),
        sa.Column("miss_policy", sa.String(40), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("policies", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("wire", sa.Text(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("node", "id"),
    )
    op.create_table(
        "fleet_alert",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", _name(), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("subject", _name(400), nullable=False),
        sa.Column("schedule_id", _name(), nullable=True),
        sa.Column("window_at", UtcDateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("detected_at", UtcDateTime(), nullable=False),
        sa.Column("sent_at", UtcDateTime(), nullable=True),
        sa.Column("lease_until", UtcDateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("resolved_at", UtcDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node", "kind", "subject", name="uq_fleet_alert_subject"),
    )
    op.create_index("ix_fleet_alert_node_open", "fleet_alert", ["node", "resolved_at"])
    op.create_table(
        "login_failure",
        sa.Column("client", sa.String(100), nullable=False),
        sa.Column("failed_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("client", "failed_at"),
    )
    op.create_index("ix_login_failure_at", "login_failure", ["failed_at"])
    op.create_table(
        "node_contract",
        sa.Column("node", _name(), nullable=False),
        sa.Column("contract_hash", sa.String(64), nullable=False),
        sa.Column("contract", sa.JSON(), nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("node"),
    )
    op.create_table(
        "node_job",
        sa.Column("node", _name(), nullable=False),
        sa.Column("key", _name(400), nullable=False),
        sa.Column("schedule_id", _name(), nullable=False),
        sa.Column("window_at", UtcDateTime(), nullable=True),
        sa.Column("trigger_key", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=True),
        sa.Column("ended_at", UtcDateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("offline", sa.Boolean(), nullable=False),
        sa.Column("flow_run_id", sa.Text(), nullable=True),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("filed_at", UtcDateTime(), nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("node", "key"),
    )
    op.create_index("ix_node_job_node_filed", "node_job", ["node", "filed_at"])
    op.create_index("ix_node_job_node_received", "node_job", ["node", "received_at"])
    op.create_table(
        "node_pull",
        sa.Column("node", _name(), nullable=False),
        sa.Column("pulled_at", UtcDateTime(), nullable=False),
        sa.Column("status", sa.String(3), nullable=False),
        sa.Column("list_version", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("node"),
    )
    op.create_table(
        "node_report",
        sa.Column("node", _name(), nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("node"),
    )
    op.create_table(
        "node_report_history",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", _name(), nullable=False),
        sa.Column("received_at", UtcDateTime(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_node_report_history_node_id", "node_report_history", ["node", "id"])
    op.create_table(
        "node_revision",
        sa.Column("node", _name(), nullable=False),
        sa.Column("epoch", sa.String(40), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("node"),
    )
    op.create_table(
        "node_seen",
        sa.Column("node", _name(), nullable=False),
        sa.Column("seen_at", UtcDateTime(), nullable=False),
        sa.Column("via", sa.String(8), nullable=False),
        sa.Column("heartbeat_s", sa.Float(), nullable=True),
        sa.Column("first_seen_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("node"),
    )
    op.create_table(
        "revoked_session",
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("expires_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_table(
        "schedule_version",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node", _name(), nullable=False),
        sa.Column("id", _name(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("wire", sa.Text(), nullable=False),
        sa.Column("valid_from", UtcDateTime(), nullable=False),
        sa.Column("valid_until", UtcDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("seq"),
    )
    op.create_index("ix_schedule_version_row", "schedule_version", ["node", "id", "valid_from"])
    op.create_table(
        "scheduled_task",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", _name(), nullable=False),
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
        sa.Column("skipped_windows", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("updated_at", UtcDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_index("ix_scheduled_task_due", "scheduled_task", ["status", "next_run_at"])
    op.create_table(
        "task_dispatch",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_name", _name(), nullable=False),
        sa.Column("scheduled_at", UtcDateTime(), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=False),
        sa.Column("finished_at", UtcDateTime(), nullable=True),
        sa.Column("renewed_at", UtcDateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("task_name", "scheduled_at", name="uq_task_dispatch_task_time"),
    )
    op.create_index("ix_task_dispatch_scheduled_at", "task_dispatch", ["scheduled_at"])
    op.create_table(
        "watch_turn",
        sa.Column("name", sa.String(40), nullable=False),
        sa.Column("taken_at", UtcDateTime(), nullable=False),
        sa.Column("holder", _name(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("watch_turn")
    op.drop_index("ix_task_dispatch_scheduled_at", table_name="task_dispatch")
    op.drop_table("task_dispatch")
    op.drop_index("ix_scheduled_task_due", table_name="scheduled_task")
    op.drop_table("scheduled_task")
    op.drop_index("ix_schedule_version_row", table_name="schedule_version")
    op.drop_table("schedule_version")
    op.drop_table("revoked_session")
    op.drop_table("node_seen")
    op.drop_table("node_revision")
    op.drop_index("ix_node_report_history_node_id", table_name="node_report_history")
    op.drop_table("node_report_history")
    op.drop_table("node_report")
    op.drop_table("node_pull")
    op.drop_index("ix_node_job_node_received", table_name="node_job")
    op.drop_index("ix_node_job_node_filed", table_name="node_job")
    op.drop_table("node_job")
    op.drop_table("node_contract")
    op.drop_index("ix_login_failure_at", table_name="login_failure")
    op.drop_table("login_failure")
    op.drop_index("ix_fleet_alert_node_open", table_name="fleet_alert")
    op.drop_table("fleet_alert")
    op.drop_table("agent_schedule")
