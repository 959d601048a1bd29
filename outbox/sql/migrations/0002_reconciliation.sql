-- 0002: reconciliation findings. Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).

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
