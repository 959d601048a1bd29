-- 0008: when each finding was last found, and the findings' retention counted from then.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- Findings are anomalies, few: backfilling the column and indexing it is quick.

-- A record stuck for longer than --findings-retention was found again at every judgement, but
-- its finding was deleted by when it was first found, then written again as new: the count of
-- new findings lied, and `outboxctl findings` lost when the trouble began. The job now moves
-- last_seen_at on when it finds a finding again, and deletes only findings not found since.
ALTER TABLE {schema}.reconciliation_finding
    ADD COLUMN last_seen_at timestamptz NOT NULL DEFAULT now();
UPDATE {schema}.reconciliation_finding SET last_seen_at = detected_at;
CREATE INDEX reconciliation_finding_seen_idx
    ON {schema}.reconciliation_finding (last_seen_at, id);
