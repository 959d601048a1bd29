-- 0003: the checker. Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- One transaction: the index builds come first and hold off only writes to outbox_record while
-- they scan it (archived rows too: with a large archive, relay.delivered_retention, migrate in a
-- quiet period); the column's addition, which holds off reads as well, comes last and is quick.

-- Prepared rows never checked yet, by age: the checker finds those past the default check
-- immunity in a range of it; those with an immunity of their own, apart, so that neither scan
-- reads the other's rows. Through outbox_record_prepared_due_idx it read every never-checked
-- row each round, due or not: 60 ms a round with 200k half records in flight.
CREATE INDEX outbox_record_never_checked_idx
    ON {schema}.outbox_record (created_at, id)
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NULL;
CREATE INDEX outbox_record_own_immunity_idx
    ON {schema}.outbox_record (created_at, id)
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NOT NULL;

-- the last re-arm (outboxctl rearm): the maximum prepared age counts from here, not from
-- created_at, else a transaction discarded at that age was discarded again at once
ALTER TABLE {schema}.outbox_record ADD COLUMN rearmed_at timestamptz;
