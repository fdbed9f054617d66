"""Names sort by bytes on every database; dispatch records are indexed by scheduled time.

1. On Postgres the name columns (``agent_schedule.node``/``id``,
   ``node_revision.node``, ``scheduled_task.name``, ``task_dispatch.task_name``)
   get ``COLLATE "C"``: they then sort by code point, as SQLite's ``BINARY``
   does, whatever locale the database was created with (``en_US.UTF-8`` would
   put ``b-1`` before ``B-2`` and ignore ``-`` and ``_`` at first), so a pull
   lists a node's schedules in the same order on both databases. SQLite is
   unchanged.
2. ``ix_task_dispatch_scheduled_at``, for pruning old dispatch records.

Downgrade drops the index and gives the columns the database's default collation.

Revision 0003 after 0002, 2026-12-02.
"""

from __future__ import annotations

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"

NAME_COLUMNS = (
    ("agent_schedule", "node"),
    ("agent_schedule", "id"),
    ("node_revision", "node"),
    ("scheduled_task", "name"),
    ("task_dispatch", "task_name"),
)


def _collate(collation: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column in NAME_COLUMNS:
        op.execute(
            f'ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar(200) COLLATE {collation}'
        )


def upgrade() -> None:
    _collate('"C"')
    op.create_index("ix_task_dispatch_scheduled_at", "task_dispatch", ["scheduled_at"])


def downgrade() -> None:
    op.drop_index("ix_task_dispatch_scheduled_at", table_name="task_dispatch")
    _collate('"default"')
