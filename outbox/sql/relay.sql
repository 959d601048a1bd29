-- Queries of the sidecar's relay, loaded by name like queries.sql.
-- A shard is a range of key hashes, [lo, hi] (relay/sharding.py); a set of shards is given as
-- two arrays, lo[] and hi[].

-- name: relay_stamp_plan
-- Before relay_stamp_commit_ts and relay_hold_back, in their transaction: statistics taken
-- while a backlog was unstamped make the planner expect every row unstamped, and it then reads
-- the whole table every round (JIT-compiled, too) instead of the small unstamped index.
-- Also the xid horizon before the stamp: once a stamp is complete, every committed row of the
-- shards below it is stamped (relay/service.py, Relay._stamp).
-- lock_timeout: the stamp locks rows in index order, and another relay's end of a transaction
-- that spans shards locks some of the same rows in its batch's order. Waiting for each other,
-- Postgres would end one after deadlock_timeout (a second, and maybe the end, which then
-- recovers from the op markers); a stamp that gives up sooner is made again (Relay._stamp).
-- statement_timeout 0: a slice of a backlog takes ~1.5 s by design; cancelled by a role's or a
-- database's statement_timeout, it failed every round and the backlog never drained.
SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true),
       set_config('max_parallel_workers_per_gather', '0', true),
       set_config('lock_timeout', %(lock_timeout)s, true),
       set_config('statement_timeout', '0', true),
       pg_snapshot_xmin(pg_current_snapshot())::text;

-- name: relay_stamp_commit_ts
-- Rows below the xid horizon belong to finished transactions: their commit time is final.
-- Stamping it once lets the claim read rows in commit order from an index. About `limit` rows
-- a statement (whole transactions: up to the xid of the limit-th row), so that a large backlog
-- is stamped in short transactions, not one that holds the horizon and its row locks for a
-- minute. A range of the unstamped index, whatever the statistics say: a list of ids
-- (`id = ANY(ARRAY(...))`) was checked row by row against the whole list when statistics
-- taken before a burst expected few unstamped rows, 23 s a slice of 50k instead of 1.3 s.
-- `stamped_below`: every row of these shards below it is stamped (see relay_stamp_plan); the
-- range starts there, past the index entries of rows stamped before, which stay in the index
-- until a vacuum (right after a million rows were stamped, with the statistics of before,
-- ~0.5 s a scan). Returns the rows stamped, and whether the slice reached the horizon (no
-- limit-th row bounded it): not told by the count, which rows deleted or changed by others
-- while the statement ran make short, and a short slice taken for the last one left the rows
-- above its bound unstamped below `stamped_below`, where no claim looks.
-- Only the shards still this relay's (`shards`, with their `epochs`, `lo` and `hi`), their
-- leases locked until the slice commits: a shard handed over between two slices (a heartbeat),
-- or taken from a relay paused mid-stamp, is stamped by its owner alone. Another relay's
-- stamp put rows in its claims past the hold-back its own stamp found: sent out of order.
WITH held AS (
    SELECT o.lo, o.hi
    FROM unnest(%(shards)s::integer[], %(epochs)s::bigint[], %(lo)s::bigint[],
                %(hi)s::bigint[]) AS o(shard, epoch, lo, hi)
    JOIN {schema}.shard_lease AS l ON l.shard = o.shard AND l.epoch = o.epoch
    WHERE l.owner = %(owner)s
    FOR SHARE OF l
), bound AS (
    SELECT committed_xid FROM {schema}.outbox_record
    WHERE state = 'committed' AND commit_ts IS NULL
      AND committed_xid >= %(stamped_below)s::xid8
      AND committed_xid < pg_snapshot_xmin(pg_current_snapshot())
      AND EXISTS (SELECT 1 FROM held AS o WHERE key_hash BETWEEN o.lo AND o.hi)
    ORDER BY committed_xid
    OFFSET %(limit)s - 1 LIMIT 1
), stamped AS (
    UPDATE {schema}.outbox_record
    SET commit_ts = coalesce(pg_xact_commit_timestamp(committed_xid::xid), state_changed_at)
    WHERE state = 'committed' AND commit_ts IS NULL
      AND committed_xid >= %(stamped_below)s::xid8
      AND committed_xid < pg_snapshot_xmin(pg_current_snapshot())
      AND committed_xid <= coalesce((SELECT committed_xid FROM bound),
                                    pg_snapshot_xmin(pg_current_snapshot()))
      AND EXISTS (SELECT 1 FROM held AS o WHERE key_hash BETWEEN o.lo AND o.hi)
    RETURNING 1
)
SELECT (SELECT count(*) FROM stamped), NOT EXISTS (SELECT 1 FROM bound);

-- name: relay_xids_of_another_cluster
-- Committed rows of the owned shards, not stamped, whose transaction id this cluster has not
-- given yet (at or above the snapshot's xmax, which no transaction it has run reaches): written
-- in another Postgres cluster, whose ids a logical move (a dump restored, a logical replica
-- promoted) carries over as they were. No xid horizon passes them until this cluster has run
-- as many transactions, so no claim takes them. Counted up to `limit`, through the unstamped
-- index's range.
SELECT count(*), min(id), min(committed_xid)::text FROM (
    SELECT id, committed_xid FROM {schema}.outbox_record
    WHERE state = 'committed' AND commit_ts IS NULL
      AND committed_xid >= pg_snapshot_xmax(pg_current_snapshot())
      AND EXISTS (SELECT 1 FROM unnest(%(lo)s::bigint[], %(hi)s::bigint[]) AS o(lo, hi)
                  WHERE key_hash BETWEEN o.lo AND o.hi)
    LIMIT %(limit)s
) AS far;

-- name: relay_hold_back
-- Committed rows not stamped yet (their transaction id is above the horizon, or they were not
-- reached yet): nothing that committed after the earliest of them may go out before it does.
-- None is below `stamped_below` (relay_stamp_commit_ts). Nor after a transaction that has
-- taken its commit time but is not visible yet (relay_running_xids, read before this, and
-- those that took their id since, running in this statement's own snapshot).
SELECT least(min(coalesce(pg_xact_commit_timestamp(committed_xid::xid), state_changed_at)),
             (SELECT min(pg_xact_commit_timestamp(x))
              FROM unnest(current_setting('outbox_relay.running_xids')::xid[]) AS x),
             (SELECT min(pg_xact_commit_timestamp(x::xid))
              FROM pg_snapshot_xip(pg_current_snapshot()) AS x
              WHERE x >= current_setting('outbox_relay.running_xmax')::xid8))
FROM {schema}.outbox_record
WHERE state = 'committed' AND commit_ts IS NULL
  AND committed_xid >= %(stamped_below)s::xid8
  AND EXISTS (SELECT 1 FROM unnest(%(lo)s::bigint[], %(hi)s::bigint[]) AS o(lo, hi)
              WHERE key_hash BETWEEN o.lo AND o.hi);

-- name: relay_running_xids
-- Before relay_hold_back and relay_claim (and relay_unstamped_below after it), in their
-- transaction: the transactions of this database running now, prepared ones too, other than
-- relays' (which commit no records). A transaction takes its commit time before it becomes
-- visible: in between it flushes its WAL and, with synchronous replication, waits for its
-- standby. One that commits meanwhile with a later time and no lock in common (unless both
-- NOTIFY: a notifying commit holds Postgres's notify lock until it is visible) is seen first,
-- and went out first though it committed second. So nothing that committed after one of these
-- that has its commit time now goes out before it. Read here, before the statement that uses
-- them: read there, after its snapshot, a transaction that became visible in between would be in
-- neither. backend_xid is shown to every role. One that takes its id and reaches its commit
-- between the two statements (back to back, in one pipeline) is missed here; the statement
-- that uses them also takes those its own snapshot lists as running (pg_snapshot_xip) whose
-- id is at or above this snapshot's xmax (`running_xmax`): only one that took its id after
-- this read (or ran already, and is listed here unless another database's or a relay's). Not
-- every one running there: with a synchronous standby, a relay's end in its wait for it held
-- back what committed after it took its time, a standby round trip a batch. Still missed: one
-- whose id is above every id that had ended by the claim's snapshot (no snapshot lists an id
-- that high).
SELECT set_config('outbox_relay.running_xids', coalesce(array_agg(x)::text, '{{}}'), true),
       set_config('outbox_relay.running_xmax', pg_snapshot_xmax(pg_current_snapshot())::text,
                  true)
FROM (
    SELECT a.backend_xid
    FROM pg_stat_get_activity(NULL) AS a
    JOIN pg_database AS d ON d.oid = a.datid AND d.datname = current_database()
    WHERE a.backend_xid IS NOT NULL
      AND NOT starts_with(coalesce(a.application_name, ''), 'outbox-relay ')
    UNION ALL
    SELECT p.transaction
    FROM pg_prepared_xact() AS p
    JOIN pg_database AS d ON d.oid = p.dbid AND d.datname = current_database()
) AS running(x);

-- name: relay_commit_times_of_running
-- At the relay's start, after relay_running_xids: that its role may call what the hold-back
-- calls (relay/service.py, Relay._check_functions_callable).
SELECT pg_xact_commit_timestamp(x)
FROM unnest(current_setting('outbox_relay.running_xids')::xid[]) AS x
UNION ALL
SELECT pg_xact_commit_timestamp(x::xid) FROM pg_snapshot_xip(pg_current_snapshot()) AS x;

-- name: relay_unstamped_below
-- After an unstamped claim (relay_claim with `inline`), in its pipeline: the xid horizon, how
-- many committed rows of the owned shards below it are unstamped (counted up to `limit` + 1;
-- the claim's own among them, not those of `ending`), and the lowest transaction id among them
-- (`ending`'s too: they stay if their end fails). Few: the next claims read them unstamped;
-- more (a backlog): the next round stamps them (relay/service.py, Relay._stamp_due). The
-- horizon written out, not in a CTE: so that it bounds the index scans, each cut short.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text,
       (SELECT count(*) FROM (
            SELECT 1 FROM {schema}.outbox_record
            WHERE state = 'committed' AND commit_ts IS NULL
              AND committed_xid >= %(stamped_below)s::xid8
              AND committed_xid < pg_snapshot_xmin(pg_current_snapshot())
              AND committed_xid <> ALL(%(ending)s::xid8[])
              AND EXISTS (SELECT 1 FROM unnest(%(lo)s::bigint[], %(hi)s::bigint[]) AS o(lo, hi)
                          WHERE key_hash BETWEEN o.lo AND o.hi)
            LIMIT %(limit)s + 1) AS n),
       (SELECT committed_xid FROM {schema}.outbox_record  -- cast outside: ordered by the xid8
        WHERE state = 'committed' AND commit_ts IS NULL
          AND committed_xid >= %(stamped_below)s::xid8
          AND committed_xid < pg_snapshot_xmin(pg_current_snapshot())
          AND EXISTS (SELECT 1 FROM unnest(%(lo)s::bigint[], %(hi)s::bigint[]) AS o(lo, hi)
                      WHERE key_hash BETWEEN o.lo AND o.hi)
        ORDER BY committed_xid
        LIMIT 1)::text,
       -- committed rows the horizon held back from the claim (a transaction older than
       -- theirs ran: an application's, another relay's end, this relay's own): the round that
       -- could not take them looks again soon, not after the poll interval (that
       -- transaction's end wakes nobody). From the horizon before the claim (relay_claim_plan),
       -- not this statement's: a transaction that ended meanwhile left rows below this one
       -- that the claim could not take, their wake-up spent (the round then waited for the
       -- poll interval). (Rows the claim took, when the horizon moved on as it ran, count
       -- too: one round more, 50 ms later.)
       EXISTS (SELECT 1 FROM {schema}.outbox_record
               WHERE state = 'committed' AND commit_ts IS NULL
                 AND committed_xid >= current_setting('outbox_relay.claim_horizon')::xid8
                 AND EXISTS (SELECT 1 FROM unnest(%(lo)s::bigint[], %(hi)s::bigint[]) AS o(lo, hi)
                             WHERE key_hash BETWEEN o.lo AND o.hi))
       -- and those held back behind a transaction in its commit (see relay_running_xids; its
       -- end wakes nobody either): one of them has taken its commit time by now. Also true
       -- for those that merely committed meanwhile: a round more, not a wait for a wake-up.
       OR EXISTS (SELECT 1 FROM unnest(current_setting('outbox_relay.running_xids')::xid[]) AS x
                  WHERE pg_xact_commit_timestamp(x) IS NOT NULL)
       -- (and one that list missed, as the claim's own snapshot did not: see relay_running_xids)
       OR EXISTS (SELECT 1 FROM pg_snapshot_xip(pg_current_snapshot()) AS x
                  WHERE x >= current_setting('outbox_relay.running_xmax')::xid8
                    AND pg_xact_commit_timestamp(x::xid) IS NOT NULL);

-- name: relay_claim_plan
-- Before relay_claim, in its transaction: the claim must walk the commit-order index and stop
-- after a batch. Statistics taken while rows were unstamped (a burst, a backlog) make the planner
-- think few rows are stamped, and it then sorts the whole backlog on every claim instead. The
-- unstamped rows are read through their own index too (see relay_stamp_plan). With the plan
-- pinned so, the prepared claim's generic plan is the custom one's shape, and planning each
-- claim anew took ~2 ms of its ~10 (a batch of 1000). Generic plans for the claim alone: the
-- statements after it in the transaction go back to custom ones (relay_claim_planned).
-- statement_timeout 0: see relay_stamp_plan (a claim takes a transaction whole, however large).
-- Keeps the xid horizon as of just before the claim, for relay_unstamped_below.
SELECT set_config('enable_sort', 'off', true), set_config('jit', 'off', true),
       set_config('statement_timeout', '0', true),
       set_config('enable_seqscan', 'off', true),
       set_config('max_parallel_workers_per_gather', '0', true),
       set_config('plan_cache_mode', 'force_generic_plan', true),
       set_config('outbox_relay.claim_horizon', pg_snapshot_xmin(pg_current_snapshot())::text,
                  true);

-- name: relay_claim_planned
-- Right after relay_claim: Postgres plans any statement with parameters, even an unprepared
-- one, by plan_cache_mode, and the claim's other statements estimate their key ranges.
SET LOCAL plan_cache_mode TO DEFAULT;

-- name: relay_claim
-- The shard's next transactions in commit order, each complete: the shard's first `limit` rows
-- (fewer, where their keys, values and headers reach `max_bytes`) pick the transactions, and every
-- committed row of those comes back, whatever its shard: the stamped ones through the commit-order
-- index, and the unstamped ones (another shard's relay has not stamped them yet, or this round did
-- not stamp) by transaction id, each with its transaction's commit time, so that the caller sees
-- which shards a transaction spans. The first rows are the stamped ones below the hold-back and,
-- with `inline` (the usual round, which stamps nothing), the unstamped rows of the shard from
-- `stamped_below` up to the xid horizon, with their commit time looked up: a stamp rewrote every
-- row once more (a new row version, its index entries, WAL), a third of the relay's time at a
-- steady 7k records/s.
-- `after_ts`, `after_xid`: where the stamped rows start, past the transactions this shard's
-- batches already took ('-infinity', 0: from the first). The index entries of rows ended stay
-- until a vacuum, and every claim stepped over them all again: over a large backlog's drain a
-- claim grew slower and slower (14 to 19 ms a batch over 300k rows).
-- Columns are qualified in ORDER BY: a bare name would sort by the output column (the text
-- cast), off the index and in the wrong order. `ending`: transactions of the batch before,
-- committed in Kafka, whose rows are being ended meanwhile.
WITH bound AS MATERIALIZED (
    -- `inline`: the hold-back and the horizon of this statement's own snapshot (one snapshot:
    -- see relay_hold_back), the hold-back over the owned shards (`lo_all`, `hi_all`).
    SELECT CASE WHEN %(inline)s THEN pg_snapshot_xmin(pg_current_snapshot()) END AS below,
           CASE WHEN %(inline)s THEN least((
               SELECT min(coalesce(pg_xact_commit_timestamp(committed_xid::xid), state_changed_at))
               FROM {schema}.outbox_record
               WHERE state = 'committed' AND commit_ts IS NULL
                 AND committed_xid >= pg_snapshot_xmin(pg_current_snapshot())
                 AND EXISTS (SELECT 1 FROM unnest(%(lo_all)s::bigint[], %(hi_all)s::bigint[])
                                          AS o(lo, hi)
                             WHERE key_hash BETWEEN o.lo AND o.hi)), (
               SELECT min(pg_xact_commit_timestamp(x))  -- see relay_running_xids
               FROM unnest(current_setting('outbox_relay.running_xids')::xid[]) AS x), (
               SELECT min(pg_xact_commit_timestamp(x::xid))  -- and this snapshot's own
               FROM pg_snapshot_xip(pg_current_snapshot()) AS x
               WHERE x >= current_setting('outbox_relay.running_xmax')::xid8))
           ELSE %(hold_back)s::timestamptz END AS hold_back
),
first AS (
    -- The shard's first `limit` rows in commit order, with their bytes: keys and values (their
    -- lengths: octet_length reads a TOASTed value's header, not the value) and the headers as
    -- text (small as a rule; a compressible one's stored size would understate it).
    (SELECT r.commit_ts, r.committed_xid, r.id,
            coalesce(octet_length(r.key), 0) + coalesce(octet_length(r.value), 0)
            + coalesce(octet_length(r.headers::text), 0) AS bytes
     FROM {schema}.outbox_record AS r
     WHERE r.state = 'committed' AND r.commit_ts IS NOT NULL
       AND r.commit_ts < coalesce((SELECT hold_back FROM bound), 'infinity')
       AND (r.commit_ts, r.committed_xid) > (%(after_ts)s::timestamptz, %(after_xid)s::xid8)
       AND r.key_hash BETWEEN %(lo)s AND %(hi)s
       AND r.committed_xid <> ALL(%(ending)s::xid8[])
     ORDER BY r.commit_ts, r.committed_xid, r.id
     LIMIT %(limit)s)
    UNION ALL
    SELECT u.commit_ts, u.committed_xid, u.id, u.bytes
    FROM (
        SELECT coalesce(pg_xact_commit_timestamp(r.committed_xid::xid), r.state_changed_at)
                   AS commit_ts, r.committed_xid, r.id,
               coalesce(octet_length(r.key), 0) + coalesce(octet_length(r.value), 0)
            + coalesce(octet_length(r.headers::text), 0) AS bytes
        FROM {schema}.outbox_record AS r
        WHERE r.state = 'committed' AND r.commit_ts IS NULL
          AND r.committed_xid >= %(stamped_below)s::xid8
          AND r.committed_xid < (SELECT below FROM bound)
          AND r.key_hash BETWEEN %(lo)s AND %(hi)s
          AND r.committed_xid <> ALL(%(ending)s::xid8[])
    ) AS u
    WHERE u.commit_ts < coalesce((SELECT hold_back FROM bound), 'infinity')
    ORDER BY 1, 2, 3
    LIMIT %(limit)s
),
head AS (
    -- Their transactions, from the rows up to the one whose bytes reach `max_bytes` (the first
    -- row always): a batch is held in the relay's memory, and librdkafka holds a copy.
    SELECT DISTINCT h.commit_ts, h.committed_xid
    FROM (
        SELECT f.commit_ts, f.committed_xid,
               sum(f.bytes) OVER (ORDER BY f.commit_ts, f.committed_xid, f.id
                                  ROWS UNBOUNDED PRECEDING) - f.bytes AS bytes_before
        FROM first AS f
    ) AS h
    WHERE h.bytes_before < %(max_bytes)s
)
SELECT r.id, r.producer_group, r.tx_id, r.topic, r.key, r.value,
       nullif(r.headers, '[]'::jsonb), r.partition, r.key_hash,
       r.committed_xid::text, r.commit_ts, r.committed_xid AS xid,
       coalesce(octet_length(r.key), 0) + coalesce(octet_length(r.value), 0)
           + coalesce(octet_length(r.headers::text), 0)  -- counted as `first` counts
FROM head
JOIN {schema}.outbox_record AS r
  ON r.commit_ts = head.commit_ts AND r.committed_xid = head.committed_xid
WHERE r.state = 'committed'
UNION ALL
SELECT u.*
FROM head
CROSS JOIN LATERAL (  -- lateral: a look-up per transaction, never a scan of all unstamped rows
    SELECT r.id, r.producer_group, r.tx_id, r.topic, r.key, r.value,
           nullif(r.headers, '[]'::jsonb), r.partition, r.key_hash,
           r.committed_xid::text, head.commit_ts, r.committed_xid,
           coalesce(octet_length(r.key), 0) + coalesce(octet_length(r.value), 0)
               + coalesce(octet_length(r.headers::text), 0)
    FROM {schema}.outbox_record AS r
    WHERE r.committed_xid = head.committed_xid AND r.state = 'committed'
      AND r.commit_ts IS NULL
    OFFSET 0  -- kept a subquery: pulled up, it became a hash join over every unstamped row
) AS u
ORDER BY commit_ts, xid, id;  -- xid8, not its text (output columns only, after a UNION)

-- name: relay_earliest_of_keys
-- For each key hash in `keys` (keys of other shards in transactions this shard would send), the
-- earliest committed row of that key that must go out before (until_ts, until_xid), leaving out
-- `skip` (the transactions of this claim, ordered by the caller, and of the batch being ended).
-- Only the keys: a transaction waits for earlier rows of its own keys, not for the other
-- shard's whole backlog (waiting for any earlier row stopped both shards of a load whose
-- transactions span them to one transaction a round). A row its relay has not stamped yet
-- counts by its real commit time.
SELECT DISTINCT ON (e.key_hash) e.key_hash, e.ts, e.xid::text
FROM (
    SELECT key_hash, commit_ts AS ts, committed_xid AS xid
    FROM {schema}.outbox_record
    WHERE state = 'committed' AND commit_ts IS NOT NULL
      AND (commit_ts, committed_xid) < (%(until_ts)s::timestamptz, %(until_xid)s::xid8)
      AND key_hash = ANY(%(keys)s::bigint[])
      AND committed_xid <> ALL(%(skip)s::xid8[])
    UNION ALL
    SELECT key_hash, coalesce(pg_xact_commit_timestamp(committed_xid::xid), state_changed_at),
           committed_xid
    FROM {schema}.outbox_record
    WHERE state = 'committed' AND commit_ts IS NULL
      AND key_hash = ANY(%(keys)s::bigint[])
      AND committed_xid <> ALL(%(skip)s::xid8[])
) AS e
WHERE (e.ts, e.xid) < (%(until_ts)s::timestamptz, %(until_xid)s::xid8)
ORDER BY e.key_hash, e.ts, e.xid;

-- name: relay_wake_relays
-- In a batch's end, when other relays hold shards: one of them may hold a transaction back for
-- this batch (relay/shard.py, _may_send), and no commit of an application wakes it. The payload
-- is this relay's id: it ignores its own, and the others heed it only while they hold a
-- transaction back. lock_timeout 0: a transaction that notified takes a cluster-wide lock at
-- commit, and a role's lock_timeout would fail the end there (so does the checker's commit).
SELECT set_config('lock_timeout', '0', true), pg_notify(%(channel)s, %(relay_id)s);

-- name: relay_unmarked
-- Rolled back, discarded and parked rows whose op marker (and dead-letter copy) is not out yet;
-- `ending`: those whose marker is committed and that are being ended meanwhile. Up to the row
-- whose bytes (as relay_claim counts them) reach `max_bytes` (the first always): parked ones
-- are often the largest.
SELECT id, producer_group, tx_id, topic, key, value, headers, partition, key_hash, state, reason,
       bytes
FROM (
    SELECT u.*, sum(u.bytes) OVER (ORDER BY u.id ROWS UNBOUNDED PRECEDING) - u.bytes
                    AS bytes_before
    FROM (
        SELECT id, producer_group, tx_id, topic, key, value, nullif(headers, '[]'::jsonb)
                   AS headers, partition, key_hash, state, reason,
               coalesce(octet_length(key), 0) + coalesce(octet_length(value), 0)
                   + coalesce(octet_length(headers::text), 0) AS bytes
        FROM {schema}.outbox_record
        WHERE ended_at IS NULL AND state IN ('rolled_back', 'discarded', 'parked')
          AND key_hash BETWEEN %(lo)s AND %(hi)s
          AND id <> ALL(%(ending)s::bigint[])
        ORDER BY id
        LIMIT %(limit)s
    ) AS u
) AS w
WHERE bytes_before < %(max_bytes)s
ORDER BY id;

-- name: relay_shipping_mark_waits
-- Right before shipping_mark, the claim's last statement: its share lock of the lease waits for
-- the end of the shard's batch before to commit (seconds, for a large one), and a role's
-- lock_timeout failed the claim there.
SELECT set_config('lock_timeout', '0', true);

-- name: shipping_mark
-- Of the discarded rows relay_unmarked read, those still discarded and not ended, marked as
-- taken to ship (their dead-letter copies and op markers): re-arm and resolve refuse them from
-- then on. Under the rows' locks: one a command holds is skipped (it ships in a later round if
-- it is still discarded), and one a command changed meanwhile is not discarded any more.
-- Only while the shard's lease is this relay's (`held`): a relay that had lost it (its claim
-- made ahead, running on) marked the heir's rows after the heir's recovery had unmarked them,
-- and re-arm and resolve refused them until the heir shipped them. Returns whether the lease
-- is held, and the ids marked. The share lock waits for an end of this shard's (its lease
-- FOR UPDATE) to commit: a claim made ahead that read discarded rows waits for the end of the
-- batch before it (rare: a round that ships discarded records).
WITH held AS (
    SELECT 1 FROM {schema}.shard_lease
    WHERE shard = %(shard)s AND owner = %(owner)s AND epoch = %(epoch)s
    FOR SHARE
), marked AS (
    UPDATE {schema}.outbox_record AS r
    SET shipping_since = coalesce(r.shipping_since, now())
    FROM (
        SELECT id FROM {schema}.outbox_record
        WHERE id = ANY(%(ids)s::bigint[]) AND state = 'discarded' AND ended_at IS NULL
          AND EXISTS (SELECT 1 FROM held)
        FOR UPDATE SKIP LOCKED
    ) AS taken
    WHERE r.id = taken.id
    RETURNING r.id
)
SELECT EXISTS (SELECT 1 FROM held), coalesce(array_agg(id), '{{}}'::bigint[]) FROM marked;

-- name: shipping_unmark
-- At recovery, once the shard's producers are fenced (its own initialised, which aborts any
-- open transaction of its transactional.id, and that of an earlier prefix the markers name)
-- and the rows its committed markers name are ended: the discarded rows of the shard's keys
-- still marked as taken went out in no committed Kafka transaction (a batch the dead-letter
-- topic refused, a crash before the commit). Not at a shard's first recovery, which reads no
-- markers (shard_lease emptied by an operator, say): a mark may stand for copies sent then.
-- Unmarked, re-arm and resolve take them again (marked, they were refused for as long as the
-- dead-letter topic refused copies); the next claim that ships them marks them anew. A row a
-- command holds is skipped: that command sees the mark and refuses, as it would have.
UPDATE {schema}.outbox_record AS r
SET shipping_since = NULL
FROM (
    SELECT id FROM {schema}.outbox_record
    WHERE ended_at IS NULL AND state = 'discarded' AND shipping_since IS NOT NULL
      AND key_hash BETWEEN %(lo)s AND %(hi)s
    FOR UPDATE SKIP LOCKED
) AS stale
WHERE r.id = stale.id
RETURNING r.id;

-- name: relay_lock_lease
-- Inside the transaction that removes delivered rows: still ours? FOR UPDATE makes a takeover
-- wait until this transaction ends, and the epoch tells if one happened before it. With where
-- the shard's markers were recorded up to (recovery reads from there).
-- statement_timeout 0 for the rest of the transaction (every shard write begins here), as the
-- stamp and the claim set it: ending a batch of 1000 rows took over a role's 300 ms on a busy
-- machine, and its rows went back to recovery, which ends as many in one transaction too.
SELECT marker_partition, marker_offset, set_config('statement_timeout', '0', true)
FROM {schema}.shard_lease
WHERE shard = %(shard)s AND owner = %(owner)s AND epoch = %(epoch)s
FOR UPDATE;

-- name: relay_end_rows
-- Record the end of rows whose op markers are committed in Kafka, kept for the archive (and
-- parked rows, always kept): the state, and for delivered rows where they landed. Only a row
-- still in the state its marker was written for: one an operator changed meanwhile (a discarded
-- transaction resolved or re-armed, a parked record redriven) stays for what it is now.
UPDATE {schema}.outbox_record AS r
SET state = CASE WHEN r.state = 'committed' THEN 'delivered' ELSE r.state END,
    -- a row of another shard's relay, delivered with its transaction before that one stamped it
    commit_ts = CASE WHEN r.state = 'committed' AND r.commit_ts IS NULL
                     THEN coalesce(pg_xact_commit_timestamp(r.committed_xid::xid),
                                   r.state_changed_at)
                     ELSE r.commit_ts END,
    ended_at = now(),
    kafka_partition = e.kafka_partition,
    kafka_offset = e.kafka_offset
FROM unnest(%(ids)s::bigint[], %(states)s::text[], %(partitions)s::integer[],
            %(offsets)s::bigint[])
     AS e(id, state, kafka_partition, kafka_offset)
WHERE r.id = e.id AND r.state = e.state AND r.ended_at IS NULL;

-- name: relay_delete_rows
-- Without an archive, rows whose op markers are committed in Kafka go at once: each only in the
-- state its marker was written for (see relay_end_rows).
DELETE FROM {schema}.outbox_record AS r
USING unnest(%(ids)s::bigint[], %(states)s::text[]) AS e(id, state)
WHERE r.id = e.id AND r.state = e.state AND r.ended_at IS NULL
  AND e.state IN ('committed', 'rolled_back', 'discarded');

-- name: relay_recovered_rows
-- Of the rows markers read back name, those that are the markers' records, locked for their end
-- (relay_end_rows / relay_delete_rows): recovery ends rows by markers, not rows it claimed, so a
-- row is ended only if it is the marker's record (its tx id, producer group, topic, key where
-- the marker has it, committing xid where both have it), not only of its id. After a database
-- restored from a backup, the ids of records delivered since the backup were given again to new
-- records, and their markers deleted those, never sent.
SELECT r.id
FROM {schema}.outbox_record AS r
JOIN unnest(%(ids)s::bigint[], %(states)s::text[], %(tx_ids)s::text[],
            %(producer_groups)s::text[], %(topics)s::text[], %(keys)s::bytea[],
            %(xids)s::text[])
     AS e(id, state, tx_id, producer_group, topic, key, xid) ON r.id = e.id
WHERE r.state = e.state AND r.ended_at IS NULL
  AND r.tx_id = e.tx_id AND r.producer_group = e.producer_group AND r.topic = e.topic
  AND (e.key IS NULL OR r.key = e.key)
  AND (e.xid IS NULL OR r.committed_xid IS NULL OR r.committed_xid = e.xid::xid8)
FOR UPDATE OF r;

-- name: relay_other_records_of_ids
-- Rows not ended under ids of markers recovery matched to none that are other records (another
-- tx id, producer group, topic or key: a database restored from a backup), left for delivery
-- and said. Not the marker's own record changed by hand meanwhile (redriven, re-armed).
SELECT count(*)
FROM {schema}.outbox_record AS r
JOIN unnest(%(ids)s::bigint[], %(tx_ids)s::text[], %(producer_groups)s::text[],
            %(topics)s::text[], %(keys)s::bytea[])
     AS e(id, tx_id, producer_group, topic, key) ON r.id = e.id
WHERE r.ended_at IS NULL
  AND (r.tx_id <> e.tx_id OR r.producer_group <> e.producer_group OR r.topic <> e.topic
       OR (e.key IS NOT NULL AND r.key IS DISTINCT FROM e.key));

-- name: relay_no_statement_timeout
-- For the rest of the transaction, as the stamp's and the claim's own: a trim's slice of 10,000
-- rows ran under a role's or database's statement_timeout, and cancelled, it failed the round.
SELECT set_config('statement_timeout', '0', true);

-- name: relay_trim_archive
-- Ended rows past the archive's retention, a bounded slice at a time (parked rows stay until
-- they are redriven or dropped). SKIP LOCKED: every relay trims, and each waited for the
-- other's slice; a row another session holds (an operator's UPDATE of the archive) held the
-- relay's round, with no statement timeout, until that session ended.
DELETE FROM {schema}.outbox_record
WHERE id IN (
    SELECT id FROM {schema}.outbox_record
    WHERE ended_at < now() - make_interval(secs => %(retention_s)s) AND state <> 'parked'
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
);

-- name: relay_trim_audit_log
-- audit_log entries past the relay's audit_retention, from the oldest id, a slice at a time, up
-- to the first young one: ids grow with time (up to a transaction's length), so the rest are
-- younger. By id, not by `at`: no index on `at` (the table takes a row only per command run by
-- hand or transaction discarded). The first young entry is looked for among the slice's rows
-- only, and the look stops there: a table of young entries costs one row read a trim (this runs
-- every heartbeat interval). A range of ids, deleted through the primary key.
DELETE FROM {schema}.audit_log
WHERE id < coalesce(
    (SELECT oldest.id
     FROM (SELECT id, at FROM {schema}.audit_log ORDER BY id LIMIT %(limit)s) AS oldest
     WHERE oldest.at >= now() - make_interval(secs => %(retention_s)s)
     ORDER BY oldest.id
     LIMIT 1),
    (SELECT max(oldest.id) + 1
     FROM (SELECT id FROM {schema}.audit_log ORDER BY id LIMIT %(limit)s) AS oldest));

-- name: relay_set_marker_offset
UPDATE {schema}.shard_lease
SET marker_partition = %(partition)s, marker_offset = %(offset)s, marker_outbox = %(outbox)s,
    transactional_id = %(transactional_id)s, marker_topic = %(topic)s,
    marker_topic_id = %(topic_id)s
WHERE shard = %(shard)s AND owner = %(owner)s AND epoch = %(epoch)s;

-- name: relay_marker_writer
-- The outbox name the shard's markers were last written under, the transactional id they were
-- written with and their topic, by name and id (relay_set_marker_offset).
SELECT marker_outbox, transactional_id, marker_topic, marker_topic_id FROM {schema}.shard_lease
WHERE shard = %(shard)s;

-- name: relay_advance_marker_offset
-- An idle shard's marker offset, moved on to the partition's end (never back: a topic made anew
-- ends below it, which recovery must still see).
UPDATE {schema}.shard_lease
SET marker_offset = %(offset)s
WHERE shard = %(shard)s AND owner = %(owner)s AND epoch = %(epoch)s
  AND marker_partition = %(partition)s AND marker_offset < %(offset)s;

-- name: relay_park
-- Poison records: the broker will never take them. Parked with the reason; the next round
-- sends their dead-letter copy and op marker.
UPDATE {schema}.outbox_record
SET state = 'parked', reason = %(reason)s, state_changed_at = now()
WHERE id = ANY(%(ids)s::bigint[]) AND state = 'committed';

-- name: relay_member_heartbeat
INSERT INTO {schema}.relay_member (relay_id, heartbeat_at, expires_at)
VALUES (%(relay_id)s, now(), now() + %(ttl)s::interval)
ON CONFLICT (relay_id) DO UPDATE
SET heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at;

-- name: relay_lease_no_timeouts
-- For the rest of a heartbeat's transaction: its renewal waits for a lease row while this relay's
-- own batch end holds it (an end of a large transaction takes seconds), and a role's or
-- database's statement_timeout or lock_timeout failed the round, every shard then recovering.
SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', '0', true);

-- name: relay_members_alive
-- In the order every relay ranks them by, to split the shards among them the same way.
SELECT relay_id FROM {schema}.relay_member WHERE expires_at > now() ORDER BY relay_id;

-- name: relay_member_leave
DELETE FROM {schema}.relay_member WHERE relay_id = %(relay_id)s;

-- name: relay_forget_members
-- Relays gone for a day (killed: they never left): a row per pod restart, else for ever.
DELETE FROM {schema}.relay_member WHERE expires_at < now() - interval '1 day';

-- name: relay_shard_count
-- How many shards the outbox's relays have run with (the lease rows they created): 0 at first.
SELECT coalesce(max(shard) + 1, 0) FROM {schema}.shard_lease;

-- name: relay_marker_partitions
-- The op-marker partition each shard's markers were recorded in (shards that shipped).
SELECT shard, marker_partition FROM {schema}.shard_lease
WHERE marker_partition IS NOT NULL
ORDER BY shard;

-- name: relay_lock_shard_set
-- Taken by a heartbeat before it reads the shard count and makes the lease rows: two relays
-- with different counts starting together on an empty table both found no rows, both made
-- theirs, and both ran (their leases do not exclude each other: the same records twice).
SELECT pg_advisory_xact_lock(74111, hashtext(%(schema)s));

-- name: relay_counts_backlog
-- Whether this relay counts the backlog for the gauges (a read of all of it), not every pod at
-- each refresh: the live relay of the lowest id does (one not yet a member counts while no
-- live one is below it). Read afresh at each refresh, from the members' heartbeats: no session
-- state (a session lock stayed with PgBouncer's server connection in transaction pooling).
SELECT NOT EXISTS (
    SELECT 1 FROM {schema}.relay_member
    WHERE relay_id < %(relay_id)s AND expires_at > now()
);

-- name: relay_ensure_shards
INSERT INTO {schema}.shard_lease (shard)
SELECT generate_series(0, %(shards)s - 1)
ON CONFLICT (shard) DO NOTHING;

-- name: relay_acquire
-- Free or expired shards, up to `want` of them; the epoch bump fences the previous owner.
UPDATE {schema}.shard_lease AS l
SET owner = %(owner)s, epoch = l.epoch + 1,
    lease_until = now() + %(duration)s::interval, heartbeat_at = now()
WHERE l.shard IN (
    SELECT shard FROM {schema}.shard_lease
    WHERE shard < %(shards)s AND (owner IS NULL OR lease_until < now())
    ORDER BY shard
    LIMIT %(want)s
    FOR UPDATE SKIP LOCKED
)
RETURNING l.shard, l.epoch, l.marker_partition, l.marker_offset;

-- name: relay_renew
UPDATE {schema}.shard_lease AS l
SET lease_until = now() + %(duration)s::interval, heartbeat_at = now()
FROM unnest(%(shards)s::integer[], %(epochs)s::bigint[]) AS m(shard, epoch)
WHERE l.shard = m.shard AND l.epoch = m.epoch AND l.owner = %(owner)s
RETURNING l.shard;

-- name: relay_release
UPDATE {schema}.shard_lease
SET owner = NULL, lease_until = NULL
WHERE shard = %(shard)s AND owner = %(owner)s AND epoch = %(epoch)s;

-- name: relay_backlog
-- For metrics, every gauge refresh: undelivered committed rows (a count of the commit-order
-- index) and the commit time of the oldest: the first stamped row in commit order, or the
-- unstamped row of the oldest transaction id, whichever is older. Not min() over the rows:
-- that read the whole backlog from the heap (a million rows: 0.4-0.8 s with two parallel
-- workers, 1.3 GB of buffers) every 10 s, beside the relay draining it.
-- Unstamped rows (few: a round stamps a backlog) have their commit times looked up, the first
-- 1000 by transaction id: not state_changed_at, when a transaction began (a long one made the
-- age, and the lag alert, that much older), and not only the lowest id's (a transaction with a
-- lower id that commits later hid the ones committed before it).
-- And the parked rows, waiting for a redrive (their own small index; few as a rule).
SELECT (SELECT count(*) FROM {schema}.outbox_record WHERE state = 'committed'),
       least(
           (SELECT commit_ts FROM {schema}.outbox_record
            WHERE state = 'committed' AND commit_ts IS NOT NULL
            ORDER BY commit_ts, committed_xid, id LIMIT 1),
           (SELECT min(coalesce(pg_xact_commit_timestamp(committed_xid::xid), state_changed_at))
            FROM (SELECT committed_xid, state_changed_at FROM {schema}.outbox_record
                  WHERE state = 'committed' AND commit_ts IS NULL
                  ORDER BY committed_xid LIMIT 1000) AS first_unstamped)),
       (SELECT count(*) FROM {schema}.outbox_record WHERE state = 'parked');

-- name: relay_horizon_holder
-- The oldest transaction still running (it holds back the xid horizon), other than ours. Its
-- age is NULL for another role's session unless ours has pg_read_all_stats (backend_xid is
-- shown to all): the relay then counts from when it first saw that transaction.
-- A prepared transaction (PREPARE TRANSACTION, two-phase commit) holds it too, with no session
-- left: pid 0, its age from when it was prepared (the gauges said nothing held the horizon
-- while delivery waited for it). `what`: which it is, for the relay's log.
SELECT pid, xid, age_s, what FROM (
    SELECT pid, backend_xid::text AS xid, extract(epoch FROM now() - xact_start)::float8 AS age_s,
           age(backend_xid) AS xid_age,
           format('the transaction of pid %s (database %s, application %L, %s)', pid, datname,
                  application_name, coalesce(state, 'state hidden from this role')) AS what
    FROM pg_stat_activity
    WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
    UNION ALL
    SELECT 0, transaction::text, extract(epoch FROM now() - prepared)::float8, age(transaction),
           format('the prepared transaction %L (database %s, two-phase commit): it is kept '
                  'until COMMIT PREPARED or ROLLBACK PREPARED', gid, database)
    FROM pg_prepared_xacts
) AS running
ORDER BY xid_age DESC
LIMIT 1;
