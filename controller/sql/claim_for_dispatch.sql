-- Claim due tasks and record their dispatches in one statement (Postgres).
--
-- 1. picked: due active tasks with no live lease, oldest first, skipping rows
--    another claimer has locked.
-- 2. claimed: lease them to %(worker_id)s until now + %(lease)s seconds.
-- 3. recorded: insert one dispatch record per (task, scheduled time); take over
--    an existing one only if it failed, or if it has been dispatching for longer
--    than %(stale_after)s seconds. The rows returned here are ours to dispatch.
-- 4. Report which claims are ours (owned). The rest (rare: a record another
--    worker holds or finished) are looked up afterwards by the caller, which
--    keeps this hot statement to the three steps above.
-- %(now)s NULL means the database's now().
-- Rows are read by position: store._CLAIM_COLUMNS (the claimed CTE's RETURNING
-- order), then owned.
WITH picked AS (
    SELECT id
    FROM scheduled_task
    WHERE status = 'active'
      AND next_run_at <= coalesce(CAST(%(now)s AS timestamptz), now())
      AND (locked_until IS NULL OR locked_until < coalesce(CAST(%(now)s AS timestamptz), now()))
    ORDER BY next_run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE scheduled_task AS t
    SET locked_by = %(worker_id)s,
        locked_until = coalesce(CAST(%(now)s AS timestamptz), now())
                       + make_interval(secs => CAST(%(lease)s AS double precision))
    FROM picked
    WHERE t.id = picked.id
    RETURNING t.id, t.name, t.next_run_at, t.locked_by, t.locked_until, t.event, t.deployment,
              t.payload, t.cron, t.schedule, t.timezone, t.attempts
), recorded AS (
    INSERT INTO task_dispatch AS d (task_name, scheduled_at, worker_id, status, started_at)
    SELECT name, next_run_at, %(worker_id)s, 'dispatching', coalesce(CAST(%(now)s AS timestamptz), now())
    FROM claimed
    ON CONFLICT (task_name, scheduled_at) DO UPDATE
    SET worker_id = excluded.worker_id,
        status = 'dispatching',
        started_at = excluded.started_at,
        finished_at = NULL,
        error = NULL
    WHERE d.status = 'failed'
       OR (d.status = 'dispatching'
           AND d.started_at < excluded.started_at
                              - make_interval(secs => CAST(%(stale_after)s AS double precision)))
    RETURNING d.task_name
)
SELECT c.*, r.task_name IS NOT NULL AS owned
FROM claimed AS c
LEFT JOIN recorded AS r ON r.task_name = c.name
ORDER BY c.next_run_at, c.name
