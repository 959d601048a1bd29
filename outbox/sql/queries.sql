-- Every query of the outbox library, loaded by name (outbox/sql/__init__.py).
-- `{schema}` is the configured schema, quoted as an identifier; %(name)s are bound parameters.

-- name: insert_record
-- The one-record hot path of publish()/prepare(): a plain INSERT, cheaper than the unnest below.
-- A caller that gives no tx id gets one per database transaction (see insert_records).
-- A prepared record is created when prepare() runs, not when its transaction began: its check
-- immunity and maximum prepared age count from there (RocketMQ's half message's store time),
-- and a long transaction before it used them up.
INSERT INTO {schema}.outbox_record
    (producer_group, tx_id, topic, key, value, headers, partition, key_hash, state, check_immunity,
     committed_xid, created_at)
VALUES (
    %(producer_group)s,
    coalesce(%(tx_id)s, 'xid:' || pg_current_xact_id()::text),
    %(topic)s, %(key)s, %(value)s, %(headers)s, %(partition)s,
    hashtextextended(
        coalesce(encode(%(key)s, 'hex'), %(tx_id)s, 'xid:' || pg_current_xact_id()::text), 0),
    %(state)s, %(check_immunity)s,
    CASE WHEN %(state)s = 'committed' THEN pg_current_xact_id() END,
    CASE WHEN %(state)s = 'prepared' THEN clock_timestamp() ELSE now() END)
RETURNING id, tx_id, CASE WHEN %(notify)s THEN pg_notify(%(channel)s, '') END;

-- name: insert_records
-- One statement for a batch: arrays unnested in order, ids returned in that order.
-- A caller that gives no tx id gets one per database transaction ('xid:' + its 64-bit xact id),
-- so everything it writes in that transaction travels in one Kafka transaction.
WITH tx AS (
    SELECT coalesce(%(tx_id)s, 'xid:' || pg_current_xact_id()::text) AS tx_id
), inserted AS (
    INSERT INTO {schema}.outbox_record
        (producer_group, tx_id, topic, key, value, headers, partition, key_hash, state,
         check_immunity, committed_xid, created_at)
    SELECT %(producer_group)s, tx.tx_id, r.topic, r.key, r.value, r.headers, r.partition,
           -- keyless records hash by tx id, so they stay with the rest of their transaction
           hashtextextended(coalesce(encode(r.key, 'hex'), tx.tx_id), 0),
           %(state)s, %(check_immunity)s,
           CASE WHEN %(state)s = 'committed' THEN pg_current_xact_id() END,
           CASE WHEN %(state)s = 'prepared' THEN clock_timestamp() ELSE now() END  -- as above
    -- The arrays go in binary (b placeholders): as text, psycopg escapes every element in Python,
    -- a regex over each value's hex, which took half the statement's time for ten 1 KiB records.
    FROM tx, unnest(%(topics)b::text[], %(keys)b::bytea[], %(values)b::bytea[],
                    %(headers)b::jsonb[], %(partitions)b::integer[])
             WITH ORDINALITY AS r(topic, key, value, headers, partition, ord)
    ORDER BY r.ord
    RETURNING id, tx_id
)
SELECT inserted.id, inserted.tx_id
FROM inserted
CROSS JOIN (SELECT CASE WHEN %(notify)s THEN pg_notify(%(channel)s, '') END) AS wake
ORDER BY inserted.id;

-- name: tx_id_used_elsewhere
-- Whether a caller-given tx id may be written in this transaction: used by another database
-- transaction; used in this one for the other kind of record (published and prepared records
-- under one tx id would end apart); the isolation level (above READ COMMITTED a transaction
-- that committed after this one's snapshot is not seen; READ UNCOMMITTED runs as READ
-- COMMITTED). With %(lock)s, and only when the id passes, it then takes the lock that
-- serialises the writers of the id, so that the check the caller runs again after it (on a
-- new snapshot, with %(lock)s false) is exact. An id refused here takes no lock: a refused
-- caller that goes on with its transaction (an "already published" retry caught) held it to
-- the end, and every later writer of the id waited for that instead of being refused at once.
-- One case keeps it still: two writers of a free id at once, the second refused only by the
-- check after the lock; it holds the lock to its end (an xact lock cannot be let go sooner).
SELECT used.elsewhere, used.other_kind, used.isolation,
       CASE WHEN %(lock)s AND NOT used.elsewhere AND NOT used.other_kind
                 AND used.isolation IN ('read committed', 'read uncommitted')
            THEN pg_advisory_xact_lock(hashtextextended(%(producer_group)s || '/' || %(tx_id)s, 7411))
       END
FROM (SELECT EXISTS (
          SELECT 1 FROM {schema}.outbox_record
          WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
            AND writer_xid <> pg_current_xact_id()
      ), EXISTS (
          SELECT 1 FROM {schema}.outbox_record
          WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
            AND writer_xid = pg_current_xact_id()
            AND (state = 'prepared') <> (%(state)s = 'prepared')
      ), current_setting('transaction_isolation')) AS used (elsewhere, other_kind, isolation);

-- name: end_transaction
-- Compare-and-set: only prepared records move; all records of the transaction move together.
-- `ids_from`..`ids_to` (the caller's records of it): only while the tx id holds one of those.
-- A tx id may be taken again once its records are removed, and a decision about the earlier
-- transaction must not end the later one, whose ids are all above the earlier one's (its
-- rows came after every earlier row was gone).
WITH ended AS (
    UPDATE {schema}.outbox_record
    SET state = %(to_state)s, state_changed_at = now(), next_check_at = NULL,
        committed_xid = CASE WHEN %(to_state)s = 'committed' THEN pg_current_xact_id() END
    WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s AND state = 'prepared'
      AND (%(ids_from)s::bigint IS NULL OR EXISTS (
               SELECT 1 FROM {schema}.outbox_record AS held
               WHERE held.producer_group = %(producer_group)s AND held.tx_id = %(tx_id)s
                 AND held.id BETWEEN %(ids_from)s AND %(ids_to)s))
    RETURNING id
)
SELECT ended.id
FROM ended
CROSS JOIN (SELECT CASE WHEN %(notify)s THEN pg_notify(%(channel)s, '') END) AS wake
ORDER BY ended.id;

-- name: transaction_states
-- With `ids_to`: the records up to it, the transaction's that end_transaction was asked about
-- (some may be removed already, delivered, while others stay parked), not a later one's.
SELECT state, count(*) FROM {schema}.outbox_record
WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
  AND (%(ids_to)s::bigint IS NULL OR id <= %(ids_to)s)
GROUP BY state
ORDER BY state;

-- checker queries --
-- The check-back service (checker/). Bookkeeping is per transaction: every record of a
-- (producer_group, tx_id) carries the same check_count and next_check_at, updated together.
-- The `now` parameter is the checker's clock (tests move it); now() is only used for wall-clock
-- stamps (state_changed_at, audit rows).

-- name: checker_lock_due
-- Due transactions, oldest due first, locked for a short claim transaction. A transaction is due
-- when all its records are prepared and coalesce(next_check_at, first created_at + check
-- immunity) <= now. Index-ordered scans find candidates: checked before, by next_check_at
-- (outbox_record_prepared_due_idx); never checked, by age: those with the default immunity are
-- a range of outbox_record_never_checked_idx; those with their own (a per-record option), a
-- range of outbox_record_own_immunity_due_idx by when their immunity ends, and one of
-- outbox_record_own_immunity_idx by age for those past the maximum prepared age; then every
-- prepared record of a candidate is locked with SKIP LOCKED and re-read in its newest version (a
-- record another checker claimed meanwhile carries its lease, so it is not due any more).
-- The caller uses a transaction only if `locked` = `prepared` (no record held elsewhere); if
-- `prepared` < `records`, some of its records are not prepared (e.g. published and prepared with
-- one tx id): it is not checked, only moved out of the way of the others.
-- The durations come as seconds (make_interval): a timedelta comes as days, and a day added to
-- a timestamptz is 23 or 25 hours across a DST change of the session's time zone, so a record
-- was due an hour early (or late) in such a zone.
-- The scans read `limit` records each, not transactions: `scan_full` says one of them came full,
-- so that more may be due even when fewer than `limit` transactions came back (transactions of
-- many records); the caller then goes again at once instead of waiting a poll interval.
-- Each scan skips the records another session holds (an application ending its transaction in
-- a long one of its own, another checker's claim): counted in the limit, the same held records
-- came first every round, and no transaction behind them was checked, nor discarded at its
-- maximum age, until they were let go (a second checker found nothing while the first claimed).
-- A union cannot lock rows: each scan is a CTE of its own.
WITH checked_before AS (
    SELECT 1 AS scan, producer_group, tx_id, next_check_at AS due_at
    FROM {schema}.outbox_record
    WHERE state = 'prepared' AND next_check_at <= %(now)s
    ORDER BY next_check_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), never_checked AS (
    SELECT 2 AS scan, producer_group, tx_id,
           created_at + least(make_interval(secs => %(default_immunity_s)s),
                              make_interval(secs => %(max_age_s)s)) AS due_at
    FROM {schema}.outbox_record
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NULL
      AND created_at <= %(now)s - least(make_interval(secs => %(default_immunity_s)s),
                                        make_interval(secs => %(max_age_s)s))
    ORDER BY created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), own_immunity_over AS (
    SELECT 3 AS scan, producer_group, tx_id,
           {schema}.immune_until(created_at, check_immunity) AS due_at
    FROM {schema}.outbox_record
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NOT NULL
      AND {schema}.immune_until(created_at, check_immunity) <= %(now)s
    ORDER BY {schema}.immune_until(created_at, check_immunity), id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), own_immunity_too_old AS (
    SELECT 4 AS scan, producer_group, tx_id,
           created_at + make_interval(secs => %(max_age_s)s) AS due_at
    FROM {schema}.outbox_record
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NOT NULL
      AND created_at <= %(now)s - make_interval(secs => %(max_age_s)s)
    ORDER BY created_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), scanned AS (
    SELECT * FROM checked_before
    UNION ALL SELECT * FROM never_checked
    UNION ALL SELECT * FROM own_immunity_over
    UNION ALL SELECT * FROM own_immunity_too_old
), candidate AS (
    SELECT producer_group, tx_id, min(due_at) AS due_at
    FROM scanned
    GROUP BY producer_group, tx_id
    ORDER BY min(due_at)
    LIMIT %(limit)s
), scan_full AS (
    SELECT coalesce(max(n) >= %(limit)s, false) AS came_full
    FROM (SELECT count(*) AS n FROM scanned GROUP BY scan) AS per_scan
), locked AS (
    SELECT r.producer_group, r.tx_id, r.id, r.created_at, r.check_immunity, r.check_count,
           r.next_check_at, r.rearmed_at, r.check_lease_until
    FROM {schema}.outbox_record AS r
    JOIN candidate AS c ON r.producer_group = c.producer_group AND r.tx_id = c.tx_id
    WHERE r.state = 'prepared'
    FOR UPDATE OF r SKIP LOCKED
), counted AS (
    -- once a transaction: counted for each of its locked rows (a lateral join), a transaction
    -- of 20k records took 133 s here (0.11 s now), holding the relays' xid horizon back
    SELECT a.producer_group, a.tx_id,
           count(*) FILTER (WHERE a.state = 'prepared') AS prepared, count(*) AS records
    FROM {schema}.outbox_record AS a
    JOIN candidate AS c ON a.producer_group = c.producer_group AND a.tx_id = c.tx_id
    GROUP BY a.producer_group, a.tx_id
)
SELECT l.producer_group, l.tx_id, max(l.check_count) AS check_count,
       min(l.created_at) AS first_created_at, count(*) AS locked, n.prepared, n.records,
       coalesce(max(l.rearmed_at), min(l.created_at)) AS age_from,
       (SELECT came_full FROM scan_full) AS scan_full,
       coalesce(bool_or(l.check_lease_until <= %(now)s), false) AS check_lost
FROM locked AS l
JOIN counted AS n ON n.producer_group = l.producer_group AND n.tx_id = l.tx_id
GROUP BY l.producer_group, l.tx_id, n.prepared, n.records
-- `age_from`: the maximum prepared age counts from the last re-arm, else from the first record.
-- `check_lost`: a check was claimed (and counted) and its lease ran out with no outcome recorded.
-- A record without its own immunity has the default, here as in the candidate scan: with
-- min() ignoring it, a transaction mixing the two was a candidate every round, never due. No
-- immunity outlasts the maximum prepared age: the checker discards such a record then.
-- An immunity counts in seconds (immune_until), as in the candidate scan.
HAVING coalesce(max(l.next_check_at),
                least({schema}.immune_until(
                          min(l.created_at),
                          min(coalesce(l.check_immunity,
                                       make_interval(secs => %(default_immunity_s)s)))),
                      min(l.created_at) + make_interval(secs => %(max_age_s)s)))
       <= %(now)s
ORDER BY coalesce(max(l.next_check_at),
                  least({schema}.immune_until(
                            min(l.created_at),
                            min(coalesce(l.check_immunity,
                                         make_interval(secs => %(default_immunity_s)s)))),
                        min(l.created_at) + make_interval(secs => %(max_age_s)s))),
         l.producer_group, l.tx_id;

-- name: checker_claim
-- Counts a check and leases it (next_check_at = check_lease_until = lease end) before the request
-- is sent, in the claim transaction that holds the locks from checker_lock_due; the lease is
-- cleared when the check's outcome is recorded. Returns a summary of at most `max_records`
-- records per transaction, for the check request (never the values), and the last record's id.
WITH claimed AS (
    UPDATE {schema}.outbox_record AS r
    SET check_count = c.check_count, next_check_at = c.lease_until, last_checked_at = %(now)s,
        check_lease_until = c.lease_until
    FROM unnest(%(producer_groups)s::text[], %(tx_ids)s::text[], %(check_counts)s::integer[],
                %(lease_until)s::timestamptz[])
         AS c(producer_group, tx_id, check_count, lease_until)
    WHERE r.producer_group = c.producer_group AND r.tx_id = c.tx_id AND r.state = 'prepared'
    RETURNING r.producer_group, r.tx_id, r.id, r.topic, r.key, r.headers
), numbered AS (
    SELECT claimed.*,
           row_number() OVER (PARTITION BY producer_group, tx_id ORDER BY id) AS n,
           max(id) OVER (PARTITION BY producer_group, tx_id) AS last_id
    FROM claimed
)
SELECT producer_group, tx_id, id, topic, key, headers, last_id
FROM numbered
WHERE n <= %(max_records)s
ORDER BY producer_group, tx_id, id;

-- name: checker_lock_answered
-- The rows of the transactions a batch of answers ends or reschedules, locked before any is
-- changed. NOWAIT: rows an application holds fail the batch at once, so that it never waits for
-- them while it holds others' (an application ending two of them, waiting for the batch's rows,
-- would be the deadlock's victim).
SELECT 1
FROM {schema}.outbox_record AS r
JOIN unnest(%(producer_groups)s::text[], %(tx_ids)s::text[]) AS t(producer_group, tx_id)
  ON r.producer_group = t.producer_group AND r.tx_id = t.tx_id
WHERE r.state = 'prepared'  -- the only rows an answer changes
FOR UPDATE OF r NOWAIT;

-- name: checker_reschedule
-- Compare-and-set on the check count and the lease a claim gave: sets the next check (after
-- UNKNOWN or a failed check: the backoff; for a check never sent: the count given back) and
-- records the outcome (no lease in flight). A transaction claimed again meanwhile (its lease ran
-- out), or ended, is left alone. `expected_lease` NULL: no claim of the caller's, which holds
-- the rows' locks.
WITH rescheduled AS (
    UPDATE {schema}.outbox_record AS r
    SET check_count = c.new_count, next_check_at = c.next_check_at, check_lease_until = NULL
    FROM unnest(%(producer_groups)s::text[], %(tx_ids)s::text[], %(expected_counts)s::integer[],
                %(new_counts)s::integer[], %(next_check_at)s::timestamptz[],
                %(expected_leases)s::timestamptz[])
         AS c(producer_group, tx_id, expected_count, new_count, next_check_at, expected_lease)
    WHERE r.producer_group = c.producer_group AND r.tx_id = c.tx_id AND r.state = 'prepared'
      AND r.check_count = c.expected_count
      AND (c.expected_lease IS NULL OR r.check_lease_until = c.expected_lease)
    RETURNING r.producer_group, r.tx_id
)
SELECT DISTINCT producer_group, tx_id FROM rescheduled;

-- name: checker_discard
-- prepared -> discarded with a reason, for transactions past max checks or max age; the relay
-- ships them (op marker and dead-letter copy) and sets ended_at. One audit row per transaction.
WITH discarded AS (
    UPDATE {schema}.outbox_record AS r
    SET state = 'discarded', reason = d.reason, state_changed_at = now(), next_check_at = NULL,
        check_lease_until = NULL
    FROM unnest(%(producer_groups)s::text[], %(tx_ids)s::text[], %(reasons)s::text[])
         AS d(producer_group, tx_id, reason)
    WHERE r.producer_group = d.producer_group AND r.tx_id = d.tx_id AND r.state = 'prepared'
    RETURNING r.producer_group, r.tx_id, r.id, r.check_count, r.created_at, d.reason
), audited AS (
    INSERT INTO {schema}.audit_log (actor, action, producer_group, tx_id, detail)
    SELECT %(actor)s, 'discard', producer_group, tx_id,
           jsonb_build_object('reason', min(reason), 'check_count', max(check_count),
                              'first_prepared_at', min(created_at),
                              'record_ids', jsonb_agg(id ORDER BY id))
    FROM discarded
    GROUP BY producer_group, tx_id
    RETURNING producer_group, tx_id
)
SELECT producer_group, tx_id FROM audited ORDER BY producer_group, tx_id;

-- name: checker_wake_relay
SELECT pg_notify(%(channel)s, '');

-- name: checker_statement_timeout
-- For the rest of the current transaction only.
SELECT set_config('statement_timeout', %(timeout)s, true);

-- name: checker_prepared_ages
-- Prepared records by age, for the metrics; one pass over the prepared rows (partial index).
SELECT count(*) AS total,
       min(created_at) AS oldest,
       count(*) FILTER (WHERE created_at <= %(now)s - interval '1 minute') AS over_1m,
       count(*) FILTER (WHERE created_at <= %(now)s - interval '10 minutes') AS over_10m,
       count(*) FILTER (WHERE created_at <= %(now)s - interval '1 hour') AS over_1h,
       count(*) FILTER (WHERE created_at <= %(now)s - interval '6 hours') AS over_6h,
       count(*) FILTER (WHERE created_at <= %(now)s - interval '24 hours') AS over_24h,
       count(*) FILTER (WHERE created_at <= %(now)s - interval '72 hours') AS over_72h
FROM {schema}.outbox_record
WHERE state = 'prepared';

-- name: checker_discarded_ids
-- The record ids the last discard of a transaction recorded (its audit row): rows shipped since
-- are gone when no archive is kept. NULL when the transaction's latest audit row is not that
-- discard: resolved or re-armed after it, its records went where that decided.
SELECT CASE WHEN action = 'discard' THEN detail -> 'record_ids' END
FROM {schema}.audit_log
WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
ORDER BY id DESC
LIMIT 1;

-- name: checker_lock_transaction
-- Every record of one transaction, locked for a manual action (rearm, resolve). NOWAIT: a row
-- locked by someone else (the relay shipping it, a checker claiming it) fails at once.
SELECT id, state, ended_at IS NOT NULL AS shipped, check_count, created_at
FROM {schema}.outbox_record
WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
ORDER BY id
FOR UPDATE NOWAIT;

-- name: shipping_taken
-- Of a transaction's rows locked by checker_lock_transaction, the discarded ones the relay has
-- taken to ship to the dead-letter topic (shipping_mark), with when.
SELECT id, shipping_since
FROM {schema}.outbox_record
WHERE id = ANY(%(ids)s::bigint[]) AND shipping_since IS NOT NULL AND ended_at IS NULL
ORDER BY id;

-- name: checker_rearm
-- RocketMQ's resumeCheckHalfMessage: discarded, not yet shipped records go back to prepared and
-- are due at once, their maximum prepared age counted from now (RocketMQ puts the half message
-- again, with a new store time). Only under the locks of checker_lock_transaction. `now` NULL:
-- the database's clock, which the checker schedules by (not the operator's host's).
UPDATE {schema}.outbox_record
SET state = 'prepared', reason = NULL, check_count = %(check_count)s,
    next_check_at = coalesce(%(now)s::timestamptz, now()),
    rearmed_at = coalesce(%(now)s::timestamptz, now()), state_changed_at = now(),
    check_lease_until = NULL
WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
  AND state = 'discarded' AND ended_at IS NULL
RETURNING id, next_check_at;

-- name: checker_redrive
-- Parked records (the broker refused them for good; kept with their reason) back to committed,
-- as if committed by this transaction: its xid, so that the relay takes them once it commits,
-- after what committed before; unstamped, not ended, no Kafka position. The relay then ships
-- them as any committed record, or parks them again if the broker still refuses them. `ids`
-- empty: every parked record of the transaction. Only under the locks of
-- checker_lock_transaction. Returns each record's id and the reason it was parked for.
UPDATE {schema}.outbox_record AS r
SET state = 'committed', reason = NULL, committed_xid = pg_current_xact_id(), commit_ts = NULL,
    ended_at = NULL, kafka_partition = NULL, kafka_offset = NULL, state_changed_at = now()
FROM {schema}.outbox_record AS was
WHERE was.id = r.id
  AND r.producer_group = %(producer_group)s AND r.tx_id = %(tx_id)s AND r.state = 'parked'
  AND (cardinality(%(ids)s::bigint[]) = 0 OR r.id = ANY(%(ids)s::bigint[]))
RETURNING r.id, was.reason;

-- name: checker_drop_parked
-- Parked records whose dead-letter copy and op marker are out (ended_at set) removed for good
-- (drop): the broker will never take them, and the operator gave up on them. `ids` empty:
-- every such record of the transaction. Only under the locks of checker_lock_transaction.
-- Returns each record's id, topic, the reason it was parked for and its value's size.
DELETE FROM {schema}.outbox_record
WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s AND state = 'parked'
  AND ended_at IS NOT NULL
  AND (cardinality(%(ids)s::bigint[]) = 0 OR id = ANY(%(ids)s::bigint[]))
RETURNING id, topic, reason, coalesce(octet_length(value), 0);

-- name: checker_parked_unshipped_of_topic
-- Records parked for a topic whose dead-letter copy and op marker are not out yet: drop --topic
-- leaves them, and says how many.
SELECT count(*) FROM {schema}.outbox_record
WHERE state = 'parked' AND topic = %(topic)s AND ended_at IS NULL;

-- name: checker_parked_of_topic
-- The transactions with records parked for one topic, and those records' ids (redrive --topic,
-- drop --topic), a page at a time in order of their first parked record: past `after`, so that
-- records the relay parks again while a redrive runs are not redriven twice by it.
-- `shipped_only`: only records whose dead-letter copy and op marker are out (drop's).
SELECT producer_group, tx_id, array_agg(id ORDER BY id) AS ids
FROM {schema}.outbox_record
WHERE state = 'parked' AND topic = %(topic)s AND (NOT %(shipped_only)s OR ended_at IS NOT NULL)
GROUP BY producer_group, tx_id
HAVING min(id) > %(after)s
ORDER BY min(id)
LIMIT %(limit)s;

-- name: checker_audit
INSERT INTO {schema}.audit_log (actor, action, producer_group, tx_id, detail)
VALUES (%(actor)s, %(action)s, %(producer_group)s, %(tx_id)s, %(detail)s)
RETURNING id, at;

-- name: cli_records
-- `outboxctl records`: records matching the filters given (null: any), oldest first, without
-- their values (they may hold personal data): the size only.
SELECT id, producer_group, tx_id, state, topic, key, partition, octet_length(value) AS value_bytes,
       created_at, state_changed_at, check_count, next_check_at, ended_at, kafka_partition,
       kafka_offset, reason
FROM {schema}.outbox_record
WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
  AND (%(producer_group)s::text IS NULL OR producer_group = %(producer_group)s::text)
  AND (%(tx_id)s::text IS NULL OR tx_id = %(tx_id)s::text)
  AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
ORDER BY id
LIMIT %(limit)s;
