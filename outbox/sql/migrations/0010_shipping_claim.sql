-- 0010: when the relay took a discarded record to ship to the dead-letter topic.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- A nullable column without a default: added without rewriting the table.

-- The relay holds no row locks while it ships a discarded transaction's dead-letter copies and
-- op markers: a re-arm or a resolve in that window went through, and the records then went out
-- twice, as dead-letter copies and again to their topics (after a relay crash between the
-- Kafka commit and the end of the rows, the window lasted until recovery). The relay now marks
-- the rows it takes, under their locks, and those commands refuse marked rows.
ALTER TABLE {schema}.outbox_record ADD COLUMN shipping_since timestamptz;
