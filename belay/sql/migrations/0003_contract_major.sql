-- belay schema revision 3 (contract v1 is at revision 3; the public reference
-- stops at 2). Additive only, so an implementation that knows revision 2
-- keeps working on a database at 3.
--
-- contract_major: the wire-contract major, separate from the revision (§1).
-- Rows written before this revision read as major 1 through the default.
ALTER TABLE belay_meta ADD COLUMN IF NOT EXISTS contract_major int NOT NULL DEFAULT 1;
-- The claim orders by ready_at ASC NULLS FIRST, but belay_jobs_claim_idx keeps
-- ready_at NULLS LAST, so Postgres sorts the whole ready set on every claim
-- (measured with pgbench, 300k ready rows: 19.6 claims/s against 2,900/s once
-- the index order matches). This variant matches the claim's ORDER BY.
CREATE INDEX IF NOT EXISTS belay_jobs_claim_order_idx
  ON belay_jobs (queue, priority, ready_at ASC NULLS FIRST, id) WHERE state = 'ready';
