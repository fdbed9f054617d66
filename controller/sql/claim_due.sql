-- Lease up to %(limit)s due active tasks to %(worker_id)s (Postgres).
-- Due: next_run_at <= now and no live lease (locked_until is null or < now).
-- The picked rows are locked FOR UPDATE SKIP LOCKED, so concurrent claimers
-- get disjoint sets and never wait for each other. %(now)s NULL means now().
-- Rows are read by position: keep the RETURNING columns in the order of
-- store._CLAIM_COLUMNS.
UPDATE scheduled_task AS t
SET locked_by = %(worker_id)s,
    locked_until = coalesce(CAST(%(now)s AS timestamptz), now())
                   + make_interval(secs => CAST(%(lease)s AS double precision))
WHERE t.id IN (
    SELECT id
    FROM scheduled_task
    WHERE status = 'active'
      AND next_run_at <= coalesce(CAST(%(now)s AS timestamptz), now())
      AND (locked_until IS NULL OR locked_until < coalesce(CAST(%(now)s AS timestamptz), now()))
    ORDER BY next_run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
RETURNING t.id, t.name, t.next_run_at, t.locked_by, t.locked_until, t.event, t.deployment,
          t.payload, t.cron, t.schedule, t.timezone, t.attempts
