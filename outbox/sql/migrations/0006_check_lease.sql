-- 0006: a check the checker lost is not counted; markers' outbox name kept with each lease; a
-- transaction's audit entries by tx id.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- Adding a nullable column with no default changes only the catalog: quick, whatever the size.
-- The index build holds off writes to audit_log (discards, commands run by hand) while it scans
-- it: a table of entries kept for the relay's audit_retention, small beside outbox_record.

-- The end of the lease of a check in flight: set when a check is claimed (and counted), cleared
-- when its outcome is recorded. Still set once the lease has run out, it marks a check whose
-- outcome was never recorded (a checker killed, or cut from the database, mid-check): the check
-- is given back and asked again, so that a lost last check does not discard the transaction.
ALTER TABLE {schema}.outbox_record ADD COLUMN check_lease_until timestamptz;

-- The outbox name (database/schema) a shard's op markers were last written under: recovery takes
-- markers of that name as its own after the database or schema was renamed (they named the old
-- one, were taken for another outbox's, and a batch in doubt went out twice).
ALTER TABLE {schema}.shard_lease ADD COLUMN marker_outbox text;

-- A transaction's latest audit entry: rearm, resolve and redrive look it up (was the transaction
-- discarded and shipped?). Without it each read every entry kept (90 days by default).
CREATE INDEX audit_log_tx_idx ON {schema}.audit_log (producer_group, tx_id, id);
