-- 0003: tx ids in printable ASCII without spaces, as the library has always written them: rows
-- another writer stored with other ids could not be committed, rolled back or resolved through
-- the library (the checker and `outboxctl resolve` refused their ids). Never edit a released
-- migration: add one. NOT VALID: rows already there are not checked (no scan, a short lock);
-- new ones are.
ALTER TABLE {schema}.outbox_record
    ADD CONSTRAINT outbox_record_tx_id_printable CHECK (tx_id ~ '^[!-~]+$') NOT VALID;
