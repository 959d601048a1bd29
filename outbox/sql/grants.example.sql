-- Least-privilege grants, an example to adapt. Render it for your roles with
--   outboxctl grants --writer-role app --relay-role outbox_relay \
--       --reconciler-role outbox_recon [--schema outbox]
-- {writer}: the application. It inserts records and ends its own half records; it can neither read
--   record contents nor delete. (It can set `state`, so it is trusted with its own records.)
-- {relay}: the sidecar (relay and checker). It reads, changes state, deletes, and keeps leases.
-- {reconciler}: the Spark reconciliation. It reads the ledger (no record contents), writes its
--   findings and deletes them once not found again for its --findings-retention.

GRANT USAGE ON SCHEMA {schema} TO {writer}, {relay};

GRANT INSERT ON {schema}.outbox_record TO {writer};
-- RETURNING id, tx-id reuse checks and commit()/rollback() read only these columns.
GRANT SELECT (id, producer_group, tx_id, state, writer_xid) ON {schema}.outbox_record TO {writer};
GRANT UPDATE (state, state_changed_at, next_check_at, committed_xid) ON {schema}.outbox_record TO {writer};

GRANT SELECT, UPDATE, DELETE ON {schema}.outbox_record TO {relay};
GRANT SELECT, INSERT, UPDATE ON {schema}.shard_lease TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.relay_member TO {relay};
-- DELETE: the relay trims entries past its audit_retention. INSERT of what a command says
-- only: when, and the role and address that wrote an entry, come from the columns' defaults.
GRANT SELECT, DELETE ON {schema}.audit_log TO {relay};
GRANT INSERT (actor, action, producer_group, tx_id, detail) ON {schema}.audit_log TO {relay};
GRANT SELECT ON {schema}.schema_migration TO {writer}, {relay};
-- an index's expression and the checker's due scan call it; a database that revoked EXECUTE
-- from PUBLIC refused the writer's prepare(check_immunity=...) and every checker round
GRANT EXECUTE ON FUNCTION {schema}.immune_until(timestamptz, interval) TO {writer}, {relay};
-- The relay also calls pg_stat_get_activity(integer), pg_prepared_xact(),
-- pg_xact_commit_timestamp(xid), pg_current_snapshot() and pg_snapshot_xip(pg_snapshot), which
-- every role may call unless the database revoked that from PUBLIC (the relay then refuses to
-- start, and says what to grant).

GRANT USAGE ON SCHEMA {schema} TO {reconciler};
-- The ledger's columns only (spark/queries.sql): not the values and headers the job never reads.
GRANT SELECT (id, producer_group, tx_id, topic, key, state, commit_ts, committed_xid,
              state_changed_at, ended_at, kafka_partition, kafka_offset)
    ON {schema}.outbox_record TO {reconciler};
GRANT SELECT ON {schema}.schema_migration TO {reconciler};
GRANT SELECT, INSERT, DELETE ON {schema}.reconciliation_finding TO {reconciler};
-- A finding found again is kept: its last_seen_at moves on (the retention counts from there).
GRANT UPDATE (last_seen_at) ON {schema}.reconciliation_finding TO {reconciler};
-- Read-only: `outboxctl findings`, run in the sidecar's container (where the alerts point).
GRANT SELECT ON {schema}.reconciliation_finding, {schema}.reconciliation_window TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.reconciliation_window TO {reconciler};
