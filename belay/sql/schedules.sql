-- Schedules (docs/cron.md): crons with an overlap policy, a catch-up mode and
-- a durable cursor, in belay_schedules (revision 5). Their occurrences are
-- jobs with cron_name = the schedule's name and cron_slot = the occurrence.

-- name: declare_schedule
-- Create or redeclare. A redeclaration that changes the definition bumps the
-- revision; one that changes nothing is a no-op (idempotent). An API
-- declaration of a cancelled schedule revives it, a static one does not (an
-- operator's cancel outlives a deploy); the cursor is kept either way.
INSERT INTO belay_schedules AS s
  (name, expression, worker, input, opts, overlap, catch_up, static, cursor_slot,
   created_at, updated_at)
VALUES (%(name)s, %(expression)s, %(worker)s, %(input)s::jsonb, %(opts)s::jsonb,
        %(overlap)s, %(catch_up)s, %(static)s, %(cursor)s, %(now)s, %(now)s)
ON CONFLICT (name) DO UPDATE
  SET expression = EXCLUDED.expression, worker = EXCLUDED.worker, input = EXCLUDED.input,
      opts = EXCLUDED.opts, overlap = EXCLUDED.overlap, catch_up = EXCLUDED.catch_up,
      static = EXCLUDED.static,
      revision = s.revision + 1,
      cancelled_at = CASE WHEN EXCLUDED.static THEN s.cancelled_at END,
      updated_at = EXCLUDED.updated_at
  WHERE (s.expression, s.worker, s.input, s.opts, s.overlap, s.catch_up, s.static)
        IS DISTINCT FROM (EXCLUDED.expression, EXCLUDED.worker, EXCLUDED.input,
                          EXCLUDED.opts, EXCLUDED.overlap, EXCLUDED.catch_up,
                          EXCLUDED.static)
     OR (NOT EXCLUDED.static AND s.cancelled_at IS NOT NULL)
RETURNING name;

-- name: cancel_schedule
-- Cancelled, not deleted: its status (and cursor) stay readable.
UPDATE belay_schedules SET cancelled_at = %(now)s, updated_at = %(now)s
WHERE name = %(name)s AND cancelled_at IS NULL
RETURNING name;

-- name: schedule_exists
SELECT cancelled_at IS NOT NULL AS cancelled FROM belay_schedules WHERE name = %s;

-- name: get_schedule
SELECT s.*, (SELECT j.id FROM belay_jobs AS j
             WHERE j.cron_name = s.name
               AND j.state NOT IN ('succeeded', 'failed', 'cancelled')
             ORDER BY j.id LIMIT 1) AS active_job_id
FROM belay_schedules AS s
WHERE s.name = %s;

-- name: schedule_page
-- A page in name order after the cursor (exclusive), one row more than asked
-- for: its presence says there is a next page.
SELECT s.*, (SELECT j.id FROM belay_jobs AS j
             WHERE j.cron_name = s.name
               AND j.state NOT IN ('succeeded', 'failed', 'cancelled')
             ORDER BY j.id LIMIT 1) AS active_job_id
FROM belay_schedules AS s
WHERE %(after)s::text IS NULL OR s.name > %(after)s::text
ORDER BY s.name
LIMIT %(limit)s;

-- name: due_schedules
-- The scheduler's round: every live schedule this node may handle now, locked
-- until its transaction ends. Another node's round holds the ones it is
-- handling: skipped here, never waited for, never handled twice.
SELECT s.name, s.expression, s.worker, s.input, s.opts, s.overlap, s.catch_up,
       s.cursor_slot,
       EXISTS (SELECT 1 FROM belay_jobs AS j
               WHERE j.cron_name = s.name
                 AND j.state NOT IN ('succeeded', 'failed', 'cancelled')) AS busy
FROM belay_schedules AS s
WHERE s.cancelled_at IS NULL
ORDER BY s.name
FOR UPDATE OF s SKIP LOCKED;

-- name: advance_schedule
UPDATE belay_schedules
SET cursor_slot = %(cursor)s, last_job_id = COALESCE(%(job_id)s, last_job_id)
WHERE name = %(name)s;

-- name: cron_named
SELECT 1 FROM belay_crons WHERE name = %s;
