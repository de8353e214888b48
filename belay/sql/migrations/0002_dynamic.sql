-- belay schema revision 2: runtime-editable queue and cron rows, reconciled by
-- every node. Equivalent in effect to the reference's migration 2.
CREATE TABLE IF NOT EXISTS belay_queues (
  name text PRIMARY KEY,
  opts jsonb NOT NULL DEFAULT '{}',
  updated_at timestamptz
);
CREATE TABLE IF NOT EXISTS belay_crons (
  name text PRIMARY KEY,
  expression text NOT NULL,
  worker text NOT NULL,
  input jsonb NOT NULL DEFAULT '{}',
  opts jsonb NOT NULL DEFAULT '{}',
  paused boolean NOT NULL DEFAULT false,
  updated_at timestamptz
);
