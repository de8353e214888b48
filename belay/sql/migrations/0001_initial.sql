-- belay schema revision 1: the job table, its indexes, and the step, event,
-- signal and rate tables. Equivalent in effect to the reference's migration 1
-- (same tables, columns, defaults, index names and predicates), so a database
-- migrated by either implementation is the same database.
CREATE TABLE IF NOT EXISTS belay_jobs (
  id bigserial PRIMARY KEY,
  kind text NOT NULL,
  queue text NOT NULL,
  state text NOT NULL DEFAULT 'ready',
  input jsonb NOT NULL DEFAULT '{}',
  meta jsonb NOT NULL DEFAULT '{}',
  priority int NOT NULL DEFAULT 0,
  attempt int NOT NULL DEFAULT 0,
  max_attempts int NOT NULL DEFAULT 20,
  partition_key text,
  ready_at timestamptz,
  lease_until timestamptz,
  leased_by text,
  await_scope text,
  await_name text,
  workflow_id text,
  wf_name text,
  wf_deps text[] NOT NULL DEFAULT '{}',
  wf_ignore text[] NOT NULL DEFAULT '{}',
  cron_name text,
  cron_slot timestamptz,
  unique_key text,
  unique_mode text,
  parent_id bigint,
  budget_usd_micros bigint,
  budget_tokens bigint,
  spent_usd_micros bigint NOT NULL DEFAULT 0,
  spent_tokens bigint NOT NULL DEFAULT 0,
  result bytea,
  errors jsonb NOT NULL DEFAULT '[]',
  cancel_requested boolean NOT NULL DEFAULT false,
  inserted_at timestamptz NOT NULL,
  started_at timestamptz,
  finished_at timestamptz
);
CREATE INDEX IF NOT EXISTS belay_jobs_claim_idx
  ON belay_jobs (queue, priority, ready_at, id) WHERE state = 'ready';
CREATE INDEX IF NOT EXISTS belay_jobs_await_due_idx
  ON belay_jobs (queue, ready_at) WHERE state = 'awaiting' AND ready_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS belay_jobs_await_wake_idx
  ON belay_jobs (await_scope, await_name) WHERE state = 'awaiting';
CREATE INDEX IF NOT EXISTS belay_jobs_lease_idx
  ON belay_jobs (lease_until) WHERE state = 'running';
CREATE INDEX IF NOT EXISTS belay_jobs_workflow_idx
  ON belay_jobs (workflow_id) WHERE workflow_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS belay_jobs_parent_idx
  ON belay_jobs (parent_id) WHERE parent_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS belay_jobs_prune_idx
  ON belay_jobs (state, finished_at) WHERE finished_at IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS belay_jobs_cron_slot_idx
  ON belay_jobs (cron_name, cron_slot) WHERE cron_name IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS belay_jobs_unique_incomplete_idx
  ON belay_jobs (unique_key)
  WHERE unique_key IS NOT NULL AND unique_mode = 'incomplete'
    AND state IN ('ready', 'running', 'awaiting', 'held', 'paused');
CREATE UNIQUE INDEX IF NOT EXISTS belay_jobs_unique_window_idx
  ON belay_jobs (unique_key)
  WHERE unique_key IS NOT NULL AND unique_mode IN ('window', 'always');
CREATE TABLE IF NOT EXISTS belay_steps (
  job_id bigint NOT NULL,
  seq int NOT NULL,
  name text NOT NULL,
  value bytea,
  usd_micros bigint NOT NULL DEFAULT 0,
  tokens bigint NOT NULL DEFAULT 0,
  inserted_at timestamptz,
  PRIMARY KEY (job_id, name)
);
CREATE TABLE IF NOT EXISTS belay_events (
  job_id bigint NOT NULL,
  seq int NOT NULL,
  payload jsonb,
  inserted_at timestamptz,
  PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS belay_signals (
  scope text NOT NULL,
  name text NOT NULL,
  payload jsonb,
  inserted_at timestamptz,
  PRIMARY KEY (scope, name)
);
CREATE TABLE IF NOT EXISTS belay_rate (
  bucket text NOT NULL,
  window_start bigint NOT NULL,
  count int NOT NULL DEFAULT 0,
  PRIMARY KEY (bucket, window_start)
);
