-- Spend analytics (belay/spend.py): cost and tokens of the jobs enqueued in a
-- time range, grouped by up to two dimensions.

-- name: spend_jit_off
-- For the rest of this transaction: a report's plan over a big range is
-- costed past jit_above_cost, and compiling it took longer than running it
-- (321 of 654 ms at 7 days of 10M jobs, bench/spend_results.md).
SELECT set_config('jit', 'off', true);

-- name: spend_by
-- Each spending job of [since, until) — found through belay_jobs_spend_idx,
-- whose predicate this repeats — with its own spend: what it spent less what
-- map_children(budget="share") charged back to it from its children (steps
-- `$spend:<name>`, which the children's own rows count already), so a tree is
-- never counted twice. A dimension is one of kind, queue, day, hour (UTC),
-- workflow, parent, tree (the id of the job's root ancestor) or meta (the
-- value of the meta key given); none when NULL. Groups by spend, largest
-- first, or by time for day and hour; every row carries the totals of all
-- groups, and how many there are, so a capped list still knows the whole.
WITH spending AS (
  SELECT j.id, j.kind, j.queue, j.inserted_at, j.workflow_id, j.parent_id, j.meta,
         j.spent_usd_micros - COALESCE(back.usd_micros, 0) AS usd_micros,
         j.spent_tokens - COALESCE(back.tokens, 0) AS tokens,
         CASE WHEN 'tree' IN (%(first)s::text, %(second)s::text) THEN (
           WITH RECURSIVE up AS (
             SELECT j.id AS id, j.parent_id AS parent_id, 0 AS depth
             UNION ALL
             SELECT p.id, p.parent_id, up.depth + 1
             FROM up JOIN belay_jobs p ON p.id = up.parent_id
             WHERE up.depth < 64
           )
           SELECT id FROM up ORDER BY depth DESC LIMIT 1)
         END AS root
  FROM belay_jobs j
  LEFT JOIN LATERAL (
    SELECT sum(s.usd_micros) AS usd_micros, sum(s.tokens) AS tokens
    FROM belay_steps s
    WHERE s.job_id = j.id AND s.name >= '$spend:' AND s.name < '$spend;'
  ) back ON true
  WHERE (j.spent_usd_micros <> 0 OR j.spent_tokens <> 0)
    AND j.inserted_at >= %(since)s AND j.inserted_at < %(until)s
    AND (%(kind)s::text IS NULL OR j.kind = %(kind)s::text)
    AND (%(queue)s::text IS NULL OR j.queue = %(queue)s::text)
    AND (%(meta)s::jsonb IS NULL OR j.meta @> %(meta)s::jsonb)
), keyed AS (
  SELECT usd_micros, tokens,
         CASE %(first)s::text
           WHEN 'kind' THEN kind WHEN 'queue' THEN queue
           WHEN 'day' THEN to_char(inserted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')
           WHEN 'hour' THEN to_char(inserted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:00')
           WHEN 'workflow' THEN workflow_id WHEN 'parent' THEN parent_id::text
           WHEN 'tree' THEN root::text WHEN 'meta' THEN meta ->> %(first_key)s::text
         END AS first_key,
         CASE %(second)s::text
           WHEN 'kind' THEN kind WHEN 'queue' THEN queue
           WHEN 'day' THEN to_char(inserted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')
           WHEN 'hour' THEN to_char(inserted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:00')
           WHEN 'workflow' THEN workflow_id WHEN 'parent' THEN parent_id::text
           WHEN 'tree' THEN root::text WHEN 'meta' THEN meta ->> %(second_key)s::text
         END AS second_key
  FROM spending
), grouped AS (
  SELECT first_key, second_key, count(*) AS jobs,
         sum(usd_micros)::bigint AS usd_micros, sum(tokens)::bigint AS tokens
  FROM keyed GROUP BY first_key, second_key
)
SELECT first_key, second_key, jobs, usd_micros, tokens,
       count(*) OVER () AS groups,
       sum(jobs) OVER ()::bigint AS total_jobs,
       sum(usd_micros) OVER ()::bigint AS total_usd_micros,
       sum(tokens) OVER ()::bigint AS total_tokens
FROM grouped
ORDER BY CASE WHEN %(first)s::text IN ('day', 'hour') THEN first_key END,
         usd_micros DESC, tokens DESC, first_key, second_key
LIMIT %(limit)s;

-- name: spend_tree
-- A job and all its descendants (children, their children, …; at most 64
-- deep): how many, and their own spend (less charge-backs, as in spend_by),
-- per kind. Whatever their age: a tree is read through belay_jobs_parent_idx.
WITH RECURSIVE tree AS (
  SELECT id, 0 AS depth FROM belay_jobs WHERE id = %(job_id)s
  UNION ALL
  SELECT c.id, tree.depth + 1 FROM tree JOIN belay_jobs c ON c.parent_id = tree.id
  WHERE tree.depth < 64
)
SELECT j.kind, count(*) AS jobs, max(tree.depth) AS depth,
       sum(j.spent_usd_micros - COALESCE(back.usd_micros, 0))::bigint AS usd_micros,
       sum(j.spent_tokens - COALESCE(back.tokens, 0))::bigint AS tokens
FROM tree JOIN belay_jobs j ON j.id = tree.id
LEFT JOIN LATERAL (
  SELECT sum(s.usd_micros) AS usd_micros, sum(s.tokens) AS tokens
  FROM belay_steps s
  WHERE s.job_id = j.id AND s.name >= '$spend:' AND s.name < '$spend;'
) back ON true
GROUP BY j.kind
ORDER BY usd_micros DESC, tokens DESC, j.kind;
