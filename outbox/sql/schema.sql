-- The whole schema at the newest migration: what a fresh install applies in one step.
-- tests/integration/test_migrations.py keeps it equal to applying every migration in order.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).

CREATE TABLE {schema}.outbox_record (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    producer_group  text        NOT NULL,
    tx_id           text        NOT NULL,
    topic           text        NOT NULL,
    key             bytea,
    value           bytea,
    -- Kafka headers in order, duplicates allowed: [[name, base64 value or null], ...]
    headers         jsonb       NOT NULL DEFAULT '[]'::jsonb,
    partition       integer,
    -- stable hash of the key (of the tx id for keyless records): a shard is a range of it
    key_hash        bigint      NOT NULL,
    state           text        NOT NULL,
    -- the transaction that inserted the row (a caller-given tx id belongs to it alone)
    writer_xid      xid8        NOT NULL DEFAULT pg_current_xact_id(),
    -- the transaction that made the row committed (the writer, or whoever ended a half record):
    -- the relay promotes rows below the xid horizon, in the commit order of this transaction
    committed_xid   xid8,
    -- commit time of committed_xid, stamped by the relay once it is below the horizon
    commit_ts       timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    state_changed_at timestamptz NOT NULL DEFAULT now(),
    -- when the relay wrote the record's op marker (its end), and where a delivered record went;
    -- kept while ended rows are archived (the relay's retention setting)
    ended_at        timestamptz,
    kafka_partition integer,
    kafka_offset    bigint,
    -- check-back bookkeeping for prepared records
    check_immunity  interval,
    check_count     integer     NOT NULL DEFAULT 0,
    next_check_at   timestamptz,
    last_checked_at timestamptz,
    -- the last re-arm (outboxctl rearm): the maximum prepared age counts from here, not from
    -- created_at, else a transaction discarded at that age was discarded again at once
    rearmed_at      timestamptz,
    -- the lease of a check in flight; still set past its end: a check lost, given back
    check_lease_until timestamptz,
    -- why the record was parked or discarded
    reason          text,
    -- when the relay took a discarded record to ship its dead-letter copy and op marker: from
    -- then on it is not re-armed nor resolved (it would go out twice)
    shipping_since  timestamptz,
    CONSTRAINT outbox_record_state_valid
        CHECK (state IN ('prepared', 'committed', 'rolled_back', 'discarded', 'delivered', 'parked')),
    CONSTRAINT outbox_record_topic_valid
        CHECK (char_length(topic) BETWEEN 1 AND 249
               AND topic ~ '^[a-zA-Z0-9._-]+$'
               AND topic NOT IN ('.', '..')),
    CONSTRAINT outbox_record_producer_group_valid
        CHECK (char_length(producer_group) BETWEEN 1 AND 128
               AND producer_group ~ '^[a-zA-Z0-9._-]+$'),
    CONSTRAINT outbox_record_tx_id_valid
        CHECK (char_length(tx_id) BETWEEN 1 AND 128),
    CONSTRAINT outbox_record_headers_is_array
        CHECK (jsonb_typeof(headers) = 'array'),
    CONSTRAINT outbox_record_partition_valid
        CHECK (partition IS NULL OR partition >= 0),
    CONSTRAINT outbox_record_check_count_valid
        CHECK (check_count >= 0),
    CONSTRAINT outbox_record_check_immunity_valid
        CHECK (check_immunity IS NULL OR check_immunity >= interval '0'),
    -- parked (poison) and discarded (never resolved) rows are the dead-letter records: say why
    CONSTRAINT outbox_record_reason_when_parked
        CHECK (state NOT IN ('parked', 'discarded') OR reason IS NOT NULL),
    CONSTRAINT outbox_record_committed_has_xid
        CHECK (state NOT IN ('committed', 'delivered') OR committed_xid IS NOT NULL)
);

-- The relay stamps commit times of committed rows that are not stamped yet...
CREATE INDEX outbox_record_unstamped_idx
    ON {schema}.outbox_record (committed_xid) WHERE state = 'committed' AND commit_ts IS NULL;
-- ...and claims stamped rows in commit order: the index is that order, so a claim reads its
-- batch off the index instead of sorting the whole backlog.
CREATE INDEX outbox_record_committed_idx
    ON {schema}.outbox_record (commit_ts, committed_xid, id) WHERE state = 'committed';
-- Rolled back, discarded and parked rows wait for their op marker (and dead-letter copy).
CREATE INDEX outbox_record_unmarked_idx
    ON {schema}.outbox_record (id)
    WHERE ended_at IS NULL AND state IN ('rolled_back', 'discarded', 'parked');
-- The archive of ended rows is trimmed by age.
CREATE INDEX outbox_record_ended_idx
    ON {schema}.outbox_record (ended_at) WHERE ended_at IS NOT NULL;
-- The checker's scan: prepared rows by due time.
CREATE INDEX outbox_record_prepared_due_idx
    ON {schema}.outbox_record (next_check_at, id) WHERE state = 'prepared';
-- ...and those never checked yet by age: the ones past the default check immunity are a range;
-- those with an immunity of their own, apart, so that neither scan reads the other's rows.
CREATE INDEX outbox_record_never_checked_idx
    ON {schema}.outbox_record (created_at, id)
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NULL;
CREATE INDEX outbox_record_own_immunity_idx
    ON {schema}.outbox_record (created_at, id)
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NOT NULL;
-- ...and those by when they are due (seconds added: timestamptz + interval depends on the time
-- zone, and cannot be indexed), so that the due scan reads only the due ones.
CREATE FUNCTION {schema}.immune_until(created_at timestamptz, immunity interval)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT created_at + make_interval(secs => extract(epoch FROM immunity)::float8) $$;
CREATE INDEX outbox_record_own_immunity_due_idx
    ON {schema}.outbox_record ({schema}.immune_until(created_at, check_immunity), id)
    WHERE state = 'prepared' AND next_check_at IS NULL AND check_immunity IS NOT NULL;
-- Parked records by topic (redrive --topic, records --state parked): few, a small index.
CREATE INDEX outbox_record_parked_idx
    ON {schema}.outbox_record (topic, id) WHERE state = 'parked';
-- commit()/rollback() and duplicate detection find a transaction's rows.
CREATE INDEX outbox_record_tx_idx
    ON {schema}.outbox_record (producer_group, tx_id);

-- Shards of the outbox, each owned by one relay at a time through a lease.
CREATE TABLE {schema}.shard_lease (
    shard           integer     PRIMARY KEY,
    owner           text,
    -- bumped on every change of owner: a stale owner's conditional writes match nothing
    epoch           bigint      NOT NULL DEFAULT 0,
    lease_until     timestamptz,
    heartbeat_at    timestamptz,
    -- op-marker offset from which this shard's markers may name rows not yet removed: recovery
    -- reads from here, and every removal of delivered rows moves it forward in the same
    -- database transaction
    marker_partition integer,
    marker_offset   bigint      NOT NULL DEFAULT 0,
    -- 0006: the outbox name (database/schema) its markers were last written under: still its
    -- own after a rename
    marker_outbox   text,
    -- 0007: the transactional id those markers were written with: recovery fences it too when
    -- the relay's own differs (the prefix changed); and their topic (read in another, an offset
    -- means nothing)
    transactional_id text,
    marker_topic    text,
    marker_topic_id text,
    CONSTRAINT shard_lease_shard_valid CHECK (shard >= 0),
    CONSTRAINT shard_lease_owner_has_expiry CHECK (owner IS NULL OR lease_until IS NOT NULL)
);

-- Relays alive now: each heartbeats here, and takes about shards / members shards.
CREATE TABLE {schema}.relay_member (
    relay_id        text        PRIMARY KEY,
    heartbeat_at    timestamptz NOT NULL,
    expires_at      timestamptz NOT NULL
);

-- Who did what by hand or by policy (re-arm, manual resolve, discard).
CREATE TABLE {schema}.audit_log (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT now(),
    actor           text        NOT NULL,
    action          text        NOT NULL,
    producer_group  text,
    tx_id           text,
    detail          jsonb       NOT NULL DEFAULT jsonb_build_object(),
    -- 0009: who, as the database knows them (the actor is what the command was told)
    db_role         text        DEFAULT session_user,
    client_addr     inet        DEFAULT inet_client_addr(),
    CONSTRAINT audit_log_action_valid CHECK (char_length(action) BETWEEN 1 AND 64)
);
-- 0006: a transaction's latest entry (rearm, resolve and redrive look it up)
CREATE INDEX audit_log_tx_idx ON {schema}.audit_log (producer_group, tx_id, id);

-- 0002: reconciliation findings
-- What the reconciliation job (spark/) found, one row per finding. The natural key makes every
-- write idempotent: a replayed micro-batch, a restart or a re-run audit inserts nothing twice.
CREATE TABLE {schema}.reconciliation_finding (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind            text        NOT NULL,
    -- the topic the record belongs on (the ledger's or op marker's), else where its copy was seen
    topic           text        NOT NULL,
    outbox_id       bigint      NOT NULL,
    -- tells apart findings of one kind about one record: 'partition:offset' of each extra copy
    -- (duplicate, orphan), which side is missing (marker_mismatch); '' when one is all there is
    occurrence      text        NOT NULL DEFAULT '',
    producer_group  text,
    tx_id           text,
    -- the Kafka position the finding is about (a copy's, or the one the relay recorded)
    kafka_partition integer,
    kafka_offset    bigint,
    -- when it happened: the copy's or marker's Kafka timestamp, the commit or delivery time
    event_time      timestamptz NOT NULL,
    detail          jsonb       NOT NULL DEFAULT jsonb_build_object(),
    detected_at     timestamptz NOT NULL DEFAULT now(),
    -- when a judgement last found it (moved on at most hourly): retention counts from here
    last_seen_at    timestamptz NOT NULL DEFAULT now(),
    -- which run found it first: 'batch <n>', 'tick', 'final', 'audit'
    detected_in     text        NOT NULL,
    CONSTRAINT reconciliation_finding_kind_valid
        CHECK (kind IN ('missing', 'duplicate', 'orphan', 'marker_mismatch', 'out_of_order')),
    CONSTRAINT reconciliation_finding_detail_is_object
        CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT reconciliation_finding_natural_key
        UNIQUE (kind, topic, outbox_id, occurrence)
);
-- `outboxctl findings`: the newest first, optionally of some kinds.
CREATE INDEX reconciliation_finding_detected_idx
    ON {schema}.reconciliation_finding (detected_at, id);
-- The job's retention: findings no judgement has found for that long.
CREATE INDEX reconciliation_finding_seen_idx
    ON {schema}.reconciliation_finding (last_seen_at, id);
-- Counting findings per summary window.
CREATE INDEX reconciliation_finding_event_idx
    ON {schema}.reconciliation_finding (event_time);

-- Per time window of delivery (Kafka timestamp): records delivered once and the latency from
-- commit to topic. Recomputed while the window is inside the job's horizon (upsert).
CREATE TABLE {schema}.reconciliation_window (
    window_start    timestamptz NOT NULL,
    window_end      timestamptz NOT NULL,
    records         bigint      NOT NULL,
    latency_p50_ms  double precision,
    latency_p95_ms  double precision,
    latency_p99_ms  double precision,
    latency_max_ms  double precision,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (window_start, window_end),
    CONSTRAINT reconciliation_window_bounds_valid CHECK (window_end > window_start),
    CONSTRAINT reconciliation_window_records_valid CHECK (records >= 0)
);
