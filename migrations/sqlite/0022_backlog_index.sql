-- The keys with a backlog (issue 46, item 1; migrations/postgres/0022 and 0023): the
-- admin reads and the readiness lag check follow the backlog, not the history.
CREATE INDEX IF NOT EXISTS outbox_keys_backlog ON outbox_keys (topic, event_key) WHERE pending > 0;
CREATE INDEX IF NOT EXISTS inbox_keys_backlog
    ON inbox_keys (subscription, topic, event_key) WHERE pending > 0;
INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES (22, 17);
