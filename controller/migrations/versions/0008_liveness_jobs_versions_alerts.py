"""The operator's morning: liveness, job records, row versions and alerts.

1. ``node_seen``: each node's latest request made with its own token, and the
   heartbeat it announced.
2. ``node_job``: the job records nodes report, one per (node, window key).
3. ``schedule_version``: every version of every row and when it was in force.
   Each existing row gets its current version, in force from its
   ``updated_at`` (the earliest instant the controller can vouch for): its
   windows before that are never counted missed.
4. ``fleet_alert``: the alerts raised, inserted once per (node, kind, subject).

Downgrade drops the four tables.

Revision 0008 after 0007, 2026-12-04.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from controller.models import KEY_TYPE, NAME_TYPE, UtcDateTime

revision: str = "0008"
down_revision: str | None = "0007"

# A frozen view of the rows as this revision knows them (never the live model); alike in
# shape to 0002's and 0005's views, which `duplicates` pairs with it.
_rows = sa.table(
    "agent_schedule",
    sa.column("node", sa.String()),
    sa.column("id", sa.String()),
    sa.column("version", sa.Integer()),
    sa.column("wire", sa.Text()),
    sa.column("updated_at", UtcDateTime()),
)


def upgrade() -> None:
    _node_seen()
    _node_job()
    _schedule_version()
    _fleet_alert()


# The steps below are alike in shape to the other revisions' create_table calls: a revision
# is a frozen record and never shares code with another.
def _node_seen() -> None:
    op.create_table(
        "node_seen",
        sa.Column("node", NAME_TYPE, primary_key=True),
        sa.Column("seen_at", UtcDateTime(), nullable=False),
        sa.Column("via", sa.String(8), nullable=False),
        sa.Column("heartbeat_s", sa.Float(), nullable=True),
        sa.Column("first_seen_at", UtcDateTime(), nullable=False),
    )


def _node_job() -> None:
    op.create_table(
        "node_job",
        sa.Column("node", NAME_TYPE, primary_key=True),
        sa.Column("key", KEY_TYPE, primary_key=True),
        sa.Column("schedule_id", NAME_TYPE, nullable=False),
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
    )
    op.create_index("ix_node_job_node_filed", "node_job", ["node", "filed_at"])
    op.create_index("ix_node_job_node_received", "node_job", ["node", "received_at"])


def _schedule_version() -> None:
    """The table, and each existing row's current version in force from its updated_at."""
    versions = op.create_table(
        "schedule_version",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("node", NAME_TYPE, nullable=False),
        sa.Column("id", NAME_TYPE, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("wire", sa.Text(), nullable=False),
        sa.Column("valid_from", UtcDateTime(), nullable=False),
        sa.Column("valid_until", UtcDateTime(), nullable=True),
    )
    op.create_index("ix_schedule_version_row", "schedule_version",
                    ["node", "id", "valid_from"])
    connection = op.get_bind()
    existing = [
        {"node": row.node, "id": row.id, "version": row.version, "wire": row.wire,
         "valid_from": row.updated_at, "valid_until": None}
        for row in connection.execute(
            sa.select(_rows.c.node, _rows.c.id, _rows.c.version, _rows.c.wire,
                      _rows.c.updated_at))
    ]
    if existing:
        op.bulk_insert(versions, existing)


def _fleet_alert() -> None:
    op.create_table(
        "fleet_alert",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("node", NAME_TYPE, nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("subject", KEY_TYPE, nullable=False),
        sa.Column("schedule_id", NAME_TYPE, nullable=True),
        sa.Column("window_at", UtcDateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("detected_at", UtcDateTime(), nullable=False),
        sa.Column("sent_at", UtcDateTime(), nullable=True),
        sa.Column("lease_until", UtcDateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("resolved_at", UtcDateTime(), nullable=True),
        sa.UniqueConstraint("node", "kind", "subject", name="uq_fleet_alert_subject"),
    )
    op.create_index("ix_fleet_alert_node_open", "fleet_alert", ["node", "resolved_at"])


def downgrade() -> None:
    op.drop_index("ix_fleet_alert_node_open", table_name="fleet_alert")
    op.drop_table("fleet_alert")
    op.drop_index("ix_schedule_version_row", table_name="schedule_version")
    op.drop_table("schedule_version")
    op.drop_index("ix_node_job_node_received", table_name="node_job")
    op.drop_index("ix_node_job_node_filed", table_name="node_job")
    op.drop_table("node_job")
    op.drop_table("node_seen")
