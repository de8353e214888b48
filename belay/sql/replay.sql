-- Replay debugging (belay/replay.py): the session a replay runs on must be
-- unable to write, whatever SQL the replayed code sends. A read-only
-- transaction alone is not enough (the code can COMMIT and begin a read-write
-- one), nor is SET ROLE (RESET ROLE undoes it): the role the session logged in
-- as must hold no write privilege. These statements check that, and make such
-- a role for the length of one replay when the connecting role may.
-- {role} and {schema} are psycopg.sql.Identifier.

-- name: replay_read_only
-- Every transaction of the replay's session is read-only (a second layer).
SET default_transaction_read_only = on

-- name: replay_write_access
-- What the session's login role, or any role it may SET ROLE to, could change:
-- superuser, or a write privilege on a table, view or sequence outside the
-- system schemas (a privilege held by PUBLIC included). Empty: the server
-- refuses every change to existing rows from this session.
SELECT format('%s is a superuser', r.rolname)
FROM pg_roles AS r
WHERE r.rolsuper AND pg_has_role(session_user, r.oid, 'MEMBER')
UNION ALL
(SELECT format('%s may write to %s', r.rolname, c.oid::regclass)
 FROM pg_class AS c
 JOIN pg_namespace AS n ON n.oid = c.relnamespace
 CROSS JOIN pg_roles AS r
 WHERE pg_has_role(session_user, r.oid, 'MEMBER')
   AND n.nspname NOT IN ('pg_catalog', 'information_schema')
   AND n.nspname NOT LIKE 'pg\_toast%' AND n.nspname NOT LIKE 'pg\_temp%'
   AND ((c.relkind IN ('r', 'p', 'v', 'f')
         AND (has_table_privilege(r.oid, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE')
              -- a column-level grant (GRANT UPDATE (state) ON …) writes too
              OR has_any_column_privilege(r.oid, c.oid, 'INSERT, UPDATE')))
        OR (c.relkind = 'S' AND has_sequence_privilege(r.oid, c.oid, 'UPDATE')))
 ORDER BY 1)
LIMIT 5

-- name: replay_may_create_role
SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user

-- name: replay_belay_schema
-- The schema belay's tables live in (the session's search_path finds them).
SELECT n.nspname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass('belay_jobs')

-- name: replay_role_create
-- The CREATE ROLE of a login role for one replay: no privilege of its own,
-- expiring soon should the replay die before it drops the role. CREATE ROLE
-- takes no bind parameters, so the server quotes them into the statement.
SELECT format(
  'CREATE ROLE %%I LOGIN PASSWORD %%L VALID UNTIL %%L '
  'NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT',
  %(role)s::text, %(password)s::text, %(until)s::text)

-- name: replay_role_read_all
-- The code's own reads see every table, as they did on the connecting role
-- (PostgreSQL 14+, and only for a role allowed to grant it).
GRANT pg_read_all_data TO {role}

-- name: replay_role_read_schema
GRANT USAGE ON SCHEMA {schema} TO {role}

-- name: replay_role_read_tables
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}

-- name: replay_role_sessions_end
-- Sessions the replayed code opened as the role and left open.
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE usename = %(role)s AND pid <> pg_backend_pid()

-- name: replay_role_revoke
DROP OWNED BY {role}

-- name: replay_role_drop
DROP ROLE IF EXISTS {role}
