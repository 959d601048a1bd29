-- 0003: a re-armed transaction's maximum prepared age counts from its re-arm. Never edit a
-- released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).

-- the last re-arm (outboxctl rearm): the maximum prepared age counts from here, not from
-- created_at, else a transaction discarded at that age was discarded again at once
ALTER TABLE {schema}.outbox_record ADD COLUMN rearmed_at timestamptz;
