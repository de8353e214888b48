-- Admission (contract §6), dynamic queues (§8.6) and retention (§8.7).
-- Admission statements run inside one transaction that holds the queue's
-- advisory lock, so their reads and the claim that follows can't race.

-- name: live_running_count
-- §6 global_limit: the queue's jobs under a live lease (an expired lease no
-- longer holds a slot; the sweeper reclaims it).
SELECT count(*) FROM belay_jobs
WHERE queue = %(queue)s AND state = 'running' AND lease_until > %(now)s;

-- name: rate_windows
-- §6: the current and previous windows of a rate bucket.
SELECT window_start, count FROM belay_rate
WHERE bucket = %(bucket)s AND window_start = ANY(%(windows)s::bigint[]);

-- name: claim_partitioned_ids
-- §6 partitioned candidates, exact: the claimable jobs ranked within each key
-- in claim order, those a key still has room for (its cap minus its
-- live-running jobs), the best globally. No FOR UPDATE: the queue's advisory
-- lock serializes claimers; claim_ids re-checks each row as it takes it.
-- Ranked first over a prefix: the first %(window)s claimable jobs in claim
-- order, read along the claim's own indexes. A job's rank counts only its
-- key's jobs ahead of it in claim order, all of which are in the prefix, so
-- the prefix's picks are exactly the full ranking's picks among it — and the
-- whole answer when they fill the take or when the prefix held every
-- claimable job. Only otherwise (keys at their cap fill the prefix: one
-- tenant's backlog ahead of the others') is the whole queue ranked; that
-- subquery is not run at all when the prefix settles it. Due awaiting jobs
-- are few; they are sorted in full claim order so the prefix is exact.
WITH running AS (
  SELECT COALESCE((CASE WHEN %(source)s = 'meta' THEN meta ELSE input END) ->> %(key)s, '') AS k,
         count(*) AS c
  FROM belay_jobs
  WHERE queue = %(queue)s AND state = 'running' AND lease_until > %(now)s
  GROUP BY 1
), ready AS (
  SELECT id, priority, ready_at,
         (CASE WHEN %(source)s = 'meta' THEN meta ELSE input END) ->> %(key)s AS k
  FROM belay_jobs
  WHERE queue = %(queue)s AND state = 'ready'
    AND COALESCE(ready_at, '-infinity') <= %(now)s
    AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
  ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
  LIMIT %(window)s
), due AS (
  SELECT id, priority, ready_at,
         (CASE WHEN %(source)s = 'meta' THEN meta ELSE input END) ->> %(key)s AS k
  FROM belay_jobs
  WHERE queue = %(queue)s AND state = 'awaiting' AND ready_at IS NOT NULL
    AND ready_at <= %(now)s
    AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
  ORDER BY priority ASC, ready_at ASC, id ASC
  LIMIT %(window)s
), prefix AS (
  SELECT id, priority, ready_at, COALESCE(k, '') AS k
  FROM (SELECT * FROM ready UNION ALL SELECT * FROM due) AS candidates
  ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
  LIMIT %(window)s
), picks AS (
  SELECT r.id, r.priority, r.ready_at
  FROM (SELECT id, priority, ready_at, k,
               row_number() OVER (PARTITION BY k ORDER BY priority ASC,
                                  ready_at ASC NULLS FIRST, id ASC) AS rn
        FROM prefix) AS r
  LEFT JOIN running ON running.k = r.k
  WHERE r.rn <= GREATEST(%(per_key)s - COALESCE(running.c, 0), 0)
  ORDER BY r.priority ASC, r.ready_at ASC NULLS FIRST, r.id ASC
  LIMIT %(take)s
)
SELECT CASE
  WHEN (SELECT count(*) FROM picks) >= %(take)s OR (SELECT count(*) FROM prefix) < %(window)s
  THEN ARRAY(SELECT id FROM picks ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC)
  ELSE ARRAY(
    SELECT r.id
    FROM (SELECT id, priority, ready_at, k,
                 row_number() OVER (PARTITION BY k ORDER BY priority ASC,
                                    ready_at ASC NULLS FIRST, id ASC) AS rn
          FROM (SELECT id, priority, ready_at,
                       COALESCE((CASE WHEN %(source)s = 'meta' THEN meta ELSE input END)
                                ->> %(key)s, '') AS k
                FROM belay_jobs
                WHERE queue = %(queue)s
                  AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
                  AND ((state = 'ready' AND (ready_at IS NULL OR ready_at <= %(now)s))
                    OR (state = 'awaiting' AND ready_at IS NOT NULL
                        AND ready_at <= %(now)s))) AS keyed
          -- A key at its cap has no room: its jobs are dropped before the
          -- ranking sorts them (the backlog that sent the claim here).
          WHERE keyed.k NOT IN (SELECT k FROM running WHERE c >= %(per_key)s)) AS r
    LEFT JOIN running ON running.k = r.k
    WHERE r.rn <= GREATEST(%(per_key)s - COALESCE(running.c, 0), 0)
    ORDER BY r.priority ASC, r.ready_at ASC NULLS FIRST, r.id ASC
    LIMIT %(take)s)
END AS ids;

-- name: claim_ids
-- §6 claim update for chosen candidates, each re-checked claimable.
UPDATE belay_jobs
SET state = 'running', attempt = attempt + 1, lease_until = %(lease_until)s,
    leased_by = %(node)s, started_at = COALESCE(started_at, %(now)s)
WHERE id = ANY(%(ids)s::bigint[])
  AND ((state = 'ready' AND (ready_at IS NULL OR ready_at <= %(now)s))
    OR (state = 'awaiting' AND ready_at IS NOT NULL AND ready_at <= %(now)s))
RETURNING {job_columns};

-- name: list_queues
SELECT name, opts, updated_at FROM belay_queues ORDER BY name;

-- name: put_queue
INSERT INTO belay_queues (name, opts, updated_at) VALUES (%(name)s, %(opts)s::jsonb, %(now)s)
ON CONFLICT (name) DO UPDATE SET opts = EXCLUDED.opts, updated_at = EXCLUDED.updated_at;

-- name: delete_queue
DELETE FROM belay_queues WHERE name = %s;

-- name: pause_queue
-- Sets "paused" in the row's options, making a pause-only row when none exists.
INSERT INTO belay_queues (name, opts, updated_at)
VALUES (%(name)s, '{"paused": true}'::jsonb, %(now)s)
ON CONFLICT (name) DO UPDATE
SET opts = belay_queues.opts || '{"paused": true}'::jsonb, updated_at = EXCLUDED.updated_at;

-- name: resume_queue
-- Drops "paused"; returns what options are left.
UPDATE belay_queues SET opts = opts - 'paused', updated_at = %(now)s
WHERE name = %(name)s
RETURNING opts;

-- name: delete_empty_queue
-- A row left with no options at all (a pause-only row) goes away.
DELETE FROM belay_queues WHERE name = %s AND opts = '{}'::jsonb;

-- name: queue_paused
SELECT COALESCE((opts ->> 'paused')::boolean, false) FROM belay_queues WHERE name = %s;

-- name: prune_jobs
-- §8.7 retention: one batch of a terminal state's jobs finished before its
-- cutoff, deleted with their steps and events in one statement. A job has
-- "expired" when it finished before its own state's cutoff (a NULL cutoff:
-- kept forever; a non-terminal job never expires). Workflow members go only
-- once every member of the workflow expired (settlement and an operator's
-- retry read the members' states), children only once their parent expired
-- too (a retried parent re-reads its children, and a pruned always-unique
-- spawn key would let a child be spawned again). The batch's rows are found
-- by id through arrays (a primary-key probe each): as joins, a prepared
-- statement's generic plan (which can't know the limit, so guesses a tenth of
-- the table) hashed all three tables, 1.8M rows read for a batch of 100 from
-- a table of 1M finished jobs (issue 39).
WITH cutoff (state, before) AS (
  VALUES ('succeeded', %(succeeded)s::timestamptz), ('failed', %(failed)s::timestamptz),
         ('cancelled', %(cancelled)s::timestamptz)
), doomed AS (
  SELECT j.id FROM belay_jobs AS j
  WHERE j.state = %(state)s AND j.finished_at IS NOT NULL AND j.finished_at < %(cutoff)s
    AND (j.workflow_id IS NULL OR NOT EXISTS (
      SELECT 1 FROM belay_jobs AS w LEFT JOIN cutoff AS c ON c.state = w.state
      WHERE w.workflow_id = j.workflow_id
        AND (c.before IS NULL OR w.finished_at IS NULL OR w.finished_at >= c.before)))
    AND (j.parent_id IS NULL OR NOT EXISTS (
      SELECT 1 FROM belay_jobs AS p LEFT JOIN cutoff AS c ON c.state = p.state
      WHERE p.id = j.parent_id
        AND (c.before IS NULL OR p.finished_at IS NULL OR p.finished_at >= c.before)))
  ORDER BY j.finished_at
  LIMIT %(limit)s
  FOR UPDATE OF j SKIP LOCKED
), gone AS (
  DELETE FROM belay_jobs AS j
  WHERE j.id = ANY(ARRAY(SELECT id FROM doomed)) AND j.state = %(state)s
  RETURNING j.id
), steps AS (
  DELETE FROM belay_steps WHERE job_id = ANY(ARRAY(SELECT id FROM gone))
), events AS (
  DELETE FROM belay_events WHERE job_id = ANY(ARRAY(SELECT id FROM gone))
)
SELECT count(*) FROM gone;

-- name: prune_signals
-- §8.7: signals past their TTL.
DELETE FROM belay_signals WHERE inserted_at < %s;

-- name: prune_rate
-- §8.7: rate windows older than a day.
DELETE FROM belay_rate WHERE window_start < %s;
