-- Every statement belay runs lives in this file, as named blocks ("-- name: x").
-- Contract rule (§2): SQL never calls now(); "now" is always a bind parameter.

-- name: job_columns
-- Every job read names its columns (expanded into "{job_columns}" below), never
-- "*": a column added by a newer revision (§1, additive) then changes nothing
-- here, where "*" would break every prepared statement on live connections
-- ("cached plan must not change result type").
id, kind, queue, state, input, meta, priority, attempt, max_attempts, partition_key,
ready_at, lease_until, leased_by, await_scope, await_name, workflow_id, wf_name, wf_deps,
wf_ignore, cron_name, cron_slot, unique_key, unique_mode, parent_id, budget_usd_micros,
budget_tokens, spent_usd_micros, spent_tokens, result, errors, cancel_requested,
inserted_at, started_at, finished_at

-- name: advisory_xact_lock
-- Keys are built by belay.locks so every lock name has one spelling.
SELECT pg_advisory_xact_lock(hashtext(%s));

-- name: advisory_xact_locks
-- Several locks in the caller's order (callers sort the keys, so two
-- transactions taking overlapping sets never wait on each other in a cycle).
SELECT pg_advisory_xact_lock(hashtext(k))
FROM unnest(%s::text[]) WITH ORDINALITY AS l(k, ord)
ORDER BY ord;

-- name: advisory_try_xact_lock
-- Taken without waiting, held until the transaction ends: the guard around
-- LangGraph's PostgresSaver.setup(), which can't itself run inside a
-- transaction (and a session lock would outlive it on a pooled server connection).
SELECT pg_try_advisory_xact_lock(hashtext(%s));

-- name: local_statement_timeout
-- SET LOCAL: ends with the transaction, so it never outlives it on a pooled
-- server connection.
SELECT set_config('statement_timeout', %s, true);

-- name: current_database
-- The server's name for the database: the NOTIFY channel derives from it, and
-- behind a pooler the client's dbname may be an alias.
SELECT current_database();

-- name: meta_create
CREATE TABLE IF NOT EXISTS belay_meta (version int NOT NULL);

-- name: meta_exists
SELECT to_regclass('belay_meta') IS NOT NULL;

-- name: meta_revision
SELECT COALESCE(max(version), 0) FROM belay_meta;

-- name: meta_has_contract_major
SELECT EXISTS (
  SELECT 1 FROM pg_attribute
  WHERE attrelid = to_regclass('belay_meta') AND attname = 'contract_major' AND NOT attisdropped
);

-- name: meta_contract_major
SELECT max(contract_major) FROM belay_meta;

-- name: meta_record
INSERT INTO belay_meta (version) VALUES (%s);

-- name: insert_jobs
-- §5.1: one multi-row INSERT whatever the batch size (arrays, so the statement
-- text never changes and stays prepared). The targetless conflict clause
-- absorbs unique-key and cron-slot dedup; skipped rows are not returned.
-- WITH ORDINALITY keeps the caller's order, which makes id order equal input
-- order: the client relies on that to tell which rows were skipped.
INSERT INTO belay_jobs (
  kind, queue, state, input, meta, priority, attempt, max_attempts, partition_key,
  ready_at, workflow_id, wf_name, wf_deps, wf_ignore, cron_name, cron_slot,
  unique_key, unique_mode, parent_id, budget_usd_micros, budget_tokens,
  spent_usd_micros, spent_tokens, errors, cancel_requested, inserted_at
)
SELECT r.kind, r.queue, r.state, r.input, r.meta, r.priority, 0, r.max_attempts,
       r.partition_key, r.ready_at, r.workflow_id, r.wf_name,
       ARRAY(SELECT jsonb_array_elements_text(r.wf_deps)),
       ARRAY(SELECT jsonb_array_elements_text(r.wf_ignore)),
       r.cron_name, r.cron_slot, r.unique_key, r.unique_mode, r.parent_id,
       r.budget_usd_micros, r.budget_tokens, 0, 0, '[]'::jsonb, false, %(now)s
FROM unnest(
  %(kind)s::text[], %(queue)s::text[], %(state)s::text[], %(input)s::text[]::jsonb[],
  %(meta)s::text[]::jsonb[], %(priority)s::int[], %(max_attempts)s::int[],
  %(partition_key)s::text[], %(ready_at)s::timestamptz[], %(workflow_id)s::text[],
  %(wf_name)s::text[], %(wf_deps)s::text[]::jsonb[], %(wf_ignore)s::text[]::jsonb[],
  %(cron_name)s::text[], %(cron_slot)s::timestamptz[], %(unique_key)s::text[],
  %(unique_mode)s::text[], %(parent_id)s::bigint[], %(budget_usd_micros)s::bigint[],
  %(budget_tokens)s::bigint[]
) WITH ORDINALITY AS r (
  kind, queue, state, input, meta, priority, max_attempts, partition_key, ready_at,
  workflow_id, wf_name, wf_deps, wf_ignore, cron_name, cron_slot, unique_key,
  unique_mode, parent_id, budget_usd_micros, budget_tokens, ord
)
ORDER BY r.ord
ON CONFLICT DO NOTHING
RETURNING {job_columns},
  -- With a channel (an enqueue on belay's own autocommit connection), the
  -- wake-up rides on the insert: one round trip, sent at the statement's
  -- commit, once per queue (Postgres folds equal notifications of one
  -- transaction). The payload is §9.2's {"t":"p","q":<queue>}.
  CASE WHEN %(channel)s::text IS NOT NULL
       THEN pg_notify(%(channel)s, '{"t":"p","q":' || to_json(queue)::text || '}') END
    AS poked;

-- name: insert_job
-- insert_jobs for one row, with plain parameters: no arrays to build and
-- dump on the client, which is most of a single enqueue's Python. Returns
-- the id when inserted (the client knows every other column), nothing when
-- skipped on conflict; pokes like insert_jobs. Positional parameters: the
-- row's fields in order, then now, then the channel twice.
INSERT INTO belay_jobs (
  kind, queue, state, input, meta, priority, attempt, max_attempts, partition_key,
  ready_at, workflow_id, wf_name, wf_deps, wf_ignore, cron_name, cron_slot,
  unique_key, unique_mode, parent_id, budget_usd_micros, budget_tokens,
  spent_usd_micros, spent_tokens, errors, cancel_requested, inserted_at
) VALUES (
  %s::text, %s::text, %s::text, %s::jsonb, %s::jsonb,
  %s::int, 0, %s::int, %s::text,
  %s::timestamptz, %s::text, %s::text,
  ARRAY(SELECT jsonb_array_elements_text(%s::jsonb)),
  ARRAY(SELECT jsonb_array_elements_text(%s::jsonb)),
  %s::text, %s::timestamptz, %s::text,
  %s::text, %s::bigint, %s::bigint,
  %s::bigint, 0, 0, '[]'::jsonb, false, %s::timestamptz
)
ON CONFLICT DO NOTHING
RETURNING id,
  CASE WHEN %s::text IS NOT NULL
       THEN pg_notify(%s, '{"t":"p","q":' || to_json(queue)::text || '}') END
    AS poked;

-- name: draw_job_ids
-- §5.1 for a batch written by COPY: its ids from the table's own sequence,
-- ascending, so id order is input order as with insert_jobs.
-- (MATERIALIZED: the sequence is looked up once, not once per id, 15x slower.)
WITH s AS MATERIALIZED (
  SELECT pg_get_serial_sequence('belay_jobs', 'id')::regclass AS seq
)
SELECT nextval(s.seq) AS id FROM s, generate_series(1, %s)
ORDER BY 1;

-- name: copy_jobs
-- §5.1 for a batch no row of which can conflict (no unique key, no cron
-- slot): COPY, the fastest way into the table. Ids come from draw_job_ids;
-- the other columns get what insert_jobs gives them.
COPY belay_jobs (
  id, kind, queue, state, input, meta, priority, attempt, max_attempts, partition_key,
  ready_at, workflow_id, wf_name, wf_deps, wf_ignore, parent_id, budget_usd_micros,
  budget_tokens, spent_usd_micros, spent_tokens, errors, cancel_requested, inserted_at
) FROM STDIN;

-- name: jobs_by_unique_keys
-- §5.2: the holder of each key, per mode group (the two unique indexes are
-- separate, so a key used in both groups never reports the other's job).
-- Each branch reads its group's unique index, so at most one row per key: a
-- live job for 'incomplete' (one that finished since the insert conflicted
-- is no holder: the key is free again, and the caller inserts once more),
-- the key's only row for 'window' and 'always'. (Asking for the newest row
-- of any state instead matched neither index: a scan of the whole table.)
SELECT {job_columns} FROM belay_jobs
WHERE unique_key = ANY(%(keys)s::text[]) AND unique_mode = 'incomplete'
  AND state IN ('ready', 'running', 'awaiting', 'held', 'paused')
UNION ALL
SELECT {job_columns} FROM belay_jobs
WHERE unique_key = ANY(%(keys)s::text[]) AND unique_mode IN ('window', 'always');

-- name: jobs_by_cron_slots
SELECT {job_columns} FROM belay_jobs
WHERE (cron_name, cron_slot) IN (
  SELECT * FROM unnest(%s::text[], %s::timestamptz[])
);

-- name: notify
-- §9.2: one pg_notify per distinct payload; inside a transaction Postgres
-- delivers them only on commit.
SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p;

-- name: get_job
SELECT {job_columns} FROM belay_jobs WHERE id = %s;

-- name: get_job_for_update
SELECT {job_columns} FROM belay_jobs WHERE id = %s FOR UPDATE;

-- name: list_jobs
-- Newest first; a NULL filter matches everything. before_id pages backwards.
-- The shape for no filter, or a workflow or parent (each has its own index);
-- store.list_jobs sends a state or queue filter to the statements below.
SELECT {job_columns} FROM belay_jobs
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (%(state)s::text IS NULL OR state = %(state)s::text)
  AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
  AND (%(workflow_id)s::text IS NULL OR workflow_id = %(workflow_id)s::text)
  AND (%(parent_id)s::bigint IS NULL OR parent_id = %(parent_id)s::bigint)
  AND (%(before_id)s::bigint IS NULL OR id < %(before_id)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: list_jobs_in_state_queue
-- A state and a queue: the page's ids straight off belay_jobs_state_queue_id_idx
-- (an index-only scan that stops after `limit` entries), then their rows. In one
-- statement the planner prefers walking the primary key backwards, expecting
-- matches spread evenly; behind a million-row ready backlog it read a million
-- rows (1 s at 10M rows; bench/bigtable_results.md). MATERIALIZED keeps the
-- two steps apart. before_id is a range bound, never "IS NULL OR", so a generic
-- plan keeps it as an index condition. `id > 0` is the index's predicate
-- (migration 4 says why).
WITH page AS MATERIALIZED (
  SELECT id FROM belay_jobs
  WHERE id > 0 AND state = %(state)s AND queue = %(queue)s
    AND id < COALESCE(%(before_id)s::bigint, 9223372036854775807)
    AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
  ORDER BY id DESC
  LIMIT %(limit)s
)
SELECT {job_columns} FROM belay_jobs JOIN page USING (id) ORDER BY id DESC;

-- name: list_jobs_in_state
-- A state, any queue: the newest `limit` ids of each of the state's queues (the
-- queues found by skipping through the index, one probe per queue), merged.
WITH RECURSIVE queues AS (
  (SELECT queue FROM belay_jobs WHERE id > 0 AND state = %(state)s ORDER BY queue LIMIT 1)
  UNION ALL
  SELECT (SELECT j.queue FROM belay_jobs j
          WHERE j.id > 0 AND j.state = %(state)s AND j.queue > q.queue
          ORDER BY j.queue LIMIT 1)
  FROM queues q WHERE q.queue IS NOT NULL
), page AS MATERIALIZED (
  SELECT newest.id FROM queues CROSS JOIN LATERAL (
    SELECT id FROM belay_jobs
    WHERE id > 0 AND state = %(state)s AND queue = queues.queue
      AND id < COALESCE(%(before_id)s::bigint, 9223372036854775807)
      AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
    ORDER BY id DESC
    LIMIT %(limit)s
  ) AS newest
  WHERE queues.queue IS NOT NULL
  ORDER BY newest.id DESC
  LIMIT %(limit)s
)
SELECT {job_columns} FROM belay_jobs JOIN page USING (id) ORDER BY id DESC;

-- name: list_jobs_in_queue
-- A queue, any state: as above, one index range per state present.
WITH RECURSIVE states AS (
  (SELECT state FROM belay_jobs WHERE id > 0 ORDER BY state LIMIT 1)
  UNION ALL
  SELECT (SELECT j.state FROM belay_jobs j WHERE j.id > 0 AND j.state > s.state
          ORDER BY j.state LIMIT 1)
  FROM states s WHERE s.state IS NOT NULL
), page AS MATERIALIZED (
  SELECT newest.id FROM states CROSS JOIN LATERAL (
    SELECT id FROM belay_jobs
    WHERE id > 0 AND state = states.state AND queue = %(queue)s
      AND id < COALESCE(%(before_id)s::bigint, 9223372036854775807)
      AND (%(kind)s::text IS NULL OR kind = %(kind)s::text)
    ORDER BY id DESC
    LIMIT %(limit)s
  ) AS newest
  WHERE states.state IS NOT NULL
  ORDER BY newest.id DESC
  LIMIT %(limit)s
)
SELECT {job_columns} FROM belay_jobs JOIN page USING (id) ORDER BY id DESC;

-- name: workflow_jobs
SELECT {job_columns} FROM belay_jobs WHERE workflow_id = %s ORDER BY id;

-- name: queue_stats
-- Jobs per queue and state, each count stopping at a cap: a count above
-- %(live_cap)s (ready, running, awaiting, held, paused) or %(terminal_cap)s
-- (succeeded, failed, cancelled) comes back as that cap + 1; a NULL cap counts
-- exactly. The (state, queue) pairs are found by skipping through
-- belay_jobs_state_queue_id_idx, one probe per pair, and each count is an
-- index-only scan of its range: no pass over the table, which took 10 s at 10M
-- rows (bench/bigtable_results.md). `id > 0` is the index's predicate.
WITH RECURSIVE pairs AS (
  (SELECT state, queue FROM belay_jobs WHERE id > 0 ORDER BY state, queue LIMIT 1)
  UNION ALL
  SELECT next.state, next.queue FROM pairs CROSS JOIN LATERAL (
    SELECT j.state, j.queue FROM belay_jobs j
    WHERE j.id > 0 AND (j.state, j.queue) > (pairs.state, pairs.queue)
    ORDER BY j.state, j.queue LIMIT 1
  ) AS next
)
SELECT pairs.queue, pairs.state, counted.count FROM pairs CROSS JOIN LATERAL (
  SELECT count(*) AS count FROM (
    SELECT FROM belay_jobs j
    WHERE j.id > 0 AND j.state = pairs.state AND j.queue = pairs.queue
    LIMIT CASE WHEN pairs.state IN ('succeeded', 'failed', 'cancelled')
               THEN %(terminal_cap)s::bigint ELSE %(live_cap)s::bigint END + 1
  ) AS capped
) AS counted
ORDER BY pairs.queue, pairs.state;

-- name: queue_spend_in_flight
-- Cost and tokens so far of the jobs not yet finished, per queue (the
-- dashboard's tiles): bounded by the work in flight, where a sum over every job
-- would read the whole table. `id > 0` lets it find them through
-- belay_jobs_state_queue_id_idx (migration 4 says why it is stated).
SELECT queue, COALESCE(sum(spent_usd_micros), 0)::bigint AS spent_usd_micros,
       COALESCE(sum(spent_tokens), 0)::bigint AS spent_tokens
FROM belay_jobs WHERE id > 0 AND state IN ('running', 'awaiting', 'held', 'paused')
GROUP BY queue;

-- name: finished_since
-- Jobs finished per queue and outcome since a moment (the dashboard's rates);
-- reads the (state, finished_at) retention index.
SELECT queue, state, count(*) AS count FROM belay_jobs
WHERE state IN ('succeeded', 'failed', 'cancelled') AND finished_at >= %s
GROUP BY queue, state;

-- name: list_steps
SELECT seq, name, value, usd_micros, tokens, inserted_at
FROM belay_steps WHERE job_id = %s ORDER BY seq;

-- name: steps_head
-- The first N entries of a job's journal (what an operator's view shows).
SELECT seq, name, value, usd_micros, tokens, inserted_at
FROM belay_steps WHERE job_id = %s ORDER BY seq LIMIT %s;

-- name: step_totals
SELECT count(*) AS count, COALESCE(sum(usd_micros), 0)::bigint AS usd_micros,
       COALESCE(sum(tokens), 0)::bigint AS tokens
FROM belay_steps WHERE job_id = %s;

-- name: events_tail
-- The newest N events of a job, oldest first.
SELECT seq, payload, inserted_at FROM (
  SELECT seq, payload, inserted_at FROM belay_events
  WHERE job_id = %s ORDER BY seq DESC LIMIT %s
) AS newest ORDER BY seq;

-- name: count_events
SELECT count(*) FROM belay_events WHERE job_id = %s;

-- name: children_head
SELECT {job_columns} FROM belay_jobs WHERE parent_id = %s ORDER BY id LIMIT %s;

-- name: count_children
SELECT count(*) FROM belay_jobs WHERE parent_id = %s;

-- name: list_events
-- LIMIT NULL is no limit.
SELECT seq, payload, inserted_at FROM belay_events
WHERE job_id = %s AND seq > %s ORDER BY seq LIMIT %s;

-- name: upsert_signal
-- §8.1: upsert-latest; the row persists until cleared or TTL-pruned, so an
-- awaiter that parks after delivery still finds it.
INSERT INTO belay_signals (scope, name, payload, inserted_at)
VALUES (%s, %s, %s::jsonb, %s)
ON CONFLICT (scope, name) DO UPDATE
  SET payload = EXCLUDED.payload, inserted_at = EXCLUDED.inserted_at;

-- name: upsert_signals
-- upsert_signal for several scopes at once, one name and payload (a batched
-- ack's $children to each parent). The scopes must be distinct.
INSERT INTO belay_signals (scope, name, payload, inserted_at)
SELECT s, %(name)s, %(payload)s::jsonb, %(now)s FROM unnest(%(scopes)s::text[]) AS s
ON CONFLICT (scope, name) DO UPDATE
  SET payload = EXCLUDED.payload, inserted_at = EXCLUDED.inserted_at;

-- name: wake_awaiting_many
UPDATE belay_jobs
SET state = 'ready', ready_at = %(now)s, await_scope = NULL, await_name = NULL
WHERE state = 'awaiting' AND await_scope = ANY(%(scopes)s::text[]) AND await_name = %(name)s
RETURNING id, queue;

-- name: wake_awaiting
UPDATE belay_jobs
SET state = 'ready', ready_at = %(now)s, await_scope = NULL, await_name = NULL
WHERE state = 'awaiting' AND await_scope = %(scope)s AND await_name = %(name)s
RETURNING id, queue;

-- name: delete_signal
DELETE FROM belay_signals WHERE scope = %s AND name = %s;

-- name: get_signal
SELECT payload FROM belay_signals WHERE scope = ANY(%s::text[]) AND name = %s LIMIT 1;

-- name: request_cancel
-- §8.6: a running job is cancelled cooperatively at its next step boundary.
UPDATE belay_jobs SET cancel_requested = true WHERE id = %s;

-- name: cancel_parked
-- §8.6: parked or held → cancelled. The row is already locked FOR UPDATE; the
-- state guard keeps this a no-op if anything moved it anyway.
UPDATE belay_jobs
SET state = 'cancelled', errors = errors || jsonb_build_array(%(error)s::jsonb),
    finished_at = %(now)s, lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = %(state)s
RETURNING {job_columns};

-- name: retry_job
-- §8.6: failed|cancelled → ready (or held for dep-bearing workflow members,
-- settled right after). Clears cancel_requested: the retry is the operator's
-- later intent. Grants one more attempt when the job had used them all.
UPDATE belay_jobs
SET state = %(target)s, ready_at = %(now)s, cancel_requested = false,
    max_attempts = GREATEST(max_attempts, attempt + 1),
    lease_until = NULL, leased_by = NULL, finished_at = NULL
WHERE id = %(id)s AND state IN ('failed', 'cancelled')
RETURNING {job_columns};

-- name: workflow_members_many
-- The settle input of each workflow: every member's name, state and
-- dependency lists (several workflows at once for a batched ack).
SELECT workflow_id, id, wf_name, state, wf_deps, wf_ignore, parent_id, queue
FROM belay_jobs WHERE workflow_id = ANY(%s::text[]);

-- name: settle_release
UPDATE belay_jobs SET state = 'ready', ready_at = %s
WHERE id = ANY(%s::bigint[]) AND state = 'held'
RETURNING id, queue, parent_id;

-- name: settle_doom
UPDATE belay_jobs SET state = 'cancelled', finished_at = %s
WHERE id = ANY(%s::bigint[]) AND state = 'held'
RETURNING id, queue, parent_id;

-- name: listen
-- The channel is an identifier: composed with psycopg.sql.Identifier.
LISTEN {channel};

-- name: signal_exists
SELECT 1 FROM belay_signals WHERE scope = %s AND name = %s;

-- name: park_await
-- §7 await park, fenced on the claimed attempt. The attempt goes back down:
-- parking is not a failed try. Not with a cancel requested (§8.6): that run
-- ends cancelled instead (cancel_flagged), not parked for days.
UPDATE belay_jobs
SET state = 'awaiting', await_scope = %(scope)s, await_name = %(name)s,
    ready_at = %(deadline)s, attempt = attempt - 1, lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s AND NOT cancel_requested;

-- name: park_ready
-- §7: the signal was already there, so park as ready instead of awaiting.
UPDATE belay_jobs
SET state = 'ready', ready_at = %(now)s, await_scope = NULL, await_name = NULL,
    attempt = attempt - 1, lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s AND NOT cancel_requested;

-- name: top_up
-- New caps for a job, and a job parked awaiting a top-up made ready when
-- they cover its spend (%(wake)s); the caller decided both under FOR UPDATE.
UPDATE belay_jobs
SET budget_usd_micros = %(usd_micros)s, budget_tokens = %(tokens)s,
    state = CASE WHEN %(wake)s THEN 'ready' ELSE state END,
    ready_at = CASE WHEN %(wake)s THEN %(now)s::timestamptz ELSE ready_at END,
    await_scope = CASE WHEN %(wake)s THEN NULL ELSE await_scope END,
    await_name = CASE WHEN %(wake)s THEN NULL ELSE await_name END
WHERE id = %(id)s
RETURNING {job_columns};

-- name: budget_mark
-- A budget's once-only mark: signal $budget:warn:<fraction> (a warning) or
-- $budget:top_up:<sha-256 of its key> (a keyed top-up) in the job's scope
-- (reserved names; no job awaits them), written once. A row comes back only
-- to the writer that inserted it, which then appends the warning event or
-- raises the caps. Not in the step journal: that holds the job's own steps only.
INSERT INTO belay_signals (scope, name, payload, inserted_at)
VALUES (%(scope)s, %(name)s, %(payload)s::jsonb, %(now)s)
ON CONFLICT (scope, name) DO NOTHING
RETURNING name;

-- name: budget_of
-- What ctx.budget reads: the four budget columns.
SELECT spent_usd_micros, spent_tokens, budget_usd_micros, budget_tokens
FROM belay_jobs WHERE id = %s;

-- name: budget_of_for_update
-- The same, with the row locked: a budget park decides on the latest caps
-- (a top-up that committed meanwhile is seen; one after waits for the park).
SELECT spent_usd_micros, spent_tokens, budget_usd_micros, budget_tokens
FROM belay_jobs WHERE id = %s FOR UPDATE;

-- name: lock_budget
-- Headroom is reserved under the job row's lock (a step's max_cost, a
-- fan-out's share): its spend and caps, and whether the run of this attempt
-- still holds the job (a run that lost its lease reserves nothing). The holds
-- are read after the lock, by a statement of their own: under READ COMMITTED
-- only a later statement sees what a racing reservation committed while this
-- one waited for the lock.
SELECT spent_usd_micros, spent_tokens, budget_usd_micros, budget_tokens,
       (state = 'running' AND attempt = %(attempt)s) AS holds_job
FROM belay_jobs WHERE id = %(id)s FOR UPDATE;

-- name: budget_holds
-- A job's holds on its headroom: signals $budget:hold:<run>:<step> and
-- $budget:share:<fan-out> in its scope (reserved names; no job awaits them).
SELECT name, payload FROM belay_signals
WHERE scope = %s AND (starts_with(name, '$budget:hold:') OR starts_with(name, '$budget:share:'));

-- name: put_budget_hold
INSERT INTO belay_signals (scope, name, payload, inserted_at)
VALUES (%(scope)s, %(name)s, %(payload)s::jsonb, %(now)s)
ON CONFLICT (scope, name) DO UPDATE
SET payload = EXCLUDED.payload, inserted_at = EXCLUDED.inserted_at;

-- name: drop_budget_holds
DELETE FROM belay_signals WHERE scope = %s AND name = ANY(%s::text[]);

-- name: claim_queues
-- The plain claim for several queues in one statement (one round trip, one
-- commit), up to its own take for each: a node serving many queues claims
-- for every queue that wants work when one of them does, instead of one
-- claim (and commit) per queue. Per queue, the same two candidate sets as
-- claim, read off the same index through a LATERAL join; the merge keeps
-- each queue's first ``take`` in claim order. The picked rows are updated by
-- id through an array, as in claim: joined to belay_jobs instead, the
-- planner (which can't know the takes, so guesses a tenth of the table per
-- queue) hashed the whole table on every claim — 17 ms against 1.5 ms with
-- 100k jobs ready (issue 39; tests/test_hot_plans.py pins the plan).
WITH want AS (
  SELECT * FROM unnest(%(queues)s::text[], %(takes)s::int[]) AS w(queue, take)
), ready AS (
  SELECT c.id, c.priority, c.ready_at, w.queue, w.take FROM want AS w
  CROSS JOIN LATERAL (
    SELECT id, priority, ready_at FROM belay_jobs
    WHERE queue = w.queue AND state = 'ready'
      AND COALESCE(ready_at, '-infinity') <= %(now)s
      AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
    ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
    LIMIT w.take
    FOR UPDATE SKIP LOCKED
  ) AS c
), due AS (
  SELECT c.id, c.priority, c.ready_at, w.queue, w.take FROM want AS w
  CROSS JOIN LATERAL (
    SELECT id, priority, ready_at FROM belay_jobs
    WHERE queue = w.queue AND state = 'awaiting' AND ready_at IS NOT NULL
      AND ready_at <= %(now)s
      AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
    ORDER BY ready_at ASC
    LIMIT w.take
    FOR UPDATE SKIP LOCKED
  ) AS c
), picked AS (
  SELECT id AS picked_id FROM (
    SELECT id, take, row_number() OVER (
      PARTITION BY queue ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC) AS n
    FROM (SELECT * FROM ready UNION ALL SELECT * FROM due) AS candidates
  ) AS ranked
  WHERE n <= take
)
UPDATE belay_jobs AS j
SET state = 'running', attempt = j.attempt + 1, lease_until = %(lease_until)s,
    leased_by = %(node)s, started_at = COALESCE(j.started_at, %(now)s)
WHERE j.id = ANY(ARRAY(SELECT picked_id FROM picked))
RETURNING {job_columns};

-- name: claim
-- §6 plain claim in one statement (so one round trip, its own transaction).
-- Two candidate sets, each locked with SKIP LOCKED and capped at the demand:
-- ready jobs in claim order straight off belay_jobs_claim_order_idx (no sort
-- of the ready set), and awaiting jobs whose deadline is due. Only the merge
-- of at most 2 × take candidates is sorted. Unpicked candidates stay locked
-- until the statement ends, a few milliseconds. "Due" is one COALESCE, not
-- "IS NULL OR <=": with the OR, a planner whose statistics lag a burst of
-- inserts (a table never analyzed yet) reads both index ranges into a bitmap
-- and sorts the whole ready set — measured 26 ms against 1.9 ms per claim of
-- 100 with 30k jobs ready. ``kinds`` (NULL: any) limits it to some job kinds,
-- for an HTTP worker that runs only the tasks it registered. The update
-- finds its rows by id through an array (one primary-key probe each), never
-- by a join the planner may turn into a scan of the table.
WITH ready AS (
  SELECT id, priority, ready_at FROM belay_jobs
  WHERE queue = %(queue)s AND state = 'ready'
    AND COALESCE(ready_at, '-infinity') <= %(now)s
    AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
  ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
  LIMIT %(take)s
  FOR UPDATE SKIP LOCKED
), due AS (
  SELECT id, priority, ready_at FROM belay_jobs
  WHERE queue = %(queue)s AND state = 'awaiting' AND ready_at IS NOT NULL
    AND ready_at <= %(now)s
    AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
  ORDER BY ready_at ASC
  LIMIT %(take)s
  FOR UPDATE SKIP LOCKED
), picked AS (
  SELECT id AS picked_id FROM (SELECT * FROM ready UNION ALL SELECT * FROM due) AS candidates
  ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
  LIMIT %(take)s
)
UPDATE belay_jobs AS j
SET state = 'running', attempt = j.attempt + 1, lease_until = %(lease_until)s,
    leased_by = %(node)s, started_at = COALESCE(j.started_at, %(now)s)
WHERE j.id = ANY(ARRAY(SELECT picked_id FROM picked))
RETURNING {job_columns};

-- name: queues_with_work
-- §9.1 idle polling, coalesced: one read for every idle queue of a node —
-- which of them have a job the claim would take now (ready and due, or
-- awaiting past its deadline). No locks, no writes; the claim re-checks.
-- Per queue, the first such job along the claim's own indexes, in their
-- order (so a probe of each, stopping at the first hit): as EXISTS, the
-- planner was free to answer every queue at once by one hashed scan of the
-- whole table, 400k rows read per poll with 100k jobs ready (issue 39).
SELECT w.q AS queue FROM unnest(%(queues)s::text[]) AS w(q)
CROSS JOIN LATERAL (
  (SELECT 1 FROM belay_jobs
   WHERE queue = w.q AND state = 'ready' AND COALESCE(ready_at, '-infinity') <= %(now)s
   ORDER BY priority ASC, ready_at ASC NULLS FIRST, id ASC
   LIMIT 1)
  UNION ALL
  (SELECT 1 FROM belay_jobs
   WHERE queue = w.q AND state = 'awaiting' AND ready_at IS NOT NULL
     AND ready_at <= %(now)s
   ORDER BY ready_at ASC
   LIMIT 1)
  LIMIT 1
) AS found;

-- name: renew_leases
-- §6: one statement renews every local lease; a pair not returned is lost.
-- Rows are locked in id order, as ack_succeeded_many locks them, so a renewal
-- and a batched ack of the same rows queue up instead of deadlocking. Each
-- row says whether a cancel was requested (executors in other processes are
-- told; a thread's job sees it at its next step).
WITH mine AS (
  SELECT id FROM belay_jobs
  WHERE id = ANY(%(ids)s::bigint[]) AND state = 'running' AND leased_by = %(node)s
  ORDER BY id
  FOR UPDATE
)
UPDATE belay_jobs AS j SET lease_until = %(until)s
FROM mine
WHERE j.id = mine.id
RETURNING j.id, j.attempt, j.cancel_requested;

-- name: ack_succeeded
-- §7 acks: each fenced on the claimed attempt; zero rows means a stale ack —
-- or, for a success, a job whose spend is over a cap: a run that crossed it
-- (in a step whose BudgetExceeded the job's code swallowed, say) never ends
-- succeeded; store.ack then fails or pauses it as the crossing would have.
UPDATE belay_jobs
SET state = 'succeeded', result = %(result)s, finished_at = %(now)s,
    lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s
  AND (budget_usd_micros IS NULL OR spent_usd_micros <= budget_usd_micros)
  AND (budget_tokens IS NULL OR spent_tokens <= budget_tokens)
RETURNING {job_columns};

-- name: ack_succeeded_many
-- §7 and deliberate difference 2: many succeeded acks in one statement, each
-- row fenced on its own claimed attempt (a stale one simply isn't returned).
-- Only for jobs outside workflows and without a parent, whose terminal write
-- settles nothing — so N rows here are exactly N single acks. Locks in id
-- order (see renew_leases).
WITH acks AS (
  -- ids and attempts come as array literals ('{1,2}'): cheaper to build
  -- than to dump element by element; results is NULL when every one is.
  SELECT * FROM unnest(
    %(ids)s::text::bigint[], %(attempts)s::text::int[],
    COALESCE(%(results)s::bytea[],
             array_fill(NULL::bytea, ARRAY[cardinality(%(ids)s::text::bigint[])])))
    AS a(id, attempt, result)
), mine AS (
  SELECT j.id FROM belay_jobs AS j JOIN acks ON acks.id = j.id
  WHERE j.state = 'running' AND j.attempt = acks.attempt
  ORDER BY j.id
  FOR UPDATE OF j
), acked AS (
  UPDATE belay_jobs AS j
  SET state = 'succeeded', result = acks.result, finished_at = %(now)s,
      lease_until = NULL, leased_by = NULL
  FROM mine JOIN acks ON acks.id = mine.id
  WHERE j.id = mine.id AND j.state = 'running' AND j.attempt = acks.attempt
  RETURNING j.id
)
-- With a channel, each result is announced (§9.2) by this same statement, so
-- on its commit: one round trip for the whole batch. The payload is the
-- contract's {"t": "r", "id": …} and nothing more: a notification only wakes
-- a waiter, which reads the row (any role may pg_notify, so a value carried
-- here could be forged).
SELECT acked.id FROM acked
LEFT JOIN LATERAL (
  SELECT pg_notify(%(channel)s, jsonb_build_object('t', 'r', 'id', acked.id)::text)
  WHERE %(channel)s::text IS NOT NULL
) AS sent ON true;

-- name: ack_retry
-- §8.6: an attempt that would run again ends cancelled instead when an
-- operator asked to cancel the job while it ran (its flag, read under the
-- row lock this update takes): a cancel the next attempt never sees would
-- run the job's side effects once more.
UPDATE belay_jobs
SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'ready' END,
    ready_at = CASE WHEN cancel_requested THEN ready_at ELSE %(at)s END,
    finished_at = CASE WHEN cancel_requested THEN %(now)s ELSE finished_at END,
    errors = errors || jsonb_build_array(%(error)s::jsonb) || CASE WHEN cancel_requested
      THEN jsonb_build_array(jsonb_build_object('reason', 'cancel_requested', 'attempt', attempt))
      ELSE '[]'::jsonb END,
    lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s
RETURNING {job_columns};

-- name: ack_failed
UPDATE belay_jobs
SET state = 'failed', errors = errors || jsonb_build_array(%(error)s::jsonb),
    finished_at = %(now)s, lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s
RETURNING {job_columns};

-- name: ack_cancelled
UPDATE belay_jobs
SET state = 'cancelled', errors = errors || jsonb_build_array(%(error)s::jsonb),
    finished_at = %(now)s, lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s
RETURNING {job_columns};

-- name: ack_snooze
-- A snooze is not a failed try: the attempt goes back down. With a cancel
-- requested it ends cancelled instead (see ack_retry), the attempt kept.
UPDATE belay_jobs
SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'ready' END,
    ready_at = CASE WHEN cancel_requested THEN ready_at ELSE %(at)s END,
    attempt = CASE WHEN cancel_requested THEN attempt ELSE attempt - 1 END,
    finished_at = CASE WHEN cancel_requested THEN %(now)s ELSE finished_at END,
    errors = CASE WHEN cancel_requested THEN errors || jsonb_build_array(
      jsonb_build_object('reason', 'cancel_requested', 'attempt', attempt)) ELSE errors END,
    lease_until = NULL, leased_by = NULL
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s
RETURNING {job_columns};

-- name: cancel_flagged
-- §8.6: a run that would park (or was claimed) with a cancel requested ends
-- cancelled instead, fenced on its attempt like any ack.
UPDATE belay_jobs
SET state = 'cancelled', finished_at = %(now)s, lease_until = NULL, leased_by = NULL,
    errors = errors || jsonb_build_array(
      jsonb_build_object('reason', 'cancel_requested', 'attempt', attempt))
WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s AND cancel_requested
RETURNING {job_columns};

-- name: give_back
-- A claimed attempt handed back because the executor running it was lost (it
-- closed, died, sent a broken frame or stopped reading): issue 38. Each
-- hand-back is an errors entry (%(entry)s: {"error": "executor_lost",
-- "attempt": n, "executor": <node>, ...}); the claimed attempt's entries are
-- counted here, on the row this statement locks, so two servers handing back
-- one row can't lose a count: the second finds state, attempt or leased_by
-- moved and is fenced out. leased_by is in the fence because a snooze puts
-- the attempt back down: once re-claimed, the row has the same attempt again.
-- Below %(limit)s losses it is a snooze due now (the attempt goes back down,
-- as in ack_snooze); the loss that reaches it fails the attempt (retried at
-- %(retry_at)s, or failed once the attempts are used up), its entry naming
-- the count and the executors (%(message)s a format() of the two). A cancel
-- requested meanwhile ends it cancelled. jsonpath's lax mode skips entries
-- of another shape (a foreign implementation's) instead of raising.
WITH held AS (
  SELECT id AS held_id, cancel_requested AS cancelling, attempt >= max_attempts AS spent,
         jsonb_array_length(jsonb_path_query_array(
           errors, '$[*] ? (@.error == "executor_lost" && @.attempt == $n)',
           jsonb_build_object('n', attempt))) + 1 AS lost,
         jsonb_path_query_array(
           errors, '$[*] ? (@.error == "executor_lost" && @.attempt == $n).executor',
           jsonb_build_object('n', attempt)) || to_jsonb(%(node)s::text) AS executors
  FROM belay_jobs
  WHERE id = %(id)s AND state = 'running' AND attempt = %(attempt)s
    AND leased_by = %(node)s
  FOR UPDATE
), decided AS (
  SELECT held_id, lost, executors,
         CASE WHEN cancelling THEN 'cancelled'
              WHEN lost < %(limit)s THEN 'snooze'
              WHEN spent THEN 'failed'
              ELSE 'retry' END AS handed_back
  FROM held
)
UPDATE belay_jobs AS j
SET state = CASE WHEN d.handed_back IN ('snooze', 'retry') THEN 'ready' ELSE d.handed_back END,
    ready_at = CASE d.handed_back WHEN 'snooze' THEN %(now)s::timestamptz
                                  WHEN 'retry' THEN %(retry_at)s::timestamptz
                                  ELSE j.ready_at END,
    attempt = CASE WHEN d.handed_back = 'snooze' THEN j.attempt - 1 ELSE j.attempt END,
    finished_at = CASE WHEN d.handed_back IN ('failed', 'cancelled') THEN %(now)s::timestamptz
                       ELSE j.finished_at END,
    errors = j.errors || CASE d.handed_back
      WHEN 'snooze' THEN jsonb_build_array(%(entry)s::jsonb)
      WHEN 'cancelled' THEN jsonb_build_array(%(entry)s::jsonb, %(cancelled)s::jsonb)
      ELSE jsonb_build_array(%(entry)s::jsonb || jsonb_build_object(
        'lost', d.lost, 'executors', d.executors,
        'message', format(%(message)s::text, d.lost, (
          SELECT string_agg(e, ', ') FROM jsonb_array_elements_text(d.executors) AS e))))
    END,
    lease_until = NULL, leased_by = NULL
FROM decided AS d
WHERE j.id = d.held_id
RETURNING {job_columns}, d.handed_back;

-- name: expired_leases
-- §6 reclaim candidates; each is then re-checked under its locks.
SELECT id, workflow_id FROM belay_jobs
WHERE state = 'running' AND lease_until <= %s
ORDER BY lease_until
LIMIT %s;

-- name: lock_expired
SELECT {job_columns} FROM belay_jobs
WHERE id = %s AND state = 'running' AND lease_until <= %s
FOR UPDATE SKIP LOCKED;

-- name: get_step
SELECT value FROM belay_steps WHERE job_id = %s AND name = %s;

-- name: step_lookup
-- §8.2 in one round trip: the journal entry, if any, and for a miss the
-- pre-flight inputs — the durable spend and caps, and a pending cancel (§8.6).
SELECT s.name IS NOT NULL AS hit, s.value, j.spent_usd_micros, j.spent_tokens,
       j.budget_usd_micros, j.budget_tokens, j.cancel_requested
FROM belay_jobs AS j
LEFT JOIN belay_steps AS s ON s.job_id = j.id AND s.name = %(name)s
WHERE j.id = %(job_id)s;

-- name: put_step
-- §8.2 journal + spend in one statement. The spend is added only when this
-- call journaled the step: a racing duplicate (a zombie attempt) neither
-- overwrites the value nor pays twice. The same statement drops the step's
-- holds on the headroom (lock_budget), so the headroom a reservation reads
-- is never the hold and the spend at once, nor neither.
WITH released AS (
  DELETE FROM belay_signals WHERE scope = %(scope)s AND name = ANY(%(holds)s::text[])
), journaled AS (
  INSERT INTO belay_steps (job_id, seq, name, value, usd_micros, tokens, inserted_at)
  VALUES (%(job_id)s,
          (SELECT COALESCE(max(seq), 0) + 1 FROM belay_steps WHERE job_id = %(job_id)s),
          %(name)s, %(value)s, %(usd_micros)s, %(tokens)s, %(now)s)
  ON CONFLICT (job_id, name) DO NOTHING
  RETURNING usd_micros, tokens
)
UPDATE belay_jobs
SET spent_usd_micros = spent_usd_micros + COALESCE((SELECT usd_micros FROM journaled), 0),
    spent_tokens = spent_tokens + COALESCE((SELECT tokens FROM journaled), 0)
WHERE id = %(job_id)s
RETURNING spent_usd_micros, spent_tokens, budget_usd_micros, budget_tokens,
          EXISTS (SELECT 1 FROM journaled) AS journaled;

-- name: append_event
-- Append-only per-job stream; seq is the job's next number. Two appends of
-- one job at once (its steps in threads, each announcing) may pick the same
-- number: the second then inserts nothing (waiting for the first to commit
-- or roll back) and returns no row, and store.append_event tries again with
-- a fresh snapshot, which sees the first.
INSERT INTO belay_events (job_id, seq, payload, inserted_at)
VALUES (%(job_id)s,
        (SELECT COALESCE(max(seq), 0) + 1 FROM belay_events WHERE job_id = %(job_id)s),
        %(payload)s::jsonb, %(now)s)
ON CONFLICT (job_id, seq) DO NOTHING
RETURNING seq;

-- name: children
SELECT {job_columns} FROM belay_jobs WHERE parent_id = %s ORDER BY id;

-- name: resettle_parents
-- §8.4 reconciler backstop (race R2): a parent awaiting $children whose
-- children all exist and are terminal is made ready, whatever happened to the
-- signal that should have woken it.
UPDATE belay_jobs AS p
SET state = 'ready', ready_at = %(now)s, await_scope = NULL, await_name = NULL
WHERE p.state = 'awaiting' AND p.await_name = '$children'
  AND EXISTS (SELECT 1 FROM belay_jobs c WHERE c.parent_id = p.id)
  AND NOT EXISTS (
    SELECT 1 FROM belay_jobs c
    WHERE c.parent_id = p.id AND c.state NOT IN ('succeeded', 'failed', 'cancelled')
  )
RETURNING p.id, p.queue;

-- name: rate_add
-- §6 sliding-window counters: add to a bucket's window (upsert-increment).
INSERT INTO belay_rate (bucket, window_start, count) VALUES (%s, %s, %s)
ON CONFLICT (bucket, window_start) DO UPDATE SET count = belay_rate.count + EXCLUDED.count;
