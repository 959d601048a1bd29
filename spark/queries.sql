-- SQL of the reconciliation job, loaded by name (spark/_sql.py). `{schema}` is the outbox schema,
-- quoted as an identifier; other `{name}` placeholders are rendered as literals (the ledger query
-- goes to Spark's JDBC source as text); `%(name)s` are psycopg parameters.

-- name: ledger_window
-- The ledger rows a judgement needs: every record still waiting for the relay, and every record
-- the relay ended inside the window (delivered ones carry their Kafka position). Uses the partial
-- indexes outbox_record_committed_idx and outbox_record_ended_idx. A row the relay has not
-- stamped yet has its commit time from Postgres: state_changed_at is the transaction's start.
SELECT id, producer_group, tx_id, topic, key, state,
       coalesce(commit_ts, pg_xact_commit_timestamp(committed_xid::xid), state_changed_at)
           AS commit_time,
       ended_at, kafka_partition, kafka_offset, committed_xid::text::bigint AS commit_xid
FROM {schema}.outbox_record
WHERE state = 'committed'
   OR (ended_at >= {ended_from} AND ended_at < {ended_until})

-- name: ledger_by_ids
-- Rows for ids seen on Kafka but not in the window: old records copied again, rolled back or
-- prepared ones, unknown ids (no row comes back).
SELECT id, producer_group, tx_id, topic, key, state,
       coalesce(commit_ts, pg_xact_commit_timestamp(committed_xid::xid), state_changed_at)
           AS commit_time,
       ended_at, kafka_partition, kafka_offset, committed_xid::text::bigint AS commit_xid
FROM {schema}.outbox_record
WHERE id = ANY(%(ids)s)

-- name: ledger_oldest_due
-- The oldest commit time among the rows a judgement of [lo, hi] may call missing: those the
-- relay ended in it, and with include_stuck every row still waiting for the relay. Their copies
-- reached Kafka after that, however late the relay ended the rows (a relay down between its
-- Kafka commit and the end of its rows): what was read since then holds them. By the ended and
-- commit-order indexes, and the unstamped rows by theirs. `topics`: the job's topics when it
-- names them (NULL with a pattern: Java's regular expressions are not Postgres's); a row stuck
-- on another topic made every judgement read Kafka back to its commit, and no tick idle.
SELECT least(
    (SELECT min(coalesce(commit_ts, pg_xact_commit_timestamp(committed_xid::xid),
                         state_changed_at))
     FROM {schema}.outbox_record
     WHERE ended_at >= %(lo)s AND ended_at <= %(hi)s AND state = 'delivered'
       AND (%(topics)s::text[] IS NULL OR topic = ANY(%(topics)s::text[]))),
    CASE WHEN %(include_stuck)s THEN
        (SELECT min(commit_ts) FROM {schema}.outbox_record WHERE state = 'committed'
           AND (%(topics)s::text[] IS NULL OR topic = ANY(%(topics)s::text[]))) END,
    CASE WHEN %(include_stuck)s THEN
        (SELECT min(coalesce(pg_xact_commit_timestamp(committed_xid::xid), state_changed_at))
         FROM {schema}.outbox_record WHERE state = 'committed' AND commit_ts IS NULL
           AND (%(topics)s::text[] IS NULL OR topic = ANY(%(topics)s::text[]))) END)

-- name: ledger_oldest_ended
-- The ledger keeps ended rows for the relay's retention: ids newer than this are all still there.
-- Not parked rows: the relay keeps them until an operator acts, past any retention (and without
-- an archive, when every other ended row is deleted at once).
SELECT min(ended_at) FROM {schema}.outbox_record WHERE ended_at IS NOT NULL AND state <> 'parked'

-- name: prune_findings
-- The job's retention: findings no judgement has found for longer than it (by the last_seen_at
-- index; a record stuck for months keeps its one finding), `limit` at a time: a table that grew
-- for months is emptied in short transactions, not in one that holds its row locks and its xid
-- (the relay's horizon) for minutes. The retention comes in seconds: an interval of days is
-- counted in the session's calendar, an hour off across a DST change.
DELETE FROM {schema}.reconciliation_finding
WHERE id IN (SELECT id FROM {schema}.reconciliation_finding
             WHERE last_seen_at < now() - make_interval(secs => %(retention_s)s)
             ORDER BY last_seen_at, id LIMIT %(limit)s)

-- name: prune_windows
-- By when a window was last written, not by its time: an audit of an old range writes old windows.
DELETE FROM {schema}.reconciliation_window
WHERE (window_start, window_end) IN (
    SELECT window_start, window_end FROM {schema}.reconciliation_window
    WHERE updated_at < now() - make_interval(secs => %(retention_s)s) LIMIT %(limit)s)

-- name: create_finding_stage
CREATE TEMPORARY TABLE reconciliation_finding_stage (
    kind            text,
    topic           text,
    outbox_id       bigint,
    occurrence      text,
    producer_group  text,
    tx_id           text,
    kafka_partition integer,
    kafka_offset    bigint,
    event_time      timestamptz,
    detail          jsonb
) ON COMMIT DROP

-- name: copy_finding_stage
COPY reconciliation_finding_stage (kind, topic, outbox_id, occurrence, producer_group, tx_id,
    kafka_partition, kafka_offset, event_time, detail) FROM STDIN

-- name: touch_findings
-- Findings found again (a record still stuck, a copy judged again inside the horizon): their
-- last_seen_at moves on, once every `every_s` at most, not at every trigger for every one.
UPDATE {schema}.reconciliation_finding AS f SET last_seen_at = now()
FROM reconciliation_finding_stage AS s
WHERE (f.kind, f.topic, f.outbox_id, f.occurrence) = (s.kind, s.topic, s.outbox_id, s.occurrence)
  AND f.last_seen_at < now() - make_interval(secs => %(every_s)s)

-- name: merge_findings
-- A finding is a fact about a record: the first detection stays, repeats change nothing.
INSERT INTO {schema}.reconciliation_finding (kind, topic, outbox_id, occurrence, producer_group,
    tx_id, kafka_partition, kafka_offset, event_time, detail, detected_in)
SELECT kind, topic, outbox_id, occurrence, producer_group, tx_id, kafka_partition, kafka_offset,
       event_time, detail, %(detected_in)s
FROM reconciliation_finding_stage
ON CONFLICT (kind, topic, outbox_id, occurrence) DO NOTHING
RETURNING kind

-- name: upsert_window
-- A window is recomputed from the whole window while it is inside the horizon: the last wins.
INSERT INTO {schema}.reconciliation_window (window_start, window_end, records, latency_p50_ms,
    latency_p95_ms, latency_p99_ms, latency_max_ms)
VALUES (%(window_start)s, %(window_end)s, %(records)s, %(latency_p50_ms)s, %(latency_p95_ms)s,
        %(latency_p99_ms)s, %(latency_max_ms)s)
ON CONFLICT (window_start, window_end) DO UPDATE
SET records = excluded.records,
    latency_p50_ms = excluded.latency_p50_ms,
    latency_p95_ms = excluded.latency_p95_ms,
    latency_p99_ms = excluded.latency_p99_ms,
    latency_max_ms = excluded.latency_max_ms,
    updated_at = now()

-- name: read_findings
SELECT id, kind, topic, outbox_id, occurrence, producer_group, tx_id, kafka_partition,
       kafka_offset, event_time, detail, detected_at, detected_in, last_seen_at
FROM {schema}.reconciliation_finding
WHERE (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
  AND (%(since)s::timestamptz IS NULL OR detected_at >= %(since)s::timestamptz)
ORDER BY detected_at DESC, id DESC
LIMIT %(limit)s

-- name: read_windows
-- The newest windows, with the findings whose event time falls inside each.
SELECT w.window_start, w.window_end, w.records, w.latency_p50_ms, w.latency_p95_ms,
       w.latency_p99_ms, w.latency_max_ms, w.updated_at,
       count(f.id) FILTER (WHERE f.kind = 'missing') AS missing,
       count(f.id) FILTER (WHERE f.kind = 'duplicate') AS duplicate,
       count(f.id) FILTER (WHERE f.kind = 'orphan') AS orphan,
       count(f.id) FILTER (WHERE f.kind = 'marker_mismatch') AS marker_mismatch,
       count(f.id) FILTER (WHERE f.kind = 'out_of_order') AS out_of_order
FROM (
    SELECT * FROM {schema}.reconciliation_window
    WHERE (%(since)s::timestamptz IS NULL OR window_end > %(since)s::timestamptz)
    ORDER BY window_start DESC
    LIMIT %(limit)s
) w
LEFT JOIN {schema}.reconciliation_finding f
       ON f.event_time >= w.window_start AND f.event_time < w.window_end
GROUP BY w.window_start, w.window_end, w.records, w.latency_p50_ms, w.latency_p95_ms,
         w.latency_p99_ms, w.latency_max_ms, w.updated_at
ORDER BY w.window_start DESC
