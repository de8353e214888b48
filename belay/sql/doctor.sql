-- `belay doctor` (belay/doctor.py): read-only checks of a deployment. "Now"
-- is a bind parameter (§2): belay's clock for job rows, the wall clock for
-- the server's own timestamps (backends, prepared transactions), which a
-- test's manual clock must not shift.

-- name: doctor_backend
-- Which server backend ran this transaction, and the port the server itself
-- listens on: two connections open at once sharing a pid means a
-- transaction pooler hands them the same server connection.
SELECT pg_backend_pid() AS pid, inet_server_port() AS server_port;

-- name: doctor_horizon
-- What holds back the xmin horizon of this database, oldest first: open
-- transactions and snapshots of its backends (lazy vacuum, which never holds
-- the horizon, left out), prepared transactions, and replication slots,
-- which hold it for every database. age_s is NULL where the server keeps no
-- start time (a slot); xid_age counts transactions since.
SELECT kind, pid, application_name, role, state, backend_type, age_s, xid_age, name
FROM (
  SELECT 'backend' AS kind, a.pid, a.application_name, a.usename::text AS role,
         a.state, a.backend_type,
         EXTRACT(epoch FROM %(wall)s::timestamptz
                            - COALESCE(a.xact_start, a.query_start, a.backend_start))::float8
           AS age_s,
         GREATEST(age(a.backend_xid), age(a.backend_xmin)) AS xid_age,
         NULL::text AS name
  FROM pg_stat_activity AS a
  WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
    AND (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
    AND a.backend_type <> 'autovacuum worker'
  UNION ALL
  SELECT 'prepared', NULL, NULL, p.owner::text, 'prepared', NULL,
         EXTRACT(epoch FROM %(wall)s::timestamptz - p.prepared)::float8,
         age(p.transaction), p.gid
  FROM pg_prepared_xacts AS p
  WHERE p.database = current_database()
  UNION ALL
  SELECT 'slot', s.active_pid, NULL, NULL, CASE WHEN s.active THEN 'active' ELSE 'inactive' END,
         s.slot_type, NULL, age(s.xmin), s.slot_name::text
  FROM pg_replication_slots AS s
  WHERE s.xmin IS NOT NULL
) AS holders
ORDER BY age_s DESC NULLS LAST, xid_age DESC NULLS LAST
LIMIT %(limit)s;

-- name: doctor_tables
-- Size, live and dead rows and the last vacuums of belay's tables (the ones
-- of the search path, as belay finds them), and the dead rows at which
-- autovacuum takes each on: its threshold plus its scale factor times its
-- rows, the table's own storage parameters first, else the server's.
SELECT s.relname::text AS table_name, s.n_live_tup AS live, s.n_dead_tup AS dead,
       s.last_autovacuum, s.last_vacuum, pg_total_relation_size(s.relid) AS bytes,
       (COALESCE(o.threshold, current_setting('autovacuum_vacuum_threshold'))::float8
        + COALESCE(o.scale, current_setting('autovacuum_vacuum_scale_factor'))::float8
          * GREATEST(c.reltuples, 0))::bigint AS vacuum_at,
       COALESCE(o.scale, current_setting('autovacuum_vacuum_scale_factor'))::float8 AS scale
FROM pg_stat_user_tables AS s
JOIN pg_class AS c ON c.oid = s.relid
LEFT JOIN LATERAL (
  SELECT max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_threshold')
           AS threshold,
         max(option_value) FILTER (WHERE option_name = 'autovacuum_vacuum_scale_factor')
           AS scale
  FROM pg_options_to_table(c.reloptions)
) AS o ON true
WHERE s.relid IN (SELECT to_regclass(t) FROM unnest(%s::text[]) AS t)
ORDER BY s.relname;

-- name: doctor_stuck_leases
-- Running jobs whose lease ran out before the cutoff (now minus a margin), or
-- that have none at all: no live worker's sweeper reclaimed them (§6). The
-- count and the oldest come off belay_jobs_lease_idx.
SELECT (SELECT count(*) FROM belay_jobs
        WHERE state = 'running' AND COALESCE(lease_until, '-infinity') < %(cutoff)s) AS stuck,
       o.id, o.queue, o.leased_by, o.lease_until
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
  SELECT id, queue, leased_by, lease_until FROM belay_jobs
  WHERE state = 'running' AND COALESCE(lease_until, '-infinity') < %(cutoff)s
  ORDER BY lease_until ASC NULLS FIRST
  LIMIT 1
) AS o ON true;

-- name: doctor_waiting_work
-- Per queue with work a claim would take now (ready and due, or awaiting past
-- its deadline, as the claim reads it): how much, since when, and the latest
-- sign of a worker on the queue — a running job's lease, a first claim
-- (started_at), a worker's succeeded or failed ack (finished_at). belay keeps
-- no worker registry; these are what a worker leaves behind. One pass over
-- belay_jobs.
SELECT queue,
       count(*) FILTER (WHERE due) AS due,
       min(COALESCE(ready_at, inserted_at)) FILTER (WHERE due) AS oldest_due,
       max(lease_until) FILTER (WHERE state = 'running') AS last_lease,
       max(started_at) AS last_start,
       max(finished_at) FILTER (WHERE state IN ('succeeded', 'failed')) AS last_finish
FROM (
  SELECT queue, state, ready_at, inserted_at, lease_until, started_at, finished_at,
         (state = 'ready' AND COALESCE(ready_at, '-infinity') <= %(now)s)
         OR (state = 'awaiting' AND ready_at IS NOT NULL AND ready_at <= %(now)s) AS due
  FROM belay_jobs
) AS j
GROUP BY queue
HAVING count(*) FILTER (WHERE due) > 0
ORDER BY queue;

-- name: doctor_oldest_terminal
-- Per terminal state: the oldest finished job outside workflows and without
-- a parent (those retention deletes as soon as they expire; a workflow or a
-- child waits for its whole tree), and how many are past the cutoff. Both off
-- belay_jobs_prune_idx.
SELECT s.state, o.finished_at AS oldest,
       (SELECT count(*) FROM belay_jobs
        WHERE state = s.state AND finished_at < s.cutoff
          AND workflow_id IS NULL AND parent_id IS NULL) AS overdue
FROM unnest(%s::text[], %s::timestamptz[]) AS s(state, cutoff)
LEFT JOIN LATERAL (
  SELECT finished_at FROM belay_jobs
  WHERE state = s.state AND finished_at IS NOT NULL
    AND workflow_id IS NULL AND parent_id IS NULL
  ORDER BY finished_at
  LIMIT 1
) AS o ON true
ORDER BY s.state;
