-- 0007: the transactional id each shard's markers were last written with.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- Adding a nullable column with no default changes only the catalog: quick, whatever the size.

-- Recovery fences this producer as well as its own when they differ (relay.transactional_id_prefix
-- changed): a paused relay of the old prefix was fenced by Kafka by nobody, woke, committed the
-- batch it had claimed, and the records went out twice.
ALTER TABLE {schema}.shard_lease ADD COLUMN transactional_id text;
