-- 0004: the checker finds records with a check immunity of their own by when they are due.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- One transaction: the index build holds off writes to outbox_record while it scans it.

-- When a record with its own check immunity is first due. The immunity is added as seconds:
-- timestamptz + interval counts a day in the session's time zone (23 or 25 hours across a DST
-- change), so it cannot be indexed; a number of seconds added is the same in every zone.
CREATE FUNCTION {schema}.immune_until(created_at timestamptz, immunity interval)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT created_at + make_interval(secs => extract(epoch FROM immunity)::float8) $$;

-- The never-checked rows with their own immunity, by that time: the due scan reads only those
-- due. By age (outbox_record_own_immunity_idx) it read every one of them each round, due or not.
CREATE INDEX outbox_record_own_immunity_due_idx
    ON {schema}.outbox_record ({schema}.immune_until(created_at, check_immunity), id)
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NOT NULL;
