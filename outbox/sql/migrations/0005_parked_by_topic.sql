-- 0005: parked records are found by topic without reading the whole table.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- One transaction: the index build holds off writes to outbox_record while it scans it.

-- Parked records (refused by the broker for good), by topic: `outboxctl redrive --topic` and
-- `outboxctl records --state parked` read only them. Without it both read every row, the
-- archive of delivered rows (delivered_retention) included. Parked rows are few: a small index.
CREATE INDEX outbox_record_parked_idx
    ON {schema}.outbox_record (topic, id) WHERE state = 'parked';
