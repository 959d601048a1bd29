-- Every query of the outbox library, loaded by name (outbox/sql/__init__.py).
-- `{schema}` is the configured schema, quoted as an identifier; %(name)s are bound parameters.

-- name: insert_record
-- The one-record hot path of publish()/prepare(): a plain INSERT, cheaper than the unnest below.
-- A caller that gives no tx id gets one per database transaction (see insert_records).
INSERT INTO {schema}.outbox_record
    (producer_group, tx_id, topic, key, value, headers, partition, key_hash, state, check_immunity,
     committed_xid)
VALUES (
    %(producer_group)s,
    coalesce(%(tx_id)s, 'xid:' || pg_current_xact_id()::text),
    %(topic)s, %(key)s, %(value)s, %(headers)s, %(partition)s,
    hashtextextended(
        coalesce(encode(%(key)s, 'hex'), %(tx_id)s, 'xid:' || pg_current_xact_id()::text), 0),
    %(state)s, %(check_immunity)s,
    CASE WHEN %(state)s = 'committed' THEN pg_current_xact_id() END)
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
         check_immunity, committed_xid)
    SELECT %(producer_group)s, tx.tx_id, r.topic, r.key, r.value, r.headers, r.partition,
           -- keyless records hash by tx id, so they stay with the rest of their transaction
           hashtextextended(coalesce(encode(r.key, 'hex'), tx.tx_id), 0),
           %(state)s, %(check_immunity)s,
           CASE WHEN %(state)s = 'committed' THEN pg_current_xact_id() END
    FROM tx, unnest(%(topics)s::text[], %(keys)s::bytea[], %(values)s::bytea[],
                    %(headers)s::jsonb[], %(partitions)s::integer[])
             WITH ORDINALITY AS r(topic, key, value, headers, partition, ord)
    ORDER BY r.ord
    RETURNING id, tx_id
)
SELECT inserted.id, inserted.tx_id
FROM inserted
CROSS JOIN (SELECT CASE WHEN %(notify)s THEN pg_notify(%(channel)s, '') END) AS wake
ORDER BY inserted.id;

-- name: lock_tx_id
-- Serialises writers that name the same caller-given tx id, so the reuse check below is exact.
SELECT pg_advisory_xact_lock(hashtextextended(%(producer_group)s || '/' || %(tx_id)s, 7411));

-- name: tx_id_used_elsewhere
SELECT EXISTS (
    SELECT 1 FROM {schema}.outbox_record
    WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
      AND writer_xid <> pg_current_xact_id()
);

-- name: end_transaction
-- Compare-and-set: only prepared records move; all records of the transaction move together.
WITH ended AS (
    UPDATE {schema}.outbox_record
    SET state = %(to_state)s, state_changed_at = now(), next_check_at = NULL,
        committed_xid = CASE WHEN %(to_state)s = 'committed' THEN pg_current_xact_id() END
    WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s AND state = 'prepared'
    RETURNING id
)
SELECT ended.id
FROM ended
CROSS JOIN (SELECT CASE WHEN %(notify)s THEN pg_notify(%(channel)s, '') END) AS wake
ORDER BY ended.id;

-- name: transaction_states
SELECT state, count(*) FROM {schema}.outbox_record
WHERE producer_group = %(producer_group)s AND tx_id = %(tx_id)s
GROUP BY state
ORDER BY state;
