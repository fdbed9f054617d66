-- Complete a batch of claims in one statement (Postgres): for each (id, name,
-- scheduled_at, next_run_at, status) row, move the task on (fenced on its
-- next_run_at still being scheduled_at) and mark its dispatch record dispatched.
WITH batch AS (
    SELECT *
    FROM unnest(
        CAST(%(ids)s AS bigint[]),
        CAST(%(names)s AS text[]),
        CAST(%(scheduled)s AS timestamptz[]),
        CAST(%(following)s AS timestamptz[]),
        CAST(%(statuses)s AS text[])
    ) AS b(id, name, scheduled_at, next_run_at, status)
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
    last_error = NULL,
    updated_at = coalesce(CAST(%(now)s AS timestamptz), now())
FROM batch
WHERE t.id = batch.id AND t.next_run_at = batch.scheduled_at
RETURNING t.id
