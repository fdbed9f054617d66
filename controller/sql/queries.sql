-- The controller's hand-written SQL, one named query each (procrastinate's layout).
--
-- A query starts at a line "-- name: <query name>"; the comment lines after it
-- describe it and are kept out of the text sent to the server. Placeholders are
-- psycopg's %(name)s (controller.sql.render gives SQLite's :name). Rows are read
-- by column name, never by position. Status literals are models.TaskStatus and
-- models.DispatchStatus values.
--
-- Everything else (task CRUD, fail, give up, release, pruning) is SQLAlchemy
-- Core in controller/tasks.py and controller/claims.py: the same on both
-- databases, and not on a hot path.

-- name: claim_for_dispatch
-- Claim due tasks and record their dispatches in one statement (Postgres).
--
-- 1. picked: due active tasks with no live lease, oldest first, skipping rows
--    another claimer has locked.
-- 2. claimed: lease them to %(worker_id)s until now + %(lease)s seconds.
-- 3. recorded: insert one dispatch record per (task, scheduled time); take over
--    an existing one only if it failed or was skipped, or if it has been
--    dispatching with neither its start nor its worker's last renewal within
--    %(stale_after)s seconds. The rows returned here are ours to dispatch.
-- 4. Report which claims are ours (owned). The rest (rare: a record another
--    worker holds or finished) are looked up afterwards with record_status,
--    which keeps this hot statement to the three steps above.
-- %(now)s NULL means the database's now().
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
    WHERE d.status IN ('failed', 'skipped')
       OR (d.status = 'dispatching'
           AND coalesce(d.renewed_at, d.started_at)
               < excluded.started_at
                 - make_interval(secs => CAST(%(stale_after)s AS double precision)))
    RETURNING d.task_name
)
SELECT c.*, r.task_name IS NOT NULL AS owned
FROM claimed AS c
LEFT JOIN recorded AS r ON r.task_name = c.name
ORDER BY c.next_run_at, c.name

-- name: record_status
-- The dispatch records of the named tasks (Postgres), for the claims
-- claim_for_dispatch did not own.
SELECT task_name, scheduled_at, status FROM task_dispatch WHERE task_name = ANY(%(names)s)

-- name: complete_many
-- Complete a batch of claims in one statement (Postgres): for each (id, name,
-- scheduled_at, next_run_at, status, last_error, skipped) row, move the task on
-- (fenced on its next_run_at still being scheduled_at), add the windows its
-- plan skipped to skipped_windows, and mark its dispatch record dispatched.
-- Returns one row per task moved.
WITH batch AS (
    SELECT *
    FROM unnest(
        CAST(%(ids)s AS bigint[]),
        CAST(%(names)s AS text[]),
        CAST(%(scheduled)s AS timestamptz[]),
        CAST(%(following)s AS timestamptz[]),
        CAST(%(statuses)s AS text[]),
        CAST(%(errors)s AS text[]),
        CAST(%(skipped)s AS integer[])
    ) AS b(id, name, scheduled_at, next_run_at, status, last_error, skipped)
), recorded AS (
    UPDATE task_dispatch AS d
    SET status = 'dispatched',
        finished_at = coalesce(CAST(%(now)s AS timestamptz), now()),
        error = NULL
    FROM batch
    WHERE d.task_name = batch.name AND d.scheduled_at = batch.scheduled_at
    RETURNING d.id
)
UPDATE scheduled_task AS t
SET next_run_at = batch.next_run_at,
    status = batch.status,
    locked_by = NULL,
    locked_until = NULL,
    last_run_at = batch.scheduled_at,
    attempts = 0,
    last_error = batch.last_error,
    skipped_windows = t.skipped_windows + batch.skipped,
    updated_at = coalesce(CAST(%(now)s AS timestamptz), now())
FROM batch
WHERE t.id = batch.id AND t.next_run_at = batch.scheduled_at
RETURNING t.id

-- name: list_wire
-- A node's rows as their stored wire JSON, sorted by id, with the list's
-- revision on every row (one statement: the rows and the ETag agree). A node
-- with a revision but no rows gives one row whose wire is NULL.
SELECT r.epoch, r.revision, a.wire
FROM node_revision r
LEFT OUTER JOIN agent_schedule a ON a.node = r.node
WHERE r.node = %(node)s
ORDER BY a.id
