-- no-transaction
-- The inbox's keys with a backlog, as 0022 for the outbox.
CREATE INDEX CONCURRENTLY IF NOT EXISTS inbox_keys_backlog
    ON inbox_keys (subscription, topic, event_key) WHERE pending > 0;
