-- 0007: the topic and transactional id each shard's markers were last written with.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).
-- Adding a nullable column with no default changes only the catalog: quick, whatever the size.

-- Recovery fences this producer as well as its own when they differ (relay.transactional_id_prefix
-- changed): a paused relay of the old prefix was fenced by Kafka by nobody, woke, committed the
-- batch it had claimed, and the records went out twice.
ALTER TABLE {schema}.shard_lease ADD COLUMN transactional_id text;

-- Recovery refuses to read a shard's markers from another topic than they went to: its offset,
-- read in a topic changed back to one used before (that had run past it), found none of the
-- markers of a batch in doubt, and the batch went out twice.
ALTER TABLE {schema}.shard_lease ADD COLUMN marker_topic text;
-- And the topic's id: a topic deleted and made again under the same name has another, and
-- its log (other shards' markers, say) could have run past the offset too.
ALTER TABLE {schema}.shard_lease ADD COLUMN marker_topic_id text;
