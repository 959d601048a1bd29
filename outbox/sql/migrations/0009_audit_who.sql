-- 0009: who ran a command by hand, as the database knows them.
-- Never edit a released migration: add one.
-- `{schema}` is replaced by the configured schema name (quoted as an identifier).

-- An audit row's actor is what the command was told (--actor, else $USER): any name at all.
-- Beside it now, from defaults no command sets: the role that logged in and the client's
-- address (NULL over a Unix socket). The defaults are set after the columns are added, so
-- rows from before stay NULL (not known) instead of taking the migrating role.
ALTER TABLE {schema}.audit_log ADD COLUMN db_role text, ADD COLUMN client_addr inet;
ALTER TABLE {schema}.audit_log
    ALTER COLUMN db_role SET DEFAULT session_user,
    ALTER COLUMN client_addr SET DEFAULT inet_client_addr();
