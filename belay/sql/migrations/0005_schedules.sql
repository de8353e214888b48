-- belay schema revision 5. Additive only: an implementation that knows
-- revision 4 (or the Elixir reference, which knows 3) keeps working on a
-- database at 5, and never reads this table.
--
-- Schedules (docs/cron.md, "Schedules"): crons with an overlap policy and a
-- catch-up mode, and a durable cursor. A schedule's occurrences are jobs like
-- a cron's — cron_name is the schedule's name, cron_slot the occurrence — so
-- belay_jobs_cron_slot_idx still makes each occurrence one row cluster-wide.
-- Schedules are not belay_crons rows: the reference would fire those with no
-- policy at all, and a name is a cron or a schedule, never both.
--
--   overlap   allow | skip | queue: what an occurrence does while the one
--             before it is not finished (run anyway, be skipped, wait)
--   catch_up  latest | all: several occurrences due at once (after downtime,
--             or waiting under queue) run as one, or each in turn
--   cursor_slot  the last occurrence handled (fired or skipped); advanced in
--             the transaction that inserts its job, so a crash never loses or
--             repeats one
--   static    declared by a Worker's crons=[…] (its definition comes from
--             code) rather than through the API
--
-- Like every belay table: no CHECK, no foreign key (§3); belay validates
-- what it writes (belay/schedules.py) and reads what it can't use as a
-- schedule to skip, with a warning.
CREATE TABLE IF NOT EXISTS belay_schedules (
  name text PRIMARY KEY,
  expression text NOT NULL,
  worker text NOT NULL,
  input jsonb NOT NULL DEFAULT '{}'::jsonb,
  opts jsonb NOT NULL DEFAULT '{}'::jsonb,
  overlap text NOT NULL DEFAULT 'skip',
  catch_up text NOT NULL DEFAULT 'latest',
  static boolean NOT NULL DEFAULT false,
  cursor_slot timestamptz,
  last_job_id bigint,
  revision integer NOT NULL DEFAULT 1,
  cancelled_at timestamptz,
  created_at timestamptz NOT NULL,
  updated_at timestamptz NOT NULL
);
