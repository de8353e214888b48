-- Cron (§8.5): the runtime-editable belay_crons rows that every node's scheduler
-- merges over its static entries. Same columns and meaning as the reference's
-- rows: worker is the kind, input the job input, opts the enqueue options as a
-- JSON object with string keys.

-- name: put_cron
-- An upsert that leaves paused alone: replacing a paused cron keeps it paused.
INSERT INTO belay_crons (name, expression, worker, input, opts, updated_at)
VALUES (%(name)s, %(expression)s, %(worker)s, %(input)s::jsonb, %(opts)s::jsonb, %(now)s)
ON CONFLICT (name) DO UPDATE
  SET expression = EXCLUDED.expression, worker = EXCLUDED.worker, input = EXCLUDED.input,
      opts = EXCLUDED.opts, updated_at = EXCLUDED.updated_at
RETURNING name, expression, worker, input, opts, paused, updated_at;

-- name: delete_cron
DELETE FROM belay_crons WHERE name = %s;

-- name: set_cron_paused
UPDATE belay_crons SET paused = %(paused)s, updated_at = %(now)s WHERE name = %(name)s;

-- name: list_crons
SELECT name, expression, worker, input, opts, paused, updated_at
FROM belay_crons
ORDER BY name;
